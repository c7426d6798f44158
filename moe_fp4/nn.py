"""``torch.nn`` modules over :func:`moe_fp4.fused_moe`: :class:`FusedMoE` and :class:`SparseMoeBlock`.

:class:`FusedMoE` holds one layer's NVFP4 experts as registered buffers (the tensors of an
:class:`~moe_fp4.NvFp4Experts`), so ``.to()``, ``state_dict()``/``load_state_dict()`` and
``named_buffers()`` behave as for any module; the :class:`~moe_fp4.NvFp4Experts` view the
kernels take is rebuilt (and validated) whenever a buffer changes::

    moe = FusedMoE.from_checkpoint("Qwen3-30B-A3B-NVFP4", layer=0, device="cuda")
    out = moe(hidden_states, topk_weights, topk_ids)          # [M, H]

    block = SparseMoeBlock.from_checkpoint("Qwen3-30B-A3B-NVFP4", layer=0, device="cuda")
    out = block(hidden_states)                                # [..., H]: router + experts

Casting a module (``.half()``, ``.to(torch.bfloat16)``, a whole model's ``.to(dtype)``) never
changes these buffers' dtypes: the packed codes, the float8 block scales and the float32
global scales are the format. Only their device follows.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .backends.registry import check_precision
from .checkpoint import load_experts, load_moe_block, route
from .experts import NvFp4Experts
from .moe import forward as moe_forward
from .moe import fused_moe

__all__ = ["ExpertParallelMoE", "FusedMoE", "SparseMoeBlock"]

_FIELDS = ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs", "a13_gs", "a2_gs")
_ROUTER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _expect(name: str, value: object, kind: type, what: str):
    """``value`` if it is a ``kind``, else a TypeError naming the argument."""
    if not isinstance(value, kind):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (nor in-place changes outside inference mode)
        return None


def _empty_fields(E: int, H: int, I: int, per_half: bool, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """Valid placeholder tensors (all-zero experts, unit global scales) of the given shape."""
    zeros = {"dtype": torch.uint8, "device": device}
    ones = {"dtype": torch.float32, "device": device}
    return {
        "w13": torch.zeros(E, 2 * I, H // 2, **zeros),
        "w13_scale": torch.zeros(E, 2 * I, H // 16, **zeros).view(torch.float8_e4m3fn),
        "w13_gs": torch.ones((E, 2) if per_half else (E,), **ones),
        "w2": torch.zeros(E, H, I // 2, **zeros),
        "w2_scale": torch.zeros(E, H, I // 16, **zeros).view(torch.float8_e4m3fn),
        "w2_gs": torch.ones(E, **ones),
        "a13_gs": torch.ones(E, **ones),
        "a2_gs": torch.ones(E, **ones),
    }


def _canonical_state(module: FusedMoE, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` hook: weights a backend re-laid out in place are saved canonical (restored copies)."""
    ex = module._relaid_view()
    if ex is not None:
        for name, t in ex.canonical_tensors().items():
            state_dict[prefix + name] = t.detach()
    elif module._cache is None or module._cache[1].layout is None:
        # The state holds the buffers themselves: a later re-layout in place would rewrite it.
        module._handed_out = True
        if module._cache is not None:
            module._cache[1]._handed_out = True


class FusedMoE(nn.Module):
    """The NVFP4 experts of one MoE layer as an ``nn.Module``; ``forward`` is :func:`moe_fp4.fused_moe`.

    Args:
        num_experts, hidden_size, intermediate_size: ``E``, ``H`` and ``I`` (``H`` and ``I``
            multiples of 16). The buffers start as valid all-zero experts: fill them with
            :meth:`load_state_dict`, or build from real weights with :meth:`from_experts` /
            :meth:`from_checkpoint`.
        separate_gate_up_scales: ``w13_gs`` is ``[E, 2]`` (gate, up) instead of ``[E]``.
            :meth:`load_state_dict` accepts either shape whatever this is.
        backend: passed to :func:`moe_fp4.fused_moe` (``"auto"``, ``"cutlass"``, ``"triton"``,
            ``"reference"``).
        apply_router_weight_on_input: passed to :func:`moe_fp4.fused_moe`.
        precision: passed to :func:`moe_fp4.fused_moe`: ``"w4a4"`` (NVFP4 activations, the
            default) or ``"w4a16"`` (16-bit activations).
        device: where the buffers are created.

    Buffers (those of :class:`~moe_fp4.NvFp4Experts`): ``w13``, ``w13_scale``, ``w13_gs``,
    ``w2``, ``w2_scale``, ``w2_gs``, ``a13_gs``, ``a2_gs``. Their dtypes are fixed; module
    casts only move them. The :class:`~moe_fp4.NvFp4Experts` view (:attr:`experts`) is
    cached under the buffers' identity, storage, device, shape, dtype and version counter,
    so any replacement or in-place change of a buffer rebuilds it before the next forward.

    One resident copy: the first forward of a backend with its own weight layout (cutlass on
    compute capability 9.x; triton's swizzled scales when they need no padding) re-lays the
    weight buffers out in place (:meth:`NvFp4Experts.in_layout`): ``w13``, ``w13_scale``,
    ``w2`` and ``w2_scale`` then hold that layout (read canonical weights with
    ``module.experts.w13`` etc. or :meth:`state_dict`, which restores them). Not when the
    buffers were handed out first (a :meth:`state_dict` taken before that forward,
    ``load_state_dict(assign=True)``) or another experts object is over them (then a copy).
    New global scales keep the layout; a move (``.to(device)``) and :meth:`load_state_dict`
    go through canonical weights. Limits: a ``state_dict`` of a re-laid-out model holds
    restored copies of every layer at once (one more copy of the weights while it lives: save
    layer by layer if that does not fit); a module first called under ``torch.compile``
    without an eager call gets a copy (the compiled call builds its own experts view).

    Under ``torch.compile`` (``fullgraph=True`` works) ``forward`` hands the buffers straight
    to the ``torch.ops.moe_fp4.fused_moe`` operator, which keeps its own view of them under the
    same kind of key (:mod:`moe_fp4._op`), so in-place changes are followed there too.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_gs: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_gs: torch.Tensor
    a13_gs: torch.Tensor
    a2_gs: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        separate_gate_up_scales: bool = False,
        backend: str = "auto",
        apply_router_weight_on_input: bool = False,
        precision: str = "w4a4",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        E = _check_size("num_experts", num_experts)
        H = _check_size("hidden_size", hidden_size)
        I = _check_size("intermediate_size", intermediate_size)
        for name, v in (("hidden_size", H), ("intermediate_size", I)):
            if v % 16:
                raise ValueError(f"{name}: expected a multiple of 16 (the NVFP4 block size), got {v}")
        _expect("separate_gate_up_scales", separate_gate_up_scales, bool, "a bool")
        self.backend = _expect("backend", backend, str, "a str (auto, cutlass, triton or reference)")
        self.apply_router_weight_on_input = _expect("apply_router_weight_on_input", apply_router_weight_on_input, bool,
                                                    "a bool")
        self.precision = check_precision(precision)
        for name, t in _empty_fields(E, H, I, separate_gate_up_scales, device).items():
            self.register_buffer(name, t)
        self._cache: tuple[tuple, NvFp4Experts] | None = None
        self._handed_out = False  # the weight buffers were handed out (state_dict, assign): never re-laid out
        self._register_state_dict_hook(_canonical_state)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_experts(
        cls, experts: NvFp4Experts, *, backend: str = "auto", apply_router_weight_on_input: bool = False,
        precision: str = "w4a4",
    ) -> FusedMoE:
        """A module whose buffers are ``experts``' tensors, shared, not copied: an in-place change
        through the module (e.g. :meth:`load_state_dict`) writes into ``experts``' tensors too,
        and the module then uses a new view (``experts``' backend caches are not refreshed)."""
        if not isinstance(experts, NvFp4Experts):
            raise TypeError(f"experts: expected an NvFp4Experts, got {type(experts).__name__}")
        module = cls(
            experts.num_experts, experts.hidden_size, experts.intermediate_size,
            separate_gate_up_scales=experts.w13_gs.dim() == 2, backend=backend,
            apply_router_weight_on_input=apply_router_weight_on_input, precision=precision, device="meta",
        )
        for name, t in zip(_FIELDS, experts.stored(), strict=True):
            setattr(module, name, t)
        module._cache = (module._key(), experts)
        return module

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, layer: int, *, device: torch.device | str = "cpu",
                        backend: str = "auto", apply_router_weight_on_input: bool = False,
                        precision: str = "w4a4") -> FusedMoE:
        """The experts of MoE layer ``layer`` of an NVFP4 checkpoint (:func:`moe_fp4.load_experts`)."""
        return cls.from_experts(load_experts(path, layer, device=device), backend=backend,
                                apply_router_weight_on_input=apply_router_weight_on_input, precision=precision)

    # ------------------------------------------------------------------ the NvFp4Experts view
    def _key(self) -> tuple:
        return tuple(
            (id(t), t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride(), _version(t))
            for t in (getattr(self, n) for n in _FIELDS)
        )

    @property
    def experts(self) -> NvFp4Experts:
        """The :class:`~moe_fp4.NvFp4Experts` over the current buffers (validated when rebuilt)."""
        key = self._key()
        if self._cache is None or self._cache[0] != key:
            if any(getattr(self, n).is_meta for n in _FIELDS):
                raise RuntimeError("FusedMoE: its buffers are on the meta device; load real tensors first")
            old = self._cache[1] if self._cache is not None else None
            if old is not None and old.layout is not None and self._weights_are(old):
                # Only global scales changed: the weights keep their layout (carried over, not re-read).
                view = old._with_scales(self.w13_gs, self.w2_gs, self.a13_gs, self.a2_gs)
            else:
                # The module's buffers are its own (a backend may re-lay them out in place), unless they
                # were handed out (state_dict, assign) or another experts object is over them.
                view = NvFp4Experts(**{n: getattr(self, n) for n in _FIELDS}, own=not self._handed_out)
            self._cache = (key, view)
        return self._cache[1]

    def _weights_are(self, ex: NvFp4Experts) -> bool:
        """Whether the four weight buffers are ``ex``'s stored tensors, unwritten since its layout."""
        stored = ex.stored()
        if not all(self._buffers[n] is stored[i] for n, i in (("w13", 0), ("w13_scale", 1), ("w2", 3),
                                                            ("w2_scale", 4))):
            return False
        try:
            ex._check_layout()
        except RuntimeError:
            return False
        return True

    num_experts = property(lambda self: self.w13.shape[0], doc="E, the number of experts.")
    hidden_size = property(lambda self: self.w13.shape[2] * 2, doc="H, the hidden size.")
    intermediate_size = property(lambda self: self.w13.shape[1] // 2, doc="I, each expert's intermediate size.")

    def extra_repr(self) -> str:
        gs = "per-half" if self.w13_gs.dim() == 2 else "shared"
        return (f"E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, gate/up global scale {gs}, "
                f"backend={self.backend!r}, apply_router_weight_on_input={self.apply_router_weight_on_input}, "
                f"precision={self.precision!r}")

    # ------------------------------------------------------------------ nn.Module hooks
    def _relaid_view(self) -> NvFp4Experts | None:
        """The experts view when a backend re-laid its buffers' weights out in place (they hold its layout)."""
        ex = self._cache[1] if self._cache is not None else None
        if ex is None or ex.layout is None:
            return None
        return ex if self._weights_are(ex) else None

    def _canonicalize(self) -> None:
        """Canonical weight buffers again (restored copies; the re-laid-out ones stay with the old view)."""
        ex = self._relaid_view()
        if ex is not None:
            self._buffers.update(zip(("w13", "w13_scale", "w2", "w2_scale"), ex._restored(), strict=True))
            self._cache = None
        elif self._cache is not None and self._cache[1].layout is not None:
            self._cache = None  # a view whose layout the buffers no longer hold (written since): dropped

    def __getstate__(self):
        # Copies and pickles (copy.deepcopy, torch.save of the module) carry canonical weights and no
        # experts view: a layout re-laid out in place is the view's, and the copy builds its own.
        state = super().__getstate__()
        ex = self._relaid_view()
        if ex is not None:
            state["_buffers"] = {**state["_buffers"],
                                 **dict(zip(("w13", "w13_scale", "w2", "w2_scale"), ex._restored(), strict=True))}
        state["_cache"] = None
        return state

    def _apply(self, fn, recurse=True):
        # Weights a backend re-laid out in place are moved canonical (the layout is the view's, on its device).
        if self._relaid_view() is not None and fn(torch.empty(0, device=self.w13.device)).device != self.w13.device:
            self._canonicalize()
        # Module casts (.half(), .to(dtype)) would convert the float8 and float32 format
        # tensors; keep each buffer's dtype and take only the device the cast gave it.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        if any(self._buffers[n] is not t for n, t in before.items()):
            self._cache = None  # do not keep the old tensors alive through the stale view
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._canonicalize()  # a state is canonical: loaded into canonical buffers, never into a GEMM's layout
        if local_metadata.get("assign_to_params_buffers", False):
            self._handed_out = True  # the caller's tensors become the buffers: never rewritten in place
        # w13_gs may be [E] (shared) or [E, 2] (gate, up): take the incoming layout.
        gs = state_dict.get(prefix + "w13_gs")
        E = self.num_experts
        if isinstance(gs, torch.Tensor) and gs.shape != self.w13_gs.shape and tuple(gs.shape) in ((E,), (E, 2)):
            self.w13_gs = torch.empty(gs.shape, dtype=self.w13_gs.dtype, device=self.w13_gs.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """:func:`moe_fp4.fused_moe` of ``hidden_states [..., H]`` routed by ``topk_weights``/``topk_ids``
        ``[..., topk]`` (ids in ``[-1, E)``, ``-1`` contributes nothing); returns ``[..., H]``."""
        x, w, ids = (_expect(n, t, torch.Tensor, "a torch.Tensor") for n, t in
                     (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids)))
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected shape [..., {self.hidden_size}] (the experts' hidden size), "
                             f"got {list(x.shape)}")
        lead = tuple(x.shape[:-1])
        for name, t in (("topk_weights", w), ("topk_ids", ids)):
            if t.dim() < 1 or tuple(t.shape[:-1]) != lead:
                raise ValueError(f"{name}: expected shape {list(lead) + ['topk']} (the leading dimensions of "
                                 f"hidden_states), got {list(t.shape)}")
        flat = (x.reshape(-1, self.hidden_size).contiguous(), w.reshape(-1, w.shape[-1]),
                ids.reshape(-1, ids.shape[-1]))
        if torch.compiler.is_compiling():
            # The view cache of `experts` reads data pointers and version counters, which a trace
            # cannot: the buffers go straight to the operator, which keeps (and validates once)
            # its own view of them.
            buffers = tuple(getattr(self, n) for n in _FIELDS)
            out = moe_forward(flat[0], None, buffers, flat[1], flat[2], self.backend, self.apply_router_weight_on_input,
                              None, None, True, self.precision)
        else:
            out = fused_moe(flat[0], self.experts, flat[1], flat[2], backend=self.backend,
                            apply_router_weight_on_input=self.apply_router_weight_on_input, precision=self.precision)
        return out.reshape(x.shape)


class ExpertParallelMoE(FusedMoE):
    """One rank's share of a layer's experts, run with :func:`moe_fp4.distributed.ep_fused_moe`.

    The buffers are the local experts' tensors (as :class:`FusedMoE`) and ``expert_map``
    (int32 ``[E_global]``: local id or ``-1``, or the ``[world, E_global]`` table of every
    rank's map). ``forward`` takes global ids; ``mode`` is ``"all_to_all"`` (tokens differ per
    rank) or ``"all_reduce"`` (every rank has the same tokens); ``group`` the process group
    (the default one when None; not saved in ``state_dict``).
    """

    expert_map: torch.Tensor

    @classmethod
    def from_shard(cls, local_experts: NvFp4Experts, expert_map: torch.Tensor, *, mode: str = "all_to_all",
                   group=None, backend: str = "auto", apply_router_weight_on_input: bool = False,
                   precision: str = "w4a4") -> ExpertParallelMoE:
        """A module over ``(local_experts, expert_map)`` as :func:`moe_fp4.distributed.shard_experts` gives them."""
        module = cls.from_experts(local_experts, backend=backend,
                                  apply_router_weight_on_input=apply_router_weight_on_input, precision=precision)
        _expect("expert_map", expert_map, torch.Tensor, "a torch.Tensor")
        module.register_buffer("expert_map", expert_map)
        module.mode = _expect("mode", mode, str, 'a str ("all_to_all" or "all_reduce")')
        module.group = group
        return module

    @classmethod
    def from_checkpoint_shard(cls, path: str | os.PathLike, layer: int, rank: int, world_size: int, *,
                              device: torch.device | str = "cpu", mode: str = "all_to_all", group=None,
                              backend: str = "auto", precision: str = "w4a4") -> ExpertParallelMoE:
        """Rank ``rank``'s experts of MoE layer ``layer``, reading only those tensors of the checkpoint."""
        from .distributed import load_expert_shard

        local, expert_map = load_expert_shard(path, layer, rank, world_size, device=device)
        return cls.from_shard(local, expert_map, mode=mode, group=group, backend=backend, precision=precision)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``ep_fused_moe`` of ``hidden_states [M, H]`` routed by global ``topk_ids [M, topk]``."""
        from .distributed import ep_fused_moe

        return ep_fused_moe(hidden_states, self.experts, topk_weights, topk_ids, expert_map=self.expert_map,
                            group=self.group, mode=self.mode, backend=self.backend,
                            apply_router_weight_on_input=self.apply_router_weight_on_input, precision=self.precision)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode}, global_experts={self.expert_map.shape[-1]}"


class SparseMoeBlock(nn.Module):
    """A Qwen3-MoE sparse MoE block: a router (``gate``, an ``nn.Linear`` ``H -> E`` without
    bias) and NVFP4 experts (``experts``, a :class:`FusedMoE`).

    Routing (:func:`moe_fp4.checkpoint.route`): logits in the hidden-state dtype, softmax in
    float32, top-k, divided by their sum when ``norm_topk_prob``; the float32 weights and the
    ids go to :func:`moe_fp4.fused_moe`. The result equals the checkpoint's
    :class:`~moe_fp4.checkpoint.MoEBlock` bit for bit. There is no shared expert.

    Args:
        num_experts, hidden_size, intermediate_size, top_k: ``E``, ``H``, ``I``, ``k``.
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        router_dtype: dtype of the router weight.
        separate_gate_up_scales, backend, apply_router_weight_on_input, precision, device: as for
            :class:`FusedMoE`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, *,
                 norm_topk_prob: bool = False, router_dtype: torch.dtype = torch.bfloat16,
                 separate_gate_up_scales: bool = False, backend: str = "auto",
                 apply_router_weight_on_input: bool = False, precision: str = "w4a4",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        E = _check_size("num_experts", num_experts)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
            raise ValueError(f"top_k: expected an int in [1, {E}] (the number of experts), got {top_k!r}")
        if router_dtype not in _ROUTER_DTYPES:
            raise TypeError(f"router_dtype: expected one of {[str(d) for d in _ROUTER_DTYPES]}, got {router_dtype!r}")
        self.top_k = top_k
        self.norm_topk_prob = _expect("norm_topk_prob", norm_topk_prob, bool, "a bool")
        self.experts = FusedMoE(E, hidden_size, intermediate_size, separate_gate_up_scales=separate_gate_up_scales,
                                backend=backend, apply_router_weight_on_input=apply_router_weight_on_input,
                                precision=precision, device=device)
        self.gate = nn.Linear(self.experts.hidden_size, E, bias=False, device=device, dtype=router_dtype)
        self.gate.weight.requires_grad_(False)
        nn.init.zeros_(self.gate.weight)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, layer: int, *, device: torch.device | str = "cpu",
                        backend: str = "auto", apply_router_weight_on_input: bool = False,
                        precision: str = "w4a4") -> SparseMoeBlock:
        """Router (``mlp.gate.weight`` as stored, ``top_k`` and ``norm_topk_prob`` from config.json)
        and NVFP4 experts of MoE layer ``layer`` (:func:`moe_fp4.load_moe_block`)."""
        block = load_moe_block(path, layer, device=device)
        router, experts = block.router, block.experts
        module = cls(
            experts.num_experts, experts.hidden_size, experts.intermediate_size, router.top_k,
            norm_topk_prob=router.renormalize, router_dtype=router.gate_weight.dtype,
            separate_gate_up_scales=experts.w13_gs.dim() == 2, backend=backend,
            apply_router_weight_on_input=apply_router_weight_on_input, precision=precision, device="meta",
        )
        module.experts = FusedMoE.from_experts(experts, backend=backend,
                                               apply_router_weight_on_input=apply_router_weight_on_input,
                                               precision=precision)
        module.gate.weight = nn.Parameter(router.gate_weight, requires_grad=False)
        return module

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights float32 [M, k], topk_ids int32 [M, k])`` for ``hidden_states [M, H]``."""
        return route(hidden_states, self.gate.weight, self.top_k, renormalize=self.norm_topk_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., H]`` (bf16/fp16) -> ``[..., H]``."""
        x = _expect("hidden_states", hidden_states, torch.Tensor, "a torch.Tensor")
        H = self.experts.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"hidden_states: expected shape [..., {H}] (the block's hidden size), got {list(x.shape)}")
        flat = x.reshape(-1, H).contiguous()
        topk_weights, topk_ids = self.route(flat)
        return self.experts(flat, topk_weights, topk_ids).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
