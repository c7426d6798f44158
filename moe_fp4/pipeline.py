"""The MoE pipeline, composed once: stage contracts, the :class:`StageSet` of a backend, workspaces.

The forward of :func:`moe_fp4.fused_moe` is six stages over the buffers of
:mod:`moe_fp4.buffers` (``M`` tokens, ``topk`` slots per token, ``n = M * topk`` slots,
``E`` experts, ``H`` hidden, ``I`` intermediate):

1. ``routing(topk_ids, E) -> RoutingData``: slots grouped by expert, ascending flat index
   ``t * topk + j`` within an expert (deterministic); ids outside ``[0, E)`` are not routed.
2. ``quantize_rows(x, gs, routing) -> Quantized``: gather (slot ``s`` holds row
   ``x[slot_to_flat[s] // topk]``), optional router weight, per-expert NVFP4 quantization.
3. ``grouped_gemm(a, w13, routing, dtype)``: ``D_e = alpha_e * (A_e . W_e^T)``, fp32
   accumulation, alpha per section (gate, up).
4. ``silu_mul_quantize(h, gs, routing) -> Quantized``: ``silu(h[:, :I]) * h[:, I:]``, quantized.
5. ``grouped_gemm(a2, w2, routing, dtype)``.
6. ``moe_reduce(y, routing, topk_weights, M, dtype)``: un-permute and the top-k weighted
   sum in float32, slot order ``j = 0..topk-1``.

That is the W4A4 pipeline (``StageSet.precision == "w4a4"``). A stage set of precision
``"w4a16"`` composes the same six stages, but its stages 2 and 4 do not quantize: they write
the gathered (router-weighted) rows and the SiLU-mul product unquantized into
``Quantized.values`` (their ``gs`` argument is unused; ``packed`` and ``scales`` are left
as they are), and its GEMMs multiply those 16-bit values with alpha ``1/gs_w`` (the weights'
global scales only). :func:`run_pipeline` refuses a stage set whose precision is not the
problem's.

A backend supplies *kernels* (:class:`StageKernels`: the stage computations writing into
buffers that are already allocated and checked); :meth:`StageSet.from_kernels` wraps them
in the stage functions below, which check their arguments (the contract, written once for
every backend), allocate what the caller did not pass and call the kernels.
:func:`run_pipeline` chains any :class:`StageSet`, so tests mix stages of different
backends with ``dataclasses.replace(triton.STAGES, grouped_gemm=stages.STAGES.grouped_gemm)``.

Workspaces (:class:`Workspace`) hold the intermediates of one layer shape for up to a
power-of-two bucket of slots; they are cached per (stage set, device, dtype, layer shape,
bucket) by :func:`cached_workspace` and never freed, so a captured CUDA graph's buffers stay
valid. They are allocated outside CUDA-graph capture: a capture uses the workspace an eager
call of the same shape made, and one with none raises and says to run the shape once first.
What a forward keeps across calls (its workspace, the experts' prepared weights, its plan) is
made on a thread of its own (:func:`off_graph_pool`), so that it stays out of the memory pool of
``torch.compile(mode="reduce-overhead")``'s CUDA graphs even when the first call of a shape is
their warm-up run: those route every allocation of the calling thread into the graphs' pool and
refuse a graph whose pool holds a tensor that is not an output.
Forwards that share a workspace are serialized by its lock and ordered across CUDA streams
(:class:`Workspace`).

On a workspace, the first forward of each shape (``M``, ``topk``, dtype, router weights on the
input or not) runs the checked stage functions. If the stage set is the one
:meth:`StageSet.from_kernels` made (not a mix), the forward is then kept as a *plan*: the
workspace's buffers for that shape, the prepared weights and the kernels' launches with their
static arguments bound (:class:`PlanBuffers`, :class:`BoundStages`). Later forwards of that
shape call the bound launches directly: the problem was validated once (:class:`~moe_fp4.moe.MoEProblem`)
and every other argument is one the checked run accepted. Plans are kept on the workspace, per
experts object (held weakly: they go with the experts; at most :data:`MAX_PLANS` each).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import torch

from ._checks import check_precision, check_tensor, dtype_name
from .buffers import (
    ROW_DTYPES,
    Quantized,
    RoutingData,
    WeightOperand,
    check_buffer,
    check_expert_vector,
    check_positive_int,
)
from .format import BLOCK_SIZE

if TYPE_CHECKING:
    from .experts import NvFp4Experts
    from .moe import MoEProblem

__all__ = [
    "MAX_PLANS",
    "BoundStages",
    "PlanBuffers",
    "Scratch",
    "StageKernels",
    "StageSet",
    "StreamOrder",
    "Workspace",
    "bind_kernels",
    "cached_workspace",
    "off_graph_pool",
    "cuda_stream_handle",
    "run_cached",
    "run_pipeline",
    "stream_handle",
]

Scratch = Callable[[str, int], torch.Tensor]
"""``scratch(name, nbytes)``: a uint8 buffer of at least ``nbytes`` (a kernel's scratch space)."""


class StageKernels(Protocol):
    """What a backend implements: the stages on checked arguments, writing into ``out``.

    Every argument has passed the checks of :class:`StageSet`'s stage functions; every
    output buffer is allocated. ``config`` is a backend launch configuration or None.

    A backend may also implement ``bind(buffers: PlanBuffers) -> BoundStages``: a forward's six
    launches with their static arguments prepared once (a plan's, see the module docstring),
    each making the same kernel call as the method it stands for. Without it a plan calls
    the five methods (:func:`bind_kernels`).
    """

    def routing(self, topk_ids: torch.Tensor, out: RoutingData, scratch: Scratch) -> None: ...

    def quantize_rows(self, x: torch.Tensor, gs: torch.Tensor, routing: RoutingData, gather: bool,
                      row_scale: torch.Tensor | None, out: Quantized, config: object) -> None: ...

    def silu_mul_quantize(self, h: torch.Tensor, gs: torch.Tensor, routing: RoutingData, out: Quantized,
                          config: object) -> None: ...

    def grouped_gemm(self, a: Quantized, w: WeightOperand, routing: RoutingData, out: torch.Tensor,
                     scratch: Scratch, config: object) -> None: ...

    def moe_reduce(self, y: torch.Tensor, routing: RoutingData, topk_weights: torch.Tensor | None,
                   out: torch.Tensor) -> None: ...


# --------------------------------------------------------------------------- argument checks


def _check_out_dtype(out_dtype: object, allowed: tuple[torch.dtype, ...]) -> None:
    if out_dtype not in allowed:
        names = [dtype_name(d) for d in allowed]
        want = " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
        got = dtype_name(out_dtype) if isinstance(out_dtype, torch.dtype) else repr(out_dtype)
        raise TypeError(f"out_dtype: expected {want}, got {got}")


def _check_width(name: str, K: int, what: str) -> None:  # noqa: N803
    if K % BLOCK_SIZE:
        raise ValueError(f"{name}: {what} must be a multiple of {BLOCK_SIZE}, got {K}")


def _device_of(named: dict[str, object]) -> torch.device:
    """The one device of the tensors and buffers in ``named`` (None entries skipped). A buffer's
    own tensors share its ``device`` (checked when it was built)."""
    first_name, first = None, None
    for name, v in named.items():
        if v is None:
            continue
        dev = v.device
        if first is None:
            first_name, first = name, dev
        elif dev != first:
            raise ValueError(f"{name}: expected a tensor on {first} (the device of {first_name}), got one on {dev}")
    return first


def _fresh_scratch(device: torch.device) -> Scratch:
    return lambda name, nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)


def _scratch(workspace: Workspace | None, device: torch.device) -> Scratch:
    return workspace.scratch if workspace is not None else _fresh_scratch(device)


# --------------------------------------------------------------------------- plans: bound launches


@dataclass(frozen=True)
class PlanBuffers:
    """What the kernels of one forward shape get besides its inputs and its output.

    ``num_tokens`` (``M``) and ``topk`` (``n = M * topk`` slots), the hidden ``dtype`` and the
    ``device``; ``apply_router_weight_on_input``; the experts' activation global scales ``gs13``
    and ``gs2``; the prepared weights ``w13`` and ``w2`` (:meth:`StageSet.weights`); the
    workspace's buffers for ``n`` slots: ``routing``, ``a1``, ``h`` (the GEMM1 output ``[n, 2I]``),
    ``a2`` and ``y`` (the GEMM2 output ``[n, H]``); and its ``scratch``.
    """

    num_tokens: int
    topk: int
    dtype: torch.dtype
    device: torch.device
    apply_router_weight_on_input: bool
    gs13: torch.Tensor
    gs2: torch.Tensor
    w13: object
    w2: object
    routing: RoutingData
    a1: Quantized
    h: torch.Tensor
    a2: Quantized
    y: torch.Tensor
    scratch: Scratch


class BoundStages(NamedTuple):
    """The launches of one forward shape (:class:`PlanBuffers`), in pipeline order.

    Each takes what changes from call to call and ``stream``, the raw handle of the current
    CUDA stream (None off CUDA): ``routing(topk_ids, stream)``; ``quantize_rows(x, row_scale,
    stream)`` (``row_scale`` the flattened router weights with ``apply_router_weight_on_input``,
    else None); ``gemm1(stream)``; ``silu_mul_quantize(stream)``; ``gemm2(stream)``;
    ``moe_reduce(topk_weights, out, stream)`` (``topk_weights`` None with the weights on the
    input). The arguments are trusted to have the shapes, dtypes and device of the buffers' call.
    ``batch``: None, or a context manager the six calls run inside (the Triton backend's
    :class:`~moe_fp4.triton_kernels._common.LaunchBatch`: their launches in one library call).
    """

    routing: Callable[[torch.Tensor, int | None], None]
    quantize_rows: Callable[[torch.Tensor, torch.Tensor | None, int | None], None]
    gemm1: Callable[[int | None], None]
    silu_mul_quantize: Callable[[int | None], None]
    gemm2: Callable[[int | None], None]
    moe_reduce: Callable[[torch.Tensor | None, torch.Tensor, int | None], None]
    batch: object = None


def bind_kernels(k: StageKernels, b: PlanBuffers) -> BoundStages:
    """The launches of ``b`` as calls of ``k``'s five methods: the calls :func:`run_pipeline`'s checked
    stage functions make on these buffers (a plan's launches for kernels without ``bind``)."""
    r, scratch = b.routing, b.scratch
    return BoundStages(
        routing=lambda topk_ids, stream: k.routing(topk_ids, r, scratch),
        quantize_rows=lambda x, row_scale, stream: k.quantize_rows(x, b.gs13, r, True, row_scale, b.a1, None),
        gemm1=lambda stream: k.grouped_gemm(b.a1, b.w13, r, b.h, scratch, None),
        silu_mul_quantize=lambda stream: k.silu_mul_quantize(b.h, b.gs2, r, b.a2, None),
        gemm2=lambda stream: k.grouped_gemm(b.a2, b.w2, r, b.y, scratch, None),
        moe_reduce=lambda topk_weights, out, stream: k.moe_reduce(b.y, r, topk_weights, out),
    )


def with_fused_routing(bound: BoundStages,
                       fused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None], None]
                       ) -> BoundStages:
    """``bound`` with the routing and the first quantization as one launch, ``fused(topk_ids, x,
    row_scale, stream)``, writing what the two launches write: the plan's ``routing`` call notes
    its ``topk_ids`` and launches nothing, its ``quantize_rows`` call launches ``fused`` with them.
    The note is a weak reference, kept after the launch: a plan's launches may also be called one
    by one (as the host-cost benchmark does), and the plan keeps no tensor of a call alive past it
    (``torch.compile(mode="reduce-overhead")`` refuses a graph whose pool holds a tensor that is
    not an output: the ids converted to int32 inside the graph were one)."""
    ids: list = [lambda: None]  # the routing call's weakref.ref(topk_ids)

    def routing(topk_ids, stream) -> None:
        ids[0] = weakref.ref(topk_ids)

    def quantize_rows(x, row_scale, stream) -> None:
        topk_ids = ids[0]()
        if topk_ids is None:
            raise RuntimeError("the fused routing and quantization launch runs with the topk_ids of the "
                               "plan's routing call, which has not been made (or whose ids are gone)")
        fused(topk_ids, x, row_scale, stream)

    return bound._replace(routing=routing, quantize_rows=quantize_rows)


# --------------------------------------------------------------------------- the stage set


@dataclass(frozen=True)
class StageSet:
    """The six stages of one backend (five functions: the GEMM serves twice) and its weight layout.

    Build one with :meth:`from_kernels`; mix backends with :func:`dataclasses.replace`.
    ``prepare_weights(experts) -> (w13, w2)`` gives the weight pair the GEMMs take (a
    :class:`WeightOperand` by default; cached on the experts under ``weights_key``).
    ``activation_values``: the GEMMs multiply the exactly dequantized 16-bit activations
    (``Quantized.values``), so the quantization stages write them.
    ``activation_codes``: the quantization stages also write ``Quantized.packed`` and
    ``scales`` (the FP4 operand of a block-scaled GEMM). False for stage sets whose GEMMs take
    only the values (Hopper): their stages 2 and 4 write ``values`` alone and leave ``packed`` and
    ``scales`` as they are. Needs ``activation_values``.
    ``precision``: ``"w4a4"``, or ``"w4a16"`` for stages that leave the activations unquantized
    (their stages 2 and 4 write ``Quantized.values`` only; the GEMMs' alpha is ``1/gs_w``):
    see the module docstring. Needs ``activation_values``; such a set writes no codes.
    ``values_dtype``: the dtype of ``Quantized.values`` (None: the activations' dtype). A W4A4
    set may fix it (fp16 holds every NVFP4 value exactly, so a GEMM can take fp16 values
    whatever the model's dtype).
    """

    name: str
    routing: Callable[..., RoutingData]
    quantize_rows: Callable[..., Quantized]
    grouped_gemm: Callable[..., torch.Tensor]
    silu_mul_quantize: Callable[..., Quantized]
    moe_reduce: Callable[..., torch.Tensor]
    prepare_weights: Callable[[NvFp4Experts], tuple[object, object]] = WeightOperand.from_experts
    weights_key: str = "swizzled"
    activation_values: bool = False
    activation_codes: bool = True
    precision: str = "w4a4"
    values_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.precision == "w4a16":
            if not self.activation_values:
                raise ValueError(f"{self.name}: a w4a16 stage set multiplies Quantized.values (the unquantized rows): "
                                 "expected activation_values=True")
            object.__setattr__(self, "activation_codes", False)
        if self.values_dtype is not None and (self.precision != "w4a4" or not self.activation_values
                                              or self.values_dtype not in ROW_DTYPES):
            raise ValueError(f"{self.name}: values_dtype fixes the 16-bit values of a w4a4 set with "
                             f"activation_values=True, got {self.values_dtype} for precision {self.precision!r}")
        if not self.activation_codes and not self.activation_values:
            raise ValueError(f"{self.name}: quantization stages that write no codes must write the values: "
                             "expected activation_values=True with activation_codes=False")

    def weights(self, experts: NvFp4Experts) -> tuple[WeightOperand, WeightOperand]:
        """``(w13, w2)`` of ``experts`` for these GEMMs, prepared once per experts object."""
        return experts.prepared(("weights", self.weights_key), self.prepare_weights)

    @classmethod
    def from_kernels(
        cls,
        name: str,
        kernels: StageKernels,
        *,
        reduce_dtypes: tuple[torch.dtype, ...] = ROW_DTYPES,
        weight_types: tuple[type, ...] = (WeightOperand,),
        activation_values: bool = False,
        **options,
    ) -> StageSet:
        """The checked stage functions over ``kernels``.

        ``reduce_dtypes``: what moe_reduce may write; ``weight_types``: what the GEMM takes;
        ``activation_values``: the GEMM multiplies ``Quantized.values`` (the quantization
        stages then allocate and write them).
        """
        k = kernels

        values_dtype = options.get("values_dtype")

        def new_quantized(n: int, K: int, E: int, like: torch.Tensor) -> Quantized:  # noqa: N803
            return Quantized.empty(n, K, E, like.device,
                                   values=(values_dtype or like.dtype) if activation_values else None)

        def routing(topk_ids: torch.Tensor, num_experts: int, *, out: RoutingData | None = None,
                    workspace: Workspace | None = None) -> RoutingData:
            """Stage 1: routing metadata of int32 ``topk_ids [M, topk]`` over ``num_experts`` experts.

            Ids outside ``[0, E)`` (``-1``, or anything else with validation skipped) are not
            routed. ``out`` may give the buffers (``RoutingData`` of ``M * topk`` slots).
            """
            check_tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, contiguous=True)
            check_positive_int("num_experts", num_experts)
            n = topk_ids.numel()
            if out is None:
                out = RoutingData.empty(n, num_experts, topk_ids.device)
            else:
                check_buffer("out", out, RoutingData).check_for("out", n, num_experts)
                _device_of({"topk_ids": topk_ids, "out": out})
            k.routing(topk_ids, out, _scratch(workspace, topk_ids.device))
            return out

        def quantize_rows(x: torch.Tensor, gs: torch.Tensor, routing: RoutingData, *, gather: bool = True,
                          row_scale: torch.Tensor | None = None, out: Quantized | None = None,
                          config: object = None) -> Quantized:
            """Stage 2: per-expert NVFP4 quantization of routed rows, with the gather fused.

            ``x`` 16-bit ``[M, K]``, K a multiple of 16; ``gs`` float32 ``[E]``. With ``gather``
            (the default) slot ``s < expert_offsets[E]`` of expert ``e`` holds row
            ``x[slot_to_flat[s] // topk]`` (``topk = n / M``), else ``x`` already holds the ``n``
            grouped rows. ``row_scale`` (float32 ``[n]``, the flattened router weights; needs
            ``gather``) first multiplies the row by ``row_scale[slot_to_flat[s]]`` in float32,
            rounded to ``x.dtype``. Rows are quantized with ``gs[e]`` (the format core); packed
            rows past ``expert_offsets[E]`` and every scale byte without a scale are zero.
            """
            check_tensor("x", x, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
            r = check_buffer("routing", routing, RoutingData)
            E, n = r.num_experts, r.num_slots
            check_expert_vector("gs", gs, E)
            M, K = x.shape
            _check_width("x", K, "the quantized width")
            if not isinstance(gather, bool):
                raise TypeError(f"gather: expected a bool, got {type(gather).__name__}")
            if gather:
                if (M == 0 and n) or (M and n % M):
                    raise ValueError(f"routing: expected a multiple of x.shape[0] = {M} slots (M * topk), got {n}")
                if row_scale is not None:
                    check_tensor("row_scale", row_scale, dtypes=(torch.float32,), shape=(n,), contiguous=True)
            else:
                if n != M:
                    raise ValueError(f"routing: expected {M} slots (x.shape[0], the grouped rows), got {n}")
                if row_scale is not None:
                    raise ValueError("row_scale: expected None without gather (it is indexed by a slot's flat index)")
            if out is None:
                out = new_quantized(n, K, E, x)
            else:
                check_buffer("out", out, Quantized).check_for("out", n, K, E)
            _device_of({"x": x, "gs": gs, "routing": r, "row_scale": row_scale, "out": out})
            k.quantize_rows(x, gs, r, gather, row_scale, out, config)
            return out

        def silu_mul_quantize(h: torch.Tensor, gs: torch.Tensor, routing: RoutingData, *,
                              out: Quantized | None = None, config: object = None) -> Quantized:
            """Stage 4: ``silu(h[:, :I]) * h[:, I:]`` then per-expert quantization with ``gs[e]``.

            ``h`` 16-bit ``[n, 2I]`` (gate half, then up half; I a multiple of 16): silu in
            float32 rounded to 16-bit, the product rounded to 16-bit. Rows past
            ``expert_offsets[E]`` are ignored (their packed rows are zero).
            """
            check_tensor("h", h, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
            r = check_buffer("routing", routing, RoutingData)
            E, n = r.num_experts, r.num_slots
            check_expert_vector("gs", gs, E)
            if h.shape[1] % 2:
                raise ValueError(f"h: expected an even row length (gate half, then up half), got shape {list(h.shape)}")
            inter = h.shape[1] // 2
            _check_width("h", inter, "the quantized width (half the row length)")
            if h.shape[0] != n:
                raise ValueError(f"h: expected {n} rows (the routing's slots), got shape {list(h.shape)}")
            if out is None:
                out = new_quantized(n, inter, E, h)
            else:
                check_buffer("out", out, Quantized).check_for("out", n, inter, E)
            _device_of({"h": h, "gs": gs, "routing": r, "out": out})
            k.silu_mul_quantize(h, gs, r, out, config)
            return out

        def grouped_gemm(a: Quantized, w: WeightOperand, routing: RoutingData, out_dtype: torch.dtype, *,
                         out: torch.Tensor | None = None, workspace: Workspace | None = None,
                         config: object = None) -> torch.Tensor:
            """Stages 3 and 5: ``D[rows of e, section h] = alpha[e, h] * sum_k A[m, k] W[e, n, k]``.

            ``a`` holds the ``n`` routed rows, ``w`` the weights of the routing's experts;
            fp32 accumulation, times alpha in float32, rounded to ``out_dtype`` (16-bit).
            Output rows past ``expert_offsets[E]`` are not written.
            """
            _check_out_dtype(out_dtype, ROW_DTYPES)
            check_buffer("a", a, Quantized)
            check_buffer("w", w, weight_types)
            r = check_buffer("routing", routing, RoutingData)
            if activation_values and (a.values is None or a.values.dtype != (values_dtype or out_dtype)):
                got = "none" if a.values is None else dtype_name(a.values.dtype)
                raise ValueError(f"a: expected values (the dequantized 16-bit rows this GEMM multiplies) of dtype "
                                 f"{dtype_name(values_dtype or out_dtype)}, got {got}")
            if w.E != r.num_experts:
                raise ValueError(f"w: expected weights of the routing's {r.num_experts} experts, got {w.E}")
            if w.K != a.K:
                raise ValueError(f"w: expected K = {a.K} (the width of a), got weights of shape {list(w.packed.shape)}")
            a.check_for("a", r.num_slots, w.K, w.E)
            n = a.rows
            if out is None:  # zeros: the rows of unserved slots, which the GEMM does not write, are defined
                out = torch.zeros((n, w.N), dtype=out_dtype, device=a.device)
            else:
                check_tensor("out", out, dtypes=(out_dtype,), shape=(n, w.N), contiguous=True)
            dev = _device_of({"a": a, "w": w, "routing": r, "out": out})
            k.grouped_gemm(a, w, r, out, _scratch(workspace, dev), config)
            return out

        def moe_reduce(y: torch.Tensor, routing: RoutingData, topk_weights: torch.Tensor | None, num_tokens: int,
                       out_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
            """Stage 6: ``out[t] = sum_j w[t, j] * y[flat_to_slot[t*topk + j]]`` over served slots.

            Summed in float32 in slot order ``j = 0..topk-1`` (each product rounded to float32,
            then added), rounded once to ``out_dtype``. ``topk_weights`` (float32
            ``[num_tokens, topk]``) None gives the plain sum (router weights applied on the input).
            """
            _check_out_dtype(out_dtype, reduce_dtypes)
            check_tensor("y", y, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
            r = check_buffer("routing", routing, RoutingData)
            check_positive_int("num_tokens", num_tokens)
            n = r.num_slots
            if n == 0 or n % num_tokens:
                raise ValueError(f"routing: expected num_tokens * topk slots (a positive multiple of num_tokens = "
                                 f"{num_tokens}), got {n}")
            if y.shape[0] < r.num_slots:
                raise ValueError(f"y: expected at least {n} rows (the routing's slots), got shape {list(y.shape)}")
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(num_tokens, n // num_tokens),
                             contiguous=True)
            if out is None:
                out = torch.empty((num_tokens, y.shape[1]), dtype=out_dtype, device=y.device)
            else:
                check_tensor("out", out, dtypes=(out_dtype,), shape=(num_tokens, y.shape[1]), contiguous=True)
            _device_of({"y": y, "routing": r, "topk_weights": topk_weights, "out": out})
            k.moe_reduce(y, r, topk_weights, out)
            return out

        for fn in (routing, quantize_rows, grouped_gemm, silu_mul_quantize, moe_reduce):
            fn.stage_kernels = k  # what _kernels_of recognises: run_pipeline may call k directly
        return cls(name=name, routing=routing, quantize_rows=quantize_rows, grouped_gemm=grouped_gemm,
                   silu_mul_quantize=silu_mul_quantize, moe_reduce=moe_reduce, activation_values=activation_values,
                   **options)


def _kernels_of(stages: StageSet) -> StageKernels | None:
    """The kernels behind all five stage functions of ``stages`` (one :meth:`StageSet.from_kernels`
    object), or None for a mix or for functions from elsewhere."""
    k = getattr(stages.routing, "stage_kernels", None)
    fns = (stages.quantize_rows, stages.grouped_gemm, stages.silu_mul_quantize, stages.moe_reduce)
    return k if k is not None and all(getattr(f, "stage_kernels", None) is k for f in fns) else None


# --------------------------------------------------------------------------- workspaces


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _refuse_capture(device: torch.device, what: str) -> None:
    if _capturing(device):
        raise RuntimeError(
            f"moe_fp4: {what} would be allocated during CUDA-graph capture; run the same call once outside "
            "capture first (a warm-up call), so its workspace exists before the graph is captured"
        )


_T = TypeVar("_T")
_OFF_POOL = threading.local()  # .active: this thread runs an off_graph_pool function


def off_graph_pool(device: torch.device, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` run on a new thread, for the allocations of ``fn`` that outlive the call.

    CUDA graph trees (``torch.compile(mode="reduce-overhead")``) route every allocation of the
    thread that runs a graph's warm-up into the graphs' memory pool, and refuse a graph once that
    pool holds a tensor that is not one of its outputs. A forward's first call of a shape
    makes what later calls reuse (a workspace, prepared weights, a plan's buffers); on a thread of
    its own, none of that lands in the pool, whether or not the call is a graph's warm-up.

    The thread runs with the caller's CUDA device and current stream (so its kernels are in the
    caller's stream order), its inference mode (grad off either way: nothing here is
    differentiated) and a copy of its context variables (e.g. a pinned GEMM configuration); the
    caller waits for it and gets its result or its exception. While the current stream is
    capturing a graph (``torch.cuda.graph``, whose pool is chosen by stream, not thread), and on a
    thread already running such a function, ``fn`` runs here.
    """
    if getattr(_OFF_POOL, "active", False) or _capturing(device):
        return fn(*args)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    inference = torch.is_inference_mode_enabled()
    context = contextvars.copy_context()
    done: list = []

    def work() -> None:
        _OFF_POOL.active = True
        try:
            with contextlib.ExitStack() as stack:
                if stream is not None:
                    stack.enter_context(torch.cuda.device(device))
                    stack.enter_context(torch.cuda.stream(stream))
                stack.enter_context(torch.inference_mode() if inference else torch.no_grad())
                done.append((True, context.run(fn, *args)))
        except BaseException as exc:  # handed to the caller
            done.append((False, exc))

    thread = threading.Thread(target=work, name="moe_fp4-first-call")
    thread.start()
    thread.join()
    ok, value = done[0]
    if not ok:
        raise value
    return value


def _current_stream_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# What Triton's launcher reads for every launch (a CUDA build of torch has it; the fallback
# builds a torch.cuda.Stream, ~1-2 us more).
_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream_handle)


def stream_handle(device: torch.device) -> int | None:
    """The raw handle (``cudaStream_t``) of the current stream of ``device`` (a CUDA device with
    its index); None for any other device (host execution)."""
    return _raw_stream(device.index) if device.type == "cuda" else None


def cuda_stream_handle(index: int) -> int:
    """:func:`stream_handle` of CUDA device ``index`` (a CUDA tensor's ``get_device()``), for a caller that
    knows the device is CUDA: no ``torch.device`` built and asked its type (~1 us together)."""
    return _raw_stream(index)


class StreamOrder:
    """Orders the forwards that share a workspace across CUDA streams (see :class:`Workspace`).

    ``handle`` and ``stream``: the raw handle and the ``torch.cuda.Stream`` of the workspace's
    last forward enqueued outside graph capture (None before the first).
    """

    __slots__ = ("handle", "stream")

    def __init__(self) -> None:
        self.handle: int | None = None
        self.stream = None

    def enter(self, handle: int, device: torch.device) -> None:
        """Before a forward enqueues its kernels on ``device``'s current stream, whose raw handle is
        ``handle``: if that is not the stream of the last forward, make it wait on that stream's work
        so far and remember it. Nothing while a CUDA graph is being captured (a capture cannot wait
        on work outside it, and its replays run wherever they are launched)."""
        if handle == self.handle or _capturing(device):
            return
        stream = torch.cuda.current_stream(device)
        if self.stream is not None:
            stream.wait_stream(self.stream)
        self.handle, self.stream = handle, stream


@dataclass
class Workspace:
    """The intermediates of one layer shape for up to ``capacity`` slots (never freed).

    ``routing``, ``a1`` (``[cap, H]``), ``a2`` (``[cap, I]``) and ``hy`` (the GEMM1 output
    ``[cap, 2I]``, then the GEMM2 output ``[cap, H]``, in one buffer) are the same for every
    backend; kernels ask :meth:`scratch` for whatever else they need.

    Forwards that share it are safe across host threads and CUDA streams, without GPU work on the
    common path: a forward holds :attr:`lock` while it enqueues its kernels, so the forwards of
    two threads never interleave their launches, and :meth:`enter` makes a forward on another
    stream than the previous one's wait on that stream first (:class:`StreamOrder`), so the GPU
    runs them one after the other. Forwards on one stream are in stream order already. Not
    covered: CUDA graphs that captured forwards on a workspace and are replayed concurrently on
    different streams (replays bypass Python; ordering them is the caller's), and eager calls that
    overlap a capture in another thread.

    :attr:`plans`: the plans of the forwards run here, per experts object (see the module docstring).
    """

    capacity: int
    num_experts: int
    routing: RoutingData
    a1: Quantized
    a2: Quantized
    hy: torch.Tensor
    _scratch: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    order: StreamOrder = field(default_factory=StreamOrder, repr=False, compare=False)
    plans: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False, compare=False)

    @classmethod
    def allocate(cls, capacity: int, num_experts: int, H: int, I: int, dtype: torch.dtype,  # noqa: N803, E741
                 device: torch.device, values: bool = False, values_dtype: torch.dtype | None = None) -> Workspace:
        """Buffers for ``capacity`` slots (``values``: the activations' dequantized rows too, of
        ``values_dtype``, default ``dtype``)."""
        _refuse_capture(device, "a workspace")
        vals = (values_dtype or dtype) if values else None
        return cls(capacity, num_experts, RoutingData.empty(capacity, num_experts, device),
                   Quantized.empty(capacity, H, num_experts, device, vals),
                   Quantized.empty(capacity, I, num_experts, device, vals),
                   # Zeroed once: the torch w4a16 row stage (stages.w4a16_silu_mul, the reference's) computes
                   # silu_mul over every row of h (no host sync to know how many the GEMM wrote) and masks the
                   # unserved ones; they must hold defined values (compute-sanitizer's initcheck read them
                   # uninitialized). The CUDA library's row kernels read the served rows only.
                   torch.zeros(capacity * max(2 * I, H), dtype=dtype, device=device))

    def scratch(self, name: str, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` for ``name``.

        A larger one is allocated when needed (before any capture); earlier ones are kept,
        so graphs that captured them stay valid.
        """
        kept = self._scratch.setdefault(name, [])
        if not kept or kept[-1].numel() < nbytes:
            _refuse_capture(self.hy.device, f"{nbytes} bytes of {name!r} scratch")
            kept.append(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.hy.device))
        return kept[-1]

    def enter(self, device: torch.device) -> int | None:
        """Before a forward enqueues its kernels here (with :attr:`lock` held): the raw handle of the
        current stream of ``device``, ordered after the previous forward's stream (:class:`StreamOrder`);
        None off CUDA."""
        if device.type != "cuda":
            return None
        return self.enter_cuda(device)

    def enter_cuda(self, device: torch.device) -> int:
        """:meth:`enter` for a CUDA ``device`` (a plan knows its device's type: ``device.type`` costs ~0.5 us)."""
        handle = _raw_stream(device.index)
        self.order.enter(handle, device)
        return handle

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (for tests that poison them between calls)."""
        out = [getattr(self.routing, f.name) for f in dataclasses.fields(RoutingData)]
        out += [t for q in (self.a1, self.a2) for t in (q.packed, q.scales, q.values) if t is not None]
        out.append(self.hy)
        return out + [t for kept in self._scratch.values() for t in kept]


_WORKSPACES: dict[tuple, Workspace] = {}


def cached_workspace(stages: StageSet, problem: MoEProblem) -> Workspace:
    """The workspace for ``problem``: one per (stage set, device, dtype, layer shape, power-of-two
    bucket of ``M * topk`` slots), allocated on first use, outside capture.

    Calls of one shape share it whatever their stream or thread, so that a CUDA graph captured on
    a side stream (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) uses the
    buffers of the eager warm-up instead of allocating in the graph's pool; :func:`run_pipeline`
    orders the forwards that share it (:class:`Workspace`).
    """
    x = problem.hidden_states
    return _workspace_for(stages, x, problem.experts, x.shape[0] * problem.topk_ids.shape[1])


def _workspace_for(stages: StageSet, x: torch.Tensor, ex: NvFp4Experts, n: int) -> Workspace:
    """:func:`cached_workspace` of a problem of ``n`` slots with hidden states ``x`` and experts ``ex``."""
    cap = 1 << max(4, (n - 1).bit_length())
    E, H, I = ex.sizes()  # noqa: N806, E741
    key = (stages.name, x.device, x.dtype, E, H, I, cap)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = off_graph_pool(x.device, lambda: Workspace.allocate(cap, E, H, I, x.dtype, x.device,
                                                                 values=stages.activation_values,
                                                                 values_dtype=stages.values_dtype))
        ws = _WORKSPACES.setdefault(key, ws)  # another thread's, if it got there first
    return ws


# --------------------------------------------------------------------------- the pipeline


class _Views(NamedTuple):
    """A workspace's buffers for ``n`` slots (all None: the stages allocate their own)."""

    routing: RoutingData | None
    a1: Quantized | None
    h: torch.Tensor | None
    a2: Quantized | None
    y: torch.Tensor | None


_NO_VIEWS = _Views(None, None, None, None, None)


def _views(ws: Workspace, n: int, E: int, H: int, I: int) -> _Views:  # noqa: N803, E741
    return _Views(ws.routing.head(n), ws.a1.head(n, E), ws.hy[: n * 2 * I].view(n, 2 * I), ws.a2.head(n, E),
                  ws.hy[: n * H].view(n, H))


def _run_stages(stages: StageSet, problem: MoEProblem, w13: object, w2: object, v: _Views,
                workspace: Workspace | None) -> torch.Tensor:
    """The forward through the checked stage functions, into ``v`` (or allocating)."""
    x, ex = problem.hidden_states, problem.experts
    r = stages.routing(problem.topk_ids, ex.num_experts, out=v.routing, workspace=workspace)
    weights = problem.topk_weights
    row_scale = weights.reshape(-1) if problem.apply_router_weight_on_input else None
    a1 = stages.quantize_rows(x, ex.a13_gs, r, row_scale=row_scale, out=v.a1)
    h = stages.grouped_gemm(a1, w13, r, x.dtype, out=v.h, workspace=workspace)
    a2 = stages.silu_mul_quantize(h, ex.a2_gs, r, out=v.a2)
    y = stages.grouped_gemm(a2, w2, r, x.dtype, out=v.y, workspace=workspace)
    return stages.moe_reduce(y, r, None if problem.apply_router_weight_on_input else weights, problem.num_tokens,
                             x.dtype, out=problem.output())


MAX_PLANS = 64
"""Plans a workspace keeps per experts object (one per forward shape and stage set; the oldest goes first)."""

REPLAY = True
"""Whether a plan whose launches run in a batch (``BoundStages.batch``) replays them: the batch learns
from a forward where each launch's free values come from (the call's ``topk_ids``, hidden states,
router weights and output) and runs later forwards' launches in one call without the stages' Python
(:meth:`~moe_fp4.triton_kernels._common.LaunchBatch.replay`). A switch for benchmarks/host_trace.py's A/B."""


class _Plan:
    """One forward shape of a :meth:`StageSet.from_kernels` stage set on one workspace: the buffers
    and weights of its first, checked run (:class:`PlanBuffers`) and the kernels' launches bound.

    Kept on the workspace (:attr:`Workspace.plans`) and holding no reference to it, so that a
    workspace dropped from the cache is freed with its plans at once.
    """

    __slots__ = ("bound", "buffers", "cuda", "pins", "stages")

    def __init__(self, stages: StageSet, kernels: StageKernels, buffers: PlanBuffers, experts: NvFp4Experts) -> None:
        self.stages, self.buffers = stages, buffers  # stages: its id is in the key
        self.cuda = buffers.device.type == "cuda"  # (off CUDA a forward has no stream to order: Workspace.enter)
        bind = getattr(kernels, "bind", None)
        self.bound = bind(buffers) if bind is not None else bind_kernels(kernels, buffers)
        # The experts' own tensors among those the launches may hold by address: the plan is stale
        # once one of them is replaced or moves (its storage swapped).
        stored = experts.stored()
        own = {id(t) for t in (stored[0], stored[3])}
        held = [buffers.gs13, buffers.gs2] + [t for w in (buffers.w13, buffers.w2)
                                             for t in getattr(w, "__dict__", {}).values() if id(t) in own]
        self.pins = tuple((t, t.data_ptr()) for t in held)

    def fits(self, experts: NvFp4Experts) -> bool:
        """Whether the experts' global scales are still the plan's tensors and nothing it holds moved
        (raises if weights re-laid out in place were written since)."""
        if experts.a13_gs is not self.buffers.gs13 or experts.a2_gs is not self.buffers.gs2:
            return False
        if experts._layout is not None:  # (_check_layout's own test, without the call for canonical weights)
            experts._check_layout()
        for t, ptr in self.pins:
            if t.data_ptr() != ptr:
                return False
        return True

    def run(self, problem: MoEProblem, ws: Workspace) -> torch.Tensor:
        b, bound = self.buffers, self.bound
        weights = problem.topk_weights
        on_input = b.apply_router_weight_on_input
        with ws.lock:
            stream = ws.enter_cuda(b.device) if self.cuda else None
            out = problem.output()
            batch = bound.batch
            if batch is None:
                self._launch(bound, problem, weights, on_input, out, stream)
            else:
                inputs = (problem.topk_ids, problem.hidden_states, weights, out)
                if not (REPLAY and batch.replay(inputs, b.device.index, stream)):
                    with batch.learning(inputs) if REPLAY else batch:
                        self._launch(bound, problem, weights, on_input, out, stream)
        return out

    @staticmethod
    def _launch(bound: BoundStages, problem: MoEProblem, weights: torch.Tensor, on_input: bool, out: torch.Tensor,
                stream: int | None) -> None:
        bound.routing(problem.topk_ids, stream)
        bound.quantize_rows(problem.hidden_states, weights.reshape(-1) if on_input else None, stream)
        bound.gemm1(stream)
        bound.silu_mul_quantize(stream)
        bound.gemm2(stream)
        bound.moe_reduce(None if on_input else weights, out, stream)


def _plan_key(stages: StageSet, problem: MoEProblem, M: int | None = None, topk: int | None = None) -> tuple:  # noqa: N803
    """What a plan is for, on its workspace and experts: the stage set (held by the plan, so its id
    stays unique) and the forward's shape (``M`` and ``topk`` where the caller has read them already)."""
    x = problem.hidden_states  # (num_tokens and topk, read without their properties: this runs per forward)
    if M is None:
        M, topk = x.shape[0], problem.topk_ids.shape[1]  # noqa: N806
    return id(stages), M, topk, x.dtype, problem.apply_router_weight_on_input


def _weak_scratch(ws: Workspace) -> Scratch:
    """``ws.scratch`` without a reference to ``ws`` (for its plans, which it holds)."""
    ref = weakref.ref(ws)
    return lambda name, nbytes: ref().scratch(name, nbytes)


def run_pipeline(stages: StageSet, problem: MoEProblem, workspace: Workspace | None = None) -> torch.Tensor:
    """The MoE forward of ``problem`` (a validated :class:`~moe_fp4.moe.MoEProblem`) on ``stages``.

    With ``workspace`` the intermediates live there (no allocation but the result, unless
    ``problem.out`` is given, and a stage's own state on a first call, such as a K-splitting GEMM's zeroed
    workspace; no host synchronization if the stages have none), forwards
    that share it are ordered (:class:`Workspace`) and a repeated shape runs its plan (see the
    module docstring); without, each stage allocates its own.
    """
    if stages.precision != problem.precision:
        _refuse_precision(stages, problem)
    if workspace is None:
        w13, w2 = stages.weights(problem.experts)
        return _run_stages(stages, problem, w13, w2, _NO_VIEWS, None)
    return _run_on(stages, problem, workspace, _plan_key(stages, problem))


def run_cached(stages: StageSet, problem: MoEProblem) -> torch.Tensor:
    """``run_pipeline(stages, problem, cached_workspace(stages, problem))`` (what a backend's forward runs),
    with the problem's shape read once for the workspace's key and the plan's."""
    x = problem.hidden_states
    M, topk = x.shape[0], problem.topk_ids.shape[1]  # noqa: N806
    ws = _workspace_for(stages, x, problem.experts, M * topk)
    if stages.precision != problem.precision:
        _refuse_precision(stages, problem)
    return _run_on(stages, problem, ws, _plan_key(stages, problem, M, topk))


def _refuse_precision(stages: StageSet, problem: MoEProblem) -> None:
    raise ValueError(f"stages: {stages.name!r} computes precision {stages.precision!r}, the problem asks for "
                     f"{problem.precision!r}")


def _run_on(stages: StageSet, problem: MoEProblem, ws: Workspace, key: tuple) -> torch.Tensor:
    """:func:`run_pipeline` on the workspace ``ws``: the plan of ``key`` (:func:`_plan_key`) when it fits, else
    the checked stages (kept as the new plan)."""
    ex = problem.experts
    plans = ws.plans.get(ex)
    plan = None if plans is None else plans.get(key)
    if plan is not None and plan.fits(ex):
        return plan.run(problem, ws)
    if problem.out is None:  # the result, made here: a graph's output (the rest is made off its pool)
        problem = dataclasses.replace(problem, out=problem.output())
    return off_graph_pool(problem.hidden_states.device, _first_run, stages, problem, ws, key)


def _first_run(stages: StageSet, problem: MoEProblem, ws: Workspace, key: tuple) -> torch.Tensor:
    """A shape's forward through the checked stages on ``ws``, then kept as a plan (trusted stages only)."""
    x, ex = problem.hidden_states, problem.experts
    M, E, topk = problem.num_tokens, ex.num_experts, problem.topk
    n, H, I = M * topk, ex.hidden_size, ex.intermediate_size  # noqa: E741
    ex._check_layout()
    w13, w2 = stages.weights(ex)
    if ws.capacity < n or ws.num_experts != E:
        raise ValueError(f"workspace: expected one for at least {n} slots over {E} experts, "
                         f"got {ws.capacity} slots over {ws.num_experts}")
    v = _views(ws, n, E, H, I)
    kernels = _kernels_of(stages)
    with ws.lock:
        ws.enter(x.device)
        out = _run_stages(stages, problem, w13, w2, v, ws)
        if kernels is not None:
            buffers = PlanBuffers(M, topk, x.dtype, x.device, problem.apply_router_weight_on_input, ex.a13_gs,
                                  ex.a2_gs, w13, w2, *v, _weak_scratch(ws))
            plans = ws.plans.setdefault(ex, {})
            plans.pop(key, None)
            if len(plans) >= MAX_PLANS:
                del plans[next(iter(plans))]
            plans[key] = _Plan(stages, kernels, buffers, ex)
    return out
