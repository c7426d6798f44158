"""The floor of one MoE forward and the metrics of a timed row.

For M tokens of a layer with E experts, top-k, hidden H and intermediate I:

* **weight bytes** = ``n_touched * 3*H*I * bits/8``: only the experts the routing actually
  touched are read, at 4.5 bits per weight in NVFP4 (a 4-bit code plus one e4m3 scale per
  16 weights). Activations are ignored.
* **FLOPs** = ``2 * M*topk * 3*H*I`` (gate+up: ``2I x H``, down: ``H x I``).
* **floor** = ``max(bytes / read bandwidth, FLOPs / bf16 matmul rate)``, with both ceilings
  measured on the same GPU in the same run (:class:`Ceilings`). Hopper has no FP4 tensor
  cores, so the compute ceiling is the bf16 rate.

A row's ``pct_roofline`` is ``100 * floor / measured``: 100 means the row runs at the floor.
Everything here is plain arithmetic (no GPU), so it is tested on CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .shapes import ModelShape

__all__ = [
    "NVFP4_BITS",
    "BF16_BITS",
    "Ceilings",
    "Floor",
    "touched_experts",
    "moe_floor",
    "gemm_floor",
    "row_metrics",
]

NVFP4_BITS = 4.5  # 4-bit code + an 8-bit scale per 16 weights
BF16_BITS = 16.0


@dataclass(frozen=True)
class Ceilings:
    """Measured rates of the GPU the rows ran on.

    copy_tbps:   device-to-device copy, bytes read + written per second (TB/s).
    stream_tbps: read-only streaming of a large buffer (TB/s).
    bf16_tflops: a large bf16 matmul (TFLOP/s).
    The floor's read bandwidth is the larger of the two bandwidths: the larger rate gives the
    lower, stricter floor, so no kernel can look better than it is.
    """

    copy_tbps: float
    stream_tbps: float
    bf16_tflops: float

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name}: expected a positive measured rate, got {v!r}")

    @property
    def read_tbps(self) -> float:
        return max(self.copy_tbps, self.stream_tbps)

    def to_dict(self) -> dict:
        return {**asdict(self), "read_tbps": self.read_tbps}


@dataclass(frozen=True)
class Floor:
    """The roofline floor of one piece of work: ``max(memory_us, compute_us)``."""

    weight_bytes: float
    flops: float
    memory_us: float
    compute_us: float

    @property
    def us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"

    def to_dict(self) -> dict:
        return {**asdict(self), "floor_us": self.us, "bound": self.bound}


def touched_experts(topk_ids: torch.Tensor) -> int:
    """Distinct expert ids actually routed to (``-1``, "not served here", is not an expert)."""
    ids = topk_ids.reshape(-1)
    return int(torch.unique(ids[ids >= 0]).numel())


def _floor(weights: float, flops: float, ceilings: Ceilings, bits: float) -> Floor:
    weight_bytes = weights * bits / 8
    return Floor(
        weight_bytes=weight_bytes,
        flops=flops,
        memory_us=weight_bytes / (ceilings.read_tbps * 1e12) * 1e6,
        compute_us=flops / (ceilings.bf16_tflops * 1e12) * 1e6,
    )


def moe_floor(shape: ModelShape, num_tokens: int, n_touched: int, ceilings: Ceilings) -> Floor:
    """Floor of the whole forward of ``num_tokens`` tokens touching ``n_touched`` experts (NVFP4 weights)."""
    if not 0 <= n_touched <= shape.E:
        raise ValueError(f"n_touched: expected 0..{shape.E} experts, got {n_touched}")
    flops = 2.0 * num_tokens * shape.topk * shape.weights_per_expert
    return _floor(float(n_touched) * shape.weights_per_expert, flops, ceilings, NVFP4_BITS)


def gemm_floor(rows: int, n: int, k: int, n_touched: int, ceilings: Ceilings) -> Floor:
    """Floor of one grouped NVFP4 GEMM: ``rows`` routed rows, ``n_touched`` experts of ``n x k`` weights."""
    return _floor(float(n_touched) * n * k, 2.0 * rows * n * k, ceilings, NVFP4_BITS)


def row_metrics(us: float, floor: Floor, bits: float) -> dict:
    """Metrics of work with ``floor`` that took ``us`` µs, whose weights are stored at ``bits`` per weight.

    ``weight_tbps`` is what the path itself moves (its own storage format: 16 bits for the
    bf16 peer, 4.5 for NVFP4), ``pct_roofline`` compares with the NVFP4 floor.
    """
    if not us > 0:
        raise ValueError(f"us: expected a positive time, got {us!r}")
    seconds = us * 1e-6
    weights = floor.weight_bytes * 8 / NVFP4_BITS
    return {
        "tflops": floor.flops / seconds / 1e12,
        "weight_tbps": weights * bits / 8 / seconds / 1e12,
        "pct_roofline": 100.0 * floor.us / us,
    }
