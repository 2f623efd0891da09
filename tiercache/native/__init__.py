"""Native code: the staged chunk loop and the planner's id validator, in one C file.

``chunk_loop.c`` is compiled at first use (``build``, the only module that runs a
compiler) and bound with ctypes (``library``; the struct mirrors in ``structs``, checked
against the C side's own ``sizeof``/``offsetof`` report by a CPU test). ``validator`` is
the planner's accelerator (``tc_validate``); ``chunk_loop`` is the issuing thread the
``staged`` backend hands block plans to. Torch-free; nothing here is imported by the
device layer or the region.
"""
