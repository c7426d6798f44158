"""Programmatic dependent launch (PDL) for the pipeline's Triton kernels (sm_90 and newer).

Every pipeline kernel takes ``PDL: tl.constexpr`` (False by default) and calls
:func:`enter_stage` first. Launched with ``launch_pdl=PDL`` (Triton's launch option: the launch
carries programmatic stream serialization), a kernel may be scheduled while the kernel before it
in the stream still runs, once every program of that kernel has entered its stage (or exited):
``enter_stage`` waits for the previous kernel to complete (its writes visible) before anything is
read or written, then lets the next kernel be scheduled. So each launch's scheduling overlaps the
tail of the kernel before, and as every kernel waits first, each sees all earlier kernels done.
Unlike the CUDA library's routing kernels (``csrc/include/moe_fp4/launch.cuh``, which never let the
next kernel start early, so that a later CUDA stage may read the routing metadata before its own
wait), the Triton routing kernels do too: no stage set runs a kernel that reads before its wait
(the sm_90a GEMM) directly after the routing, and each kernel between them waits first. Without a
programmatic predecessor the wait returns at once. The launchers set ``PDL`` from
:func:`moe_fp4.triton_kernels._common.pdl_enabled`.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton 3.4 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover (older Triton: PDL stays off)
    gdc_launch_dependents = gdc_wait = None

AVAILABLE = gdc_wait is not None


@triton.jit
def enter_stage(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous kernel in the stream, then allow the next one to be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
