"""``torch.ops.moe_fp4.fused_moe``: the MoE forward as one opaque operator.

Defined with ``torch.library.Library("moe_fp4", "DEF")`` (lower dispatch overhead than
``torch.library.custom_op``), with one Python implementation registered for the CPU and CUDA
dispatch keys and a fake implementation (shapes only) for ``torch.compile``, ``FakeTensorMode``
and the meta device::

    moe_fp4::fused_moe(Tensor hidden_states, Tensor w13, Tensor w13_scale, Tensor w13_gs, Tensor w2,
                       Tensor w2_scale, Tensor w2_gs, Tensor a13_gs, Tensor a2_gs, Tensor topk_weights,
                       Tensor topk_ids, str backend, bool apply_router_weight_on_input,
                       str precision="w4a4") -> Tensor
    moe_fp4::fused_moe_out(<the same arguments but precision>, Tensor(a!) out, str precision="w4a4") -> ()

The arguments are those :func:`moe_fp4.fused_moe` has checked: ``hidden_states`` bf16/fp16
``[M, H]`` contiguous, the eight tensors of an :class:`~moe_fp4.NvFp4Experts`, ``topk_weights``
float32 and ``topk_ids`` int32 ``[M, topk]`` contiguous (ids already mapped through
``expert_map``), ``backend`` a resolved backend name (not ``"auto"``) that computes
``precision`` (``"w4a4"`` or ``"w4a16"``, last in both schemas so that calls without it keep
their meaning). The operator does not check them again. ``fused_moe_out`` writes the result
into ``out`` (``[M, H]``, the hidden dtype, contiguous) and allocates nothing itself.

Inductor sees only the operator, never the quantizer inside it, so compiled results equal
eager ones bit for bit. The implementation neither imports (the backend module was imported
when the backend was resolved), compiles, reads files nor synchronizes once the experts'
view exists; the backends allocate no workspace during CUDA-graph capture.

The experts' view: the backends cache prepared weights on an :class:`NvFp4Experts` object, so
the operator must find the same object for the same tensors on every call.
:func:`experts_for` returns, in order: the object ``moe_fp4.fused_moe`` was called with (an
identity check of the eight tensors, eager calls only); the object registered under the
tensors' key ``(device, and per tensor data_ptr, version, shape, strides, dtype)``; or a new
object over aliases of the tensors (validated once, which synchronizes). Registered objects
are held weakly: a caller's object lives as long as the caller keeps it, and one built here
as long as the caller's ``w13`` tensor, so the cache never keeps a dropped layer's weights
alive. An in-place change of any tensor (a new version) makes the next keyed lookup build
a new view; the caller's own object is used as it is (its prepared weights are not rebuilt).

Eager calls: :func:`call` (what :func:`moe_fp4.fused_moe` runs when not compiling) calls the
implementation directly when the dispatcher would do nothing else with the call (that saves
its ~4 us): plain ``torch.Tensor`` arguments, no torch-function or dispatch mode (fake
tensors, tracing), no functorch transform, no profiler recording, and no autograd to record
(the functional operator's result gets a ``grad_fn`` when an argument requires grad).
Otherwise it calls the operator.

CUDA graphs of ``torch.compile(mode="reduce-overhead")`` copy every graph input that is not a
static address into their pool before capture; the operator would then see new addresses and
would have to build a view (which synchronizes) during capture. So the eight tensors of a CUDA
experts object are marked with ``torch._dynamo.mark_static_address`` when it is made
(:func:`moe_fp4.experts.mark_static`; when first registered if it was made while dynamo traced);
module buffers (:class:`moe_fp4.nn.FusedMoE`) are static anyway. A view that would have to be
built during capture raises an error that says so.
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType

import torch

from . import moe as _moe
from .backends import registry as _registry
from .experts import NvFp4Experts, _in_place_owner, mark_static

__all__ = ["OUT_SCHEMA", "SCHEMA", "call", "clear_cache", "experts_for", "fused_moe", "fused_moe_out", "tensors_of"]

_ARGS = ("Tensor hidden_states, Tensor w13, Tensor w13_scale, Tensor w13_gs, Tensor w2, Tensor w2_scale, "
         "Tensor w2_gs, Tensor a13_gs, Tensor a2_gs, Tensor topk_weights, Tensor topk_ids, str backend, "
         "bool apply_router_weight_on_input")
_PRECISION = 'str precision="w4a4"'
SCHEMA = f"fused_moe({_ARGS}, {_PRECISION}) -> Tensor"
OUT_SCHEMA = f"fused_moe_out({_ARGS}, Tensor(a!) out, {_PRECISION}) -> ()"

# --------------------------------------------------------------------------- the experts' view

_VIEWS: weakref.WeakValueDictionary[tuple, NvFp4Experts] = weakref.WeakValueDictionary()
_BUILT: dict[tuple, NvFp4Experts] = {}  # views made here; each entry dies with the caller's w13
_ADOPTED = ("moe_fp4._op", "registered")  # NvFp4Experts.prepared key: the object is in _VIEWS
_HINT: NvFp4Experts | None = None  # the object of the eager moe_fp4.fused_moe call in progress


def tensors_of(ex: NvFp4Experts) -> tuple[torch.Tensor, ...]:
    """The eight tensors of ``ex`` in the operator's argument order, as stored (:meth:`NvFp4Experts.stored`:
    the weights in the layout a backend may have re-laid them out to, in place)."""
    return ex.stored()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (nor in-place changes outside inference mode)
        return None


def _key(tensors: tuple[torch.Tensor, ...]) -> tuple:
    try:
        parts = [(t.data_ptr(), t._version, t.shape, t.stride(), t.dtype) for t in tensors]
    except RuntimeError:
        parts = [(t.data_ptr(), _version(t), t.shape, t.stride(), t.dtype) for t in tensors]
    parts.append(tensors[0].device)
    return tuple(parts)


def _is_over(ex: NvFp4Experts, t: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``ex`` holds exactly the tensor objects ``t`` (in field order, as stored)."""
    w13, s13, w2, s2 = ex._stored  # (what ex.stored() returns, without building its tuple)
    return (t[0] is w13 and t[1] is s13 and t[2] is ex.w13_gs and t[3] is w2 and t[4] is s2 and t[5] is ex.w2_gs
            and t[6] is ex.a13_gs and t[7] is ex.a2_gs)


def _register(ex: NvFp4Experts) -> bool:
    tensors = tensors_of(ex)
    key = _key(tensors)
    _VIEWS[key] = ex
    _BUILT.pop(key, None)  # a view built earlier (by a compiled call) over the same tensors gives way
    mark_static(tensors)  # (done when the object was made, unless that was while dynamo traced)
    return True


def _build(key: tuple, tensors: tuple[torch.Tensor, ...]) -> NvFp4Experts:
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moe_fp4.fused_moe: the experts' tensors have an address not seen outside CUDA-graph capture, and "
            "their view cannot be built (validated, its weights prepared) during capture. Under torch.compile("
            "mode='reduce-overhead') tensors that are not module parameters or buffers are copied into the graph's "
            "pool: use moe_fp4.nn.FusedMoE or an NvFp4Experts over the tensors (made outside torch.compile, it marks "
            "them with torch._dynamo.mark_static_address), or mark each of them so")
    ex = NvFp4Experts(*(t.detach() for t in tensors))  # aliases: the view must not keep the caller's objects alive
    for old in [k for k in _BUILT if k[0][0] == key[0][0] and k[-1] == key[-1]]:
        del _BUILT[old]  # an older version over the same w13 storage
    _BUILT[key] = ex
    _VIEWS[key] = ex
    weakref.finalize(tensors[0], _BUILT.pop, key, None)
    return ex


def experts_for(tensors: tuple[torch.Tensor, ...], hint: NvFp4Experts | None = None) -> NvFp4Experts:
    """The :class:`NvFp4Experts` over the eight tensors ``tensors`` (see the module docstring)."""
    if hint is not None and _is_over(hint, tensors):
        if _ADOPTED not in hint._prepared:  # (the cheap test of prepared()'s cache first: every eager call asks)
            hint.prepared(_ADOPTED, _register)  # once per object: keyed lookups (compiled calls) find it too
        return hint
    key = _key(tensors)
    ex = _VIEWS.get(key)
    if ex is None:
        # Weights a live experts object re-laid out in place are that object's (a new view would misread them).
        owner = _in_place_owner(tensors[0])
        if owner is not None and all(a.data_ptr() == b.data_ptr() for a, b in zip(owner.stored(), tensors)):
            return owner
    return ex if ex is not None else _build(key, tensors)


def clear_cache() -> None:
    """Forget every registered view (the next call of each layer validates its tensors again)."""
    _VIEWS.clear()
    _BUILT.clear()


# --------------------------------------------------------------------------- the operator

def _backend_module(name: str) -> ModuleType:
    spec = _registry.BACKENDS.get(name)
    mod = sys.modules.get(spec.module) if spec is not None else None
    # Imported when the backend was resolved, outside any traced region; the registry's table
    # and sys.modules are read on every call, so a backend registered later (tests) is found.
    return mod if mod is not None else _registry.get_backend_module(name)


def _forward(x, tensors, topk_weights, topk_ids, backend, on_input, out, precision, hint):
    problem = _moe.MoEProblem(x, experts_for(tensors, hint), topk_weights, topk_ids, on_input, out, precision)
    return _backend_module(backend).fused_moe(problem)


def _run(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs, topk_weights, topk_ids, backend,
         on_input, out, precision):
    return _forward(x, (w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs), topk_weights, topk_ids, backend,
                    on_input, out, precision, _HINT)


def _fused_moe_impl(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs, topk_weights, topk_ids, backend,
                    apply_router_weight_on_input, precision="w4a4"):
    if x.shape[0] == 0:
        return torch.empty_like(x)
    return _run(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs, topk_weights, topk_ids, backend,
                apply_router_weight_on_input, None, precision)


def _fused_moe_out_impl(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs, topk_weights, topk_ids,
                        backend, apply_router_weight_on_input, out, precision="w4a4"):
    if x.shape[0]:
        _run(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, a13_gs, a2_gs, topk_weights, topk_ids, backend,
             apply_router_weight_on_input, out, precision)


def _fused_moe_fake(x, *args):
    return torch.empty_like(x)


def _fused_moe_out_fake(x, *args):
    return None


_LIB = torch.library.Library("moe_fp4", "DEF")
_LIB.define(SCHEMA)
_LIB.define(OUT_SCHEMA)
for _key_name in ("CPU", "CUDA"):
    _LIB.impl("fused_moe", _fused_moe_impl, _key_name)
    _LIB.impl("fused_moe_out", _fused_moe_out_impl, _key_name)
torch.library.register_fake("moe_fp4::fused_moe", _fused_moe_fake, lib=_LIB)
torch.library.register_fake("moe_fp4::fused_moe_out", _fused_moe_out_fake, lib=_LIB)

fused_moe = torch.ops.moe_fp4.fused_moe.default
fused_moe_out = torch.ops.moe_fp4.fused_moe_out.default


_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_stack = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_profiler_enabled = torch.autograd._profiler_enabled


def _dispatcher_idle(x: torch.Tensor, tensors: tuple[torch.Tensor, ...], topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether the dispatcher would only call the implementation with these arguments (see the module docstring)."""
    plain = torch.Tensor
    if type(x) is not plain or type(topk_weights) is not plain or type(topk_ids) is not plain:
        return False
    if out is not None and type(out) is not plain:
        return False
    for t in tensors:  # (a loop: any() over a generator costs ~0.5 us more for the eight)
        if type(t) is not plain:
            return False
    if _function_mode() or _dispatch_stack() or _functorch_transforms() or _profiler_enabled():
        return False
    if out is not None or not torch.is_grad_enabled():
        return True
    if x.requires_grad or topk_weights.requires_grad:
        return False
    for t in tensors:
        if t.requires_grad:
            return False
    return True


def call(hidden_states: torch.Tensor, experts: NvFp4Experts | None, tensors: tuple[torch.Tensor, ...],
         topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str, apply_router_weight_on_input: bool,
         out: torch.Tensor | None, precision: str = "w4a4") -> torch.Tensor:
    """An eager call of the operator that hands it ``experts`` (the caller's object) for ``tensors``
    (the implementation itself when the dispatcher would add nothing; ``M >= 1``)."""
    global _HINT
    if _dispatcher_idle(hidden_states, tensors, topk_weights, topk_ids, out):  # _forward's two lines, inline
        problem = _moe.MoEProblem(hidden_states, experts_for(tensors, experts), topk_weights, topk_ids,
                                  apply_router_weight_on_input, out, precision)
        result = _backend_module(backend).fused_moe(problem)
        return result if out is None else out
    _HINT = experts
    try:
        if out is None:
            return fused_moe(hidden_states, *tensors, topk_weights, topk_ids, backend, apply_router_weight_on_input,
                             precision)
        fused_moe_out(hidden_states, *tensors, topk_weights, topk_ids, backend, apply_router_weight_on_input, out,
                      precision)
        return out
    finally:
        _HINT = None
