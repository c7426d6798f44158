"""Stages 3 and 5: the grouped NVFP4 x NVFP4 GEMM (``moe_fp4.stages.grouped_gemm``).

``D[rows of e] = alpha[e, section(n)] * (A_e . B_e^T)``. Both operands are dequantized in
registers to ``e2m1 * scale`` (exact in bf16), multiplied on the tensor cores with float32
accumulation (float32 operands in the CPU interpreter), scaled by alpha per expert and
weight section in float32, and rounded to the output dtype. Tiles are scheduled from
``expert_offsets`` alone over a static grid of ``ceil(n/BM) + min(E, n)`` row tiles, so
there is no host synchronization. Rows past ``expert_offsets[E]`` are not written.

The launch configuration comes from :data:`GEMM_CONFIGS`, keyed on the average rows per
expert; ``config=`` pins one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..format import BLOCK_SIZE, swizzled_shape
from ._common import DOT_DTYPE, expert_block
from .gemm_details._gemm import grouped_gemm_kernel

__all__ = ["GemmConfig", "GEMM_CONFIGS", "gemm_config", "grouped_gemm"]


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the grouped GEMM.

    block_m: rows of one expert per tile (>= 16); block_n: output columns per tile (>= 16);
    block_k: reduction step (>= 32, so a row's packed bytes are >= 16 per step);
    swap_ab: compute ``B . A^T`` (weights on the MMA's M side; for few rows per expert).
    All blocks are powers of two.
    """

    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, low in (("block_m", 16), ("block_n", 16), ("block_k", 32), ("num_warps", 1), ("num_stages", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low or (name != "num_stages" and v & (v - 1)):
                raise ValueError(f"GemmConfig.{name}: expected a power of two >= {low}, got {v!r}")


# (largest average rows per expert, config), first match wins; tests and benchmarks pin
# others. Every entry compiles for sm_90 and sm_80 without register spills and streams the
# packed weights with 16-byte cp.async (tests/test_triton_compile.py). With swap_ab the
# compiler (triton 3.6) keeps the dequantized weights in wgmma's register operand layout
# and so loads them 4 bytes at a time; whether that beats the smem round trip of the
# unswapped mma.sync path at decode is for the GPU timings (tests/gpu_report.py) to say.
GEMM_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    (4, GemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=False, num_warps=4, num_stages=4)),
    (24, GemmConfig(block_m=32, block_n=128, block_k=64, swap_ab=False, num_warps=4, num_stages=4)),
    (96, GemmConfig(block_m=64, block_n=128, block_k=64, swap_ab=False, num_warps=8, num_stages=3)),
    (math.inf, GemmConfig(block_m=128, block_n=128, block_k=64, swap_ab=False, num_warps=8, num_stages=3)),
)


def gemm_config(n_rows: int, num_experts: int) -> GemmConfig:
    """The table's configuration for ``n_rows`` routed rows over ``num_experts`` experts."""
    per_expert = n_rows / max(num_experts, 1)
    return next(cfg for bound, cfg in GEMM_CONFIGS if per_expert <= bound)


def grouped_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The grouped GEMM of ``a [n, K/2]`` with ``b [E, N, K/2]``.

    ``a_sf`` is the grouped swizzled scale buffer, ``b_sf [E, S, Np_s, Cp]`` the weight scales
    per section, ``alpha [E, S]`` the epilogue scales.

    ``out`` may give the ``[n, N]`` result buffer (``out_dtype``); ``config`` pins the launch.
    """
    n_rows, K = a.shape[0], a.shape[1] * 2
    E, N = b.shape[0], b.shape[1]
    S = b_sf.shape[1]
    if out is None:
        out = torch.empty((n_rows, N), dtype=out_dtype, device=a.device)
    if n_rows == 0:
        return out
    cfg = config if config is not None else gemm_config(n_rows, E)
    _, cp = swizzled_shape(1, K // BLOCK_SIZE)
    n_tiles_n = triton.cdiv(N, cfg.block_n)
    m_tiles = triton.cdiv(n_rows, cfg.block_m) + min(E, n_rows)
    grouped_gemm_kernel[(m_tiles * n_tiles_n,)](
        a, a_sf.view(torch.uint8), b, b_sf.view(torch.uint8), alpha, expert_offsets, blockscale_offsets, out,
        N, K // 2, K // BLOCK_SIZE, E, N // S, b_sf.shape[2], cp, n_tiles_n,
        S=S, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SWAP_AB=cfg.swap_ab,
        DOT_DTYPE=DOT_DTYPE, E_BLOCK=expert_block(E),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
