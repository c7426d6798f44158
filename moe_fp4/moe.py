"""``fused_moe``: the one public MoE forward, validated once and dispatched to a backend."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import _native, _op
from ._checks import PRECISIONS, check_tensor
from .backends.registry import check_precision, resolve_backend
from .experts import NvFp4Experts
from .format import grouped_scale_rows_bound
from .pipeline import cuda_stream_handle

__all__ = ["MoEProblem", "fused_moe"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_MAX_ROWS = 2**31 - 1  # int32 slot indices and grouped scale rows


@dataclass(frozen=True)
class MoEProblem:
    """One validated ``fused_moe`` call, as every backend receives it.

    hidden_states: bf16/fp16 ``[M, H]``, contiguous, ``M >= 1``.
    experts:       the layer's :class:`NvFp4Experts`, on the same device.
    topk_weights:  float32 ``[M, topk]``, contiguous.
    topk_ids:      int32 ``[M, topk]``, contiguous. ``-1`` means "not served here". Ids
                   outside ``[-1, E)`` were rejected when the call validated them; with
                   validation skipped, backends must treat them as ``-1`` and never index
                   memory with them.
    apply_router_weight_on_input: see :func:`fused_moe`.
    out:           optional preallocated ``[M, H]`` output in the hidden-state dtype.
    precision:     ``"w4a4"`` or ``"w4a16"`` (see :func:`fused_moe`); the backend was resolved
                   for it.
    """

    hidden_states: torch.Tensor
    experts: NvFp4Experts
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    apply_router_weight_on_input: bool
    out: torch.Tensor | None
    precision: str = "w4a4"

    def __init__(self, hidden_states: torch.Tensor, experts: NvFp4Experts, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, out: torch.Tensor | None,
                 precision: str = "w4a4") -> None:
        # What the generated __init__ of a frozen dataclass does, which calls object.__setattr__ once per
        # field: the stores into the instance dict are ~2x cheaper (every forward builds one).
        fields = self.__dict__
        fields["hidden_states"] = hidden_states
        fields["experts"] = experts
        fields["topk_weights"] = topk_weights
        fields["topk_ids"] = topk_ids
        fields["apply_router_weight_on_input"] = apply_router_weight_on_input
        fields["out"] = out
        fields["precision"] = precision

    @property
    def num_tokens(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_ids.shape[1]

    def output(self) -> torch.Tensor:
        """The tensor to write the result into (``out`` or a new one)."""
        if self.out is not None:
            return self.out
        return torch.empty_like(self.hidden_states)


def _check_values(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, id_limit: int,
                  expert_map: torch.Tensor | None, num_local: int) -> None:
    """Data-dependent checks, one host synchronization on CUDA: where the CUDA library serves the
    device, its one entry ``moe_fp4_check_inputs`` (:func:`_library_extremes`), else three small
    torch kernels and one read-back (:func:`_torch_extremes`). Both give whether every input is
    finite and the extremes of ``topk_ids`` (and ``expert_map``), which answer every check at
    once. Only when that shows a problem do the exact per-argument checks run (more
    synchronizations, on the error path only). ``x`` and ``topk_weights`` (float32) are
    contiguous.
    """
    found = _library_extremes(x, topk_weights, topk_ids, expert_map)
    finite, lo, hi, map_lo, map_hi = found if found is not None else _torch_extremes(x, topk_weights, topk_ids,
                                                                                     expert_map)
    ok = finite and lo >= -1 and hi < id_limit
    if expert_map is not None:
        ok = ok and map_lo >= -1 and map_hi < num_local
    if not ok:
        _explain_values(x, topk_weights, topk_ids, id_limit, expert_map, num_local)


def _torch_extremes(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor | None) -> tuple:
    """``(finite, min id, max id, min map, max map)`` by torch ops (the map's None without it): three
    small kernels and one read-back of two floats (with ``expert_map``: two more kernels, four floats).

    ``t = topk_ids + 0 * topk_weights * sum(x)`` (``x`` summed in float64, so no finite input
    overflows; ``t`` float32, exact for ids below ``2**24``) equals the ids where every input
    is finite and is NaN elsewhere, so ``[min t, max t]`` (plus ``expert_map``'s extremes),
    written into one small buffer, holds every answer: NaN (min and max propagate it) where an
    input is not finite, and NaN fails every comparison.
    """
    t = torch.addcmul(topk_ids, topk_weights, torch.sum(x, dtype=torch.float64), value=0)
    if t.requires_grad:  # out= takes no inputs that require grad (a detach, not torch.no_grad(): ~4 us less)
        t = t.detach()
    extremes = torch.empty(2 if expert_map is None else 4, dtype=t.dtype, device=t.device)
    torch.aminmax(t, out=(extremes[0], extremes[1]))
    if expert_map is not None:
        torch.aminmax(expert_map.to(t.dtype), out=(extremes[2], extremes[3]))
    vals = extremes.tolist()
    lo = vals[0]
    return (lo == lo, lo, vals[1], *(vals[2:] if expert_map is not None else (None, None)))


# ``moe_fp4_check_inputs`` of the CUDA library (moe_fp4/_native.py): None until first needed, False
# where the library is unavailable. Devices it does not serve (an UNSUPPORTED status) use torch.
_check_entry = None
_unserved_devices: set[int] = set()
# Tests set this to check CPU tensors with the library's host oracle (device = MOE_FP4_HOST).
_HOST_ORACLE = False
_X_CODES = {torch.bfloat16: _native.BF16, torch.float16: _native.FP16}
_INDEX_CODES = {torch.int32: _native.INT32, torch.int64: _native.INT64}
_Result = ctypes.c_int64 * 6


def _check_function():
    global _check_entry
    if _check_entry is None:
        try:
            _check_entry = _native.library().function("moe_fp4_check_inputs")
        except _native.LibraryUnavailable:
            _check_entry = False
    return _check_entry


def _library_extremes(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None) -> tuple | None:
    """:func:`_torch_extremes`'s answer from the CUDA library's ``moe_fp4_check_inputs`` (one kernel,
    its answer written into mapped pinned memory and polled: no copy, no stream synchronization;
    exact for every id), or None where it does not check these tensors: CPU tensors (unless
    ``_HOST_ORACLE``), no library, a device it does not serve."""
    cuda = x.is_cuda
    if cuda:
        device = x.get_device()
    elif _HOST_ORACLE:
        device = _native.HOST
    else:
        return None
    fn = _check_entry or _check_function()
    if not fn or device in _unserved_devices:
        return None
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    result = _Result()
    if expert_map is None:
        emap, map_ptr, map_code, map_numel = None, None, 0, 0
    else:  # emap holds a contiguous copy until the call returns
        emap = expert_map if expert_map.is_contiguous() else expert_map.contiguous()
        map_ptr, map_code, map_numel = emap.data_ptr(), _INDEX_CODES[emap.dtype], emap.numel()
    status = fn(x.data_ptr(), _X_CODES[x.dtype], x.numel(), topk_weights.data_ptr(), topk_weights.numel(),
                ids.data_ptr(), _INDEX_CODES[ids.dtype], ids.numel(), map_ptr, map_code, map_numel, result, device,
                cuda_stream_handle(device) if cuda else None)
    if status:
        if status == _native.UNSUPPORTED:  # e.g. a GPU older than the pipeline kernels' sm_90
            _unserved_devices.add(device)
            return None
        _native.library().check("moe_fp4_check_inputs", status)
    bad_x, bad_w, lo, hi, map_lo, map_hi = result[:]  # (a slice reads the array at once, ~5x faster than iterating)
    return (not (bad_x or bad_w), lo, hi, *((map_lo, map_hi) if expert_map is not None else (None, None)))


def _explain_values(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, id_limit: int,
                    expert_map: torch.Tensor | None, num_local: int) -> None:
    """The exact checks behind :func:`_check_values`, each its own read-back: raises the first failure."""
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(topk_ids)).tolist())
    if lo < -1 or hi >= id_limit:
        raise ValueError(f"topk_ids: expected expert ids in [-1, {id_limit}) (-1 = not served here), "
                         f"got values in [{lo}, {hi}]")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("hidden_states: expected finite values, got inf or nan")
    if not bool(torch.isfinite(topk_weights).all()):
        raise ValueError("topk_weights: expected finite values, got inf or nan")
    if expert_map is not None:
        mlo, mhi = (int(v) for v in torch.stack(torch.aminmax(expert_map)).tolist())
        if mlo < -1 or mhi >= num_local:
            raise ValueError(f"expert_map: expected local expert ids in [-1, {num_local}) (-1 = not on this rank), "
                             f"got values in [{mlo}, {mhi}]")


def _check_arguments(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str,
                     apply_router_weight_on_input: bool, expert_map: torch.Tensor | None, out: torch.Tensor | None,
                     precision: str, dev: torch.device, E: int, H: int) -> tuple[int, int, int]:  # noqa: N803
    """Every argument check of :func:`forward`, in order, for the experts' device ``dev``, ``E`` experts and
    hidden size ``H``: raises the first failure (``TypeError`` / ``ValueError`` naming the argument), else
    returns ``(M, topk, id_limit)`` (``id_limit``: the number of ids ``topk_ids`` may name, ``E`` or the
    length of ``expert_map``)."""
    check_tensor("hidden_states", hidden_states, dtypes=_HIDDEN_DTYPES, ndim=2, device=dev, contiguous=True)
    M = hidden_states.shape[0]
    if hidden_states.shape[1] != H:
        raise ValueError(f"hidden_states: expected shape [M, {H}] (the experts' hidden size), "
                         f"got {list(hidden_states.shape)}")
    check_tensor("topk_ids", topk_ids, dtypes=_ID_DTYPES, ndim=2, device=dev)
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected shape [{M}, topk] (M from hidden_states), got {list(topk_ids.shape)}")
    if topk < 1:
        raise ValueError(f"topk_ids: expected at least one slot per token, got shape {list(topk_ids.shape)}")
    # Slots and grouped scale rows are int32 in the routing metadata of every backend: refused here,
    # before any workspace is allocated or kernel launched.
    if grouped_scale_rows_bound(M * topk, E) > _MAX_ROWS:
        raise ValueError(f"topk_ids: {M} tokens x {topk} slots = {M * topk} slots over {E} experts exceed the int32 "
                         f"slot indices and grouped scale rows of the routing (at most 2^31 - 1 = {_MAX_ROWS}); "
                         "split the batch")
    check_tensor("topk_weights", topk_weights, dtypes=_WEIGHT_DTYPES, shape=(M, topk), device=dev)
    if not isinstance(apply_router_weight_on_input, bool):
        raise TypeError("apply_router_weight_on_input: expected a bool, "
                        f"got {type(apply_router_weight_on_input).__name__}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    check_precision(precision)
    id_limit = E
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=_ID_DTYPES, ndim=1, device=dev)
        id_limit = expert_map.shape[0]
    if topk > id_limit:
        raise ValueError(f"topk_ids: expected topk <= the number of experts ({id_limit}), got topk = {topk}")
    if out is not None:
        check_tensor("out", out, dtypes=(hidden_states.dtype,), shape=(M, H), device=dev, contiguous=True)

    return M, topk, id_limit


def _plain_arguments(x: object, topk_weights: object, topk_ids: object, backend: object, on_input: object,
                     expert_map: object, out: object, precision: object, dev: torch.device, E: int,  # noqa: N803
                     H: int) -> tuple[int, int, torch.dtype] | None:  # noqa: N803
    """``(M, topk, hidden dtype)`` when every check of :func:`_check_arguments` passes, from one read of each
    attribute (what an eager call's checks cost: about half of those calls of ``check_tensor``); None says
    only that :func:`_check_arguments` must run (it raises the first failure with its message, or passes
    what these tests are stricter about)."""
    if not (isinstance(x, torch.Tensor) and isinstance(topk_ids, torch.Tensor)
            and isinstance(topk_weights, torch.Tensor)):
        return None
    xs, ts, dtype = x.shape, topk_ids.shape, x.dtype
    # (n slots take at most 128 * n grouped scale rows, whatever E: grouped_scale_rows_bound's exact bound is
    # _check_arguments')
    if not (len(xs) == 2 and xs[1] == H and dtype in _HIDDEN_DTYPES and x.device == dev and x.is_contiguous()
            and len(ts) == 2 and ts[0] == xs[0] and ts[1] >= 1 and 128 * xs[0] * ts[1] <= _MAX_ROWS
            and topk_ids.dtype in _ID_DTYPES and topk_ids.device == dev
            and topk_weights.shape == ts and topk_weights.dtype in _WEIGHT_DTYPES and topk_weights.device == dev
            and type(on_input) is bool and isinstance(backend, str) and isinstance(precision, str)
            and precision in PRECISIONS):
        return None
    if expert_map is not None:
        if not (isinstance(expert_map, torch.Tensor) and expert_map.dtype in _ID_DTYPES and expert_map.dim() == 1
                and expert_map.device == dev and ts[1] <= expert_map.shape[0]):
            return None
    elif ts[1] > E:
        return None
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == xs and out.dtype == dtype
                                and out.device == dev and out.is_contiguous()):
        return None
    return xs[0], ts[1], dtype


def fused_moe(
    hidden_states: torch.Tensor,
    experts: NvFp4Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str = "auto",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    precision: str = "w4a4",
) -> torch.Tensor:
    """NVFP4 Mixture-of-Experts forward: NVFP4 weights with NVFP4 (W4A4) or 16-bit (W4A16) activations.

    ``precision="w4a4"`` (the default) computes, with ``E = experts.num_experts`` and ``I``
    the intermediate size::

        out = zeros(M, H, float32)
        for t in range(M):
            for j in range(topk):                      # in slot order
                e = topk_ids[t, j]
                if e == -1: continue                   # not served here: contributes 0
                x = hidden_states[t]
                if apply_router_weight_on_input:
                    x = dtype(float32(x) * topk_weights[t, j])
                a = quantize_nvfp4(x, experts.a13_gs[e])                        # format core
                h = dtype(alpha13[e] * (a @ w13[e].T))  # fp32 accumulation; alpha per half
                act = dtype(dtype(silu(float32(h[:I]))) * h[I:])
                b = quantize_nvfp4(act, experts.a2_gs[e])
                y = dtype(alpha2[e] * (b @ w2[e].T))    # fp32 accumulation
                out[t] += y if apply_router_weight_on_input else topk_weights[t, j] * y
        return dtype(out)

    where ``alpha13[e, h] = 1 / (a13_gs[e] * w13_gs[e, h])`` (h = gate, up) and
    ``alpha2[e] = 1 / (a2_gs[e] * w2_gs[e])``, and the products ``a @ w.T`` use the
    block-scaled values ``e2m1 * scale`` (exact) so that the global scales enter once.

    ``precision="w4a16"`` (Marlin's semantics) does not quantize the activations: the same
    loop with::

                x = hidden_states[t]                   # (times the router weight, as above)
                h = dtype(alpha13[e] * (x @ w13[e].T))  # fp32 accumulation; alpha per half
                act = dtype(dtype(silu(float32(h[:I]))) * h[I:])
                y = dtype(alpha2[e] * (act @ w2[e].T))  # fp32 accumulation

    where now ``alpha13[e, h] = 1 / w13_gs[e, h]`` and ``alpha2[e] = 1 / w2_gs[e]`` (the
    weights' global scales only; ``a13_gs`` and ``a2_gs`` are not used) and ``w`` is again
    ``e2m1 * scale``. W4A16 is closer to the 16-bit MoE than W4A4 (no activation
    quantization error, ~10% relative per GEMM on Gaussian data) and moves 16-bit
    activations through its GEMMs. Backends: ``reference`` computes both; ``cutlass``
    computes ``w4a16`` on compute capability 9.x only (its sm_90a GEMM multiplies 16-bit
    activations; Blackwell's FP4 tensor-core GEMM needs FP4 activations); ``triton``
    computes ``w4a16`` wherever it runs, on its values operand (H and I multiples of 64;
    off Hopper on a table of tiles compiled for sm_80, sm_100 and sm_120, never run on
    those GPUs). ``backend="auto"`` takes the first backend of the device's preference
    order that computes the precision (for W4A16 on a layer that ``triton`` cannot take,
    the next one).

    Args:
        hidden_states: bf16 or fp16 ``[M, H]``, contiguous. The result has this dtype.
        experts: the layer's :class:`~moe_fp4.NvFp4Experts` (same device).
        topk_weights: ``[M, topk]`` router weights (float32 preferred; 16-bit is upcast).
        topk_ids: int32/int64 ``[M, topk]`` expert ids in ``[-1, E)``; ``-1`` contributes
            nothing (expert parallelism: the expert lives elsewhere).
        backend: ``"auto"``, ``"cutlass"``, ``"triton"`` or ``"reference"``. ``"auto"``
            picks by compute capability (see :func:`moe_fp4.explain_backend`); a named
            backend that cannot run raises :class:`~moe_fp4.BackendUnavailableError`.
        apply_router_weight_on_input: scale each routed row by its weight before
            quantization, then sum without weights (any topk).
        expert_map: optional int ``[E_global]`` map from global to local expert ids
            (``-1`` = not on this rank); ``topk_ids`` are then global ids.
        out: optional preallocated ``[M, H]`` result.
        validate: check data-dependent preconditions (ids in range, finite inputs), which
            costs one host synchronization on CUDA. Skipped automatically while a CUDA
            graph is being captured and while ``torch.compile`` traces the call
            (``torch.compiler.is_compiling()``): compiled code never checks values. With
            ``validate=False`` no call synchronizes with the host; ids outside ``[-1, E)``
            are then treated as ``-1`` (never read out of bounds) and non-finite inputs
            give non-finite rows.
        precision: ``"w4a4"`` or ``"w4a16"`` (above). A named backend that does not compute
            it on this device raises ``ValueError`` saying why; any other value raises
            ``ValueError`` (``TypeError`` for a non-str).

    Returns:
        ``[M, H]`` in the dtype of ``hidden_states`` (``out`` when given).

    The forward itself is one opaque operator, ``torch.ops.moe_fp4.fused_moe`` (and
    ``fused_moe_out`` with ``out``; see :mod:`moe_fp4._op`): ``torch.compile(fullgraph=True)``
    traces this function's checks and the ``expert_map`` translation, never the kernels.
    The backend is resolved once per (backend, device, dtype, precision, environment) by
    :func:`moe_fp4.backends.registry.resolve_backend`, a constant to the compiler.

    Calls from several host threads or CUDA streams are safe: the forwards of one layer shape
    share a workspace, and each holds its lock while it enqueues its kernels and first waits on
    the stream of the previous one (:class:`moe_fp4.pipeline.Workspace`). CUDA graphs of such
    calls replayed concurrently on different streams are the caller's to order.
    """
    if not isinstance(experts, NvFp4Experts):
        raise TypeError(f"experts: expected an NvFp4Experts, got {type(experts).__name__}")
    # (experts.stored(): the eight tensors in the operator's argument order, _op.tensors_of's)
    return forward(hidden_states, experts, experts.stored(), topk_weights, topk_ids, backend,
                   apply_router_weight_on_input, expert_map, out, validate, precision)


def forward(
    hidden_states: torch.Tensor,
    experts: NvFp4Experts | None,
    tensors: tuple[torch.Tensor, ...],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str,
    apply_router_weight_on_input: bool,
    expert_map: torch.Tensor | None,
    out: torch.Tensor | None,
    validate: bool,
    precision: str = "w4a4",
) -> torch.Tensor:
    """:func:`fused_moe` over the experts' eight tensors ``tensors`` (``experts``: their
    :class:`NvFp4Experts` when the caller has it, else None; the tensors are then validated
    when the operator first sees them). For :class:`moe_fp4.nn.FusedMoE` under ``torch.compile``."""
    w13 = tensors[0]
    dev = w13.device
    w13_shape = w13.shape
    E, H = w13_shape[0], w13_shape[2] * 2
    # The argument checks: one cheap read of each attribute, and each check with its own message only where
    # those find something to refuse (or are in doubt).
    plain = _plain_arguments(hidden_states, topk_weights, topk_ids, backend, apply_router_weight_on_input, expert_map,
                             out, precision, dev, E, H)
    if plain is not None:
        M, topk, dtype = plain
        id_limit = E if expert_map is None else expert_map.shape[0]
    else:
        M, topk, id_limit = _check_arguments(hidden_states, topk_weights, topk_ids, backend,
                                             apply_router_weight_on_input, expert_map, out, precision, dev, E, H)
        dtype = hidden_states.dtype

    name = resolve_backend(backend, dev, dtype, precision, (H, w13_shape[1] // 2))
    if M == 0:
        return out if out is not None else hidden_states.new_empty((0, H))
    compiling = torch.compiler.is_compiling()
    # ``.to(dtype).contiguous()`` of the router weights (float32) and ids (int32): eagerly the tensors themselves
    # when they are both already, without the two calls (~1 us each); a traced call keeps them (graph ops
    # rather than guards on the layout).
    weights = topk_weights
    if compiling or weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    if validate and not compiling and not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_values(hidden_states, weights, topk_ids, id_limit, expert_map, E)

    ids = topk_ids
    if expert_map is not None:
        safe = ids.clamp(0, id_limit - 1).long()
        ids = torch.where((ids >= 0) & (ids < id_limit), expert_map[safe], -1)
    if compiling or ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    if not compiling:
        return _op.call(hidden_states, experts, tensors, weights, ids, name, apply_router_weight_on_input, out,
                        precision)
    if out is None:
        return _op.fused_moe(hidden_states, *tensors, weights, ids, name, apply_router_weight_on_input, precision)
    _op.fused_moe_out(hidden_states, *tensors, weights, ids, name, apply_router_weight_on_input, out, precision)
    return out
