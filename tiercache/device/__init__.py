"""The device layer, at the bottom of the worker wing: no torch at import, never compiles
anything.

``driver`` (ctypes over libcuda: batch copies, events, host registration, entry points
for native code), ``events`` (the ``Stream`` / ``Event`` / ``Ticket`` interfaces the
transfer code speaks, ``DriverEvent``, ``TORCH_DEVICE_ERRORS``), ``streams`` (where a handler's
streams and events come from: ``CudaStreams``), ``host_streams`` (host threads that act
as streams, for the ``cpu`` backend) and ``pinning`` (page-locking a host range for one
GPU, per process: what the region's ``pin`` is given).
"""
