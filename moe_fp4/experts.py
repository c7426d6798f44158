"""``NvFp4Experts``: one MoE layer's experts in NVFP4, validated once, shared by all backends."""

from __future__ import annotations

import threading
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


def _check_global(name: str, g: torch.Tensor) -> None:
    if g.numel() and not (bool(torch.isfinite(g).all()) and bool((g > 0).all())):
        raise ValueError(
            f"{name}: expected finite positive quantize-direction global scales, got {g.flatten()[:8].tolist()}"
        )


# Builds of prepared layouts (rare: once per experts object and layout; reentrant, as one layout may
# build on another).
_PREPARE_LOCK = threading.RLock()


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
    every tensor. Backends may cache prepared layouts on the object with :meth:`prepared`;
    the cache is private and never changes the public attributes.
    """

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
    ) -> None:
        check_tensor("w13", w13, dtypes=(torch.uint8,), ndim=3, contiguous=True)
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
        check_tensor("w13_gs", w13_gs, dtypes=(torch.float32,), ndim=(1, 2), device=device)
        if tuple(w13_gs.shape) not in ((E,), (E, 2)):
            raise ValueError(f"w13_gs: expected shape [{E}] or [{E}, 2] (gate, up), got {list(w13_gs.shape)}")
        check_tensor("w2", w2, dtypes=(torch.uint8,), shape=(E, H, I // 2), device=device, contiguous=True)
        check_tensor("w2_scale", w2_scale, dtypes=(_F8,), shape=(E, H, I // BLOCK_SIZE), device=device, contiguous=True)
        check_tensor("w2_gs", w2_gs, dtypes=(torch.float32,), shape=(E,), device=device)
        check_tensor("a13_gs", a13_gs, dtypes=(torch.float32,), shape=(E,), device=device)
        check_tensor("a2_gs", a2_gs, dtypes=(torch.float32,), shape=(E,), device=device)
        for name, g in (("w13_gs", w13_gs), ("w2_gs", w2_gs), ("a13_gs", a13_gs), ("a2_gs", a2_gs)):
            _check_global(name, g)
        _check_block_scales("w13_scale", w13_scale)
        _check_block_scales("w2_scale", w2_scale)

        self.w13, self.w13_scale, self.w13_gs = w13, w13_scale, w13_gs.contiguous()
        self.w2, self.w2_scale, self.w2_gs = w2, w2_scale, w2_gs.contiguous()
        self.a13_gs, self.a2_gs = a13_gs.contiguous(), a2_gs.contiguous()
        self._prepared: dict[Any, Any] = {}

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

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
        return (
            f"NvFp4Experts(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"gate/up global scale {gs}, device={self.device})"
        )

    # ------------------------------------------------------------------ conversions
    def to(self, device: torch.device | str) -> NvFp4Experts:
        """A copy on ``device`` (the prepared-layout cache is not copied)."""
        t = {k: getattr(self, k).to(device) for k in self._fields()}
        return NvFp4Experts(**t)

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
        w13 = decode_scaled(self.w13[sel], self.w13_scale[sel]).to(work) / gs13
        w2 = decode_scaled(self.w2[sel], self.w2_scale[sel]).to(work) / gs2
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
        return cls(q13, s13, w13_gs.float().contiguous(), q2, s2, w2_gs, a13, a2)
