"""``NvFp4Experts``: one MoE layer's experts in NVFP4, validated once, shared by all backends."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._checks import check_divisible, check_precision, check_tensor
from .format import (
    BLOCK_SIZE,
    _as_global_scale,
    _quantize_blocks,
    decode_scaled,
    global_scale_for,
)

__all__ = ["NvFp4Experts"]

_F8 = torch.float8_e4m3fn


def _check_block_scales(name: str, s: torch.Tensor) -> None:
    bits = s.view(torch.uint8)
    if s.numel() and bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name}: expected finite float8_e4m3fn block scales, got NaN (0x7f/0xff) entries")
    if s.numel() and bool(((bits & 0x80) != 0).any()):
        raise ValueError(f"{name}: expected non-negative block scales, got entries with the sign bit set")


def _check_global_scales(E: int, device: torch.device, w13_gs: torch.Tensor, w2_gs: torch.Tensor,  # noqa: N803
                         a13_gs: torch.Tensor, a2_gs: torch.Tensor) -> None:
    check_tensor("w13_gs", w13_gs, dtypes=(torch.float32,), ndim=(1, 2), device=device)
    if tuple(w13_gs.shape) not in ((E,), (E, 2)):
        raise ValueError(f"w13_gs: expected shape [{E}] or [{E}, 2] (gate, up), got {list(w13_gs.shape)}")
    for name, g in (("w2_gs", w2_gs), ("a13_gs", a13_gs), ("a2_gs", a2_gs)):
        check_tensor(name, g, dtypes=(torch.float32,), shape=(E,), device=device)
    for name, g in (("w13_gs", w13_gs), ("w2_gs", w2_gs), ("a13_gs", a13_gs), ("a2_gs", a2_gs)):
        _check_global(name, g)


def _check_global(name: str, g: torch.Tensor) -> None:
    if g.numel() and not (bool(torch.isfinite(g).all()) and bool((g > 0).all())):
        raise ValueError(
            f"{name}: expected finite positive quantize-direction global scales, got {g.flatten()[:8].tolist()}"
        )


# Builds of prepared layouts (rare: once per experts object and layout; reentrant, as one layout may
# build on another).
_PREPARE_LOCK = threading.RLock()

# The four weight tensors a layout may re-lay out in place, in field order.
_WEIGHTS = ("w13", "w13_scale", "w2", "w2_scale")

# Experts objects whose weight storage holds a layout other than the canonical one, by the device
# and address of their w13 (while they live): NvFp4Experts over those tensors would misread them.
_IN_PLACE: weakref.WeakValueDictionary[tuple, NvFp4Experts] = weakref.WeakValueDictionary()

# Every live experts object by the device and address of its w13 and w2 (a layout is re-laid out in
# place only over storage no other object reads).
_ALIASES: dict[tuple, weakref.WeakSet] = {}


def mark_static(tensors: tuple[torch.Tensor, ...]) -> None:
    """Marks CUDA ``tensors`` (an experts object's eight, :meth:`NvFp4Experts.stored`) as static addresses for
    torch.compile: CUDA graphs of ``mode="reduce-overhead"`` copy every other graph input into their pool before
    capture, and the operator would see the weights at a new address there, whose view it cannot build during
    capture (``moe_fp4._op``). Done when the object is made, so that a model compiled before its first call has
    its experts' tensors marked when dynamo first meets them; not while dynamo traces (it forbids the call)."""
    if tensors[0].is_cuda and not torch.compiler.is_compiling():
        from torch._dynamo import mark_static_address

        for t in tensors:
            mark_static_address(t)


def _storage_key(t: torch.Tensor) -> tuple:
    return str(t.device), t.data_ptr()


def _forget_aliases(keys: tuple) -> None:
    for k in keys:
        members = _ALIASES.get(k)
        # Iterating a WeakSet yields live objects only (its length may still count the dying one).
        if members is not None and not any(True for _ in members):
            _ALIASES.pop(k, None)


# Whether layouts may replace the canonical tensors in place (moe_fp4.bench.hostcost turns it off:
# its stubbed library writes nothing).
IN_PLACE_LAYOUTS = True

Relayout = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
Restore = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _of_weight(f, j: int):
    """``f`` for weight pair ``j`` (0: w13, 1: w2): ``in_layout`` takes one function for both or a pair."""
    return f[j] if isinstance(f, tuple) else f


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _kept_blocks(codes: torch.Tensor, scales: torch.Tensor, step: int) -> tuple | None:
    """``(block indices, their 8 code bytes)`` of the blocks whose scale is zero but whose codes are not
    (a layout that zeroes them can then be undone byte for byte), or None when there are none; scanned
    ``step`` experts at a time (small masks)."""
    idx, vals = [], []
    blocks = scales[0].numel()
    for e0 in range(0, codes.shape[0], step):
        c = codes[e0:e0 + step].view(torch.int64).reshape(-1)  # one int64 = one 16-element block's 8 code bytes
        hit = ((scales[e0:e0 + step].view(torch.uint8).reshape(-1) == 0) & (c != 0)).nonzero().reshape(-1)
        if hit.numel():
            idx.append(hit + e0 * blocks)
            vals.append(c[hit].clone())
    return (torch.cat(idx), torch.cat(vals)) if idx else None


def _restore_pair(restore: Restore, codes: torch.Tensor, scales: torch.Tensor, kept: tuple | None):
    c, sc = restore(codes, scales)
    if kept is not None:
        c.view(torch.int64).reshape(-1)[kept[0]] = kept[1]
    return c, sc


class NvFp4Experts:
    """The experts of one MoE layer, quantized to NVFP4.

    Attributes (all on one device):
        w13:       uint8 ``[E, 2I, H/2]``: gate_proj rows ``0..I-1``, then up_proj rows ``I..2I-1``.
        w13_scale: float8_e4m3fn ``[E, 2I, H/16]``, logical row-major block scales.
        w13_gs:    float32 ``[E]`` or ``[E, 2]`` (gate, up) quantize-direction global scales.
                   Different gate and up scales are kept and applied exactly, per half.
        w2:        uint8 ``[E, H, I/2]``.
        w2_scale:  float8_e4m3fn ``[E, H, I/16]``.
        w2_gs:     float32 ``[E]``.
        a13_gs:    float32 ``[E]``: global scale used to quantize each expert's input rows.
        a2_gs:     float32 ``[E]``: global scale used to quantize each expert's intermediate.

    Global scales are in the quantize direction, ``448 * 6 / amax``. Construction validates
    every tensor. Backends may cache prepared layouts on the object with :meth:`prepared`.

    **One resident copy.** A backend whose GEMM reads its own layout (the cutlass backend on
    compute capability 9.x) re-lays the four weight tensors out *in place* (:meth:`in_layout`),
    so that a layer holds its NVFP4 bytes once, as vLLM's and SGLang's weight processing does:
    the storage of the tensors the object was built over then holds that layout (:attr:`layout`
    names it), and the attributes above return canonical copies restored from it, exactly,
    built on first access and kept (a caller that uses that backend and another one holds both
    layouts). :meth:`canonical_tensors` gives canonical tensors without keeping them
    (``state_dict`` of :class:`moe_fp4.nn.FusedMoE`, :meth:`to`). In place happens only while
    nothing may hold the canonical storage for a kernel: not once an attribute above was read
    (by a user, another backend, the reference), nor with ``keep_canonical = True``, nor during
    CUDA-graph capture, and only over tensors the object owns: built with ``own=True`` (what
    moe_fp4's loaders, :meth:`quantize`, :meth:`to` and ``shard_experts`` do: their tensors are
    fresh; pass it for tensors you hand over and will not read again) and by no other live
    ``NvFp4Experts``. Otherwise the layout is a copy beside the canonical tensors.
    :meth:`stored` gives the tensors as stored (what the ``torch.ops.moe_fp4`` operator takes).
    An object owns its layout: its tensors are not to be written in place afterwards (that is
    detected and refused), and another ``NvFp4Experts`` over them is refused while it lives.
    """

    keep_canonical: bool = False  # True: layouts are always copies beside the canonical tensors

    def __init__(
        self,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w13_gs: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        w2_gs: torch.Tensor,
        a13_gs: torch.Tensor,
        a2_gs: torch.Tensor,
        *,
        own: bool = False,
    ) -> None:
        check_tensor("w13", w13, dtypes=(torch.uint8,), ndim=3, contiguous=True)
        owner = _in_place_owner(w13)
        if owner is not None:
            raise ValueError(f"w13: this storage holds the {owner.layout!r} layout of another NvFp4Experts, re-laid "
                             "out in place for its GEMM, not canonical NVFP4 codes; use that object (or its "
                             "canonical_tensors())")
        E, two_i, h_half = w13.shape
        device = w13.device
        if two_i % 2:
            raise ValueError(f"w13: expected an even number of rows (gate rows then up rows), got {two_i}")
        I, H = two_i // 2, h_half * 2
        if E < 1:
            raise ValueError(f"w13: expected at least one expert, got shape {list(w13.shape)}")
        check_divisible("w13", H, BLOCK_SIZE, "the hidden size H (2 * w13.shape[2])")
        check_divisible("w13", I, BLOCK_SIZE, "the intermediate size I (w13.shape[1] / 2)")
        check_tensor("w13_scale", w13_scale, dtypes=(_F8,), shape=(E, 2 * I, H // BLOCK_SIZE), device=device,
                     contiguous=True)
        check_tensor("w2", w2, dtypes=(torch.uint8,), shape=(E, H, I // 2), device=device, contiguous=True)
        check_tensor("w2_scale", w2_scale, dtypes=(_F8,), shape=(E, H, I // BLOCK_SIZE), device=device, contiguous=True)
        _check_global_scales(E, device, w13_gs, w2_gs, a13_gs, a2_gs)
        _check_block_scales("w13_scale", w13_scale)
        _check_block_scales("w2_scale", w2_scale)

        self._stored = (w13, w13_scale, w2, w2_scale)  # the weights as stored (see layout)
        self.w13_gs = w13_gs.contiguous()
        self.w2_gs = w2_gs.contiguous()
        self.a13_gs, self.a2_gs = a13_gs.contiguous(), a2_gs.contiguous()
        self._prepared: dict[Any, Any] = {}
        self._layout: tuple | None = None  # (key, restore, kept blocks, versions) once re-laid out in place
        self._handed_out = False  # an attribute read gave the canonical storage away
        self._canonical_copy: tuple[torch.Tensor, ...] | None = None
        if not isinstance(own, bool):
            raise TypeError(f"own: expected a bool, got {type(own).__name__}")
        self._own = own
        self._register_aliases()
        mark_static(self.stored())

    def _register_aliases(self) -> None:
        """Enters this object in the alias registry under its w13 and w2 (left when it dies)."""
        keys = (_storage_key(self._stored[0]), _storage_key(self._stored[2]))
        for k in keys:
            _ALIASES.setdefault(k, weakref.WeakSet()).add(self)
        weakref.finalize(self, _forget_aliases, keys)

    # ------------------------------------------------------------------ the stored weights
    def _canonical(self, i: int) -> torch.Tensor:
        if self._layout is None:
            with _PREPARE_LOCK:  # not while another thread re-lays the storage out
                if self._layout is None:
                    self._handed_out = True
                    return self._stored[i]
        if self._canonical_copy is None:
            with _PREPARE_LOCK:
                if self._canonical_copy is None:
                    copy = self._restored()
                    self._wait_for_current_stream()  # published only once written
                    self._canonical_copy = copy
        return self._canonical_copy[i]

    w13 = property(lambda self: self._canonical(0), doc="uint8 ``[E, 2I, H/2]`` canonical codes (see the class).")
    w13_scale = property(lambda self: self._canonical(1), doc="float8_e4m3fn ``[E, 2I, H/16]`` block scales.")
    w2 = property(lambda self: self._canonical(2), doc="uint8 ``[E, H, I/2]`` canonical codes.")
    w2_scale = property(lambda self: self._canonical(3), doc="float8_e4m3fn ``[E, H, I/16]`` block scales.")

    @property
    def layout(self) -> Any:
        """The key of the layout the weight tensors' storage holds (:meth:`in_layout`); None: canonical."""
        return None if self._layout is None else self._layout[0]

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The eight tensors as stored, in field order (the weights in :attr:`layout`)."""
        w13, s13, w2, s2 = self._stored
        return w13, s13, self.w13_gs, w2, s2, self.w2_gs, self.a13_gs, self.a2_gs

    def canonical_tensors(self, expert: int | None = None) -> dict[str, torch.Tensor]:
        """The four weight tensors in the canonical layout (with ``expert``: that expert's, ``[1, ...]``).

        When re-laid out: restored copies, not kept (but the kept canonical copy when there is
        one); else the stored tensors themselves, which are then handed out (never re-laid out
        in place afterwards).
        """
        return self._canonical_tensors(expert, hand_out=True)

    def _canonical_tensors(self, expert: int | None = None, *, hand_out: bool) -> dict[str, torch.Tensor]:
        """:meth:`canonical_tensors`; ``hand_out=False`` for a caller that only copies them at once (``to``,
        ``dequantize``, ``shard_experts``) and keeps no reference: the storage is not marked handed out."""
        sel = slice(None) if expert is None else slice(expert, expert + 1)
        if self._layout is None:
            with _PREPARE_LOCK:
                if self._layout is None:
                    self._handed_out = self._handed_out or hand_out
                    return {k: t[sel] for k, t in zip(_WEIGHTS, self._stored, strict=True)}
        if self._canonical_copy is not None:
            return {k: t[sel] for k, t in zip(_WEIGHTS, self._canonical_copy, strict=True)}
        return dict(zip(_WEIGHTS, self._restored(expert), strict=True))

    def _check_layout(self) -> None:
        """Raises if the weights were written in place since they were re-laid out (no-op when canonical)."""
        if self._layout is None:
            return
        key, _, _, versions = self._layout
        if tuple(_version(t) for t in self._stored) != versions:
            raise RuntimeError(
                f"experts: the weight tensors were written in place after they were re-laid out ({key!r}) for a "
                "GEMM; they no longer hold that layout. Build a new NvFp4Experts over the new weights")

    def _restored(self, expert: int | None = None) -> tuple[torch.Tensor, ...]:
        """Canonical copies restored from the stored layout (all experts, or ``expert``'s as ``[1, ...]``)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("experts: their canonical weights cannot be restored during CUDA-graph capture (the "
                               "restore would be captured, not run); read them once before capture")
        self._check_layout()
        _, restore, kept, _ = self._layout
        out = []
        for j, ((c, sc), k) in enumerate(zip(((self._stored[0], self._stored[1]), (self._stored[2], self._stored[3])),
                                             kept, strict=True)):
            if expert is not None:
                blocks = sc[0].numel()  # one int64 of codes per 16-element block
                c, sc = c[expert:expert + 1], sc[expert:expert + 1]
                if k is not None:
                    mine = (k[0] >= expert * blocks) & (k[0] < (expert + 1) * blocks)
                    k = (k[0][mine] - expert * blocks, k[1][mine]) if bool(mine.any()) else None
            out += _restore_pair(_of_weight(restore, j), c, sc, k)
        return tuple(out)

    def _wait_for_current_stream(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).synchronize()

    def _with_scales(self, w13_gs: torch.Tensor, w2_gs: torch.Tensor, a13_gs: torch.Tensor,
                     a2_gs: torch.Tensor) -> NvFp4Experts:
        """A new object over these re-laid-out weights as stored (their layout and its record carried
        over) with other global scales, validated (:class:`moe_fp4.nn.FusedMoE` when only its global
        scales changed; a canonical object needs none of this: build a new one)."""
        if self._layout is None:
            raise ValueError("experts: _with_scales carries a layout over; these weights are canonical")
        _check_global_scales(self.num_experts, self.device, w13_gs, w2_gs, a13_gs, a2_gs)
        new = object.__new__(NvFp4Experts)
        new.__dict__.update(self.__dict__)
        new.w13_gs, new.w2_gs = w13_gs.contiguous(), w2_gs.contiguous()
        new.a13_gs, new.a2_gs = a13_gs.contiguous(), a2_gs.contiguous()
        new._prepared = {}
        new._register_aliases()
        mark_static(new.stored())
        _IN_PLACE[_storage_key(self._stored[0])] = new
        return new

    def in_layout(self, key: Any, relayout: Relayout | tuple[Relayout, Relayout],
                  restore: Restore | tuple[Restore, Restore], *,
                  codes: bool = True) -> tuple[torch.Tensor, ...]:
        """``(w13, w13_scale, w2, w2_scale)`` in a GEMM's own layout ``key``, re-laid out once.

        ``relayout(codes, scales, out_codes, out_scales)`` writes the layout of canonical
        ``[e, N, K/2]`` codes and ``[e, N, K/16]`` scales into outputs of the same shapes and
        dtypes, expert by expert (so any leading slice of experts is laid out alone);
        ``restore(codes, scales)`` returns new canonical tensors from laid-out ones (also of any
        slice of experts), exact but for the codes of zero-scale blocks (kept aside here and put
        back). Either may be a pair, ``(w13's, w2's)``, for a layout that differs between the two
        (the sm_90a one interleaves w13's gate and up rows). ``codes=False``: a layout of the
        scales alone (``out_codes`` is None; the codes stay canonical and ``restore`` returns them
        as they are). In place, replacing the
        canonical tensors, when the class docstring allows it (without a new version of the
        tensors: what holds them keys on their versions); else a copy, cached. A failure part
        way restores what was re-laid out, so the object stays canonical.
        """
        if self._layout is not None and self._layout[0] == key:
            self._check_layout()
            return self._stored
        with _PREPARE_LOCK:
            if self._layout is not None and self._layout[0] == key:
                return self._stored
            cuda = self.device.type == "cuda"
            capturing = cuda and torch.cuda.is_current_stream_capturing()
            versioned = all(_version(t) is not None for t in self._stored)  # inference tensors: writes undetectable
            if (self._layout is None and self._own and not self._handed_out and not self.keep_canonical
                    and not capturing and versioned and IN_PLACE_LAYOUTS and self._exclusive()):
                self._relayout_in_place(key, relayout, restore, codes)
                return self._stored
        return self.prepared(("layout", key), lambda ex: ex._relayout_copy(relayout, codes))

    def _exclusive(self) -> bool:
        """Whether no other live experts object is over this one's weight storage."""
        keys = (_storage_key(self._stored[0]), _storage_key(self._stored[2]))
        return all(all(o is self for o in _ALIASES.get(k, ())) for k in keys)

    def _relayout_copy(self, relayout: Relayout | tuple[Relayout, Relayout], codes: bool) -> tuple[torch.Tensor, ...]:
        out = []
        for j, (c, sc) in enumerate(((self.w13, self.w13_scale), (self.w2, self.w2_scale))):
            c_out, sc_out = torch.empty_like(c) if codes else None, torch.empty_like(sc)
            _of_weight(relayout, j)(c, sc, c_out, sc_out)
            out += [c_out if codes else c, sc_out]
        return tuple(out)

    def _relayout_in_place(self, key: Any, relayout: Relayout | tuple[Relayout, Relayout],
                           restore: Restore | tuple[Restore, Restore], codes: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing else may still read the canonical bytes
        pairs = ((self._stored[0], self._stored[1]), (self._stored[2], self._stored[3]))
        # Expert slices of at most ~64 MiB at a time: the transient copies stay small.
        steps = [max(1, (64 << 20) // max(1, c[0].numel() + sc[0].numel())) for c, sc in pairs]
        kept = tuple(_kept_blocks(c, sc, step) if codes else None for (c, sc), step in zip(pairs, steps, strict=True))
        preserve = torch.autograd._unsafe_preserve_version_counter
        done: list[tuple[int, slice]] = []
        try:
            for j, ((c, sc), step) in enumerate(zip(pairs, steps, strict=True)):
                with preserve(c), preserve(sc):  # a torch write would give them a new version
                    for e0 in range(0, c.shape[0], step):
                        part = slice(e0, e0 + step)
                        if codes:
                            _of_weight(relayout, j)(c[part].clone(), sc[part].clone(), c[part], sc[part])
                        else:
                            _of_weight(relayout, j)(c[part], sc[part].clone(), None, sc[part])
                        done.append((j, part))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            self._undo(done, pairs, kept, restore)
            raise
        self._layout = (key, restore, kept, tuple(_version(t) for t in self._stored))
        _IN_PLACE[(str(self.device), self._stored[0].data_ptr())] = self

    @staticmethod
    def _undo(done: list, pairs: tuple, kept: tuple, restore: Restore | tuple[Restore, Restore]) -> None:
        """Restores the expert slices a failed re-layout had written (the object stays canonical)."""
        preserve = torch.autograd._unsafe_preserve_version_counter
        try:
            for j, part in reversed(done):
                c, sc = pairs[j]
                with preserve(c), preserve(sc):
                    cv, sv = c[part], sc[part]
                    rc, rs = _of_weight(restore, j)(cv, sv)
                    if rc.data_ptr() != cv.data_ptr():  # (a scales-only layout returns the codes themselves)
                        cv.copy_(rc)
                    sv.copy_(rs)
            for (c, _), k in zip(pairs, kept, strict=True):
                if k is not None:
                    with preserve(c):
                        c.view(torch.int64).reshape(-1)[k[0]] = k[1]
        except BaseException as exc:
            raise RuntimeError("experts: a re-layout failed and so did undoing it: the weight tensors are in an "
                               "undefined state; load them again") from exc

    def __getstate__(self) -> dict:
        """Copies and pickles carry the canonical tensors (and not the prepared cache)."""
        fields = {**self._canonical_tensors(hand_out=False), "w13_gs": self.w13_gs, "w2_gs": self.w2_gs,
                  "a13_gs": self.a13_gs, "a2_gs": self.a2_gs}
        return {"fields": fields, "keep_canonical": self.keep_canonical}

    def __setstate__(self, state: dict) -> None:
        # A deep copy's or an unpickled object's tensors are its own; a shallow copy's are shared with
        # the original, which the alias registry sees (no re-layout in place while both live).
        self.__init__(**state["fields"], own=True)
        self.keep_canonical = state["keep_canonical"]

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_experts(self) -> int:
        return self._stored[0].shape[0]

    @property
    def hidden_size(self) -> int:
        return self._stored[0].shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self._stored[0].shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self._stored[0].device

    def sizes(self) -> tuple[int, int, int]:
        """``(num_experts, hidden_size, intermediate_size)``, from one read of ``w13``'s shape (a forward's)."""
        E, two_i, h_half = self._stored[0].shape  # noqa: N806
        return E, h_half * 2, two_i // 2

    @property
    def w13_gs_per_half(self) -> torch.Tensor:
        """float32 ``[E, 2]``: the (gate, up) global scales, equal columns when shared."""
        return self.w13_gs.unsqueeze(1).expand(-1, 2).contiguous() if self.w13_gs.dim() == 1 else self.w13_gs

    @property
    def gate_up_scales_differ(self) -> bool:
        return self.w13_gs.dim() == 2 and not bool(torch.equal(self.w13_gs[:, 0], self.w13_gs[:, 1]))

    def alphas(self, precision: str = "w4a4") -> tuple[torch.Tensor, torch.Tensor]:
        """GEMM epilogue scales: ``alpha13 [E, 2] = 1/(a13_gs * w13_gs[:, h])``, ``alpha2 [E] = 1/(a2_gs * w2_gs)``.

        Computed in float32 exactly as the kernels apply them: one product, one reciprocal.
        With ``precision="w4a16"`` (activations not quantized, so no activation global scale)
        the weights' global scales only: ``alpha13 [E, 2] = 1/w13_gs[:, h]``, ``alpha2 [E] =
        1/w2_gs``, one float32 reciprocal each.
        """
        if check_precision(precision) == "w4a16":
            return (1.0 / self.w13_gs_per_half).contiguous(), (1.0 / self.w2_gs).contiguous()
        alpha13 = 1.0 / (self.a13_gs.unsqueeze(1) * self.w13_gs_per_half)
        alpha2 = 1.0 / (self.a2_gs * self.w2_gs)
        return alpha13.contiguous(), alpha2.contiguous()

    def prepared(self, key: Any, build: Callable[[NvFp4Experts], Any]) -> Any:
        """Backend-private cache: return ``build(self)`` once per ``key``.

        Thread-safe (one build per key), and a build that ran kernels on a CUDA stream is waited
        for before its result is published, so a forward on another stream or thread never reads
        a half-written layout (one wait per layout, at first use; none during graph capture).
        """
        got = self._prepared.get(key)
        if got is not None:
            return got
        with _PREPARE_LOCK:
            if key not in self._prepared:
                value = build(self)
                if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                    torch.cuda.current_stream(self.device).synchronize()
                self._prepared[key] = value
        return self._prepared[key]

    def __repr__(self) -> str:
        gs = "per-half" if self.w13_gs.dim() == 2 else "shared"
        layout = "" if self._layout is None else f", layout={self.layout!r}"
        return (
            f"NvFp4Experts(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"gate/up global scale {gs}, device={self.device}{layout})"
        )

    # ------------------------------------------------------------------ conversions
    def to(self, device: torch.device | str) -> NvFp4Experts:
        """A copy on ``device``, canonical (the prepared-layout cache is not copied)."""
        t = {**self._canonical_tensors(hand_out=False), "w13_gs": self.w13_gs, "w2_gs": self.w2_gs,
             "a13_gs": self.a13_gs, "a2_gs": self.a2_gs}
        return NvFp4Experts(**{k: t[k].to(device, copy=True) for k in self._fields()}, own=True)

    @staticmethod
    def _fields() -> tuple[str, ...]:
        return ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs", "a13_gs", "a2_gs")

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, expert: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``(w13 [E, 2I, H], w2 [E, H, I])``: ``e2m1 * scale / gs``, gate and up each with its own gs.

        ``e2m1 * scale`` is exact in float32; the division by the global scale is done in
        float64 for ``dtype=torch.float64`` (exact there too) and in float32 otherwise, then
        rounded to ``dtype``. With ``expert``, that expert's ``(w13 [2I, H], w2 [H, I])`` only.
        This is the one place that applies the per-half w13 global scales.
        """
        sel = slice(None) if expert is None else expert
        work = torch.float64 if dtype == torch.float64 else torch.float32
        I = self.intermediate_size  # noqa: E741
        gs13 = self.w13_gs_per_half[sel].to(work).repeat_interleave(I, dim=-1).unsqueeze(-1)
        gs2 = self.w2_gs[sel].to(work)[..., None, None]
        if expert is None:
            c = self._canonical_tensors(hand_out=False)
        else:  # that expert's alone (a re-laid-out layer restores one expert, not all)
            c = {k: t[0] for k, t in self._canonical_tensors(expert, hand_out=False).items()}
        w13 = decode_scaled(c["w13"], c["w13_scale"]).to(work) / gs13
        w2 = decode_scaled(c["w2"], c["w2_scale"]).to(work) / gs2
        return w13.to(dtype), w2.to(dtype)

    @classmethod
    def quantize(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        a13_gs: torch.Tensor | float,
        a2_gs: torch.Tensor | float,
        w13_gs: torch.Tensor | None = None,
        w2_gs: torch.Tensor | None = None,
        separate_gate_up_scales: bool = False,
    ) -> NvFp4Experts:
        """Quantize 16-bit (or fp32) weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``.

        Weight global scales default to ``448*6/amax`` per expert, computed over gate and up
        together as the checkpoint producers do (or per half with
        ``separate_gate_up_scales=True``, which gives ``w13_gs [E, 2]``). ``a13_gs`` and
        ``a2_gs`` are the activation global scales, a float (for all experts) or ``[E]``.
        """
        check_tensor("w13", w13, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
        E, two_i, H = w13.shape
        check_tensor("w2", w2, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=(E, H, two_i // 2),
                     device=w13.device)
        if two_i % 2:
            raise ValueError(f"w13: expected an even number of rows (gate then up), got {two_i}")
        I = two_i // 2
        dev = w13.device
        for name, w in (("w13", w13), ("w2", w2)):
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"{name}: expected finite weights, got inf or nan")
        if w13_gs is None:
            if separate_gate_up_scales:
                halves = (w13[:, :I], w13[:, I:])
                w13_gs = torch.stack([global_scale_for(h, dim=(1, 2)) for h in halves], 1)
            else:
                w13_gs = global_scale_for(w13, dim=(1, 2))
        if w2_gs is None:
            w2_gs = global_scale_for(w2, dim=(1, 2))

        def per_expert(name: str, v: torch.Tensor | float) -> torch.Tensor:
            if isinstance(v, (int, float)):
                return torch.full((E,), float(v), dtype=torch.float32, device=dev)
            check_tensor(name, v, dtypes=(torch.float32,), shape=(E,), device=dev)
            return v

        a13 = per_expert("a13_gs", a13_gs)
        a2 = per_expert("a2_gs", a2_gs)
        check_tensor("w13_gs", w13_gs, dtypes=(torch.float32,), ndim=(1, 2), device=dev)
        gs_half = w13_gs.unsqueeze(1).expand(-1, 2) if w13_gs.dim() == 1 else w13_gs
        if tuple(gs_half.shape) != (E, 2):
            raise ValueError(f"w13_gs: expected shape [{E}] or [{E}, 2], got {list(w13_gs.shape)}")
        _check_global("w13_gs", w13_gs)

        q13 = torch.empty((E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
        s13 = torch.empty((E, 2 * I, H // BLOCK_SIZE), dtype=_F8, device=dev)
        q2 = torch.empty((E, H, I // 2), dtype=torch.uint8, device=dev)
        s2 = torch.empty((E, H, I // BLOCK_SIZE), dtype=_F8, device=dev)
        check_divisible("w13", H, BLOCK_SIZE, "the hidden size H")
        check_divisible("w2", I, BLOCK_SIZE, "the intermediate size I")
        # One expert at a time keeps the float32 temporaries small for large layers.
        for e in range(E):
            for h in range(2):
                rows = slice(h * I, (h + 1) * I)
                gs = _as_global_scale(gs_half[e, h].contiguous(), w13[e, rows])
                q13[e, rows], s13[e, rows] = _quantize_blocks(w13[e, rows], gs)
            gs2 = _as_global_scale(w2_gs[e].contiguous(), w2[e])
            q2[e], s2[e] = _quantize_blocks(w2[e], gs2)
        return cls(q13, s13, w13_gs.float().contiguous(), q2, s2, w2_gs, a13, a2, own=True)


def _in_place_owner(w13: torch.Tensor) -> NvFp4Experts | None:
    """The live experts object whose weights were re-laid out in place over ``w13``'s storage, if any
    (and they were not written since: then the storage holds what was written, canonical or not)."""
    if not _IN_PLACE:
        return None
    owner = _IN_PLACE.get((str(w13.device), w13.data_ptr()))
    if owner is None or owner._stored[0].data_ptr() != w13.data_ptr():
        return None
    if tuple(_version(t) for t in owner._stored) != owner._layout[3]:
        return None
    return owner
