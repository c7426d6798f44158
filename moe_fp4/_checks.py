"""Input validation shared by every public entry point.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError``
(wrong shape, device, value or layout) with a message that names the argument, says what
was expected and what came. Nothing here uses ``assert``: validation must survive ``-O``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "PRECISIONS",
    "check_precision",
    "check_tensor",
    "check_same_device",
    "check_divisible",
    "dtype_name",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def check_tensor(
    name: str,
    x: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; return it unchanged.

    ``shape`` entries that are ``None`` are not checked.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {dtype_name(x.dtype)}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            if len(allowed) > 2 and allowed == tuple(range(allowed[0], allowed[-1] + 1)):
                want = f"{allowed[0]}-D to {allowed[-1]}-D"
            else:
                want = " or ".join(f"{a}-D" for a in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    if contiguous and not x.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {tuple(x.stride())} "
            f"for shape {tuple(x.shape)} (call .contiguous())"
        )
    return x


def check_same_device(named: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one device; return it."""
    items = list(named.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected a tensor on {first.device} (the device of {first_name}), got one on {t.device}"
            )
    return first.device


def check_divisible(name: str, value: int, divisor: int, what: str) -> None:
    if value % divisor != 0:
        raise ValueError(f"{name}: {what} must be a multiple of {divisor}, got {value}")


PRECISIONS = ("w4a4", "w4a16")
"""What ``precision=`` may be: NVFP4 weights with NVFP4 (``w4a4``) or 16-bit (``w4a16``) activations."""


def check_precision(precision: object) -> str:
    """``precision`` is one of :data:`PRECISIONS` (``TypeError`` / ``ValueError`` naming it otherwise)."""
    if not isinstance(precision, str):
        raise TypeError(f"precision: expected a str ('w4a4' or 'w4a16'), got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected 'w4a4' or 'w4a16', got {precision!r}")
    return precision
