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

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import stages as ref_stages
from ..buffers import Quantized, RoutingData, WeightOperand
from ..errors import BackendUnavailableError
from ..experts import NvFp4Experts
from ..format import (
    FP4_AMAX_SCALE,
    decode_scaled,
    global_scale_for,
    grouped_scale_rows_bound,
    quantize_nvfp4,
    unswizzle_scales_grouped,
)
from ..moe import MoEProblem, fused_moe
from ..pipeline import StageSet, run_pipeline
from ..reference import dequantized_moe, exact_moe
from .checks import (
    ACT_QUANT_REL_TOL,
    BF16_ULP_REL_TOL,
    FUSED_REL_TOL,
    PEER_REL_TOL,
    CheckResult,
    check_rows,
    exact,
    spread_indices,
    within,
)
from .roofline import BF16_BITS, NVFP4_BITS, Ceilings, Floor, gemm_floor, moe_floor, touched_experts
from .shapes import ModelShape

__all__ = [
    "GEMM_CHECK_EXPERTS",
    "STAGES",
    "STAGE_FUNCTIONS",
    "Case",
    "StageChain",
    "TimedPath",
    "decoded_rows",
    "describe_exception",
    "gemm_rows_check",
    "is_unavailable",
    "poison",
    "layer_inputs",
    "random_experts",
    "tensors_of",
]

STAGE_FUNCTIONS = ("routing", "quantize_rows", "grouped_gemm", "silu_mul_quantize", "moe_reduce")
"""The stage functions of a :class:`~moe_fp4.pipeline.StageSet` (the GEMM serves twice)."""
STAGES = ("routing", "quantize", "gemm1", "silu_mul_quantize", "gemm2", "reduce")
"""The six timed stages, in pipeline order (the row names ``<provider>/<stage>``)."""

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
    E, H, I = shape.E, shape.H, shape.I
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
    return NvFp4Experts(q13, s13, gs13, q2, s2, gs2, a13, a2, own=True)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors in a path's output: a tensor, a tuple/list of outputs, or a buffer dataclass (RoutingData)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    return []


def poison(obj: Any) -> None:
    """Fill every output tensor with values no correct write leaves.

    1-byte tensors get 0xFF (an e4m3 NaN scale, E2M1 codes -6, -6), floats NaN, integers their
    maximum: not the all-ones bytes of :func:`moe_fp4.testing.poison`, which in int32 are
    ``-1``, a value routing writes (``slot_to_flat`` past the routed slots).
    """
    for t in tensors_of(obj):
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0xFF)
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


def layer_inputs(shape: ModelShape, tokens: int, device: torch.device, seed: int):
    """``(x, topk_weights, topk_ids)`` of ``tokens`` tokens, a function of ``seed`` and ``tokens`` only.

    The benchmark's distributions (every path, script and the expert-parallel benchmark draw them
    here): x ~ N(0, 1) in bf16; the top-k of a softmax of N(0, 1) logits, renormalized
    (near-uniform routing); float32 weights, int32 ids.
    """
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + tokens)
    x = torch.randn((tokens, shape.H), generator=gen, device=device).to(torch.bfloat16)
    top = torch.softmax(torch.randn((tokens, shape.E), generator=gen, device=device), dim=-1).topk(shape.topk, dim=-1)
    return x, (top.values / top.values.sum(-1, keepdim=True)).contiguous(), top.indices.to(torch.int32).contiguous()


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
        self.x, self.topk_weights, self.topk_ids = layer_inputs(shape, num_tokens, dev, seed)
        self.problem = MoEProblem(self.x, experts, self.topk_weights, self.topk_ids,
                                  apply_router_weight_on_input=False, out=None)
        self.n_touched = touched_experts(self.topk_ids)
        self.ceilings = ceilings
        self.floor = moe_floor(shape, num_tokens, self.n_touched, ceilings)
        self.rows = check_rows(num_tokens, check_tokens, dev)
        checked = (self.x[self.rows], experts, self.topk_weights[self.rows], self.topk_ids[self.rows])
        self.ref_w4a4 = _cached(lambda: exact_moe(*checked))
        self.ref_w4a16 = _cached(lambda: dequantized_moe(*checked))

    def summary(self) -> dict:
        return {"model": self.shape.name, "M": self.M, "experts_touched": self.n_touched,
                "checked_tokens": int(self.rows.numel()), **self.floor.to_dict()}

    def check_fused(self, out: torch.Tensor) -> CheckResult:
        """A moe_fp4 forward's rows against the exact W4A4 forward on the same tokens."""
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


# ----------------------------------------------------------------------------- stage checks


def decoded_rows(q: Quantized, routing: RoutingData) -> torch.Tensor:
    """float32 values of the routed rows of ``q`` (every expert's rows, in slot order)."""
    valid = int(routing.expert_offsets[-1])
    logical = unswizzle_scales_grouped(q.scales, routing.expert_offsets, routing.blockscale_offsets, q.K // 16)
    return decode_scaled(q.packed[:valid], logical)


def _reference_gemm(codes: bool) -> StageSet:
    """The reference GEMM of activations given by their codes and scales, or (``codes`` False: a stage set
    whose quantization writes the values only) by their exact values: the W4A16 reference GEMM multiplies
    ``Quantized.values``, which are ``e2m1 * scale`` exactly, so with the W4A4 alpha it computes the
    W4A4 reference GEMM bit for bit."""
    return ref_stages.STAGES if codes else ref_stages.STAGES_W4A16


def _one_expert_gemm(a: Quantized, w: WeightOperand, lo: int, hi: int, bso: tuple[int, int], e: int,
                     out_dtype: torch.dtype, codes: bool = True) -> torch.Tensor:
    """The reference GEMM of expert ``e``'s rows ``lo..hi`` alone (its scale region copied into a buffer of its own)."""
    m, region = hi - lo, bso[1] - bso[0]
    dev = a.device
    scales = torch.zeros((grouped_scale_rows_bound(m, 1), a.scales.shape[1]), dtype=a.scales.dtype, device=dev)
    scales[:region] = a.scales[bso[0]:bso[1]]
    slots = torch.arange(m, dtype=torch.int32, device=dev)
    routing = RoutingData(torch.tensor([0, m], dtype=torch.int32, device=dev),
                          torch.tensor([0, region], dtype=torch.int32, device=dev), slots, slots.clone())
    w_e = WeightOperand(w.packed[e:e + 1], w.scales[e:e + 1], w.alpha[e:e + 1])
    values = None if codes else _values_as(a, out_dtype).values[lo:hi]
    return _reference_gemm(codes).grouped_gemm(Quantized(a.packed[lo:hi], scales, values), w_e, routing, out_dtype)


def _values_as(a: Quantized, dtype: torch.dtype) -> Quantized:
    """``a`` with its values in ``dtype``, what the reference GEMM of 16-bit values takes (the output's dtype).
    Exact: values of stages with ``values_dtype`` are NVFP4 values (at most 6 significant bits, in
    ``[2^-10, 2688]``), which bf16 and fp16 both hold."""
    if a.values is None or a.values.dtype == dtype:
        return a
    return Quantized(a.packed, a.scales, a.values.to(dtype))


def gemm_rows_check(a: Quantized, w: WeightOperand, routing: RoutingData, out_dtype: torch.dtype,
                    codes: bool = True) -> Callable[[torch.Tensor], CheckResult]:
    """A grouped GEMM output's rows of up to :data:`GEMM_CHECK_EXPERTS` experts (spread, plus the largest)
    against one-expert reference GEMMs on the same operands, within one bf16 ulp (norm-relative)."""
    offs = routing.expert_offsets.tolist()
    bso = routing.blockscale_offsets.tolist()
    sizes = [offs[e + 1] - offs[e] for e in range(len(offs) - 1)]
    nonempty = [e for e, m in enumerate(sizes) if m]
    chosen = sorted({nonempty[i] for i in spread_indices(len(nonempty), GEMM_CHECK_EXPERTS - 1)}
                    | ({max(nonempty, key=lambda e: sizes[e])} if nonempty else set()))
    idx = torch.cat([torch.arange(offs[e], offs[e + 1], device=a.device) for e in chosen]) if chosen \
        else torch.zeros(0, dtype=torch.long, device=a.device)

    def reference() -> torch.Tensor:
        parts = [_one_expert_gemm(a, w, offs[e], offs[e + 1], (bso[e], bso[e + 1]), e, out_dtype, codes)
                 for e in chosen]
        return torch.cat(parts) if parts else torch.zeros((0, w.N), dtype=out_dtype, device=a.device)

    ref = _cached(reference)
    what = f"rows of experts {chosen} vs reference GEMM"
    return lambda out: within(what, out[idx], ref(), BF16_ULP_REL_TOL)


# ----------------------------------------------------------------------------- stage chains

_LABELS = {"routing": "routing", "quantize_rows": "quantize", "silu_mul_quantize": "silu_mul_quantize",
           "moe_reduce": "reduce"}
_BUFFER_KWARGS = ("out", "workspace", "config")  # where the output goes and how it is launched, not what it is
_SIGNATURES = {f: inspect.signature(getattr(ref_stages.STAGES, f)) for f in STAGE_FUNCTIONS}


def _reference_with_values(fn: str, args: dict[str, Any], values_dtype: torch.dtype | None = None) -> Quantized:
    """The reference quantization stage ``fn`` with the exact 16-bit ``values`` too (what the GEMMs of a
    stage set with ``activation_values`` multiply), of ``values_dtype`` (default: the rows' dtype)."""
    routing = args["routing"]
    src = args["x"] if fn == "quantize_rows" else args["h"]
    K = src.shape[1] if fn == "quantize_rows" else src.shape[1] // 2  # noqa: N806
    buf = Quantized.empty(routing.num_slots, K, routing.num_experts, src.device, values=values_dtype or src.dtype)
    kwargs = {k: v for k, v in args.items() if k not in _BUFFER_KWARGS}
    return getattr(ref_stages.STAGES, fn)(**kwargs, out=buf)


def _activation_rows(q: Quantized, routing: RoutingData, codes: bool) -> torch.Tensor:
    """float32 ``e2m1 * scale`` of the routed rows: decoded from the codes, or the values themselves."""
    return decoded_rows(q, routing) if codes else q.values[: int(routing.expert_offsets[-1])].float()


class StageChain:
    """The stages of one provider's pipeline, each checked and timed on the inputs :func:`run_pipeline` gives it.

    A provider is a :class:`~moe_fp4.pipeline.StageSet` (``moe_fp4.stages.STAGES``,
    ``moe_fp4.backends.triton.STAGES``, ...). :meth:`paths` runs ``run_pipeline`` once on a copy
    of it whose stage functions each (1) run the provider's stage on the arguments the
    pipeline passes, (2) check its output against the reference stage on the same arguments,
    (3) record a :class:`TimedPath` that re-runs the provider's stage on those arguments and
    (4) return the provider's output if it passed, else the reference's, so a stage that fails
    or cannot run here (a Blackwell-only GEMM on Hopper) does not stop the stages after it
    from being timed. The GEMM's first call is ``gemm1``, its second ``gemm2``.
    """

    def __init__(self, case: Case, provider: str, stages: StageSet) -> None:
        if not isinstance(stages, StageSet):
            raise TypeError(f"stages: expected a StageSet, got {type(stages).__name__}")
        self.case, self.provider, self.stages = case, provider, stages
        self._reset()

    def _reset(self) -> None:
        self._paths: list[TimedPath] = []
        self._gemms = 0
        self.all_provider = True  # every stage so far fed its own output on

    def _check(self, fn: str, args: dict[str, Any], reference: Callable[[], Any]) -> tuple[
            str, Callable[[Any], CheckResult], Floor | None]:
        """The stage's row name, the check of its output and its roofline floor (GEMMs only)."""
        c = self.case
        codes = self.stages.activation_codes  # else the quantization stages write the values only
        if fn == "grouped_gemm":
            self._gemms += 1
            a, w = args["a"], self._canonical(args["w"], self._gemms - 1)
            floor = gemm_floor(a.rows, w.N, w.K, c.n_touched, c.ceilings)
            return f"gemm{self._gemms}", gemm_rows_check(a, w, args["routing"], args["out_dtype"], codes), floor
        stage = _LABELS[fn]
        if stage == "routing":
            return stage, lambda out: exact(stage, out, reference()), None
        if stage == "quantize":
            if codes:
                return stage, lambda out: exact(stage, out, reference()), None
            return stage, lambda out: exact(f"{stage}.values", out.values, reference().values), None
        if stage == "silu_mul_quantize":
            r = args["routing"]
            ref_rows = _cached(lambda: decoded_rows(reference(), r))
            return stage, lambda out: within("decoded intermediate vs reference", _activation_rows(out, r, codes),
                                             ref_rows(), ACT_QUANT_REL_TOL), None
        end_to_end = self.all_provider  # all five earlier stages were the provider's own

        def check_reduce(out: torch.Tensor) -> CheckResult:
            res = within("reduce vs reference", out, reference(), BF16_ULP_REL_TOL)
            if not (res.ok and end_to_end):
                return res
            chain = c.check_fused(out)
            return CheckResult(chain.ok, f"{res.detail}; whole chain {chain.detail}", res.rel_err, res.tol)

        return stage, check_reduce, None

    def _canonical(self, w: Any, index: int) -> WeightOperand:
        """``w``, or for a backend's own weight layout (the sm_90a GEMM's) the canonical operand of GEMM ``index``."""
        return w if isinstance(w, WeightOperand) else ref_stages.STAGES.weights(self.case.experts)[index]

    def _run(self, fn: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One stage call of the pipeline: run, check, record, and hand on the provider's or the reference's output."""
        provider_fn = getattr(self.stages, fn)
        ref_kwargs = {k: v for k, v in kwargs.items() if k not in _BUFFER_KWARGS}
        bound = _SIGNATURES[fn].bind(*args, **kwargs).arguments
        if self.stages.activation_values and fn in ("quantize_rows", "silu_mul_quantize"):
            # the next GEMM multiplies the values
            reference = _cached(lambda: _reference_with_values(fn, bound, self.stages.values_dtype))
        elif fn == "grouped_gemm":
            index, codes = self._gemms, self.stages.activation_codes
            reference = _cached(lambda: _reference_gemm(codes).grouped_gemm(
                _values_as(bound["a"], bound["out_dtype"]), self._canonical(bound["w"], index), bound["routing"],
                bound["out_dtype"]))
        else:
            reference = _cached(lambda: getattr(ref_stages.STAGES, fn)(*args, **ref_kwargs))
        stage, check, floor = self._check(fn, bound, reference)
        name = f"{self.provider}/{stage}"

        def call() -> Any:
            return provider_fn(*args, **kwargs)

        try:
            out = call()
            ok = check(out).ok
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the next stages still run
            why = describe_exception(exc)
            reason = {"unavailable": why} if is_unavailable(exc) else {"error": why}
            self._paths.append(TimedPath(name, "stage", None, None, provider=self.provider, stage=stage, **reason))
            ok = False
        else:
            self._paths.append(TimedPath(name, "stage", call, check, floor, NVFP4_BITS if floor is not None else None,
                                         provider=self.provider, stage=stage))
        if ok:
            return out
        self.all_provider = False
        return reference()

    def checked_stages(self) -> StageSet:
        """The provider's stage set with every stage function run through :meth:`_run`."""

        def stage(fn: str) -> Callable[..., Any]:
            return lambda *args, **kwargs: self._run(fn, args, kwargs)

        return dataclasses.replace(self.stages, **{fn: stage(fn) for fn in STAGE_FUNCTIONS})

    def paths(self) -> Iterator[TimedPath]:
        """The six stage paths in pipeline order, recorded by one ``run_pipeline`` of :meth:`checked_stages`.

        If the pipeline itself raises (outside a provider stage), the stages it did not reach
        are rows with that error.
        """
        self._reset()
        try:
            run_pipeline(self.checked_stages(), self.case.problem)
        except Exception as exc:  # noqa: BLE001 - the remaining rows say why
            why = describe_exception(exc)
            for stage in STAGES[len(self._paths):]:
                self._paths.append(TimedPath(f"{self.provider}/{stage}", "stage", None, None, provider=self.provider,
                                             stage=stage, error=why))
        yield from self._paths
