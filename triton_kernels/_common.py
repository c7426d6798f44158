"""Host-side helpers shared by the kernel wrappers of ``moe_fp4.triton_kernels``."""

from __future__ import annotations

import triton

BLOCK_SIZE = 16  # elements per NVFP4 block scale

# Whether the @triton.jit functions of this package were created for Triton's CPU
# interpreter (TRITON_INTERPRET=1 when the package was imported). The interpreter gets
# numpy's exp and no inline assembly.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

# Options for the kernels that must reproduce the format core's (and torch's) roundings: no
# FMA contraction (with it, expf's last multiply fuses with silu's "1 +"), and libdevice
# without flush-to-zero, like torch's CUDA math.
EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

def pow2_at_least(n: int, floor: int = 1, cap: int | None = None) -> int:
    """The smallest power of two >= max(n, floor), capped at ``cap``."""
    p = triton.next_power_of_2(max(int(n), floor))
    return p if cap is None else min(p, cap)


def expert_block(num_experts: int) -> int:
    """Chunk size (a constexpr) for loops over experts: 256 up to 256 experts, else 1024.

    Two values only, so that different expert counts share compiled kernels.
    """
    return 256 if num_experts <= 256 else 1024
