"""The Triton backend: the NVFP4 MoE pipeline of ``moe_fp4.stages`` on Triton kernels.

It serves every CUDA GPU Triton supports from SM80 on (Hopper above all, which has no FP4
tensor cores: both operands are turned in registers into fp16 ``e2m1 * e4m3 * 2^-7``,
exactly, and multiplied with float32 accumulation), and the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``), which runs the same kernels on the same fp16
operands (its float32 product of them is exact) without inline assembly.

The stage functions below take and return exactly the buffers of ``moe_fp4.stages`` (so
any stage can be checked against the reference or swapped with the CUDA backend's), after
validating shapes, dtypes and devices with :mod:`._stage_args`, the checks shared with the
CUDA backend (no data-dependent checks: they would synchronize).
``expert_offsets``/``blockscale_offsets``/``slot_to_flat``/``flat_to_slot`` must come
from :func:`routing` (or ``stages.routing``). Extra keyword arguments: ``out=`` buffers
and, for :func:`grouped_gemm`, ``config=`` (a ``moe_fp4.triton_kernels.GemmConfig``;
:func:`pinned_gemm_config` pins one for :func:`fused_moe`).

:func:`fused_moe` chains them with six kernel launches (routing takes two more when
``M * topk > 256``, and a GEMM one more when its configuration splits K), never
synchronizes with the host, allocates only the result (unless ``problem.out`` is given)
and is capturable in a CUDA graph. Intermediates live in workspaces cached per (device,
stream, dtype, layer shape, power-of-two row bucket) that are never freed, so a captured
graph's buffers stay valid; prepared weight layouts are cached on the experts object.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from types import ModuleType

import torch

from .._checks import check_tensor
from .._kernels import NAME as KERNELS_NAME
from .._kernels import load_triton_kernels
from ..format import grouped_scale_rows_bound
from ..stages import RoutingData, prepare_weight_scales
from . import _stage_args as stage_args

__all__ = [
    "availability",
    "fused_moe",
    "routing",
    "quantize_rows",
    "silu_mul_quantize",
    "grouped_gemm",
    "moe_reduce",
    "pinned_gemm_config",
]

# The Triton kernels take float8_e4m3fn grouped scales of exactly the bound's rows.
_SCALES = stage_args.ScaleBuffers((torch.float8_e4m3fn,), exact_rows=True)


def _kernels() -> ModuleType:
    return load_triton_kernels()


def availability(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """None when the Triton kernels can run on ``device``, otherwise why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    loaded = sys.modules.get(KERNELS_NAME)
    if loaded is not None and loaded.INTERPRET != interpreted:
        mode = "Triton's CPU interpreter" if loaded.INTERPRET else "the GPU compiler"
        return f"its kernels were already created for {mode}; TRITON_INTERPRET changed after they were imported"
    if device.type == "cuda":
        if capability is None or capability < (8, 0):
            return f"needs compute capability 8.0 or newer (bf16 tensor cores), this device has {capability}"
        return None
    if device.type == "cpu":
        if not interpreted:
            return "runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 before moe_fp4 imports its kernels"
        return None
    return f"runs on cuda devices (or cpu with TRITON_INTERPRET=1), not {device.type}"


# --------------------------------------------------------------------------- validation (Triton's own)


def _check_config(name: str, config, kind: type) -> None:
    """``config`` None or a ``kind`` (a ``triton_kernels`` launch configuration)."""
    if config is not None and not isinstance(config, kind):
        raise TypeError(f"{name}: expected a {kind.__name__}, got {type(config).__name__}")


# --------------------------------------------------------------------------- stages


def routing(topk_ids: torch.Tensor, num_experts: int, *, out: RoutingData | None = None) -> RoutingData:
    """Stage 1 (``stages.routing``) for int32 ``topk_ids [M, topk]``; ids outside ``[0, E)`` are not routed."""
    stage_args.routing_args(topk_ids, num_experts, out)
    return _kernels().routing(topk_ids, num_experts, out=out)


def quantize_rows(
    x: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor | None = None,
    topk: int = 1,
    row_scale: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 (``stages.quantize_rows``): gather + optional router weight + per-expert quantization.

    ``config`` pins a ``moe_fp4.triton_kernels.QuantConfig``.
    """
    stage_args.quantize_rows_args(x, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, row_scale, out,
                                  _SCALES)
    _check_config("config", config, _kernels().QuantConfig)
    return _kernels().quantize_rows(x, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, row_scale, out=out,
                                    config=config)


def silu_mul_quantize(
    h: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 4 (``stages.silu_mul_quantize``): SiLU-and-mul of the grouped GEMM1 output, then quantization.

    ``config`` pins a ``moe_fp4.triton_kernels.QuantConfig``.
    """
    stage_args.silu_mul_quantize_args(h, gs, expert_offsets, blockscale_offsets, out, _SCALES)
    _check_config("config", config, _kernels().QuantConfig)
    return _kernels().silu_mul_quantize(h, gs, expert_offsets, blockscale_offsets, out=out, config=config)


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
    config=None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stages 3 and 5 (``stages.grouped_gemm``); ``config`` pins a ``GemmConfig``.

    Rows past ``expert_offsets[E]`` are not written. ``partials`` may give the float32
    split-K workspace (at least ``triton_kernels.partials_numel`` elements; allocated when
    the configuration splits K and none is given).
    """
    g = stage_args.grouped_gemm_args(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out_dtype, out,
                                     _SCALES)
    tk = _kernels()
    _check_config("config", config, tk.GemmConfig)
    if partials is not None:
        check_tensor("partials", partials, dtypes=(torch.float32,), ndim=1, device=g.device, contiguous=True)
        cfg = config if config is not None else tk.gemm_config(g.n, g.E)
        need = tk.partials_numel(cfg, g.n, g.E, g.N, g.K, g.device)
        if partials.numel() < need:
            raise ValueError(f"partials: expected at least {need} float32 elements for this split-K launch, "
                             f"got {partials.numel()}")
    return tk.grouped_gemm(a, a_sf, b, b_sf, alpha, expert_offsets, blockscale_offsets, out_dtype,
                           out=out, config=config, partials=partials)


def moe_reduce(
    y: torch.Tensor,
    flat_to_slot: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_tokens: int,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 6 (``stages.moe_reduce``): un-permute and the weighted top-k sum (float32, slot order)."""
    stage_args.moe_reduce_args(y, flat_to_slot, topk_weights, num_tokens, out_dtype, out)
    return _kernels().moe_reduce(y, flat_to_slot, topk_weights, num_tokens, out_dtype, out=out)


# --------------------------------------------------------------------------- fused_moe

_PINNED_GEMM_CONFIG: contextvars.ContextVar = contextvars.ContextVar("moe_fp4_triton_gemm_config", default=None)


@contextlib.contextmanager
def pinned_gemm_config(config) -> Iterator[None]:
    """Within the block, :func:`fused_moe` runs both GEMMs with ``config`` (a ``GemmConfig``), not the table's."""
    if config is None:
        raise TypeError("config: expected a GemmConfig, got NoneType")
    _check_config("config", config, _kernels().GemmConfig)
    token = _PINNED_GEMM_CONFIG.set(config)
    try:
        yield
    finally:
        _PINNED_GEMM_CONFIG.reset(token)


@dataclass
class _Workspace:
    """Intermediate buffers for up to ``capacity`` routed rows of one layer shape (never freed)."""

    capacity: int
    routing: RoutingData
    scratch: torch.Tensor  # int32 per-chunk expert counts of the routing kernels
    a1: torch.Tensor  # uint8 [cap, H/2]
    a1_sf: torch.Tensor  # fp8 [rows_bound(cap), Cp(H)]
    a2: torch.Tensor  # uint8 [cap, I/2]
    a2_sf: torch.Tensor  # fp8 [rows_bound(cap), Cp(I)]
    hy: torch.Tensor  # GEMM1 output [cap, 2I], then GEMM2 output [cap, H] (flat)
    partials: list[torch.Tensor] = field(default_factory=list)  # float32 split-K sums; the last is current

    def split_k_buffer(self, numel: int) -> torch.Tensor | None:
        """A float32 split-K workspace of at least ``numel`` elements (None for 0).

        A larger one is allocated when needed (on a first call with a new shape or pinned
        config, before any graph capture); earlier ones are kept, so graphs that captured
        them stay valid.
        """
        if numel == 0:
            return None
        if not self.partials or self.partials[-1].numel() < numel:
            self.partials.append(torch.empty(numel, dtype=torch.float32, device=self.hy.device))
        return self.partials[-1]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (for tests that poison them between calls)."""
        out = [getattr(self.routing, f.name) for f in fields(RoutingData)]
        return out + [self.scratch, self.a1, self.a1_sf, self.a2, self.a2_sf, self.hy] + self.partials


_WORKSPACES: dict[tuple, _Workspace] = {}


def _workspace(device: torch.device, dtype: torch.dtype, E: int, H: int, I: int, n: int) -> _Workspace:
    tk = _kernels()
    cap = 1 << max(4, (n - 1).bit_length())  # power-of-two bucket >= n
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, dtype, E, H, I, cap)
    ws = _WORKSPACES.get(key)
    if ws is None:
        a1, a1_sf = tk.quantized_buffers(cap, H, E, device)
        a2, a2_sf = tk.quantized_buffers(cap, I, E, device)
        chunks, _ = tk.routing_scratch_shape(cap, E)
        ws = _Workspace(
            capacity=cap,
            routing=tk.routing_buffers(cap, E, device),
            scratch=torch.empty(max(chunks, 1) * E, dtype=torch.int32, device=device),
            a1=a1, a1_sf=a1_sf, a2=a2, a2_sf=a2_sf,
            hy=torch.empty(cap * max(2 * I, H), dtype=dtype, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


def _prepare_weights(ex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 scales [E,2,Np,Cp], w2 scales [E,1,Np,Cp], alpha13 [E,2], alpha2 [E,1]): swizzled per section."""
    alpha13, alpha2 = ex.alphas()
    return (
        prepare_weight_scales(ex.w13_scale, 2),
        prepare_weight_scales(ex.w2_scale, 1),
        alpha13,
        alpha2.reshape(-1, 1).contiguous(),
    )


def fused_moe(problem) -> torch.Tensor:
    """The MoE forward of ``moe_fp4.fused_moe`` (``problem`` is a validated ``MoEProblem``)."""
    tk = _kernels()
    x, ex = problem.hidden_states, problem.experts
    M, H = x.shape
    topk, E, I = problem.topk, ex.num_experts, ex.intermediate_size
    n = M * topk
    b13_sf, b2_sf, alpha13, alpha2 = ex.prepared(("triton", "weights"), _prepare_weights)
    ws = _workspace(x.device, x.dtype, E, H, I, n)
    pinned = _PINNED_GEMM_CONFIG.get()
    config = pinned if pinned is not None else tk.gemm_config(n, E)
    partials = ws.split_k_buffer(max(tk.partials_numel(config, n, E, 2 * I, H, x.device),
                                     tk.partials_numel(config, n, E, H, I, x.device)))
    rb = grouped_scale_rows_bound(n, E)

    full = ws.routing
    r = RoutingData(full.expert_offsets, full.blockscale_offsets, full.slot_to_flat[:n], full.flat_to_slot[:n])
    tk.routing(problem.topk_ids, E, out=r, scratch=ws.scratch)
    offs, bso = r.expert_offsets, r.blockscale_offsets
    w = problem.topk_weights
    a1 = tk.quantize_rows(x, ex.a13_gs, offs, bso, r.slot_to_flat, topk,
                          w.reshape(-1) if problem.apply_router_weight_on_input else None,
                          out=(ws.a1[:n], ws.a1_sf[:rb]))
    h = tk.grouped_gemm(*a1, ex.w13, b13_sf, alpha13, offs, bso, x.dtype,
                        out=ws.hy[: n * 2 * I].view(n, 2 * I), config=config, partials=partials)
    a2 = tk.silu_mul_quantize(h, ex.a2_gs, offs, bso, out=(ws.a2[:n], ws.a2_sf[:rb]))
    y = tk.grouped_gemm(*a2, ex.w2, b2_sf, alpha2, offs, bso, x.dtype,
                        out=ws.hy[: n * H].view(n, H), config=config, partials=partials)
    return tk.moe_reduce(y, r.flat_to_slot, None if problem.apply_router_weight_on_input else w, M, x.dtype,
                         out=problem.output())
