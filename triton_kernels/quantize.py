"""Grouped NVFP4 quantization of activations: stage 2 (gather + quantize) and stage 4 (SiLU-mul + quantize).

Both write packed rows ``uint8 [n, K/2]`` (rows past ``expert_offsets[E]`` zero) and a
grouped swizzled scale buffer ``[rows, Cp]`` (``rows`` a multiple of 128, ``Cp =
ceil(K/64)*4``) in which every byte that holds no scale is zero. One launch each: programs
over blocks of slots (and of columns) quantize, so padding rows cost no loads and no math,
and programs over the 128-row bands of the scale buffer zero the bytes that hold no scale;
no separate memset is needed. The launch configuration comes from :data:`QUANT_CONFIGS`.
The ``*_launcher`` functions prepare a launch for given buffers once (a function of the rows).
The ``*_values_launcher`` ones write the quantized rows' fp16 values ``e2m1 * e4m3`` ``[n, K]``
instead (the activation operand of the values GEMM; no codes, no scales).

Inputs are not validated here (``moe_fp4.backends.triton`` does that); all tensors must
be contiguous and on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ._common import BLOCK_SIZE, EXACT, FREE, INTERPRET, Launch, expert_block, pdl_constants, pow2_at_least
from .quantize_details._quantize import GATHER, ROWS, SILU_MUL, quantize_grouped_kernel, routing_quantize_kernel
from .routing import J_BLOCK

__all__ = ["QuantConfig", "QUANT_CONFIGS", "QUANT_VALUES_CONFIGS", "QUANT_SILU_VALUES_CONFIGS", "quant_config",
           "quantize_rows",
           "quantize_rows_launcher", "quantize_rows_values_launcher", "silu_mul_quantize", "silu_mul_quantize_launcher",
           "silu_mul_quantize_values_launcher", "FUSED_ROUTING_MAX", "routing_quantize_values_launcher"]


@dataclass(frozen=True)
class QuantConfig:
    """One launch configuration of the quantization kernel.

    block_r: slots per program; block_k: columns per program (a multiple of 64);
    zero_words: int32 words of scale padding a zeroing program writes. Powers of two.
    whole_blocks: each 16-element block's halves loaded as two 8-element vectors so that one thread
    holds the whole block and quantizes it alone, rounding on the bits (``quantize_values_halves``,
    ``quantize_codes_halves``) and, on a GPU, the 16-bit roundings of the SiLU and the router weight
    by the hardware's conversion: the same bytes in fewer instructions where a program has a block or
    more per thread (``block_r * block_k / 16 >= 32 * num_warps``; with fewer, Triton splits a block
    over threads again). Rows whose K is not a multiple of 16 take the 16-wide form.
    """

    block_r: int
    block_k: int
    num_warps: int = 4
    zero_words: int = 1024
    whole_blocks: bool = False

    def __post_init__(self) -> None:
        for name, low in (("block_r", 1), ("block_k", 64), ("num_warps", 1), ("zero_words", 128)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low or v & (v - 1):
                raise ValueError(f"QuantConfig.{name}: expected a power of two >= {low}, got {v!r}")
        if not isinstance(self.whole_blocks, bool):
            raise ValueError(f"QuantConfig.whole_blocks: expected a bool, got {self.whole_blocks!r}")


# (largest number of slots, config), first match wins; ``config=`` pins another
# (benchmarks/tune_triton.py times candidates on the H200). Few slots (decode): one row of
# 256 columns per program, so many programs share the latency; many: larger blocks.
QUANT_CONFIGS: tuple[tuple[float, QuantConfig], ...] = (
    (64, QuantConfig(block_r=1, block_k=256, num_warps=1)),
    (1024, QuantConfig(block_r=4, block_k=256, num_warps=4)),
    (4096, QuantConfig(block_r=16, block_k=256, num_warps=4)),
    (float("inf"), QuantConfig(block_r=8, block_k=512, num_warps=4)),  # best at 32768 slots on the H200
)
# The values form's (``*_values_launcher``), one table per front end: whole blocks per thread past decode.
# Chosen on the H200 by benchmarks/sweep_triton_values.py --quant (2026-12-05,
# results/triton-quant-sweep-h200-2026-12-05.json): per slot range and front end, the candidate with the
# lowest mean of candidate / table time over the three layers' points. Against the codes form's table,
# which served both forms before (us): Qwen3 M = 4096 gather 145.1 -> 71.5 (4 x 512), SiLU-and-mul
# 176.1 -> 74.2 (8 x 256); M = 16384 563.8 -> 292.8 and 674.5 -> 267.0. At decode (<= 64 slots) the
# 16-wide 1 x 256 stays.
QUANT_VALUES_CONFIGS: tuple[tuple[float, QuantConfig], ...] = (
    QUANT_CONFIGS[0],
    (4096, QuantConfig(block_r=2, block_k=512, num_warps=1, whole_blocks=True)),
    (float("inf"), QuantConfig(block_r=4, block_k=512, num_warps=2, whole_blocks=True)),
)
# The SiLU-and-mul's 65-4096 slots: 2 x 256 on 1 warp (one block per lane) since the twenty-fifth session's
# sweep (results/triton-quant-sweep-h200-2026-12-05-s25-qwen.json; the other layers in
# tests/results/h200-2026-12-05-s25/call2/quant.log): Qwen3 (I = 768) M = 16 / 64 / 256 8.6 / 9.6 / 13.9 ->
# 6.9 / 7.4 / 9.9 us against the 1 x 512 before; Llama-4-Scout (I = 8192) M = 256 and 1024 and DeepSeek-V3
# (I = 2048) M = 256, 0.6-2.4% slower than it.
# Past 4096 slots 4 x 256 on 2 warps since the twenty-ninth session's sweep (on an H100, the H200 did not come:
# tests/results/h100-2026-12-05-s29/s29b/res/silu-sweep.json), against the 8 x 256 on 2 warps before, at every
# point of the three layers past 4096 slots (Qwen3 and DeepSeek-V3 M = 1024, 4096, 16384, Llama-4-Scout
# M = 16384): 0.84-0.89x its time, mean 0.85x (Qwen3 M = 4096 77.4 -> 65.7 us, M = 16384 274 -> 232); 2 x 256 on
# 1 warp 0.84-0.90x, mean 0.87x. (4 x 256 was not among the earlier sweeps' candidates.)
QUANT_SILU_VALUES_CONFIGS: tuple[tuple[float, QuantConfig], ...] = (
    QUANT_CONFIGS[0],
    (4096, QuantConfig(block_r=2, block_k=256, num_warps=1, whole_blocks=True)),
    # (256 columns: Qwen3's I = 768 is three such blocks, and 512-column ones leave a quarter of the lanes idle)
    (float("inf"), QuantConfig(block_r=4, block_k=256, num_warps=2, whole_blocks=True)),
)
# The interpreter runs each program in Python: few, large ones.
_INTERPRETER_CONFIG = QuantConfig(block_r=16, block_k=1024, zero_words=8192)


def quant_config(n_slots: int, values: bool = False, silu: bool = False) -> QuantConfig:
    """The table's configuration for ``n_slots`` rows (``values``: the values form's, the SiLU-and-mul
    front end's with ``silu``: :data:`QUANT_VALUES_CONFIGS`, :data:`QUANT_SILU_VALUES_CONFIGS`)."""
    if INTERPRET:
        return _INTERPRETER_CONFIG
    table = (QUANT_SILU_VALUES_CONFIGS if silu else QUANT_VALUES_CONFIGS) if values else QUANT_CONFIGS
    return next(cfg for bound, cfg in table if n_slots <= bound)



def _no_launch(src: torch.Tensor, row_scale: torch.Tensor | None) -> None:
    return None


def _launcher(mode, K, n, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, has_row_scale, packed, scales,
              config, raw=False) -> Callable[[torch.Tensor, torch.Tensor | None], None]:
    """The quantization kernel's launch on these buffers, a function of ``(src, row_scale)`` (the
    router weights, read only with ``has_row_scale``). ``scales`` None: ``packed`` is the fp16
    values buffer ``[n, K]`` (:func:`quantize_rows_values_launcher`); with ``raw``, the 16-bit values
    unquantized, in the source's dtype (``gs`` unused)."""
    E = expert_offsets.numel() - 1
    values = scales is None
    cp, rows = (triton.cdiv(K, 64) * 4, 0) if values else (scales.shape[1], scales.shape[0])
    if n == 0 or (rows == 0 and not values):
        return _no_launch
    cfg = config if config is not None else quant_config(n, values, mode == SILU_MUL)
    n_k_blocks = triton.cdiv(cp * BLOCK_SIZE, cfg.block_k)
    n_row_programs = triton.cdiv(n, cfg.block_r) * n_k_blocks
    n_w_blocks = triton.cdiv(32 * cp, cfg.zero_words)
    dummy = expert_offsets  # stands in for unused pointer arguments
    gather = dummy if slot_to_flat is None else slot_to_flat
    scale_bytes = packed if values else scales.view(torch.uint8)
    constants = dict(MODE=mode, HAS_ROW_SCALE=has_row_scale, INTERPRET=INTERPRET,
                     BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, W_BLOCK=cfg.zero_words, E_BLOCK=expert_block(E),
                     VALUES=values, WHOLE=cfg.whole_blocks and K % BLOCK_SIZE == 0 and not raw, RAW=raw,
                     num_warps=cfg.num_warps, **EXACT, **pdl_constants(packed.device))
    launch = Launch(quantize_grouped_kernel, (n_row_programs + rows // 128 * n_w_blocks,),
                    (FREE, FREE, gather, FREE, gs, expert_offsets, blockscale_offsets, packed, scale_bytes, n, topk, E,
                     K, cp, n_row_programs, n_k_blocks, n_w_blocks), constants)

    def run(src: torch.Tensor, row_scale: torch.Tensor | None) -> None:
        launch(src, src.stride(0), row_scale if has_row_scale else dummy)

    return run


def quantize_rows(x: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor,
                  slot_to_flat: torch.Tensor | None, row_scale: torch.Tensor | None, packed: torch.Tensor,
                  scales: torch.Tensor, config: QuantConfig | None = None) -> None:
    """Stage 2 into ``(packed [n, K/2], scales)``: gather, optional router weight, per-expert quantization.

    With ``slot_to_flat`` (``[n]``, ``n = x.shape[0] * topk``) slot ``s`` of expert ``e``
    holds ``x[slot_to_flat[s] // topk]`` (times ``row_scale[slot_to_flat[s]]``); without,
    ``x`` holds the ``n`` grouped rows. ``config`` pins the launch.
    """
    quantize_rows_launcher(x.shape[0], x.shape[1], gs, expert_offsets, blockscale_offsets, slot_to_flat,
                           row_scale is not None, packed, scales, config)(x, row_scale)


def quantize_rows_launcher(x_rows: int, K: int, gs: torch.Tensor, expert_offsets: torch.Tensor,  # noqa: N803
                           blockscale_offsets: torch.Tensor, slot_to_flat: torch.Tensor | None, has_row_scale: bool,
                           packed: torch.Tensor, scales: torch.Tensor | None,
                           config: QuantConfig | None = None, raw: bool = False
                           ) -> Callable[[torch.Tensor, torch.Tensor | None], None]:
    """:func:`quantize_rows` of rows ``x [x_rows, K]`` into these buffers, prepared once: a function of
    ``(x, row_scale)`` (``row_scale`` given exactly when ``has_row_scale``; needs ``slot_to_flat``)."""
    n = packed.shape[0]
    if slot_to_flat is None:
        return _launcher(ROWS, K, n, gs, expert_offsets, blockscale_offsets, None, 1, False, packed, scales, config,
                         raw)
    topk = n // x_rows if x_rows else 1
    return _launcher(GATHER, K, n, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, has_row_scale, packed,
                     scales, config, raw)


def quantize_rows_values_launcher(x_rows: int, K: int, gs: torch.Tensor, expert_offsets: torch.Tensor,  # noqa: N803
                                  slot_to_flat: torch.Tensor | None, has_row_scale: bool, values: torch.Tensor,
                                  config: QuantConfig | None = None, raw: bool = False
                                  ) -> Callable[[torch.Tensor, torch.Tensor | None], None]:
    """:func:`quantize_rows_launcher` writing the quantized rows' fp16 values ``e2m1 * e4m3`` (the global
    scale left to the GEMM) into ``values [n, K]`` instead of codes and scales. ``raw``
    (``precision="w4a16"``): the routed rows themselves (times the router weight, rounded to the rows'
    dtype, with ``has_row_scale``), not quantized, into ``values`` of the rows' dtype (zeros where a slot
    holds no row), what ``moe_fp4.stages.w4a16_rows`` writes."""
    return quantize_rows_launcher(x_rows, K, gs, expert_offsets, expert_offsets, slot_to_flat, has_row_scale, values,
                                  None, config, raw)


# Flat indices (M * topk) up to which the routing and the first quantization of the values form
# run as one launch (routing_quantize_values_launcher): decode, where a launch's latency is a large
# part of the forward. Each quantization program recomputes the routing of all of them (a
# FUSED_ROUTING_MAX^2 comparison), which grows past what a launch costs well before the
# single-program routing's limit (routing.SMALL_MAX).
FUSED_ROUTING_MAX = 64


def routing_quantize_values_launcher(x_rows: int, K: int, gs: torch.Tensor, expert_offsets: torch.Tensor,  # noqa: N803
                                     blockscale_offsets: torch.Tensor, slot_to_flat: torch.Tensor,
                                     flat_to_slot: torch.Tensor, has_row_scale: bool, values: torch.Tensor,
                                     config: QuantConfig | None = None, raw: bool = False
                                     ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None:
    """The routing (``routing.routing_launcher``: the four outputs) and :func:`quantize_rows_values_launcher`
    (gathered rows of ``x [x_rows, K]``) in one launch, prepared once: a function of
    ``(topk_ids, x, row_scale)``, writing the same bytes as the two launches. None where the
    ``n = values.shape[0]`` flat indices are more than :data:`FUSED_ROUTING_MAX` (or none). ``raw``: the
    rows unquantized (:func:`quantize_rows_values_launcher`)."""
    n = values.shape[0]
    if n == 0 or n > FUSED_ROUTING_MAX or x_rows == 0:
        return None
    E = expert_offsets.numel() - 1
    cfg = config if config is not None else quant_config(n, True)
    n_k_blocks = triton.cdiv(triton.cdiv(K, 64) * 4 * BLOCK_SIZE, cfg.block_k)
    n_row_programs = triton.cdiv(n, cfg.block_r) * n_k_blocks
    dummy = expert_offsets  # stands in for the router weights when they are not read
    constants = dict(HAS_ROW_SCALE=has_row_scale, INTERPRET=INTERPRET, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
                     E_BLOCK=expert_block(E), N_BLOCK=pow2_at_least(n, 16), J_BLOCK=J_BLOCK,
                     WHOLE=cfg.whole_blocks and K % BLOCK_SIZE == 0 and not raw, RAW=raw, num_warps=cfg.num_warps,
                     **EXACT, **pdl_constants(values.device))
    launch = Launch(routing_quantize_kernel, (n_row_programs + 1,),
                    (FREE, FREE, FREE, FREE, gs, expert_offsets, blockscale_offsets, slot_to_flat, flat_to_slot,
                     values, n, n // x_rows, E, K, n_row_programs, n_k_blocks), constants)

    def run(topk_ids: torch.Tensor, x: torch.Tensor, row_scale: torch.Tensor | None) -> None:
        launch(topk_ids.reshape(-1), x, x.stride(0), row_scale if has_row_scale else dummy)

    return run


def silu_mul_quantize(h: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor,
                      blockscale_offsets: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      config: QuantConfig | None = None) -> None:
    """Stage 4 into ``(packed, scales)``: ``silu(h[:, :I]) * h[:, I:]``, then per-expert quantization."""
    silu_mul_quantize_launcher(h, gs, expert_offsets, blockscale_offsets, packed, scales, config)()


def silu_mul_quantize_launcher(h: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor,
                               blockscale_offsets: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                               config: QuantConfig | None = None, raw: bool = False) -> Callable[[], None]:
    """:func:`silu_mul_quantize` of ``h`` into these buffers, prepared once (call it to launch)."""
    run = _launcher(SILU_MUL, h.shape[1] // 2, h.shape[0], gs, expert_offsets, blockscale_offsets, None, 1, False,
                    packed, scales, config, raw)
    return lambda: run(h, None)


def silu_mul_quantize_values_launcher(h: torch.Tensor, gs: torch.Tensor, expert_offsets: torch.Tensor,
                                      values: torch.Tensor, config: QuantConfig | None = None,
                                      raw: bool = False) -> Callable[[], None]:
    """:func:`silu_mul_quantize_launcher` writing fp16 values ``[n, I]`` instead of codes and scales. ``raw``
    (``precision="w4a16"``): the SiLU-and-mul product itself, not quantized, into ``values`` of ``h``'s dtype
    (zeros past ``expert_offsets[E]``), what ``moe_fp4.stages.w4a16_silu_mul`` writes."""
    return silu_mul_quantize_launcher(h, gs, expert_offsets, expert_offsets, values, None, config, raw)
