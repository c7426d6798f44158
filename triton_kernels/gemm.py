"""Stages 3 and 5: the grouped NVFP4 x NVFP4 GEMM .

``D[rows of e] = alpha[e, section(n)] * (A_e . B_e^T)``. Both operands are turned in registers
into fp16 ``e2m1 * e4m3 * 2^-X`` (exact), multiplied on the tensor cores with float32
accumulation, scaled by ``2^2X * alpha`` per expert and weight section in float32 and rounded
to the output dtype (the same in Triton's CPU interpreter, whose fp16 dot is exact). Tiles
are scheduled from ``expert_offsets`` alone over a static grid of ``ceil(n/BM) + min(E, n)``
row tiles, so there is no host synchronization. Rows past ``expert_offsets[E]`` are not
written. With split-K, float32 partial sums over K ranges go to a workspace and a second
launch adds them in range order (deterministic); :func:`grouped_gemm_reduce_launcher` can make
that launch the top-k reduce's (a plan's second GEMM, with the backend's ``FUSE_TOPK_REDUCE``).
With ``fixup=`` / ``in_gemm=`` the GEMM's own last programs do that work instead, counted with atomic
counters (the same bits; the backend's ``FUSE_SPLIT_K_IN_GEMM`` and ``FUSE_TOPK_IN_GEMM``).

With ``a_sf=None`` the activation operand is the fp16 values the quantization stage wrote
(``[n, K]``) and the weights are in the K16 layout (:func:`k16_codes`): only the weights are
dequantized; the values may also be bf16 (``precision="w4a16"``: the model's rows, not quantized), and the
weight tiles are then converted to bf16 for the dot (exact). The launch configuration comes from
:data:`GEMM_CONFIGS`, keyed on the average rows per expert; ``config=`` pins one.
:func:`grouped_gemm_launcher` prepares the launches for given buffers and configuration once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton

from ._common import EXACT, FREE, INTERPRET, Launch, expert_block, pdl_constants
from .gemm_details._gemm import (
    dequantize_k16_kernel,
    grouped_gemm_kernel,
    split_k_reduce_kernel,
    split_k_topk_reduce_kernel,
)
from .reduce import moe_reduce_launcher

__all__ = ["GemmConfig", "GEMM_CONFIGS", "GEMM_VALUES_CONFIGS", "GEMM_VALUES_TILES", "GEMM_VALUES_PORTABLE_CONFIGS",
           "PORTABLE_SHARED_BYTES", "GEMM_CONFIGS_SM100", "NARROW_BELOW", "DEQUANT_MODES", "DENSE_FROM",
           "gemm_config", "pinned_config", "pinned_gemm_config", "resolve_config", "silu_fusable", "split_k_for",
           "k_ranges",
           "partials_numel", "dense_experts", "dense_nbytes", "grouped_gemm", "grouped_gemm_launcher",
           "grouped_gemm_reduce_launcher", "K16_SHIFTS",
           "k16_codes", "k16_restore"]

# How the operands are built (numerics_details/_nvfp4.py, "GEMM operands"); all exact.
# "bits": fp16 bits from the nibbles, fp16x2 multiply by the scale in inline assembly
# (plain fp16 multiplies in the interpreter); "bits-plain": the same without assembly;
# "float": float32 decode, no subnormal fp16 anywhere (the fallback).
DEQUANT_MODES = ("bits", "bits-plain", "float")


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the grouped GEMM.

    block_m: rows of one expert per tile (>= 16); block_n: output columns per tile (>= 16);
    block_k: reduction step (>= 64: four fp16 dots of block_k/4 >= 16); swap_ab: compute
    ``B . A^T`` (weights on the MMA's M side; for few rows per expert); split_k: K ranges
    summed by separate programs (1: none; 0: chosen by :func:`split_k_for` from the problem
    and the GPU); dequant: one of :data:`DEQUANT_MODES`. All blocks are powers of two.

    dense_mib (the values GEMM only; 0: off): instead of dequantizing the weights in the GEMM's
    loop, once per row tile, a separate kernel writes them as the fp16 operand (natural K order)
    into a scratch of at most ``dense_mib`` MiB (at least one expert), a chunk of experts at a
    time, and each chunk's GEMM multiplies fp16 by fp16 (no split). Pays where many row tiles
    share an expert's weights (prefill): :data:`DENSE_FROM`.

    maxnreg (0: the compiler's choice): at most that many registers a thread (ptxas's ``.maxnreg``, Triton's
    ``maxnreg`` option), so more programs fit an SM where registers bound them; a multiple of 8 from 32 to 248.
    """

    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    dequant: str = "bits"
    dense_mib: int = 0
    maxnreg: int = 0

    def __post_init__(self) -> None:
        for name, low in (("block_m", 16), ("block_n", 16), ("block_k", 64), ("num_warps", 1), ("num_stages", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low or (name != "num_stages" and v & (v - 1)):
                raise ValueError(f"GemmConfig.{name}: expected a power of two >= {low}, got {v!r}")
        if not isinstance(self.split_k, int) or self.split_k < 0 or self.split_k & (self.split_k - 1):
            raise ValueError(f"GemmConfig.split_k: expected 0 (auto) or a power of two, got {self.split_k!r}")
        if self.dequant not in DEQUANT_MODES:
            raise ValueError(f"GemmConfig.dequant: expected one of {DEQUANT_MODES}, got {self.dequant!r}")
        if not isinstance(self.dense_mib, int) or self.dense_mib < 0:
            raise ValueError(f"GemmConfig.dense_mib: expected an int >= 0, got {self.dense_mib!r}")
        if not isinstance(self.maxnreg, int) or (self.maxnreg and (self.maxnreg % 8 or not 32 <= self.maxnreg <= 248)):
            raise ValueError(f"GemmConfig.maxnreg: expected 0 (the compiler's choice) or a multiple of 8 from 32 to "
                             f"248, got {self.maxnreg!r}")
        if self.dense_mib and self.split_k != 1:
            raise ValueError(f"GemmConfig.split_k: the dense GEMM (dense_mib > 0) does not split K, "
                             f"got {self.split_k!r}")


# (largest average rows per expert, config), first match wins; tests and benchmarks pin
# others. Chosen on the H200 by benchmarks/tune_triton.py (2026-11-29: the lowest gemm1 +
# gemm2 time summed over Qwen3-30B-A3B, Llama-4-Scout and DeepSeek-V3 at M = 1, 16, 256,
# 4096; results in benchmarks/results/). Decode: weights on the MMA's M side (wgmma with
# the dequantized weights as its register operand, the activation tile in shared memory)
# and split-K for enough programs in flight. Prefill: 128x128 wgmma tiles on two warpgroups.
# 24 < rows <= 96 (M ~ 1024) was not tuned: 64x128x128 on one warpgroup there. Every entry
# compiles for sm_90 and sm_80 without register spills (tests/test_triton_compile.py).
GEMM_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    (4, GemmConfig(block_m=16, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=3, split_k=0)),
    (8, GemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=True, num_warps=4, num_stages=4, split_k=0)),
    (24, GemmConfig(block_m=32, block_n=64, block_k=128, swap_ab=True, num_warps=4, num_stages=4)),
    (96, GemmConfig(block_m=64, block_n=128, block_k=128, swap_ab=False, num_warps=4, num_stages=3)),
    (math.inf, GemmConfig(block_m=128, block_n=128, block_k=128, swap_ab=False, num_warps=8, num_stages=3)),
)
# The GEMM of fp16 activation values (``a_sf=None``): the same breakpoints, tiles of its own where the
# H200 sweep (benchmarks/sweep_triton_values.py, results/triton-values-sweep-h200-2026-12-02.json, Qwen3
# layer) found them faster: a 32x128 tile at 9-24 rows per expert (M=256: gemm1 125.6 -> 115.0 us,
# gemm2 82.2 -> 72.0) and a 64x256x64 tile past 96 (M=4096: 1082.5 -> 883.3, 667.5 -> 508.3); the
# others kept the codes table's tile, which won or tied there. Swept again on Llama-4-Scout and
# DeepSeek-V3 (results/triton-values-sweep-h200-2026-12-02-llama-deepseek.json): the best candidate
# or within 2% at every M but two GEMMs, DeepSeek-V3 M=1024 gemm1 (a 64x64 swap tile 4% faster,
# its gemm2 1% slower: not changed) and the one NARROW_BELOW takes. A third sweep (tenth session:
# results/triton-values-sweep-h200-2026-12-02-s10.json) gave 4-8 rows per expert a 16x128 tile with a
# five-deep ring: DeepSeek-V3 M=256 (K = 7168) gemm1 1803.9 -> 1576.2 us, gemm2 889.8 -> 813.2; Qwen3
# M=128 114.1 -> 112.1 and 70.5 -> 69.5; Llama-4-Scout M=128 gemm1 324.7 -> 318.8, its gemm2 (640 tiles)
# 187.8 -> 227.5, hence the same NARROW_BELOW fallback, to the codes table's 16x64 tile.
# An H100 sweep (forty-sixth session, tests/results/h100-2026-12-07-s46/s46b: the sweep, then the whole
# forward in turns with the table before, fusion_ab.py --values-tile) replaced two rows, each with a
# three-stage ring (it won wherever it was swept against deeper rings of the same tile: more programs per SM):
# - 4-8 rows per expert: the decode row's 16x64x256 tile, which the tenth session had not tried there.
#   Cold µs, gemm1 / gemm2, 16x128x128x5 -> 16x64x256x3: DeepSeek-V3 M=256 2420.3 -> 1545.0 /
#   938.4 -> 824.1; Qwen3 M=128 131.5 -> 106.8 / 76.4 -> 71.5; Llama-4-Scout M=128 389.2 -> 297.1 /
#   263.8 -> 161.2 (the narrow fallback's 16x64x128x4 ran 384.9 / 228.7). A 16x128x256 tile tied on
#   gemm1 (1537.3 at DeepSeek-V3) and lost on gemm2. Whole forward: DeepSeek-V3 M=256 3017.3 -> 2374.6,
#   Qwen3 M=128 213.4 -> 183.7, Llama-4-Scout M=128 620.5 -> 459.4. The NARROW_BELOW fallback has no
#   use here any more (the decode tile is the narrow one).
# - 25-96 rows: a 32x128x128 swap tile in place of the codes table's 64x128x128 mma tile. gemm1 / gemm2:
#   DeepSeek-V3 M=1024 2946.8 -> 2491.9 / 1565.7 -> 1328.4; Qwen3 M=1024 275.1 -> 262.5 / 170.4 -> 164.6;
#   Llama-4-Scout M=1024 824.9 -> 836.8 / 458.1 -> 389.4 (its four-stage ring slower at every one of the six).
#   Whole forward: DeepSeek-V3 M=1024 4446.0 -> 3972.4, Qwen3 M=512 319.8 -> 289.0, M=1024 481.0 ->
#   462.5, Llama-4-Scout M=512 856.9 -> 809.9, M=1024 1298.4 -> 1259.7; DeepSeek-V3 M=512 (16 rows, the
#   row before) level.
# The other rows held: at 9-24 rows (Llama-4-Scout and Qwen3 M=256) no candidate beat the table's tiles
# by more than 1% in gemm1 or in the narrow gemm2, and a 32x64x128 tile for the whole row lost 4-5% in
# the forward; at decode (Qwen3 M=16 and 64) the 16x64x256 three-stage tile won every GEMM. Timed on the
# H100 only: the H200 (4.8 TB/s against 3.35) may rank the rings differently.
#
# Past DENSE_FROM rows per expert the dense GEMM (GemmConfig.dense_mib): the weights dequantized once into
# an fp16 scratch of up to 1 GiB, then a 128x256x64 fp16 x fp16 tile on two warpgroups. Its extra memory
# traffic (the 2-byte weights written and read again) is paid back only where each expert's weights
# serve many row tiles. H200 sweeps (benchmarks/sweep_triton_values.py --dense / --fields,
# results/triton-dense-sweep-h200-2026-12-04.json; gemm1 / gemm2 us, in-loop -> dense): 512 rows per
# expert, Qwen3 M=8192 1601.8 -> 1207.0 / 941.7 -> 762.3, Llama-4-Scout M=8192 4843.3 -> 3789.9 /
# 2573.7 -> 1717.7, DeepSeek-V3 M=16384 26492.9 -> 21133.2 / 14678.3 -> 12464.3; 1024 rows, Qwen3
# M=16384 3096.0 -> 1911.7 / 1829.4 -> 1281.4; at 256 rows level or mixed (Qwen3 M=4096 882.0 -> 867.2
# / 510.5 -> 511.7, Llama-4-Scout 2633.4 -> 2746.8 / 1399.8 -> 1304.4), at 128 (DeepSeek-V3 M=4096)
# far slower (7665.2 -> 11824.9). Chunks of 512 MiB were 0-6% slower, of 2048 MiB level or 2-6% faster
# (Llama-4-Scout M=16384 gemm1, DeepSeek-V3 M=16384); four stages (192 KiB of shared memory, more than
# sm_80 has) within 2%.
DENSE_FROM = 256
GEMM_VALUES_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    GEMM_CONFIGS[0],
    (8, GEMM_CONFIGS[0][1]),
    (24, _SWAP32 := GemmConfig(block_m=32, block_n=128, block_k=128, swap_ab=True, num_warps=4, num_stages=3)),
    (96, _SWAP32),
    (DENSE_FROM, GemmConfig(block_m=64, block_n=256, block_k=64, swap_ab=False, num_warps=4, num_stages=3)),
    (math.inf, GemmConfig(block_m=128, block_n=256, block_k=64, swap_ab=False, num_warps=8, num_stages=3,
                          dense_mib=1024)),
)

# The values GEMM off Hopper (compute capability 8.x, 10.x, 12.x: ``precision="w4a16"``, whose rows are the
# model's 16-bit activations; W4A4 takes the codes operand there): the Hopper table's tiles made for wgmma
# spill registers on sm_80 (64x128x128: 32 bytes of stack with bf16 rows) or take more shared memory than the
# 99 KiB of a block on sm_86/sm_89/sm_120 (the dense 128x256 tile), so these, each compiled for sm_80, sm_100
# and sm_120 without spills, in at most 99 KiB on sm_80 and sm_120 (tests/test_triton_compile.py): up to 8
# rows per expert the codes table's 16x64x128 tile (its 16x64x256 decode tile spills 8 bytes on sm_100 where
# it splits K), then its 32x64x128 tile, a 64x128x64 tile at 25-96 rows per expert (64x128x128 spills) and
# the codes table's 128x128 prefill tile (82 KiB with 16-bit rows). Compiled, never run: no GPU of those
# generations exists here, so not timed either.
GEMM_VALUES_PORTABLE_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    *GEMM_CONFIGS[1:3],
    (96, GemmConfig(block_m=64, block_n=128, block_k=64, swap_ab=False, num_warps=4, num_stages=3)),
    GEMM_CONFIGS[4],
)
# The codes GEMM on compute capability 10.x and 11.x (Triton's tcgen05 lowering): Triton 3.6 compiles the codes
# GEMM's 128x128 tiles for sm_100 and sm_103 to a lone ``trap`` (the whole kernel: any warps, stages, K step or dequant
# mode; the values GEMM's 128x128 tile compiles), and its 16x64x256 decode tile unsplit to 32 bytes of stack.
# So the 16x64x128 tile up to 8 rows per expert and a 128x64x128 prefill tile, each compiled for sm_100
# without spills or traps (tests/test_triton_compile.py). Compiled, never run: no Blackwell GPU exists here.
GEMM_CONFIGS_SM100: tuple[tuple[float, GemmConfig], ...] = (
    *GEMM_CONFIGS[1:4],
    (math.inf, GemmConfig(block_m=128, block_n=64, block_k=128, swap_ab=False, num_warps=8, num_stages=3)),
)
# Shared memory a block of sm_86, sm_89 and sm_120 can take (sm_80, sm_90 and sm_100 take more).
PORTABLE_SHARED_BYTES = 99 * 1024

# The values table's 9-24-rows tile where it would leave the GPU few programs: with fewer than
# NARROW_BELOW tiles per SM (an E x N/128 grid, one row tile per expert: a layer with few experts),
# the codes table's 32x64 tile, twice the programs, fills the waves better (a long K at up to 16 rows per expert
# takes the long-K tile first; the 25-96 rows' 64-token tile is kept off the same small grids: below). H200
# sweep, Llama-4-Scout (E=16) M=256 gemm2 (N=5120: 640 tiles) 221.6 -> 201.6 us, its gemm1 (2048 tiles) keeps the 32x128
# (338.0 against 383.3); Qwen3 and DeepSeek-V3 (1536 tiles and more) keep it too
# (results/triton-values-sweep-h200-2026-12-02-llama-deepseek.json, benchmarks/README.md, ninth session).
NARROW_BELOW = 8
# The values table's rows that have a narrow fallback, by row bound: the 9-24 rows' 32x128 tile falls back to
# the codes table's tile of those rows (the 25-96 row, the same tile, has none: not measured there).
_VALUES_NARROW = {GEMM_VALUES_CONFIGS[2][0]: GEMM_CONFIGS[2][1]}
# Two alternatives of the values table's rows for the GEMM's shape (gemm_config), each from an H100 sweep and then
# the whole forward in turns (forty-seventh session, tests/results/h100-2026-12-07-s47: s47a the sweep, cold us;
# s47b the forward, fusion_ab.py, every output bitwise equal to the default plan's).
# - Long K at up to 16 rows per expert (9-24 rows' row; K >= VALUES_LONG_K_MIN, per expert <=
#   VALUES_LONG_K_MAX_ROWS): the decode row's 16x64x256 three-stage tile, ahead of the narrow fallback. Sweep at
#   16 rows, the row's tile -> 16x64x256x3: DeepSeek-V3 M=512 gemm1 (K = 7168) 2480.9 -> 2088.6, Llama-4-Scout
#   M=256 gemm2 (K = 8192; its narrow tile 220.3 in session 46) -> 210.6; shorter K lost (Llama-4-Scout gemm1,
#   K = 5120, 399.7 -> 427.7; DeepSeek-V3 gemm2, K = 2048, 1006.0 -> 1179.8; Qwen3's). Forward, rule off -> on:
#   DeepSeek-V3 M=512 3185.5 -> 3154.6, Llama-4-Scout M=256 630.1 -> 619.4; at 24 rows it lost (16-token row tiles
#   read most experts' weights twice): DeepSeek-V3 M=768 3384.5 -> 4099.9, Llama-4-Scout M=384 689.7 -> 732.3,
#   hence the rows bound. No K between 5120 and 7168 was timed, nor 17-23 rows.
# - At 25-96 rows per expert, a 64-token swap tile (64x128x128, three stages: one row tile for most experts where
#   the 32-token tile takes two) for the GEMMs whose grid is not small (E x N/128 >= NARROW_BELOW tiles per SM)
#   and whose K loop is not short (K >= VALUES_WIDE_K_MIN). Sweep at 32 rows, 32x128 -> 64x128 swap: gemm1 won
#   (Llama-4-Scout M=512, 2048 tiles, K = 5120: 530.3 -> 485.6; Qwen3, 1536 tiles, K = 2048: 168.0 -> 159.8);
#   gemm2 lost on a small grid (Llama-4-Scout, 640 tiles: 267.7 -> 276.9) and a short K (Qwen3, K = 768: 103.6
#   -> 106.9). Forward, off -> on: Llama-4-Scout M=512 803.2 -> 759.9, M=1024 1254.0 -> 1158.0; Qwen3 M=512
#   285.0 -> 277.7, M=1024 462.2 -> 436.7; DeepSeek-V3 M=1024 level (4070.7 -> 4068.8; the same call ran its
#   unfused plan, the same GEMMs, at 3918.8: a 4 % spread between copies of its 5.9 GiB of weights).
# Timed on the H100 only.
VALUES_LONG_K_MIN = 6144
VALUES_LONG_K_MAX_ROWS = 16
_VALUES_LONG_K = {GEMM_VALUES_CONFIGS[2][0]: GEMM_CONFIGS[0][1]}
VALUES_WIDE_ROWS = True
VALUES_WIDE_K_MIN = 1024
_VALUES_WIDE = {GEMM_VALUES_CONFIGS[3][0]: GemmConfig(block_m=64, block_n=128, block_k=128, swap_ab=True,
                                                       num_warps=4, num_stages=3)}
# Every tile the values table can choose (its rows' and the alternatives', each once): what the compile tests hold.
GEMM_VALUES_TILES: tuple[GemmConfig, ...] = tuple(dict.fromkeys(
    (*(cfg for _, cfg in GEMM_VALUES_CONFIGS), *_VALUES_NARROW.values(), *_VALUES_LONG_K.values(),
     *_VALUES_WIDE.values())))

_AUTO_SPLIT_MAX = 16
_AUTO_MIN_STEPS = 4  # K steps each range keeps at least
# A long K splits in two where the rule above leaves it whole (more than about 6 programs per SM): at decode
# (at most LONG_K_MAX_ROWS_PER_EXPERT rows per expert), for at least LONG_K_MIN_STEPS K steps (10 per range) on
# at most LONG_K_MAX_TILES_PER_SM tiles per SM. H200, twenty-fifth session (benchmarks/README.md):
# - the sweep (results/triton-decode-split-sweep-h200-2026-12-05.json, each GEMM with its reduce, cold us,
#   split 1 -> 2): Llama-4-Scout gemm1 (K = 5120) at M = 4 (1024 tiles) 70.7 -> 65.1, its gemm2 (K = 8192) at
#   M = 16 (1280 tiles) 107.7 -> 100.9, DeepSeek-V3 gemm1 (K = 7168) at M = 4 (2048 tiles) 193.3 -> 182.2;
#   level at 4096 tiles (Llama-4-Scout gemm1 M = 16) and at DeepSeek-V3 gemm1 M = 1 (512 tiles); a K of 8
#   steps lost (Qwen3 gemm1 M = 4 35.4 -> 37.3, DeepSeek-V3 gemm2 M = 4 106.3 -> 119.6);
# - the whole forward (fusion_ab.py, rule off -> on): Llama-4-Scout M = 4 107.0 -> 100.5, 16 296.8 -> 286.7,
#   64 377.9 -> 364.4; DeepSeek-V3 M = 1 102.8 -> 98.7, 4 301.6 -> 289.8; at 8 rows per expert (Llama-4-Scout
#   M = 128, the 4-8 rows' tiles) 510.1 -> 517.5, hence the rows bound.
# Measured on the H200's values form only; the codes form (whose decode row is the same tile) and other
# GPUs (the tile bound scales with their SM count) take the rule untimed. The rule is read when a plan
# first launches a configuration. False: the rule above alone.
LONG_K_SPLIT = True
LONG_K_MIN_STEPS = 20
LONG_K_MAX_TILES_PER_SM = 16
LONG_K_MAX_ROWS_PER_EXPERT = GEMM_CONFIGS[0][0]  # the tables' decode row (4 rows per expert)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache
def _major(device: torch.device) -> int | None:
    """The compute capability's major version of a GPU (None: the CPU, Triton's interpreter)."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def _table(values: bool, device: torch.device | None) -> tuple[tuple[float, GemmConfig], ...]:
    """The launch table of the GEMM of codes or (``values``) of values on ``device`` (None: as on Hopper)."""
    major = None if device is None else _major(device)
    if values:
        return GEMM_VALUES_CONFIGS if major in (None, 9) else GEMM_VALUES_PORTABLE_CONFIGS
    return GEMM_CONFIGS_SM100 if major in (10, 11) else GEMM_CONFIGS


def gemm_config(n_rows: int, num_experts: int, values: bool = False, N: int | None = None,  # noqa: N803
                device: torch.device | None = None, K: int | None = None) -> GemmConfig:  # noqa: N803
    """The table's configuration for ``n_rows`` routed rows over ``num_experts`` experts on ``device`` (``values``:
    :data:`GEMM_VALUES_CONFIGS`, for the GEMM of activation values, or :data:`GEMM_VALUES_PORTABLE_CONFIGS` off
    Hopper; the codes' :data:`GEMM_CONFIGS`, or :data:`GEMM_CONFIGS_SM100` on 10.x and 11.x). On Hopper's values
    table (also the CPU's and ``device=None``'s) a row may have alternatives for the GEMM's shape: with its ``K``,
    the long-K tile up to :data:`VALUES_LONG_K_MAX_ROWS` rows per expert (:data:`VALUES_LONG_K_MIN`); else with
    its ``N`` and ``device``, the narrow tile where the grid is small (:data:`NARROW_BELOW`); else with ``N``,
    ``device`` and ``K``, the 64-token tile where it is not (:data:`VALUES_WIDE_ROWS`)."""
    per_expert = n_rows / max(num_experts, 1)
    table = _table(values, device)
    bound, cfg = next((bound, cfg) for bound, cfg in table if per_expert <= bound)
    if table is not GEMM_VALUES_CONFIGS:
        return cfg
    long_k = _VALUES_LONG_K.get(bound)
    if long_k is not None and K is not None and K >= VALUES_LONG_K_MIN and per_expert <= VALUES_LONG_K_MAX_ROWS:
        return long_k
    if N is None or device is None:  # the grid unknown: neither the narrow nor the 64-token tile
        return cfg
    small_grid = num_experts * triton.cdiv(N, cfg.block_n) < NARROW_BELOW * _sm_count(device)
    narrow, wide = _VALUES_NARROW.get(bound), _VALUES_WIDE.get(bound) if VALUES_WIDE_ROWS else None
    if narrow is not None and small_grid:
        return narrow
    if wide is not None and not small_grid and K is not None and K >= VALUES_WIDE_K_MIN:
        return wide
    return cfg


_PINNED: contextvars.ContextVar[GemmConfig | None] = contextvars.ContextVar("moe_fp4_gemm_config", default=None)


@contextlib.contextmanager
def pinned_gemm_config(config: GemmConfig) -> Iterator[None]:
    """Within the block, GEMMs launched without ``config`` use ``config`` instead of the table's."""
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config: expected a GemmConfig, got {type(config).__name__}")
    token = _PINNED.set(config)
    try:
        yield
    finally:
        _PINNED.reset(token)


def pinned_config() -> GemmConfig | None:
    """The configuration :func:`pinned_gemm_config` pins here, or None."""
    return _PINNED.get()


def resolve_config(config: GemmConfig | None, n_rows: int, num_experts: int, values: bool = False,
                   N: int | None = None, device: torch.device | None = None,  # noqa: N803
                   K: int | None = None) -> GemmConfig:  # noqa: N803
    """``config``, else the pinned one, else the table's for ``n_rows`` rows over ``num_experts`` experts
    (:func:`gemm_config`)."""
    if config is not None:
        return config
    pinned = _PINNED.get()
    return pinned if pinned is not None else gemm_config(n_rows, num_experts, values, N, device, K)


def split_k_for(cfg: GemmConfig, n_rows: int, num_experts: int, N: int, K: int, device: torch.device) -> int:
    """K ranges for ``cfg``: its ``split_k``, or for 0 the largest power of two (<= 16) that keeps about
    6 programs per SM (row tiles counted as ``min(E, n)``, the decode case) and >= 4 K steps per range;
    where that is 1, 2 for a long K at decode on a grid of at most :data:`LONG_K_MAX_TILES_PER_SM` tiles per SM."""
    if cfg.split_k:
        return cfg.split_k
    tiles = min(num_experts, n_rows) * triton.cdiv(N, cfg.block_n)
    steps = triton.cdiv(K, cfg.block_k)
    sms = _sm_count(device)
    split = 1
    while split * 2 <= _AUTO_SPLIT_MAX and tiles * split * 2 <= 6 * sms and steps >= _AUTO_MIN_STEPS * split * 2:
        split *= 2
    if (split == 1 and LONG_K_SPLIT and n_rows <= LONG_K_MAX_ROWS_PER_EXPERT * num_experts
            and steps >= LONG_K_MIN_STEPS and tiles <= LONG_K_MAX_TILES_PER_SM * sms):
        split = 2
    return split


def k_ranges(cfg: GemmConfig, n_rows: int, num_experts: int, N: int, K: int,  # noqa: N803
             device: torch.device) -> tuple[int, int]:
    """``(ranges, steps per range)`` of the GEMM of ``cfg``: :func:`split_k_for`'s split, with as many K steps
    in each range as that needs and no empty range (1: the GEMM does not split)."""
    steps = triton.cdiv(K, cfg.block_k)
    per_range = triton.cdiv(steps, split_k_for(cfg, n_rows, num_experts, N, K, device))
    return triton.cdiv(steps, per_range), per_range


def partials_numel(config: GemmConfig | None, n_rows: int, num_experts: int, N: int, K: int,  # noqa: N803
                   device: torch.device, values: bool = False) -> int:
    """float32 elements of the split-K workspace :func:`grouped_gemm` needs (0: none); ``config`` as there."""
    cfg = resolve_config(config, n_rows, num_experts, values, N, device, K)
    split, _ = k_ranges(cfg, n_rows, num_experts, N, K, device)
    return split * n_rows * N if split > 1 else 0


def dense_experts(cfg: GemmConfig, num_experts: int, N: int, K: int) -> int:  # noqa: N803
    """Experts per chunk of the dense GEMM of ``cfg`` (0: ``cfg`` is not dense): as many as ``dense_mib`` MiB
    of fp16 weights hold, at least one, a multiple of 4 from 4 on (the chunks' per-expert views stay
    16-byte aligned, as Triton specializes pointers on it)."""
    if not cfg.dense_mib:
        return 0
    chunk = max(1, (cfg.dense_mib << 20) // (2 * N * K))
    return min(num_experts, chunk - chunk % 4 if chunk >= 4 else chunk)


def dense_nbytes(config: GemmConfig | None, n_rows: int, num_experts: int, N: int, K: int,  # noqa: N803
                 device: torch.device, values: bool = True) -> int:
    """Bytes of the fp16 weight scratch :func:`grouped_gemm` needs (0: none); ``config`` as there."""
    cfg = resolve_config(config, n_rows, num_experts, values, N, device, K)
    return 2 * dense_experts(cfg, num_experts, N, K) * N * K


def grouped_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig | None = None,
    partials: torch.Tensor | None = None,
    dense: torch.Tensor | None = None,
) -> None:
    """The grouped GEMM of ``a [n, K/2]`` with ``b [E, N, K/2]`` into ``out [n, N]``.

    ``a_sf`` is the grouped swizzled scale buffer (None: ``a`` is fp16 values ``[n, K]`` and
    ``b`` K16 codes), ``b_sf [E, S, Np_s, Cp]`` the weight scales per section, ``alpha [E, S]``
    the epilogue scales. ``config`` pins the launch (default: the pinned one of
    :func:`pinned_gemm_config`, else the table's); ``partials`` is the float32 split-K
    workspace (at least :func:`partials_numel` elements; allocated when needed and not given), ``dense``
    the dense GEMM's weight scratch (any dtype, at least :func:`dense_nbytes` bytes; likewise).
    """
    grouped_gemm_launcher(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, config, partials,
                          dense=dense)()


def _no_launch() -> None:
    return None


def silu_fusable(cfg: GemmConfig, values: bool, N: int, S: int) -> bool:  # noqa: N803
    """Whether the GEMM of ``cfg`` can take the SiLU-and-mul quantization into its epilogue: the values
    GEMM of gate and up (``S = 2``, ``N = 2 I``) with a tile of whole 16-column output blocks (``BN``
    a multiple of 32) and an ``I`` of whole blocks."""
    return values and S == 2 and cfg.block_n % 32 == 0 and (N // 2) % 16 == 0


def grouped_gemm_launcher(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, config=None,
                          partials=None, silu=None, dense=None, fixup=False) -> Callable[[], None]:
    """:func:`grouped_gemm` of these arguments (the same), prepared once with its configuration
    resolved now: call the result to launch.

    ``silu = (gs, h_dtype)`` (the values GEMM of gate and up, ``S = 2``; see :func:`silu_fusable`):
    the SiLU-and-mul quantization fused into the epilogue, ``out`` the fp16 values ``[n, N / 2]``
    the values form's quantization stage writes from ``h`` of dtype ``h_dtype`` with ``gs``.

    ``fixup``: where the configuration splits K, the GEMM's last program of each tile adds the K ranges
    (``FIXUP`` of the kernel: the same bits, one launch, a zeroed int32 counter per tile held by the launch;
    with ``silu``, then the SiLU-and-mul quantization, on gate/up tiles) in place of
    :func:`split_k_reduce_kernel`'s launch."""
    return _prepare(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, config, partials, silu,
                    dense, fixup).joined()


def grouped_gemm_reduce_launcher(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, y, flat_to_slot,
                                 weighted, num_tokens, config=None, partials=None, dense=None, fuse=True,
                                 in_gemm=False
                                 ) -> tuple[Callable[[], None], Callable[[torch.Tensor | None, torch.Tensor], None]]:
    """A plan's second GEMM and top-k reduce, prepared together: ``(gemm, reduce)``, where ``gemm()``
    and then ``reduce(topk_weights, out)`` write into ``out [num_tokens, N]`` what :func:`grouped_gemm`
    into ``y`` and then ``moe_reduce(y, flat_to_slot, topk_weights, out)`` write (the same bits).

    Where the configuration splits K (decode), ``gemm`` launches only the GEMM's K ranges and ``reduce``
    adds them, applies alpha, rounds each slot's row to ``y``'s dtype and takes the weighted top-k sum
    in one launch (:func:`~.gemm_details._gemm.split_k_topk_reduce_kernel`): one launch fewer, and ``y``
    is not written. Elsewhere (no split, as in the dense GEMM; no tokens; weights of more than one
    section, which a second GEMM does not have; more than 1024 experts; a float32 ``y``, or one with
    other rows than ``a``) the two launchers as they are. ``topk_weights`` is given exactly when
    ``weighted``. ``fuse=False``: the two launchers as they are, always.

    ``in_gemm`` (the same cases but the dense GEMM's, with or without a split; elsewhere ``fuse`` decides): one launch,
    ``reduce``'s, does all of it: the GEMM writes ``y``, its last program of each tile adds the K ranges
    (where it splits) and the last row tile of each column tile takes the top-k reduce of those columns
    for every token (``FIXUP`` and ``TOPK`` of :func:`~.gemm_details._gemm.grouped_gemm_kernel`: the same
    operations in the same order, the same bits; zeroed int32 counters held by the launch); ``gemm()``
    launches nothing. The last program reduces all ``num_tokens`` tokens of its columns: for decode."""
    fusable = (num_tokens > 0 and y.dtype in (torch.bfloat16, torch.float16) and b_sf.shape[1] == 1
               and y.shape[0] == a.shape[0])
    if in_gemm and fusable:
        prepared = _prepare(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, y, config, partials, None,
                            dense, True, (flat_to_slot, weighted, num_tokens))
        if prepared.reduce is None and prepared.topk is not None:
            launch = prepared.topk

            def reduce_in_gemm(topk_weights: torch.Tensor | None, out: torch.Tensor) -> None:
                launch(topk_weights if weighted else flat_to_slot, out)

            return _no_launch, reduce_in_gemm
    prepared = _prepare(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, y, config, partials, None, dense)
    E, N = b.shape[0], b.shape[1]
    if not fuse or not fusable or prepared.reduce is None or E > expert_block(E):
        return prepared.joined(), moe_reduce_launcher(y, flat_to_slot, weighted, num_tokens, N)
    block_n = min(triton.next_power_of_2(N), 4096 if INTERPRET else 256)
    block_t = 64 if INTERPRET else 1
    launch = Launch(split_k_topk_reduce_kernel, (triton.cdiv(num_tokens, block_t), triton.cdiv(N, block_n)),
                    (prepared.partials, alpha, expert_offsets, flat_to_slot, FREE, FREE, num_tokens, a.shape[0], N, E,
                     prepared.split),
                    dict(TOPK=flat_to_slot.numel() // num_tokens, FAST=prepared.fast, VALUES=a_sf is None,
                         Y_BF16=y.dtype == torch.bfloat16, HAS_WEIGHTS=weighted, BLOCK_T=block_t, BLOCK_N=block_n,
                         E_BLOCK=expert_block(E), num_warps=2, **EXACT, **pdl_constants(a.device)))

    def reduce(topk_weights: torch.Tensor | None, out: torch.Tensor) -> None:
        launch(topk_weights if weighted else flat_to_slot, out)

    return prepared.gemm, reduce


@dataclass(frozen=True)
class _Prepared:
    """A GEMM's launches: ``gemm`` (the main kernel, or the dense chunks' launches, or nothing) and, where
    the configuration splits K into ``split`` ranges of ``partials``, ``reduce`` (:func:`split_k_reduce_kernel`);
    ``fast``: the operands' 2^-X scaling (``GemmConfig.dequant`` not ``"float"``); ``topk``: with ``topk=`` of
    :func:`_prepare` where it took it, the GEMM's launch with the top-k reduce in it, whose two free
    values are the router weights (or ``flat_to_slot`` unweighted) and the output (``gemm`` is then unused)."""

    gemm: Callable[[], None]
    reduce: Launch | None = None
    split: int = 1
    partials: torch.Tensor | None = None
    fast: bool = True
    topk: Launch | None = None

    def joined(self) -> Callable[[], None]:
        """One function launching the GEMM and then its split-K reduce (if any)."""
        if self.reduce is None:
            return self.gemm
        gemm, reduce = self.gemm, self.reduce

        def launch_split() -> None:
            gemm()
            reduce()

        return launch_split


def _prepare(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, config, partials, silu,
             dense, fixup=False, topk=None) -> _Prepared:
    """:func:`grouped_gemm_launcher`'s launches, not yet joined. ``fixup``: a split GEMM adds its K ranges
    itself; ``topk = (flat_to_slot, weighted, num_tokens)``: the top-k reduce in the
    GEMM's launch (``_Prepared.topk``; with ``fixup``, not dense, not ``silu``; ``out`` is ``y``)."""
    values = a_sf is None
    n_rows, K = a.shape[0], a.shape[1] * (1 if values else 2)
    E, N = b.shape[0], b.shape[1]
    S = b_sf.shape[1]
    cfg = resolve_config(config, n_rows, E, values, N, a.device, K)
    if cfg.dense_mib:
        if not values:
            raise ValueError(f"config: the dense GEMM (dense_mib > 0) multiplies the activation values (a_sf=None), "
                             f"not codes, got {cfg}")
        if K % cfg.block_k:
            raise ValueError(f"config: the dense GEMM needs K a multiple of block_k (its K loop has no K mask), "
                             f"got K = {K}, {cfg}")
    if n_rows == 0:
        return _Prepared(_no_launch)
    split, split_steps = k_ranges(cfg, n_rows, E, N, K, a.device)
    if split > 1 and (partials is None or partials.numel() < split * n_rows * N):
        partials = torch.empty(split * n_rows * N, dtype=torch.float32, device=a.device)
    cp = b_sf.shape[-1]
    n_tiles_n = triton.cdiv(N, cfg.block_n)
    m_tiles = triton.cdiv(n_rows, cfg.block_m) + min(E, n_rows)
    fast = cfg.dequant != "float"
    if silu is not None and not silu_fusable(cfg, values, N, S):
        raise ValueError(f"silu: the fused SiLU-and-mul quantization needs the values GEMM of gate and up (S = 2) "
                         f"and a tile of whole 16-column blocks of both halves, got S = {S}, {cfg}")
    gs = alpha if silu is None else silu[0]  # (unused without silu)
    # The fused epilogue's gate/up column pairs and constants, where it runs: the GEMM without a split or with
    # fixup, else the reduce (compiled without contraction as the quantization kernel is). A split GEMM without
    # fixup computes its partial sums in natural column tiles (each element's sum is the same in any tile), and
    # the reduce reads them in pairs.
    rows = {} if silu is None else dict(SILU=True)
    epilogue = {} if silu is None else dict(H_BF16=silu[1] == torch.bfloat16, INTERPRET=INTERPRET, **EXACT)
    fixup = fixup and split > 1 and not cfg.dense_mib
    if topk is not None and (silu is not None or cfg.dense_mib or (split > 1 and not fixup)):
        topk = None
    # FIXUP's counters (one per program of grid axis 0) and TOPK's (one per column tile), zero between launches:
    # zeroed now, which a CUDA-graph capture would only record.
    counters = out
    if fixup or topk is not None:
        if a.device.type == "cuda" and _capturing(a.device):
            raise RuntimeError("the GEMM's reduce counters (fixup / the top-k reduce in the GEMM) are zeroed when its "
                               "launch is prepared, which cannot happen inside a CUDA-graph capture: run this "
                               "configuration once outside the capture first")
        counters = torch.zeros(m_tiles * n_tiles_n + n_tiles_n, dtype=torch.int32, device=a.device)
    gemm_args = (a, a if values else a_sf.view(torch.uint8), b, b_sf.view(torch.uint8), alpha, expert_offsets,
                 blockscale_offsets, out, partials if split > 1 else out, gs,
                 n_rows, N, K // 8, E, N // S, b_sf.shape[2], cp, n_tiles_n, split_steps, counters, out, out, out, 0)
    gemm_constants = dict(S=S, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SWAP_AB=cfg.swap_ab, SPLIT=split > 1,
                          FAST=fast, ASM=fast and cfg.dequant == "bits" and not INTERPRET, E_BLOCK=expert_block(E),
                          VALUES=values, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_constants(a.device),
                          **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
                          **(dict(rows, **epilogue) if split == 1 or fixup else {}))
    if values and a.dtype == torch.bfloat16 and INTERPRET:
        gemm_constants["INTERPRET"] = True  # bf16 rows (w4a16): the interpreter's dot in float32 (_mma)
    if cfg.dense_mib:
        return _Prepared(_dense_launches(cfg, a, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, gs, dense,
                                         gemm_args, gemm_constants), fast=fast)
    if fixup:
        gemm_constants["FIXUP"] = True
    if topk is not None:
        flat_to_slot, weighted, num_tokens = topk
        topk_args = gemm_args[:-4] + (flat_to_slot, FREE, FREE, num_tokens)
        topk_constants = dict(gemm_constants, TOPK=flat_to_slot.numel() // num_tokens, HAS_WEIGHTS=weighted,
                              BLOCK_T=64 if INTERPRET else 4, **EXACT)
        return _Prepared(_no_launch, None, split, partials, fast,
                         Launch(grouped_gemm_kernel, (m_tiles * n_tiles_n, split), topk_args, topk_constants))
    gemm = Launch(grouped_gemm_kernel, (m_tiles * n_tiles_n, split), gemm_args, gemm_constants)
    if split == 1 or fixup:
        return _Prepared(gemm, fast=fast)
    reduce = Launch(split_k_reduce_kernel, (m_tiles * n_tiles_n,),
                    (partials, alpha, expert_offsets, out, gs, n_rows, N, E, N // S, n_tiles_n, split),
                    dict(S=S, FAST=fast, BM=cfg.block_m, BN=cfg.block_n, E_BLOCK=expert_block(E), VALUES=values,
                         num_warps=4, **pdl_constants(a.device), **rows, **epilogue))
    return _Prepared(gemm, reduce, split, partials, fast)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _dense_launches(cfg, a, b, b_sf, alpha, expert_offsets, blockscale_offsets, out, gs, dense, gemm_args,
                    gemm_constants) -> Callable[[], None]:
    """The dense GEMM (``cfg.dense_mib``): per chunk of :func:`dense_experts` experts, the dequantization of
    their weights into ``dense`` and the GEMM of their rows with it (views of the per-expert arguments
    at the chunk's first expert; the rest of ``gemm_args`` as the in-loop GEMM has them)."""
    n_rows, E, N, K = a.shape[0], b.shape[0], b.shape[1], a.shape[1]
    chunk = dense_experts(cfg, E, N, K)
    need = chunk * N * K
    if dense is None or dense.numel() * dense.element_size() < 2 * need:
        dense = torch.empty(need, dtype=torch.float16, device=a.device)
    dense = dense.view(-1).view(torch.uint8)[:2 * need].view(torch.float16)
    bk = next(bk for bk in (256, 128, 64) if K % bk == 0)
    bn = 32
    deq_constants = dict(BN=bn, BK=bk, num_warps=4, **pdl_constants(a.device),  # the GEMM's operand constants
                         **{k: gemm_constants[k] for k in ("S", "FAST", "ASM")})
    constants = dict(gemm_constants, DENSE=True)
    sf = b_sf.view(torch.uint8)
    launches = []
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        launches.append(Launch(dequantize_k16_kernel, ((e1 - e0) * triton.cdiv(N, bn), K // bk),
                               (b[e0:e1], sf[e0:e1], dense, N, K // 8, N // b_sf.shape[1], b_sf.shape[2],
                                b_sf.shape[3], triton.cdiv(N, bn)), deq_constants))
        args = list(gemm_args)
        args[2:10] = dense, sf[e0:e1], alpha[e0:e1], expert_offsets[e0:], blockscale_offsets[e0:], out, out, gs[e0:]
        args[13] = e1 - e0  # E
        m_tiles = triton.cdiv(n_rows, cfg.block_m) + min(e1 - e0, n_rows)
        launches.append(Launch(grouped_gemm_kernel, (m_tiles * triton.cdiv(N, cfg.block_n), 1), tuple(args),
                               constants))

    def launch_dense() -> None:
        for launch in launches:
            launch()

    return launch_dense


# --------------------------------------------------------------------------- the K16 weight layout
#
# For the GEMM whose activation operand is the fp16 values (``VALUES``). Elements: within every
# 64-element group of K (32 bytes, 8 little-endian int32 words), word ``i`` holds the elements
# ``16 J + 2 i + h`` of the group for tiles ``J = 0..3`` and halves ``h = 0, 1``, so tile ``J`` of
# a K step is 16 consecutive elements of each group (whole scale blocks, and activation
# columns the kernel loads as they are). Bits: the magnitude bits (``e1 e0 m``) of element
# ``(J, h)`` sit at ``9 + 16 h - K16_SHIFTS[J][0]`` up and its sign at ``15 + 16 h -
# K16_SHIFTS[J][1]``, so the left shifts of the table (negative: right) put them where fp16
# wants them (``k16_pair_bits`` in ``numerics_details/_nvfp4.py``, which spells the same
# table out): 11 integer operations per word for its 8 elements, 15 in the canonical layout.
# The shifts were chosen by an exhaustive search of the layouts with one shift per field and
# tile (none does all four tiles with a single mask). The same bits, permuted: the layout can
# replace the canonical codes.
K16_SHIFTS = ((0, 0), (8, 8), (-3, 7), (5, 15))


def _k16_positions() -> list[tuple[int, int, int, int]]:
    """``(J, h, magnitude bit position, sign bit position)`` in a K16 word, for its 8 elements."""
    return [(j, h, 9 + 16 * h - dm, 15 + 16 * h - ds) for j, (dm, ds) in enumerate(K16_SHIFTS) for h in (0, 1)]


def k16_codes(codes: torch.Tensor) -> torch.Tensor:
    """Canonical NVFP4 codes ``uint8 [..., K/2]`` (K a multiple of 64) in the K16 layout (a new tensor)."""
    *lead, half_k = codes.shape
    nib = torch.stack((codes & 15, codes >> 4), dim=-1)  # element 2b + n of byte b
    nib = nib.reshape(*lead, half_k // 32, 4, 8, 2)  # (group, J, i, h): element 16 J + 2 i + h
    word = torch.zeros(nib.shape[:-3] + (8,), dtype=torch.int32, device=codes.device)  # wraps into bit 31
    for j, h, mag, sign in _k16_positions():
        c = nib[..., j, :, h].to(torch.int32)
        word |= ((c & 7) << mag) | ((c >> 3) << sign)
    return word.view(torch.uint8).reshape(*lead, half_k)  # int32 words, little-endian bytes


def k16_restore(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`k16_codes`: K16-layout codes back to canonical ones (a new tensor)."""
    *lead, half_k = codes.shape
    word = codes.reshape(*lead, half_k // 32, 8, 4).contiguous().view(torch.int32)[..., 0]  # masks undo sign shifts
    nib = torch.empty(word.shape[:-1] + (4, 8, 2), dtype=torch.uint8, device=codes.device)
    for j, h, mag, sign in _k16_positions():
        nib[..., j, :, h] = (((word >> mag) & 7) | (((word >> sign) & 1) << 3)).to(torch.uint8)
    nib = nib.reshape(*lead, half_k, 2)
    return nib[..., 0] | (nib[..., 1] << 4)
