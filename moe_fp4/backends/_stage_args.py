"""Argument checks of the stage functions, shared by the ``triton`` and ``cutlass`` backends.

Both backends implement the stages of :mod:`moe_fp4.stages` on the same buffers, so they
take the same arguments and check them here, once. Each stage has one function
(:func:`routing_args`, :func:`quantize_rows_args`, :func:`silu_mul_quantize_args`,
:func:`grouped_gemm_args`, :func:`moe_reduce_args`) that checks every tensor's dtype, shape
and layout, then that all of them (``out=`` buffers included) are on one device, and returns
the sizes the stage needs. Nothing here reads tensor data (that would synchronize).

What the backends accept differently is passed in: the grouped scale buffers they take
(:class:`ScaleBuffers`) and, for :func:`moe_reduce_args`, the ``out_dtype`` values.
Requirements of one backend only (the CUDA library's devices, Triton's launch
configurations) stay in that backend.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
shape, value or device) naming the argument, what was expected and what came, as
:mod:`moe_fp4._checks` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._checks import check_same_device, check_tensor, dtype_name
from ..format import BLOCK_SIZE, grouped_scale_rows_bound, swizzled_shape
from ..stages import RoutingData

__all__ = [
    "ROW_DTYPES",
    "ScaleBuffers",
    "GemmShape",
    "check_positive_int",
    "check_offsets",
    "check_expert_vector",
    "check_quantized_width",
    "check_quantized_out",
    "check_out_dtype",
    "routing_args",
    "quantize_rows_args",
    "silu_mul_quantize_args",
    "grouped_gemm_args",
    "moe_reduce_args",
]

ROW_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes of activation rows (``x``, ``h``, ``y``) and of GEMM outputs."""

_I32 = (torch.int32,)
_F32 = (torch.float32,)


# --------------------------------------------------------------------------- single checks


@dataclass(frozen=True)
class ScaleBuffers:
    """The grouped scale buffers (``a_sf``, ``out[1]``) a backend takes, and their check.

    A grouped scale buffer of ``n`` rows of width ``K`` over ``E`` experts has
    ``Cp = ceil(K/64)*4`` columns and ``grouped_scale_rows_bound(n, E)`` rows.

    dtypes:     the accepted dtypes (float8_e4m3fn; the CUDA library also takes the uint8 view).
    exact_rows: True, exactly ``grouped_scale_rows_bound(n, E)`` rows; False, any multiple
                of 128 of at least that many.
    """

    dtypes: tuple[torch.dtype, ...]
    exact_rows: bool

    def check(self, name: str, scales: object, n: int, K: int, E: int) -> None:
        """``scales`` is a contiguous 2-D buffer of the accepted dtypes, rows and ``Cp`` columns."""
        check_tensor(name, scales, dtypes=self.dtypes, ndim=2, contiguous=True)
        _, cp = swizzled_shape(1, K // BLOCK_SIZE)
        if scales.shape[1] != cp:
            raise ValueError(
                f"{name}: expected {cp} columns (ceil(K/64)*4 for K = {K}), got shape {list(scales.shape)}"
            )
        bound, rows = grouped_scale_rows_bound(n, E), scales.shape[0]
        why = f"grouped_scale_rows_bound for {n} rows over {E} experts"
        if self.exact_rows and rows != bound:
            raise ValueError(f"{name}: expected {bound} rows ({why}), got shape {list(scales.shape)}")
        if not self.exact_rows and (rows < bound or rows % 128):
            raise ValueError(
                f"{name}: expected a multiple of 128 of at least {bound} rows ({why}), got shape {list(scales.shape)}"
            )


def check_positive_int(name: str, value: object) -> int:
    """``value`` is an ``int`` (not a bool) of at least 1; returns it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def check_offsets(expert_offsets: object, blockscale_offsets: object) -> int:
    """Both offsets contiguous int32 ``[E+1]`` with ``E >= 1`` (as :func:`routing` gives them); returns E."""
    check_tensor("expert_offsets", expert_offsets, dtypes=_I32, ndim=1, contiguous=True)
    if expert_offsets.numel() < 2:
        raise ValueError(f"expert_offsets: expected [E+1] offsets with E >= 1, got shape {list(expert_offsets.shape)}")
    E = expert_offsets.numel() - 1
    check_tensor("blockscale_offsets", blockscale_offsets, dtypes=_I32, shape=(E + 1,), contiguous=True)
    return E


def check_expert_vector(name: str, v: object, E: int) -> None:
    """``v`` is a contiguous float32 ``[E]`` vector (one value per expert, e.g. a global scale)."""
    check_tensor(name, v, dtypes=_F32, shape=(E,), contiguous=True)


def check_quantized_width(name: str, K: int, what: str = "the quantized width") -> None:
    """``K``, the width that is quantized in 16-element blocks, is a multiple of 16."""
    if K % BLOCK_SIZE:
        raise ValueError(f"{name}: {what} must be a multiple of {BLOCK_SIZE}, got {K}")


def check_quantized_out(out: object, n: int, K: int, E: int, scales: ScaleBuffers) -> None:
    """``out`` None, or the ``(packed uint8 [n, K/2], grouped scales)`` buffers of a quantization stage."""
    if out is None:
        return
    if not isinstance(out, tuple) or len(out) != 2:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(f"out: expected a (packed, scales) tuple, got {got}")
    check_tensor("out[0] (packed)", out[0], dtypes=(torch.uint8,), shape=(n, K // 2), contiguous=True)
    scales.check("out[1] (scales)", out[1], n, K, E)


def check_out_dtype(out_dtype: object, allowed: Sequence[torch.dtype] = ROW_DTYPES) -> None:
    """``out_dtype`` is one of ``allowed``."""
    if out_dtype not in allowed:
        names = [dtype_name(d) for d in allowed]
        want = " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
        got = dtype_name(out_dtype) if isinstance(out_dtype, torch.dtype) else repr(out_dtype)
        raise TypeError(f"out_dtype: expected {want}, got {got}")


def _same_device(named: dict[str, torch.Tensor | None], out: object = None) -> torch.device:
    """The one device of the tensors in ``named`` (None entries skipped) and of the ``out`` buffer(s)."""
    tensors = {k: v for k, v in named.items() if v is not None}
    if isinstance(out, tuple):
        tensors.update({"out[0] (packed)": out[0], "out[1] (scales)": out[1]})
    elif out is not None:
        tensors["out"] = out
    return check_same_device(tensors)


# --------------------------------------------------------------------------- one function per stage


def routing_args(topk_ids: object, num_experts: object, out: object) -> None:
    """Stage 1: int32 ``topk_ids [M, topk]``, a positive ``num_experts``, ``out`` None or RoutingData.

    ``out``'s fields are contiguous int32 ``[E+1]``, ``[E+1]``, ``[M*topk]``, ``[M*topk]``
    on the device of ``topk_ids``.
    """
    check_tensor("topk_ids", topk_ids, dtypes=_I32, ndim=2, contiguous=True)
    check_positive_int("num_experts", num_experts)
    if out is None:
        return
    if not isinstance(out, RoutingData):
        raise TypeError(f"out: expected a RoutingData, got {type(out).__name__}")
    n = topk_ids.numel()
    named = {"topk_ids": topk_ids}
    for f, size in (("expert_offsets", num_experts + 1), ("blockscale_offsets", num_experts + 1),
                    ("slot_to_flat", n), ("flat_to_slot", n)):
        named[f"out.{f}"] = check_tensor(f"out.{f}", getattr(out, f), dtypes=_I32, shape=(size,), contiguous=True)
    check_same_device(named)


def quantize_rows_args(
    x: object,
    gs: object,
    expert_offsets: object,
    blockscale_offsets: object,
    slot_to_flat: object,
    topk: object,
    row_scale: object,
    out: object,
    scales: ScaleBuffers,
) -> tuple[int, int, torch.device]:
    """Stage 2: returns ``(E, n, device)``, ``n`` the quantized rows (``x.shape[0] * topk`` with the gather).

    ``x`` 16-bit ``[M, K]`` with K a multiple of 16; ``gs`` float32 ``[E]``; with
    ``slot_to_flat`` (int32 ``[M*topk]``) a positive ``topk`` and optionally ``row_scale``
    (float32 ``[M*topk]``), which needs ``slot_to_flat``; ``out`` as
    :func:`check_quantized_out`.
    """
    check_tensor("x", x, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
    E = check_offsets(expert_offsets, blockscale_offsets)
    check_expert_vector("gs", gs, E)
    M, K = x.shape
    check_quantized_width("x", K)
    n = M
    if slot_to_flat is not None:
        check_positive_int("topk", topk)
        n = M * topk
        check_tensor("slot_to_flat", slot_to_flat, dtypes=_I32, ndim=1, contiguous=True)
        if slot_to_flat.numel() != n:
            raise ValueError(f"slot_to_flat: expected x.shape[0] * topk = {M} * {topk} = {n} entries, "
                             f"got shape {list(slot_to_flat.shape)}")
        if row_scale is not None:
            check_tensor("row_scale", row_scale, dtypes=_F32, shape=(n,), contiguous=True)
    elif row_scale is not None:
        got = list(row_scale.shape) if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__
        raise ValueError(
            f"row_scale: expected None without slot_to_flat (it is indexed by the flat index of a slot), got {got}"
        )
    check_quantized_out(out, n, K, E, scales)
    named = {"x": x, "gs": gs, "expert_offsets": expert_offsets, "blockscale_offsets": blockscale_offsets,
             "slot_to_flat": slot_to_flat, "row_scale": row_scale}
    return E, n, _same_device(named, out)


def silu_mul_quantize_args(
    h: object, gs: object, expert_offsets: object, blockscale_offsets: object, out: object, scales: ScaleBuffers
) -> tuple[int, int, torch.device]:
    """Stage 4: returns ``(E, I, device)`` for 16-bit ``h [n, 2I]`` (gate half, then up half), I a multiple of 16."""
    check_tensor("h", h, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
    if h.shape[1] % 2:
        raise ValueError(f"h: expected an even row length (gate half, then up half), got shape {list(h.shape)}")
    E = check_offsets(expert_offsets, blockscale_offsets)
    check_expert_vector("gs", gs, E)
    inter = h.shape[1] // 2
    check_quantized_width("h", inter, "the quantized width (half the row length)")
    check_quantized_out(out, h.shape[0], inter, E, scales)
    named = {"h": h, "gs": gs, "expert_offsets": expert_offsets, "blockscale_offsets": blockscale_offsets}
    return E, inter, _same_device(named, out)


class GemmShape(NamedTuple):
    """The sizes of one grouped GEMM: ``a [n, K/2]``, ``b [E, N, K/2]`` in ``S`` sections of rows."""

    E: int
    n: int
    N: int
    K: int
    S: int
    device: torch.device


def grouped_gemm_args(
    a: object,
    a_sf: object,
    b: object,
    b_sf: object,
    alpha: object,
    expert_offsets: object,
    blockscale_offsets: object,
    out_dtype: object,
    out: object,
    scales: ScaleBuffers,
) -> GemmShape:
    """Stages 3 and 5 (``stages.grouped_gemm``).

    ``a`` uint8 ``[n, K/2]`` (K a multiple of 16) with grouped scales ``a_sf``; ``b`` uint8
    ``[E, N, K/2]``; ``b_sf [E, S, Np_s, Cp]`` (``prepare_weight_scales``, N divisible by S);
    ``alpha`` float32 ``[E, S]`` (``[E]`` when S = 1); ``out_dtype`` 16-bit; ``out`` None
    or ``[n, N]`` of ``out_dtype``.
    """
    check_out_dtype(out_dtype)
    check_tensor("a", a, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    E = check_offsets(expert_offsets, blockscale_offsets)
    n, K = a.shape[0], a.shape[1] * 2
    check_quantized_width("a", K, "the quantized width (twice the packed row length)")
    scales.check("a_sf", a_sf, n, K, E)
    check_tensor("b", b, dtypes=(torch.uint8,), shape=(E, None, K // 2), contiguous=True)
    N = b.shape[1]
    check_tensor("b_sf", b_sf, dtypes=scales.dtypes, ndim=4, contiguous=True)
    S = b_sf.shape[1]
    if S < 1 or N % S:
        raise ValueError(f"b_sf: expected [E, S, Np_s, Cp] with N = {N} divisible by S, got shape {list(b_sf.shape)}")
    np_s, cp = swizzled_shape(N // S, K // BLOCK_SIZE)
    check_tensor("b_sf", b_sf, shape=(E, S, np_s, cp))
    check_tensor("alpha", alpha, dtypes=_F32, ndim=(1, 2), contiguous=True)
    if list(alpha.shape) != [E, S] and not (S == 1 and list(alpha.shape) == [E]):
        raise ValueError(f"alpha: expected float32 [E, S] = [{E}, {S}] ([E] when S = 1), got {list(alpha.shape)}")
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(n, N), contiguous=True)
    named = {"a": a, "a_sf": a_sf, "b": b, "b_sf": b_sf, "alpha": alpha, "expert_offsets": expert_offsets,
             "blockscale_offsets": blockscale_offsets}
    return GemmShape(E, n, N, K, S, _same_device(named, out))


def moe_reduce_args(
    y: object,
    flat_to_slot: object,
    topk_weights: object,
    num_tokens: object,
    out_dtype: object,
    out: object,
    out_dtypes: Sequence[torch.dtype] = ROW_DTYPES,
) -> tuple[int, torch.device]:
    """Stage 6: returns ``(topk, device)``.

    16-bit ``y [n, H]``; int32 ``flat_to_slot [num_tokens * topk]`` (topk >= 1);
    ``topk_weights`` None or float32 ``[num_tokens, topk]``; ``out_dtype`` in
    ``out_dtypes``; ``out`` None or ``[num_tokens, H]`` of ``out_dtype``.
    """
    check_out_dtype(out_dtype, out_dtypes)
    check_tensor("y", y, dtypes=ROW_DTYPES, ndim=2, contiguous=True)
    check_positive_int("num_tokens", num_tokens)
    check_tensor("flat_to_slot", flat_to_slot, dtypes=_I32, ndim=1, contiguous=True)
    if flat_to_slot.numel() % num_tokens or flat_to_slot.numel() == 0:
        raise ValueError(f"flat_to_slot: expected num_tokens * topk entries (a positive multiple of num_tokens = "
                         f"{num_tokens}), got {flat_to_slot.numel()}")
    topk = flat_to_slot.numel() // num_tokens
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=_F32, shape=(num_tokens, topk), contiguous=True)
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(num_tokens, y.shape[1]), contiguous=True)
    return topk, _same_device({"y": y, "flat_to_slot": flat_to_slot, "topk_weights": topk_weights}, out)
