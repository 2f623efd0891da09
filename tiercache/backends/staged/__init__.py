"""``staged``: pack GPU pages into a GPU staging ring with a kernel, move whole host rows
on the copy engines, chunk by chunk (``backend``: the pipeline and its contract).

``block_layout`` lays a block plan out as row images (pure numpy, the specification the
native chunk loop follows) and ``block_kernel`` expands it to pages on the device;
``page_layout`` does the same from page descriptors (geometries the block layout
refuses, and the calibration). Import ``backend`` for the backend: this package's own
import loads neither torch nor Triton.
"""
