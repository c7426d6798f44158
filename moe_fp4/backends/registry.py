"""The backend registry: what each backend serves, as data, and the one dispatch rule.

Registration is pure metadata: it imports no Triton and loads no native library. A
backend's module is imported only when availability is asked for or a call is made.

Each backend module exposes::

    def why_unavailable(device: torch.device, capability: tuple[int, int] | None) -> str | None
        # None when the backend can run on that device, otherwise why it cannot
    def fused_moe(problem: moe_fp4.moe.MoEProblem) -> torch.Tensor

``backend="auto"`` tries the backends in the order of :data:`BACKENDS` (the preference),
keeping those whose ``auto_devices`` and ``auto_capabilities`` admit the device and that
compute the requested precision there (``precisions``, ``precision_capabilities``): the
table is the one place that says what runs where.

Precisions (:data:`PRECISIONS`, the ``precision=`` of :func:`moe_fp4.fused_moe`): ``"w4a4"``
(activations quantized to NVFP4 before each GEMM) and ``"w4a16"`` (16-bit activations, NVFP4
weights). Which backend computes which is data of the table, with the reason where it does
not; a backend named for a precision it does not compute raises ``ValueError`` with that reason.

Environment variables (for tests and debugging):

* ``MOE_FP4_BACKEND``: the backend ``backend="auto"`` must use (it raises if that one cannot run).
* ``MOE_FP4_FORCE_CAPABILITY``: e.g. ``9.0`` or ``12.0``, the compute capability that
  dispatch assumes for CUDA devices, instead of the device's own.

:func:`resolve_backend` is :func:`select_backend` cached per (backend, device, dtype, precision, layer sizes,
the values of these variables and ``TRITON_INTERPRET``): what :func:`moe_fp4.fused_moe` calls on every
call. It is marked as ``torch.compiler.assume_constant_result`` marks a function, so ``torch.compile`` runs it once
while tracing and puts the name in the graph as a constant (a compiled function keeps the
backend it was traced with; changing these variables afterwards does not retrace it).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from .._checks import PRECISIONS, check_precision
from ..errors import BackendUnavailableError

__all__ = [
    "Backend",
    "BACKENDS",
    "BackendUnavailableError",
    "PRECISIONS",
    "check_precision",
    "precision_unserved",
    "capability_of",
    "preference_order",
    "why_unavailable",
    "layer_unserved",
    "select_backend",
    "resolve_backend",
    "clear_resolved_backends",
    "explain_backend",
    "available_backends",
    "backend_status",
    "get_backend_module",
]

ENV_BACKEND = "MOE_FP4_BACKEND"
ENV_CAPABILITY = "MOE_FP4_FORCE_CAPABILITY"


CapabilityRange = tuple[tuple[int, int], tuple[int, int]]



def _in_ranges(cap: tuple[int, int] | None, ranges: tuple[CapabilityRange, ...]) -> bool:
    return cap is None or not ranges or any(lo <= cap < hi for lo, hi in ranges)


def _ranges_text(ranges: tuple[CapabilityRange, ...]) -> str:
    return ", ".join(f"sm_{lo[0]}{lo[1]}..<sm_{hi[0]}{hi[1]}" for lo, hi in ranges)


@dataclass(frozen=True)
class Backend:
    """What one backend serves.

    name:              the ``backend=`` string.
    devices:           device types it runs on (``"cuda"``, ``"cpu"``).
    capabilities:      half-open ranges ``((lo_major, lo_minor), (hi_major, hi_minor))`` of CUDA
                       compute capabilities it serves; empty means any.
    dtypes:            hidden-state dtypes.
    module:            the module that implements it, imported lazily.
    summary:           one line for ``moe-fp4 info``.
    auto_devices:      device types ``backend="auto"`` considers it on.
    auto_capabilities: capability ranges ``auto`` considers it on (a subset of
                       ``capabilities``, where it is measured to be the faster choice);
                       empty means wherever it serves.
    precisions:        the precisions (:data:`PRECISIONS`) it computes somewhere.
    precision_capabilities: ``(precision, ranges)`` pairs: that precision is computed on CUDA
                       devices of those capability ranges only (a precision not listed: wherever
                       the backend serves).
    precision_notes:   ``(precision, reason)`` pairs: why the precision is not computed (where not).
    """

    name: str
    devices: tuple[str, ...]
    capabilities: tuple[CapabilityRange, ...]
    dtypes: tuple[torch.dtype, ...]
    module: str
    summary: str
    auto_devices: tuple[str, ...]
    auto_capabilities: tuple[CapabilityRange, ...] = ()
    precisions: tuple[str, ...] = ("w4a4",)
    precision_capabilities: tuple[tuple[str, tuple[CapabilityRange, ...]], ...] = ()
    precision_notes: tuple[tuple[str, str], ...] = ()

    def precision_unserved(self, precision: str, device_type: str, cap: tuple[int, int] | None) -> str | None:
        """None when this backend computes ``precision`` on a device of type ``device_type`` and
        compute capability ``cap`` (None: not a CUDA device), otherwise why it does not.

        Capability limits apply to CUDA devices; on a device type the backend does not run on
        the device itself is the reason (:func:`why_unavailable`), not the precision.
        """
        note = dict(self.precision_notes).get(precision)
        if precision not in self.precisions:
            return note or f"computes {' and '.join(self.precisions)} only"
        limits = dict(self.precision_capabilities).get(precision)
        if limits is not None and device_type == "cuda" and cap is not None and not _in_ranges(cap, limits):
            where = f"computes {precision} on compute capability {_ranges_text(limits)} only, " \
                    f"this device is sm_{cap[0]}{cap[1]}"
            return f"{where}: {note}" if note else where
        return None

    def precision_text(self) -> str:
        """The precisions it computes and where (for ``moe-fp4 info``)."""
        limits = dict(self.precision_capabilities)
        return ", ".join(f"{p} ({_ranges_text(limits[p])})" if p in limits else p for p in self.precisions)

    def serves_capability(self, cap: tuple[int, int] | None) -> bool:
        return _in_ranges(cap, self.capabilities)

    def auto_considers(self, device: torch.device, cap: tuple[int, int] | None) -> bool:
        """Whether ``backend="auto"`` tries this backend on ``device`` (of capability ``cap``)."""
        if device.type not in self.auto_devices:
            return False
        if device.type != "cuda":
            return True
        return self.serves_capability(cap) and _in_ranges(cap, self.auto_capabilities)

    def capability_text(self) -> str:
        if not self.capabilities:
            return "any"
        return _ranges_text(self.capabilities)


_16BIT = (torch.bfloat16, torch.float16)

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="cutlass",
            devices=("cuda",),
            capabilities=(((9, 0), (10, 0)), ((10, 0), (12, 0)), ((12, 0), (13, 0))),
            dtypes=_16BIT,
            module="moe_fp4.backends.cutlass",
            summary="CUDA pipeline kernels + NVFP4 grouped GEMMs: block-scaled FP4 MMA (CUTLASS) on SM100/SM120/SM121, "
                    "16-bit wgmma on dequantized weights on sm_90a",
            auto_devices=("cuda",),
            # On 9.x only when named: auto keeps triton there until a committed benchmark shows the
            # sm_90a GEMM's whole forward faster at every M.
            auto_capabilities=(((10, 0), (12, 0)), ((12, 0), (13, 0))),
            precisions=PRECISIONS,
            # W4A16 on Hopper only: the sm_90a GEMM is the one that takes 16-bit activations.
            precision_capabilities=(("w4a16", (((9, 0), (10, 0)),)),),
            precision_notes=(("w4a16", "on Blackwell (SM100/SM120/SM121) the block-scaled FP4 tensor-core GEMM "
                                       "needs FP4 activations; only the sm_90a GEMM (compute capability 9.x) takes "
                                       "16-bit activations"),),
        ),
        Backend(
            name="triton",
            devices=("cuda", "cpu"),
            capabilities=(((8, 0), (13, 0)),),
            dtypes=_16BIT,
            module="moe_fp4.backends.triton",
            summary="portable Triton NVFP4 pipeline (in-kernel dequant to bf16/fp16 + tensor-core dot), SM80+",
            auto_devices=("cuda",),  # on CPU only in Triton's interpreter, and only when asked for
            precisions=PRECISIONS,  # w4a16 on the values GEMM: off Hopper its portable table, compiled, not run
        ),
        Backend(
            name="reference",
            devices=("cuda", "cpu"),
            capabilities=(),
            dtypes=_16BIT,
            module="moe_fp4.backends.reference",
            summary="plain torch, exact dequantization, loops over experts",
            auto_devices=("cuda", "cpu"),
            precisions=PRECISIONS,
        ),
    )
}


def preference_order(device: torch.device, capability: tuple[int, int] | None) -> list[str]:
    """The order ``backend="auto"`` tries on ``device``: :data:`BACKENDS` in order, filtered by their auto fields."""
    return [name for name, b in BACKENDS.items() if b.auto_considers(device, capability)]


def _parse_capability(text: str) -> tuple[int, int]:
    try:
        major, minor = text.strip().split(".")
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"{ENV_CAPABILITY}: expected MAJOR.MINOR such as 9.0 or 12.1, got {text!r}") from None


def capability_of(device: torch.device | str | int | None) -> tuple[int, int] | None:
    """Compute capability used for dispatch: ``MOE_FP4_FORCE_CAPABILITY`` or the device's; None on CPU."""
    device = _as_device(device)
    if device.type != "cuda":
        return None
    forced = os.environ.get(ENV_CAPABILITY)
    if forced:
        return _parse_capability(forced)
    return torch.cuda.get_device_capability(device)


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def get_backend_module(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {name!r}")
    return importlib.import_module(BACKENDS[name].module)


def why_unavailable(
    name: str, device: torch.device | str | int | None = None, dtype: torch.dtype | None = None
) -> str | None:
    """None when backend ``name`` can run on ``device`` (and ``dtype``), otherwise the reason."""
    device = _as_device(device)
    b = BACKENDS[name] if name in BACKENDS else None
    if b is None:
        raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {name!r}")
    if device.type not in b.devices:
        return f"runs on {'/'.join(b.devices)} devices, not {device.type}"
    cap = capability_of(device)
    if device.type == "cuda" and not b.serves_capability(cap):
        return f"serves compute capability {b.capability_text()}, this device is sm_{cap[0]}{cap[1]}"
    if dtype is not None and dtype not in b.dtypes:
        return f"supports hidden-state dtypes {[str(d) for d in b.dtypes]}, not {dtype}"
    try:
        mod = importlib.import_module(b.module)
    except ImportError as exc:  # e.g. triton not installed
        return f"cannot be imported: {exc}"
    return mod.why_unavailable(device, cap)


def precision_unserved(name: str, device: torch.device | str | int | None = None,
                       precision: str = "w4a4") -> str | None:
    """None when backend ``name`` computes ``precision`` on ``device`` (by the table alone:
    whether the backend can run there at all is :func:`why_unavailable`), otherwise why not."""
    check_precision(precision)
    device = _as_device(device)
    b = BACKENDS.get(name)
    if b is None:
        raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {name!r}")
    limited = device.type == "cuda" and precision in dict(b.precision_capabilities)
    return b.precision_unserved(precision, device.type, capability_of(device) if limited else None)


def layer_unserved(name: str, precision: str, hidden_size: int, intermediate_size: int) -> str | None:
    """None when backend ``name``, where it computes ``precision`` at all, can compute it for a layer of these
    sizes, otherwise why not (e.g. triton's W4A16 GEMM takes only sizes that are multiples of 64). A backend
    module says so through its optional ``layer_unserved(precision, hidden_size, intermediate_size)``."""
    check = getattr(get_backend_module(name), "layer_unserved", None)
    return None if check is None else check(precision, hidden_size, intermediate_size)


def _why_not(name: str, device: torch.device, dtype: torch.dtype | None, precision: str,
             layer: tuple[int, int] | None = None) -> str | None:
    """None when ``name`` can run ``precision`` on ``device`` (for a layer of sizes ``layer``, (H, I), when
    given): the precision first, then availability, then the layer."""
    why = precision_unserved(name, device, precision)
    if why is not None:
        return f"does not compute precision={precision!r}: {why}"
    why = why_unavailable(name, device, dtype)
    if why is None and layer is not None:
        why = layer_unserved(name, precision, *layer)
        if why is not None:
            return f"does not compute precision={precision!r} for this layer: {why}"
    return why


def _precision_error(backend: str, device: torch.device, precision: str, why: str) -> ValueError:
    serving = [n for n, b in BACKENDS.items()
               if device.type in b.devices and precision_unserved(n, device, precision) is None]
    return ValueError(f"backend={backend!r} does not compute precision={precision!r} on {device}: {why}. "
                      f"Backends that compute it there: {', '.join(serving) or 'none'} "
                      "(backend='auto' picks one that can run)")


def select_backend(
    backend: str, device: torch.device | str | int | None = None, dtype: torch.dtype | None = None,
    precision: str = "w4a4", layer: tuple[int, int] | None = None,
) -> str:
    """Resolve ``backend`` ("auto" or a name) to the backend that will run ``precision``, or raise.

    ``auto`` takes the first backend of the preference order that computes ``precision`` on
    the device (for a layer of sizes ``layer``, (hidden, intermediate), when given:
    :func:`layer_unserved`) and can run there. A named backend (or ``MOE_FP4_BACKEND``) that does not
    compute ``precision`` there, or cannot take the layer, raises ``ValueError`` with the reason; one
    that cannot run there raises :class:`BackendUnavailableError`.
    """
    check_precision(precision)
    device = _as_device(device)
    if backend == "auto":
        forced = os.environ.get(ENV_BACKEND)
        if forced:
            if forced not in BACKENDS:
                raise ValueError(f"{ENV_BACKEND}: expected one of {list(BACKENDS)}, got {forced!r}")
            backend = forced
        else:
            reasons = []
            for name in preference_order(device, capability_of(device)):
                why = _why_not(name, device, dtype, precision, layer)
                if why is None:
                    return name
                reasons.append(f"{name}: {why}")
            what = "" if precision == "w4a4" else f" with precision={precision!r}"
            raise BackendUnavailableError(f"no backend can run on {device}{what}: " + "; ".join(reasons))
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {backend!r}")
    why = precision_unserved(backend, device, precision)
    if why is not None:
        raise _precision_error(backend, device, precision, why)
    why = why_unavailable(backend, device, dtype)
    if why is not None:
        raise BackendUnavailableError(f"backend={backend!r} cannot run on {device}: {why}. {_advice(backend, device)}")
    why = None if layer is None else layer_unserved(backend, precision, *layer)
    if why is not None:
        raise ValueError(f"experts: backend={backend!r} does not compute precision={precision!r} for this layer: {why}")
    return backend


_RESOLVED: dict[tuple, str] = {}


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, precision: str = "w4a4",
                    layer: tuple[int, int] | None = None) -> str:
    """:func:`select_backend` of a device (``torch.device``, with its index), dtype, precision and layer sizes,
    cached.

    Successful resolutions are cached per (``backend``, ``device``, ``dtype``, ``precision``, ``layer``,
    ``MOE_FP4_BACKEND``, ``MOE_FP4_FORCE_CAPABILITY``, ``TRITON_INTERPRET``), and the backend's module is imported
    here, so that a call after the first imports nothing and asks no device anything; errors
    are not cached (they raise again, with their reason, on every call).
    """
    # Only the variables that can change this resolution are read, all of them whatever the device
    # (device.type costs more than the reads): the key is then finer than the resolution needs
    # (TRITON_INTERPRET for cutlass on CPU), never coarser.
    get = os.environ.get
    key = (backend, device, dtype, precision, layer, get(ENV_BACKEND) if backend == "auto" else None,
           get(ENV_CAPABILITY), get("TRITON_INTERPRET"))
    name = _RESOLVED.get(key)
    if name is None:
        name = select_backend(backend, device, dtype, precision, layer)
        get_backend_module(name)
        _RESOLVED[key] = name
    return name


# What torch.compiler.assume_constant_result does (dynamo runs the function while tracing and
# puts its result in the graph as a constant); calling it here would import torch._dynamo, and
# with it triton, whenever moe_fp4 is imported. tests/test_compile.py checks the attribute name.
resolve_backend._dynamo_marked_constant = True  # type: ignore[attr-defined]


def clear_resolved_backends() -> None:
    """Forget :func:`resolve_backend`'s cache (after changing what a backend's availability depends on)."""
    _RESOLVED.clear()


def _advice(name: str, device: torch.device) -> str:
    if name == "cutlass":
        return (
            "Use backend='auto' (it picks triton on GPUs without native FP4), or build the CUDA library: "
            "install with nvcc on PATH (see README, 'CUDA library')."
        )
    if name == "triton":
        return "Install triton (pip install triton), or on CPU set TRITON_INTERPRET=1, or use backend='reference'."
    return "Use backend='auto'."


def explain_backend(device: torch.device | str | int | None = None, dtype: torch.dtype | None = None,
                    precision: str = "w4a4", layer: tuple[int, int] | None = None) -> str:
    """Human-readable account of what ``backend="auto"`` picks on ``device`` for ``precision`` (and a layer of
    sizes ``layer``, (hidden, intermediate), when given) and why."""
    check_precision(precision)
    device = _as_device(device)
    cap = capability_of(device)
    lines = []
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "?"
        forced = " (forced by MOE_FP4_FORCE_CAPABILITY)" if os.environ.get(ENV_CAPABILITY) else ""
        lines.append(f"device {device}: {name}, compute capability {cap[0]}.{cap[1]}{forced}")
    else:
        lines.append(f"device {device}: no CUDA compute capability")
    lines.append(f"precision {precision}: " + ("NVFP4 weights, NVFP4 activations" if precision == "w4a4"
                                                else "NVFP4 weights, 16-bit activations"))
    order = preference_order(device, cap)
    lines.append("auto preference order: " + " > ".join(order))
    chosen = None
    for name in BACKENDS:
        why = _why_not(name, device, dtype, precision, layer)
        mark = "available" if why is None else f"unavailable: {why}"
        lines.append(f"  {name:9s} {mark}")
    forced_backend = os.environ.get(ENV_BACKEND)
    try:
        chosen = select_backend("auto", device, dtype, precision, layer)
    except (BackendUnavailableError, ValueError) as exc:
        lines.append(f"auto -> error: {exc}")
    else:
        skipped = [n for n in order[: order.index(chosen)]] if chosen in order else []
        how = f" (forced by {ENV_BACKEND}={forced_backend})" if forced_backend else ""
        if skipped:
            how += " after skipping " + ", ".join(f"{n} ({_why_not(n, device, dtype, precision, layer)})"
                                                  for n in skipped)
        lines.append(f"auto -> {chosen}{how}")
    return "\n".join(lines)


def backend_status(device: torch.device | str | int | None = None,
                   precision: str | None = None) -> dict[str, str | None]:
    """``{name: None if available else the reason}`` for every registered backend on ``device``
    (and computing ``precision`` there, when given)."""
    if precision is None:
        return {name: why_unavailable(name, device) for name in BACKENDS}
    device = _as_device(device)
    return {name: _why_not(name, device, None, precision) for name in BACKENDS}


def available_backends(device: torch.device | str | int | None = None, precision: str | None = None) -> list[str]:
    """Names of the backends that can run on ``device`` (default: the current CUDA device, else CPU),
    computing ``precision`` there when given."""
    return [name for name, why in backend_status(device, precision).items() if why is None]
