"""``kernel``: one Triton kernel reads and writes pinned host memory through UVA.

Reaches ~0.93 of the PCIe ceiling at any page size and has the lowest latency for
small transfers, but its programs occupy SMs for the whole transfer: a matmul beside
it was measured to lose 47–78 % of its speed even at 8 CTAs. Choose it where latency
matters more than the model's throughput, never by default.

Host memory must be registered (page-locked and mapped): the GPU dereferences host
addresses directly, and a page that is not mapped faults the kernel (the CUDA context
is lost). The handler only builds plans over the worker's registered slice.
"""

from __future__ import annotations

from typing import cast

import torch

from tiercache.backends.base import BackendContext, StreamBackend
from tiercache.backend_kind import BackendKind
from tiercache.backends.triton_copy import CopyKernel, upload_table
from tiercache.device.driver import device_index, stream_handle
from tiercache.device.events import Stream
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan

DEFAULT_NUM_PROGRAMS = 32  # enough bytes in flight to fill PCIe (16 CTAs reach 0.93)


class KernelBackend(StreamBackend[CopyPlan]):
    """Triton copy over UVA with at most ``num_programs`` programs (SMs held)."""

    kind = BackendKind.KERNEL

    def __init__(self, device: int, num_programs: int = DEFAULT_NUM_PROGRAMS,
                 num_warps: int = 4):
        self.device = torch.device("cuda", int(device))
        self.kernel = CopyKernel(num_programs, num_warps)

    def copy(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        stream_handle(stream)  # refuses the legacy default stream
        src, dst, sizes = plan.arrays()
        cuda = cast(torch.cuda.Stream, stream)  # a GPU kind's stream is torch's (Ordering)
        try:
            with torch.cuda.stream(cuda):
                table = upload_table(src, dst, sizes, cuda)
                self.kernel.launch(table)
        except Exception as e:  # torch/Triton raise several types; re-raised with the cause
            raise BackendError(f"kernel copy of {sizes.size} descriptors could not be "
                               f"submitted: {e}") from e
        return (table,)


def create(context: BackendContext) -> KernelBackend:
    if not context.host_registered:
        raise BackendError("backend 'kernel' reads host memory through UVA and needs the "
                           "region slice page-locked (region.pinning); it is not (use 'ce' "
                           "or 'staged')")
    return KernelBackend(device_index(context.device))
