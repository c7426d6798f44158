"""Weights, per-M inputs and the timed paths of one benchmark case.

* :func:`random_experts` makes one layer's NVFP4 experts from random bf16 weights, generated
  and quantized one expert at a time on the device (the DeepSeek-V3-like layer is 22.5 GB in
  bf16, 6.3 GB in NVFP4).
* :class:`Case` holds one M: random activations and routing, the roofline floor, the checked
  token rows and, computed once when first needed, the references on those rows.
* :class:`TimedPath` is one thing to time: a whole ``fused_moe`` per backend, a peer, or one
  stage of a backend's pipeline (:class:`StageChain`), each with the check its output must pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from .. import stages as ref_stages
from ..experts import NvFp4Experts
from ..format import FP4_AMAX_SCALE, decode_scaled, global_scale_for, quantize_nvfp4, unswizzle_scales_grouped
from ..backends.registry import BackendUnavailableError
from ..moe import fused_moe
from .checks import (
    ACT_QUANT_REL_TOL,
    BF16_ULP_REL_TOL,
    FUSED_REL_TOL,
    PEER_REL_TOL,
    CheckResult,
    check_rows,
    exact,
    spread_indices,
    w4a16_reference,
    within,
)
from .roofline import BF16_BITS, NVFP4_BITS, Ceilings, Floor, gemm_floor, moe_floor, touched_experts
from .shapes import ModelShape

__all__ = [
    "STAGES",
    "STAGE_FUNCTIONS",
    "random_experts",
    "TimedPath",
    "Case",
    "StageChain",
    "tensors_of",
    "poison",
    "describe_exception",
    "is_unavailable",
]

STAGE_FUNCTIONS = ("routing", "quantize_rows", "grouped_gemm", "silu_mul_quantize", "moe_reduce")
STAGES = ("routing", "quantize", "gemm1", "silu_mul_quantize", "gemm2", "reduce")

# Activation global scales (quantize direction, 2688/amax). x ~ N(0, 1) rarely exceeds 6; the
# intermediate silu(g)*u with g, u ~ N(0, 1) rarely exceeds 16. Larger blocks saturate at the
# e4m3 maximum, identically in every implementation (format core).
_A13_AMAX = 6.0
_A2_AMAX = 16.0

GEMM_CHECK_EXPERTS = 8  # experts whose grouped-GEMM rows are checked against the reference


def random_experts(shape: ModelShape, device: torch.device, seed: int) -> NvFp4Experts:
    """Random NVFP4 experts: ``w13 ~ N(0, 1/H)`` and ``w2 ~ N(0, 1/I)`` in bf16, quantized per expert.

    The scales make GEMM1 outputs ~N(0, 1) for x ~ N(0, 1). Each expert gets its own weight global
    scale (gate and up share one, as the checkpoint producers do).
    """
    E, H, I = shape.E, shape.H, shape.I  # noqa: E741
    gen = torch.Generator(device=device).manual_seed(seed)
    u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    q13 = torch.empty((E, 2 * I, H // 2), dtype=u8, device=device)
    s13 = torch.empty((E, 2 * I, H // 16), dtype=f8, device=device)
    q2 = torch.empty((E, H, I // 2), dtype=u8, device=device)
    s2 = torch.empty((E, H, I // 16), dtype=f8, device=device)
    gs13 = torch.empty(E, dtype=f32, device=device)
    gs2 = torch.empty(E, dtype=f32, device=device)
    for e in range(E):
        for (q, s, gs), (rows, k) in (((q13, s13, gs13), (2 * I, H)), ((q2, s2, gs2), (H, I))):
            w = (torch.randn((rows, k), generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
            gs[e] = global_scale_for(w)
            q[e], s[e] = quantize_nvfp4(w, gs[e])
    a13 = torch.full((E,), FP4_AMAX_SCALE / _A13_AMAX, dtype=f32, device=device)
    a2 = torch.full((E,), FP4_AMAX_SCALE / _A2_AMAX, dtype=f32, device=device)
    return NvFp4Experts(q13, s13, gs13, q2, s2, gs2, a13, a2)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors in a path's output: a tensor, a tuple/list of outputs, or a dataclass (RoutingData)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if is_dataclass(obj):
        return [t for f in fields(obj) for t in tensors_of(getattr(obj, f.name))]
    return []


def poison(obj: Any) -> None:
    """Fill every output tensor with values no correct write leaves (NaN, all-ones bytes, the int maximum)."""
    for t in tensors_of(obj):
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0xFF)  # e4m3 NaN; E2M1 codes -6, -6
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max)


@dataclass
class TimedPath:
    """One thing to time.

    name:        ``"triton"``, ``"marlin"``, ``"triton/gemm1"``, ...
    kind:        ``"backend"`` (a whole fused_moe), ``"peer"`` or ``"stage"``.
    fn:          one call, returning the output that ``check`` judges (None when unavailable).
    check:       the output's check against an independent reference.
    floor, bits: the roofline of the work and the path's weight storage (None for non-GEMM stages).
    unavailable: why the path cannot run here (then ``fn`` is None).
    error:       the exception its first call raised (then ``fn`` is None).
    """

    name: str
    kind: str
    fn: Callable[[], Any] | None
    check: Callable[[Any], CheckResult] | None
    floor: Floor | None = None
    bits: float | None = None
    provider: str | None = None
    stage: str | None = None
    unavailable: str | None = None
    error: str | None = None


def describe_exception(exc: BaseException) -> str:
    """``"Type: first line of the message"`` (at most 300 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_unavailable(exc: BaseException) -> bool:
    """An exception that means "cannot run here" (not built, not supported), as opposed to a failure."""
    return isinstance(exc, (ImportError, NotImplementedError, BackendUnavailableError))


def _cached(fn: Callable[[], Any]) -> Callable[[], Any]:
    return functools.lru_cache(maxsize=1)(fn)


class Case:
    """One M of one layer: inputs, floor, checked rows and (lazily) the references on them."""

    def __init__(self, shape: ModelShape, experts: NvFp4Experts, num_tokens: int, ceilings: Ceilings, seed: int,
                 check_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens: expected at least 1 token, got {num_tokens}")
        self.shape, self.experts, self.M = shape, experts, num_tokens
        dev = experts.device
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + num_tokens)
        self.x = torch.randn((num_tokens, shape.H), generator=gen, device=dev).to(torch.bfloat16)
        probs = torch.softmax(torch.randn((num_tokens, shape.E), generator=gen, device=dev), dim=-1)
        w, ids = probs.topk(shape.topk, dim=-1)
        self.topk_weights = (w / w.sum(-1, keepdim=True)).contiguous()
        self.topk_ids = ids.to(torch.int32).contiguous()
        self.n_touched = touched_experts(self.topk_ids)
        self.ceilings = ceilings
        self.floor = moe_floor(shape, num_tokens, self.n_touched, ceilings)
        self.rows = check_rows(num_tokens, check_tokens, dev)
        self.ref_w4a4 = _cached(lambda: fused_moe(self.x[self.rows], experts, self.topk_weights[self.rows],
                                                  self.topk_ids[self.rows], backend="reference"))
        self.ref_w4a16 = _cached(lambda: w4a16_reference(self.x[self.rows], self.topk_weights[self.rows],
                                                         self.topk_ids[self.rows], experts))

    def summary(self) -> dict:
        return {"model": self.shape.name, "M": self.M, "experts_touched": self.n_touched,
                "checked_tokens": int(self.rows.numel()), **self.floor.to_dict()}

    def check_fused(self, out: torch.Tensor) -> CheckResult:
        """A moe_fp4 forward's rows against the reference backend on the same tokens."""
        return within("out vs reference backend (W4A4)", out[self.rows], self.ref_w4a4(), FUSED_REL_TOL)

    def check_peer(self, out: torch.Tensor) -> CheckResult:
        return within("out vs float64 W4A16 reference", out[self.rows], self.ref_w4a16(), PEER_REL_TOL)

    def backend_path(self, backend: str, unavailable: str | None) -> TimedPath:
        """The whole ``fused_moe`` on ``backend`` (``unavailable``: the registry's reason, if any)."""
        out = torch.empty_like(self.x)

        def fn() -> torch.Tensor:
            return fused_moe(self.x, self.experts, self.topk_weights, self.topk_ids, backend=backend, out=out,
                             validate=False)

        return TimedPath(backend, "backend", None if unavailable else fn, self.check_fused, self.floor, NVFP4_BITS,
                         unavailable=unavailable)

    def peer_path(self, name: str, forward: Any | None, unavailable: str | None) -> TimedPath:
        out = torch.empty_like(self.x)
        bits = BF16_BITS if name == "bf16" else NVFP4_BITS

        def fn() -> torch.Tensor:
            return forward(self.x, self.topk_weights, self.topk_ids, out=out)

        return TimedPath(name, "peer", None if unavailable else fn, self.check_peer, self.floor, bits,
                         unavailable=unavailable)


def _decoded_grouped(packed: torch.Tensor, scales: torch.Tensor, routing: Any) -> torch.Tensor:
    """Values of grouped quantized rows (the rows of every expert, in slot order)."""
    valid = int(routing.expert_offsets[-1])
    cols = packed.shape[1] * 2 // 16
    logical = unswizzle_scales_grouped(scales, routing.expert_offsets, routing.blockscale_offsets, cols)
    return decode_scaled(packed[:valid], logical)


class StageChain:
    """The stages of one provider's pipeline, each timed on its own inputs.

    A provider is a module with the functions of :mod:`moe_fp4.stages` (``routing``,
    ``quantize_rows``, ``grouped_gemm``, ``silu_mul_quantize``, ``moe_reduce``), and optionally
    its own ``prepare_weight_scales``. Each stage is first run once eagerly and checked; the
    next stage takes that output if it passed, else the reference stage's output on the same
    inputs, so a stage that fails or cannot run here (a Blackwell-only GEMM on Hopper) does not
    stop the stages after it from being timed.
    """

    def __init__(self, case: Case, provider: str, module: Any) -> None:
        self.case, self.provider, self.module = case, provider, module
        ex = case.experts
        prep = getattr(module, "prepare_weight_scales", ref_stages.prepare_weight_scales)
        self.b13_sf = prep(ex.w13_scale, 2)
        self.b2_sf = prep(ex.w2_scale, 1)
        self.alpha13, self.alpha2 = ex.alphas()
        self.all_provider = True  # every stage so far fed its own output on

    def _gemm_check(self, a, a_sf, b, b_sf, alpha, routing) -> Callable[[torch.Tensor], CheckResult]:
        """GEMM rows of up to GEMM_CHECK_EXPERTS experts (spread, plus the largest) vs one-expert reference GEMMs."""
        offs = routing.expert_offsets.tolist()
        bso = routing.blockscale_offsets.tolist()
        sizes = [offs[e + 1] - offs[e] for e in range(len(offs) - 1)]
        nonempty = [e for e, m in enumerate(sizes) if m]
        chosen = sorted({nonempty[i] for i in spread_indices(len(nonempty), GEMM_CHECK_EXPERTS - 1)}
                        | {max(nonempty, key=lambda e: sizes[e])})
        idx = torch.cat([torch.arange(offs[e], offs[e + 1], device=a.device) for e in chosen])
        alpha2d = alpha.reshape(b.shape[0], -1)

        def one_expert(e: int) -> torch.Tensor:
            lo, hi = offs[e], offs[e + 1]
            i32 = functools.partial(torch.tensor, dtype=torch.int32, device=a.device)
            return ref_stages.grouped_gemm(a[lo:hi], a_sf[bso[e]:bso[e + 1]], b[e:e + 1], b_sf[e:e + 1],
                                           alpha2d[e:e + 1], i32([0, hi - lo]), i32([0, bso[e + 1] - bso[e]]),
                                           self.case.x.dtype)

        ref = _cached(lambda: torch.cat([one_expert(e) for e in chosen]))
        what = f"rows of experts {chosen} vs reference GEMM"
        return lambda out: within(what, out[idx], ref(), BF16_ULP_REL_TOL)

    def _stage(self, stage: str, call: Callable[[], Any], check: Callable[[Any], CheckResult],
               reference: Callable[[], Any], floor: Floor | None = None) -> Iterator[TimedPath]:
        """Yield the stage's path; afterwards ``self.result`` is the output the next stage takes."""
        name = f"{self.provider}/{stage}"
        try:
            out = call()
            ok = check(out).ok
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the next stages still run
            why = describe_exception(exc)
            if is_unavailable(exc):
                yield TimedPath(name, "stage", None, None, provider=self.provider, stage=stage, unavailable=why)
            else:
                yield TimedPath(name, "stage", None, None, provider=self.provider, stage=stage, error=why)
            out, ok = None, False
        else:
            bits = NVFP4_BITS if floor is not None else None
            yield TimedPath(name, "stage", call, check, floor, bits, provider=self.provider, stage=stage)
        if not ok:
            self.all_provider = False
            out = reference()
        self.result = out

    def paths(self) -> Iterator[TimedPath]:
        """The six stage paths in pipeline order (a generator: each stage's inputs exist once the previous yielded)."""
        c, m, ex, dt = self.case, self.module, self.case.experts, self.case.x.dtype
        shape = c.shape
        rows = c.M * shape.topk
        ids = c.topk_ids

        ref_r = _cached(lambda: ref_stages.routing(ids, shape.E))
        yield from self._stage("routing", lambda: m.routing(ids, shape.E),
                               lambda r: exact("routing", {f: (getattr(r, f), getattr(ref_r(), f))
                                                           for f in ("expert_offsets", "blockscale_offsets",
                                                                     "slot_to_flat", "flat_to_slot")}), ref_r)
        r = self.result

        def quant_args():
            return (c.x, ex.a13_gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, shape.topk)

        ref_q = _cached(lambda: ref_stages.quantize_rows(*quant_args()))
        yield from self._stage("quantize", lambda: m.quantize_rows(*quant_args()),
                               lambda o: exact("quantize", {"packed": (o[0], ref_q()[0]),
                                                            "scales": (o[1], ref_q()[1])}),
                               ref_q)
        a, a_sf = self.result

        def gemm_stage(stage, a, a_sf, b, b_sf, alpha, n, k):
            args = (a, a_sf, b, b_sf, alpha, r.expert_offsets, r.blockscale_offsets, dt)
            return self._stage(stage, lambda: m.grouped_gemm(*args), self._gemm_check(*args[:5], r),
                               lambda: ref_stages.grouped_gemm(*args), gemm_floor(rows, n, k, c.n_touched, c.ceilings))

        yield from gemm_stage("gemm1", a, a_sf, ex.w13, self.b13_sf, self.alpha13, 2 * shape.I, shape.H)
        h = self.result

        sq_args = (h, ex.a2_gs, r.expert_offsets, r.blockscale_offsets)
        ref_sq = _cached(lambda: ref_stages.silu_mul_quantize(*sq_args))
        yield from self._stage("silu_mul_quantize", lambda: m.silu_mul_quantize(*sq_args),
                               lambda o: within("decoded intermediate vs reference", _decoded_grouped(*o, r),
                                                _decoded_grouped(*ref_sq(), r), ACT_QUANT_REL_TOL), ref_sq)
        a2, a2_sf = self.result

        yield from gemm_stage("gemm2", a2, a2_sf, ex.w2, self.b2_sf, self.alpha2, shape.H, shape.I)
        y = self.result

        red_args = (y, r.flat_to_slot, c.topk_weights, c.M, dt)
        ref_red = _cached(lambda: ref_stages.moe_reduce(*red_args))
        end_to_end = self.all_provider  # all five earlier stages were the provider's own

        def check_reduce(out: torch.Tensor) -> CheckResult:
            res = within("reduce vs reference", out, ref_red(), BF16_ULP_REL_TOL)
            if not (res.ok and end_to_end):
                return res
            chain = c.check_fused(out)
            return CheckResult(chain.ok, f"{res.detail}; whole chain {chain.detail}", res.rel_err, res.tol)

        yield from self._stage("reduce", lambda: m.moe_reduce(*red_args), check_reduce, ref_red)
