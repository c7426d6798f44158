"""The buffers that flow between the MoE stages, as types that check themselves.

Every backend's stages take and return these (:mod:`moe_fp4.pipeline`), so a stage of one
backend can be checked against, or swapped with, the same stage of another.

* :class:`RoutingData`: the routing metadata of ``topk_ids`` (stage 1).
* :class:`Quantized`: NVFP4 activation rows grouped by expert, packed codes and a grouped
  swizzled scale buffer (stages 2 and 4).
* :class:`WeightOperand`: one grouped GEMM's NVFP4 weights, their swizzled scales per
  section of rows and the epilogue scales ``alpha`` (stages 3 and 5).

Construction checks what a buffer can check alone (dtypes, ranks, contiguity, one device,
consistent sizes); :meth:`RoutingData.check_for` and :meth:`Quantized.check_for` check a
buffer against the problem it is used for. Nothing here reads tensor data, so no check
synchronizes with the GPU. Failures are ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, value or device) naming the argument, what was expected and
what came.

Buffer conventions (identical in every backend), with ``E`` experts and ``n`` slots:

* ``expert_offsets [E+1]`` prefix sums of ``m_e``, the rows routed to expert ``e``;
  ``blockscale_offsets [E+1]`` prefix sums of ``ceil(m_e/128)*128``.
* A grouped scale buffer has ``Cp = ceil(K/64)*4`` columns and a multiple of 128 rows, at
  least :func:`~moe_fp4.format.grouped_scale_rows_bound` ``(n, E)``; expert ``e``'s 128x4
  swizzled region starts at row ``blockscale_offsets[e]``. **Every byte that holds no scale
  is zero**, including region rows past ``m_e``, padded columns and rows past
  ``blockscale_offsets[E]``. Packed rows past ``expert_offsets[E]`` are zero.
* Weight scales are swizzled per expert and per *section* of rows: w13 has two sections
  (gate rows, then up rows), so that gate and up can carry different global scales
  (``alpha [E, 2]``); w2 has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from ._checks import check_same_device, check_tensor
from .format import BLOCK_SIZE, grouped_scale_rows_bound, swizzle_scales, swizzled_shape, unswizzle_scales

if TYPE_CHECKING:
    from .experts import NvFp4Experts

__all__ = [
    "ROW_DTYPES",
    "RoutingData",
    "Quantized",
    "K16Weights",
    "Sm90Weights",
    "WeightOperand",
    "check_expert_vector",
    "check_buffer",
    "check_positive_int",
]

ROW_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes of activation rows (hidden states, GEMM outputs, the intermediate)."""

_B = TypeVar("_B")
_I32 = (torch.int32,)
_F32 = (torch.float32,)
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def check_positive_int(name: str, value: object) -> int:
    """``value`` is an ``int`` (not a bool) of at least 1; returns it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def check_expert_vector(name: str, v: object, E: int) -> torch.Tensor:
    """``v`` is a contiguous float32 ``[E]`` vector (one value per expert, e.g. a global scale)."""
    return check_tensor(name, v, dtypes=_F32, shape=(E,), contiguous=True)


def _fp8(scales: torch.Tensor) -> torch.Tensor:
    return scales if scales.dtype == torch.float8_e4m3fn else scales.view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class RoutingData:
    """Routing metadata (all contiguous int32 on one device).

    expert_offsets:     ``[E+1]`` prefix sums of ``m_e`` (rows per expert; ``-1`` ids excluded).
    blockscale_offsets: ``[E+1]`` prefix sums of ``ceil(m_e/128)*128``.
    slot_to_flat:       ``[n]`` flat index ``t*topk+j`` of each slot; ``-1`` past ``expert_offsets[E]``.
    flat_to_slot:       ``[n]`` slot of each flat index; ``-1`` where the id is not served.

    Within an expert, slots are in ascending flat index (deterministic).
    """

    expert_offsets: torch.Tensor
    blockscale_offsets: torch.Tensor
    slot_to_flat: torch.Tensor
    flat_to_slot: torch.Tensor

    def __post_init__(self) -> None:
        named = {}
        for f in ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot"):
            named[f"routing.{f}"] = check_tensor(f"routing.{f}", getattr(self, f), dtypes=_I32, ndim=1,
                                                 contiguous=True)
        E1 = self.expert_offsets.numel()
        if E1 < 2:
            raise ValueError(f"routing.expert_offsets: expected [E+1] offsets with E >= 1, got shape [{E1}]")
        if self.blockscale_offsets.numel() != E1:
            raise ValueError(f"routing.blockscale_offsets: expected shape [{E1}] (as expert_offsets), "
                             f"got {list(self.blockscale_offsets.shape)}")
        if self.flat_to_slot.numel() != self.slot_to_flat.numel():
            raise ValueError(f"routing.flat_to_slot: expected shape [{self.slot_to_flat.numel()}] (as slot_to_flat), "
                             f"got {list(self.flat_to_slot.shape)}")
        check_same_device(named)

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def num_slots(self) -> int:
        """``n = M * topk``."""
        return self.slot_to_flat.numel()

    @property
    def device(self) -> torch.device:
        return self.expert_offsets.device

    @classmethod
    def empty(cls, n: int, num_experts: int, device: torch.device) -> RoutingData:
        """Uninitialised buffers for ``n`` slots over ``num_experts`` experts."""
        i32 = torch.int32
        return cls(*(torch.empty(s, dtype=i32, device=device) for s in (num_experts + 1,) * 2 + (n,) * 2))

    def head(self, n: int) -> RoutingData:
        """The same offsets with the first ``n`` slots (a view into a larger workspace)."""
        return RoutingData(self.expert_offsets, self.blockscale_offsets, self.slot_to_flat[:n], self.flat_to_slot[:n])

    def check_for(self, name: str, num_slots: int, num_experts: int | None = None) -> RoutingData:
        """``self`` describes ``num_slots`` slots (and ``num_experts`` experts when given); returns it."""
        if self.num_slots != num_slots:
            raise ValueError(f"{name}: expected routing of {num_slots} slots, got one of {self.num_slots}")
        if num_experts is not None and self.num_experts != num_experts:
            raise ValueError(f"{name}: expected routing over {num_experts} experts, got {self.num_experts}")
        return self


@dataclass(frozen=True)
class Quantized:
    """NVFP4 rows grouped by expert: the output of the quantization stages, the GEMMs' activations.

    packed: uint8 ``[n, K/2]``, two e2m1 codes per byte (element ``2j`` in the low nibble).
    scales: float8_e4m3fn ``[rows, Cp]``, the grouped swizzled block scales (a uint8 view is
            accepted and stored as float8_e4m3fn); ``rows`` a multiple of 128.
    values: optional 16-bit ``[n, K]``: the same rows exactly dequantized, ``e2m1 * scale``
            without the global scale (exact in bf16 and fp16), zero past ``expert_offsets[E]``:
            the activation operand of GEMMs that multiply 16-bit values (Hopper).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("packed", self.packed, dtypes=(torch.uint8,), ndim=2, contiguous=True)
        check_tensor("scales", self.scales, dtypes=_SCALE_DTYPES, ndim=2, contiguous=True)
        object.__setattr__(self, "scales", _fp8(self.scales))
        _, cp = swizzled_shape(1, self.K // BLOCK_SIZE)
        if self.scales.shape[1] != cp:
            raise ValueError(f"scales: expected {cp} columns (ceil(K/64)*4 for K = {self.K}), "
                             f"got shape {list(self.scales.shape)}")
        if self.scales.shape[0] % 128:
            raise ValueError(f"scales: expected a multiple of 128 rows, got shape {list(self.scales.shape)}")
        named = {"packed": self.packed, "scales": self.scales}
        if self.values is not None:
            named["values"] = check_tensor("values", self.values, dtypes=ROW_DTYPES, shape=(self.rows, self.K),
                                           contiguous=True)
        check_same_device(named)

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @property
    def K(self) -> int:  # noqa: N802
        return self.packed.shape[1] * 2

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @classmethod
    def empty(cls, n: int, K: int, num_experts: int, device: torch.device,  # noqa: N803
              values: torch.dtype | None = None) -> Quantized:
        """Uninitialised buffers for ``n`` rows of width ``K`` over ``num_experts`` experts
        (with ``values`` of that dtype when given)."""
        _, cp = swizzled_shape(1, K // BLOCK_SIZE)
        packed = torch.empty((n, K // 2), dtype=torch.uint8, device=device)
        scales = torch.empty((grouped_scale_rows_bound(n, num_experts), cp), dtype=torch.float8_e4m3fn, device=device)
        vals = None if values is None else torch.empty((n, K), dtype=values, device=device)
        return cls(packed, scales, vals)

    def head(self, n: int, num_experts: int) -> Quantized:
        """The first ``n`` rows and the scale rows they need (views into a larger workspace)."""
        return Quantized(self.packed[:n], self.scales[: grouped_scale_rows_bound(n, num_experts)],
                         None if self.values is None else self.values[:n])

    def check_for(self, name: str, n: int, K: int, num_experts: int) -> Quantized:  # noqa: N803
        """``self`` holds ``n`` rows of width ``K`` for ``num_experts`` experts; returns it."""
        if (self.rows, self.K) != (n, K):
            raise ValueError(f"{name}: expected packed rows [{n}, {K // 2}] ({n} rows of width {K}), "
                             f"got {list(self.packed.shape)}")
        bound = grouped_scale_rows_bound(n, num_experts)
        if self.scales.shape[0] < bound:
            raise ValueError(f"{name}: expected at least {bound} scale rows (grouped_scale_rows_bound for {n} rows "
                             f"over {num_experts} experts), got shape {list(self.scales.shape)}")
        return self


@dataclass(frozen=True)
class WeightOperand:
    """One grouped GEMM's weights: ``D[rows of e, section h] = alpha[e, h] * A_e . packed[e, rows of h]^T``.

    packed: uint8 ``[E, N, K/2]``, NVFP4 codes of ``N`` weight rows per expert.
    scales: float8_e4m3fn ``[E, S, Np_s, Cp]``, block scales swizzled per expert and per
            section of ``N/S`` rows (``Np_s = ceil((N/S)/128)*128``).
    alpha:  float32 ``[E, S]``, ``1/(gs_a * gs_w)`` per expert and section.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("w.packed", self.packed, dtypes=(torch.uint8,), ndim=3, contiguous=True)
        check_tensor("w.scales", self.scales, dtypes=_SCALE_DTYPES, ndim=4, contiguous=True)
        object.__setattr__(self, "scales", _fp8(self.scales))
        E, N, half_k = self.packed.shape
        S = self.scales.shape[1]
        if S < 1 or N % S:
            raise ValueError(f"w.scales: expected [E, S, Np_s, Cp] with N = {N} divisible by S, "
                             f"got shape {list(self.scales.shape)}")
        np_s, cp = swizzled_shape(N // S, half_k * 2 // BLOCK_SIZE)
        check_tensor("w.scales", self.scales, shape=(E, S, np_s, cp))
        check_tensor("w.alpha", self.alpha, dtypes=_F32, shape=(E, S), contiguous=True)
        check_same_device({"w.packed": self.packed, "w.scales": self.scales, "w.alpha": self.alpha})

    @property
    def E(self) -> int:  # noqa: N802
        return self.packed.shape[0]

    @property
    def N(self) -> int:  # noqa: N802
        return self.packed.shape[1]

    @property
    def K(self) -> int:  # noqa: N802
        return self.packed.shape[2] * 2

    @property
    def S(self) -> int:  # noqa: N802
        return self.scales.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @classmethod
    def build(cls, packed: torch.Tensor, logical_scales: torch.Tensor, alpha: torch.Tensor) -> WeightOperand:
        """From logical row-major scales ``[E, N, K/16]`` and ``alpha [E, S]`` (S sections of rows)."""
        E, N, C = logical_scales.shape
        S = alpha.shape[1] if alpha.dim() == 2 else 1
        if N % S:
            raise ValueError(f"alpha: expected a number of sections dividing N = {N}, got shape {list(alpha.shape)}")
        swizzled = swizzle_scales(logical_scales.reshape(E, S, N // S, C))
        return cls(packed, swizzled, alpha.reshape(E, S).contiguous())

    @classmethod
    def from_experts(cls, experts: NvFp4Experts, precision: str = "w4a4") -> tuple[WeightOperand, WeightOperand]:
        """``(w13, w2)`` of a layer: w13 in two sections (gate, up) with alpha13 ``[E, 2]``, w2 in one.

        ``precision="w4a16"``: alpha holds the weights' global scales only
        (:meth:`~moe_fp4.NvFp4Experts.alphas`), for GEMMs of unquantized 16-bit activations.
        """
        alpha13, alpha2 = experts.alphas(precision)
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size  # noqa: E741
        if _swizzles_in_place(I, H // BLOCK_SIZE) and _swizzles_in_place(H, I // BLOCK_SIZE):
            # The swizzled scales have the logical ones' size: they replace them (one resident copy).
            w13, s13, w2, s2 = experts.in_layout("swizzled-scales", _swizzle_relayout, _swizzle_restore, codes=False)
            return (cls(w13, s13.view(E, 2, I, H // BLOCK_SIZE), alpha13.contiguous()),
                    cls(w2, s2.view(E, 1, H, I // BLOCK_SIZE), alpha2.reshape(-1, 1).contiguous()))
        return (cls.build(experts.w13, experts.w13_scale, alpha13),
                cls.build(experts.w2, experts.w2_scale, alpha2.reshape(-1, 1)))


def _swizzles_in_place(rows: int, cols: int) -> bool:
    """Whether ``rows x cols`` scales (per section) swizzle without padding (the same bytes, permuted)."""
    return swizzled_shape(rows, cols) == (rows, cols)


def _swizzle_relayout(codes, scales, out_codes, out_scales) -> None:
    """:meth:`NvFp4Experts.in_layout`'s ``relayout`` of :meth:`WeightOperand.from_experts`: the scales
    swizzled (128-row tiles, so one section or two of whole tiles swizzle alike), the codes as they are."""
    out_scales.copy_(swizzle_scales(scales))


def _swizzle_restore(codes, scales):
    return codes, unswizzle_scales(scales, scales.shape[1], scales.shape[2])


@dataclass(frozen=True)
class Sm90Weights:
    """One grouped GEMM's weights in the layout of the CUDA library's sm_90a GEMM.

    packed: uint8 ``[E, N, K/2]`` bytes, codes re-laid out in register-fragment order;
    scales: uint8 ``[E, N, K/16]`` bytes, block scales re-encoded in one byte each (the byte
    sizes of the originals, so the prepared copy can replace them); alpha: float32 ``[E, S]``.
    The layout is defined in ``csrc/include/moe_fp4/sm90_layout.cuh``; only that GEMM reads it.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("w.packed", self.packed, dtypes=(torch.uint8,), ndim=3, contiguous=True)
        E, N, half_k = self.packed.shape
        check_tensor("w.scales", self.scales, dtypes=(torch.uint8,), shape=(E, N, half_k * 2 // BLOCK_SIZE),
                     contiguous=True)
        check_tensor("w.alpha", self.alpha, dtypes=_F32, ndim=2, contiguous=True)
        if self.alpha.shape[0] != E or N % self.alpha.shape[1]:
            raise ValueError(f"w.alpha: expected [E, S] = [{E}, S] with S dividing N = {N}, "
                             f"got {list(self.alpha.shape)}")
        check_same_device({"w.packed": self.packed, "w.scales": self.scales, "w.alpha": self.alpha})

    E = WeightOperand.E
    N = WeightOperand.N
    K = WeightOperand.K
    device = WeightOperand.device

    @property
    def S(self) -> int:  # noqa: N802
        return self.alpha.shape[1]


@dataclass(frozen=True)
class K16Weights:
    """One grouped GEMM's weights for the Triton GEMM that multiplies fp16 activation values.

    As :class:`WeightOperand` (the same fields, shapes and swizzled scales) but the codes of
    every 64-element group of K re-laid out so that each nibble tile of the Triton GEMM holds
    16 consecutive elements, one scale block (the K16 layout, defined by
    ``moe_fp4.triton_kernels.gemm.k16_codes``); K a multiple of 64. A distinct type, so that no
    GEMM reading canonical codes can be handed these.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor

    def __post_init__(self) -> None:
        WeightOperand.__post_init__(self)
        if self.packed.shape[2] % 32:
            raise ValueError(f"w.packed: the K16 layout needs K a multiple of 64, got K = {self.packed.shape[2] * 2}")

    E = WeightOperand.E
    N = WeightOperand.N
    K = WeightOperand.K
    S = WeightOperand.S
    device = WeightOperand.device


def check_buffer(name: str, buf: object, kind: type[_B] | tuple[type, ...]) -> _B:
    """``buf`` is a ``kind`` (:class:`RoutingData`, :class:`Quantized`, :class:`WeightOperand`); returns it."""
    if not isinstance(buf, kind):
        want = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise TypeError(f"{name}: expected a {want}, got {type(buf).__name__}")
    return buf
