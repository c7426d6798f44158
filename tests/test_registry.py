"""The backend registry: dispatch by compute capability, fallbacks that explain themselves, env overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import moe_fp4
from moe_fp4.backends import registry
from moe_fp4.backends.registry import (
    BACKENDS,
    BackendUnavailableError,
    capability_of,
    explain_backend,
    preference_order,
    select_backend,
)

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "cap,order",
    [
        ((10, 0), ["cutlass", "triton", "reference"]),  # B200
        ((10, 3), ["cutlass", "triton", "reference"]),
        ((11, 0), ["cutlass", "triton", "reference"]),
        ((12, 0), ["cutlass", "triton", "reference"]),  # RTX 50xx, RTX PRO 6000
        ((12, 1), ["cutlass", "triton", "reference"]),  # DGX Spark
        ((9, 0), ["triton", "reference"]),  # H100/H200
        ((8, 0), ["triton", "reference"]),  # A100
        ((8, 9), ["triton", "reference"]),  # L40S
        ((7, 5), ["reference"]),
    ],
)
def test_preference_order_keyed_on_capability(cap, order):
    assert preference_order(CUDA, cap) == order


def test_cpu_picks_reference():
    assert preference_order(torch.device("cpu"), None) == ["reference"]
    assert select_backend("auto", "cpu", torch.bfloat16) == "reference"
    assert "reference" in moe_fp4.available_backends("cpu")


def test_preference_order_is_derived_from_the_table(monkeypatch):
    # The auto order is BACKENDS filtered by each entry's auto fields: a new entry (here a
    # Hopper-only backend listed first) changes the order where it is admitted and nowhere else.
    hopper = registry.Backend(name="hopper", devices=("cuda",), capabilities=(((9, 0), (10, 0)),),
                              dtypes=(torch.bfloat16,), module="moe_fp4.backends.reference", summary="test",
                              auto_devices=("cuda",))
    monkeypatch.setattr(registry, "BACKENDS", {"hopper": hopper, **BACKENDS})
    assert preference_order(CUDA, (9, 0)) == ["hopper", "triton", "reference"]
    assert preference_order(CUDA, (12, 0)) == ["cutlass", "triton", "reference"]
    assert preference_order(torch.device("cpu"), None) == ["reference"]
    # An entry that serves a capability but is not auto-chosen there is only used when named.
    picky = registry.Backend(name="picky", devices=("cuda",), capabilities=(((8, 0), (13, 0)),),
                             dtypes=(torch.bfloat16,), module="moe_fp4.backends.reference", summary="test",
                             auto_devices=("cuda",), auto_capabilities=(((12, 0), (13, 0)),))
    monkeypatch.setattr(registry, "BACKENDS", {"picky": picky, **BACKENDS})
    assert preference_order(CUDA, (9, 0)) == ["triton", "reference"]
    assert preference_order(CUDA, (12, 1)) == ["picky", "cutlass", "triton", "reference"]


def test_a_dtype_the_backend_does_not_serve_is_explained():
    why = registry.why_unavailable("reference", "cpu", torch.float32)
    assert why is not None and "supports hidden-state dtypes" in why and "torch.float32" in why


def test_named_backend_that_cannot_run_raises_with_reason():
    with pytest.raises(BackendUnavailableError,
                       match=r"backend='cutlass' cannot run on cpu: runs on cuda devices.*build"):
        select_backend("cutlass", "cpu")
    with pytest.raises(ValueError,
                       match=r"backend: expected one of \['auto', 'cutlass', 'triton', 'reference'\], got 'fast'"):
        select_backend("fast", "cpu")


def test_auto_falls_back_in_order_and_explains(monkeypatch):
    # A Blackwell device whose CUDA library was not built: auto must take triton and say why.
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "12.0")
    reasons = {"cutlass": "library not built (nvcc was not found at install time)", "triton": None, "reference": None}
    monkeypatch.setattr(registry, "why_unavailable", lambda name, device=None, dtype=None: reasons[name])
    assert capability_of(CUDA) == (12, 0)
    assert select_backend("auto", CUDA) == "triton"
    text = explain_backend(CUDA)
    assert "auto preference order: cutlass > triton > reference" in text
    assert "cutlass   unavailable: library not built" in text
    assert "auto -> triton after skipping cutlass (library not built" in text
    with pytest.raises(BackendUnavailableError, match="library not built"):
        select_backend("cutlass", CUDA)
    reasons["triton"] = "triton is not installed"
    assert select_backend("auto", CUDA) == "reference"


def test_env_forces_backend(monkeypatch):
    monkeypatch.setenv("MOE_FP4_BACKEND", "reference")
    assert select_backend("auto", "cpu") == "reference"
    monkeypatch.setenv("MOE_FP4_BACKEND", "cutlass")
    with pytest.raises(BackendUnavailableError, match="backend='cutlass' cannot run on cpu"):
        select_backend("auto", "cpu")
    monkeypatch.setenv("MOE_FP4_BACKEND", "nope")
    with pytest.raises(ValueError, match="MOE_FP4_BACKEND: expected one of"):
        select_backend("auto", "cpu")


def test_env_forces_capability(monkeypatch):
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "9.0")
    assert capability_of(CUDA) == (9, 0)
    assert capability_of("cpu") is None
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "sm90")
    with pytest.raises(ValueError, match="MOE_FP4_FORCE_CAPABILITY: expected MAJOR.MINOR"):
        capability_of(CUDA)


def test_explain_backend_on_cpu():
    text = explain_backend("cpu")
    assert text.startswith("device cpu: no CUDA compute capability")
    assert "auto -> reference" in text
    assert "cutlass   unavailable: runs on cuda devices, not cpu" in text


def test_importing_the_package_loads_no_backend():
    # Registration is metadata only: importing moe_fp4 imports no triton and loads no native library.
    code = (
        "import sys, moe_fp4\n"
        "from moe_fp4.backends import registry\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('triton' in sys.modules, 'libmoe_fp4_cuda' in maps,"
        " 'moe_fp4.backends.triton' in sys.modules, 'moe_fp4.backends.cutlass' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "False"], out


def test_resolve_backend_caches_per_environment(monkeypatch):
    # fused_moe resolves through resolve_backend: select_backend once per (backend, device,
    # dtype, environment), the environment variables that change the answer read on every call.
    cpu = torch.device("cpu")
    registry.clear_resolved_backends()
    calls = []
    real = registry.select_backend
    monkeypatch.setattr(registry, "select_backend", lambda *a: calls.append(a) or real(*a))
    monkeypatch.delenv("MOE_FP4_BACKEND", raising=False)
    assert registry.resolve_backend("auto", cpu, torch.bfloat16) == "reference"
    assert registry.resolve_backend("auto", cpu, torch.bfloat16) == "reference"
    assert len(calls) == 1
    monkeypatch.setenv("MOE_FP4_BACKEND", "cutlass")  # a new environment is resolved again, and raises
    with pytest.raises(BackendUnavailableError, match="backend='cutlass' cannot run on cpu"):
        registry.resolve_backend("auto", cpu, torch.bfloat16)
    with pytest.raises(BackendUnavailableError):  # errors are not cached
        registry.resolve_backend("auto", cpu, torch.bfloat16)
    assert len(calls) == 3
    monkeypatch.delenv("MOE_FP4_BACKEND")
    assert registry.resolve_backend("auto", cpu, torch.bfloat16) == "reference" and len(calls) == 3
    registry.clear_resolved_backends()
    assert registry.resolve_backend("auto", cpu, torch.bfloat16) == "reference" and len(calls) == 4


def test_resolve_backend_reads_triton_interpret_for_a_named_backend(monkeypatch):
    """``TRITON_INTERPRET`` is part of a named backend's resolution (read on every call, as the others)."""
    pytest.importorskip("triton")
    from moe_fp4.backends import triton as triton_backend

    if not triton_backend.kernels().INTERPRET:
        pytest.skip("needs the kernels of Triton's CPU interpreter (TRITON_INTERPRET=1 at import)")
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry.clear_resolved_backends()
    assert registry.resolve_backend("triton", cpu, torch.bfloat16) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # changed after the kernels were made: refused
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET changed after they were imported"):
        registry.resolve_backend("triton", cpu, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.resolve_backend("triton", cpu, torch.bfloat16) == "triton"
