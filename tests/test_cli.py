"""The command line (``python -m moe_fp4`` / ``moe-fp4``) and the installed layout."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import tempfile

import pytest

import moe_fp4
from moe_fp4 import cli


def _run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "moe_fp4", *args], check=False, capture_output=True, text=True,
                          env=env, cwd=cwd)


def _installed() -> bool:
    """True when moe_fp4 imports from outside the source tree (an installed or editable package)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-c", "import moe_fp4"], check=False, capture_output=True, cwd=tmp,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return r.returncode == 0


def test_info_lists_devices_and_backends():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "backends:" in r.stdout and "device cpu" in r.stdout
    for name in ("cutlass", "triton", "reference"):
        assert name in r.stdout
    assert "auto -> " in r.stdout


def test_demo_prints_backend_error_and_time():
    r = _run("demo", "--repeat", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    import torch

    from moe_fp4.backends.registry import select_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"backend: {select_backend('auto', device, torch.bfloat16)} " in r.stdout
    assert "relative error vs the reference backend:" in r.stdout
    assert "time per forward:" in r.stdout and r.stdout.rstrip().endswith("OK")


def test_demo_with_a_named_backend_that_cannot_run_says_why():
    r = _run("demo", "--backend", "cutlass", "--device", "cpu")
    assert r.returncode == 2
    assert "backend='cutlass' cannot run on cpu" in r.stderr


@pytest.mark.skipif(not _installed(), reason="moe_fp4 is not installed (running from a source tree)")
def test_console_script_is_installed():
    eps = [ep for ep in md.entry_points(group="console_scripts") if ep.name == "moe-fp4"]
    assert eps and eps[0].value == "moe_fp4.cli:main"


@pytest.mark.skipif(not _installed(), reason="moe_fp4 is not installed (running from a source tree)")
def test_triton_kernels_live_under_the_moe_fp4_namespace(tmp_path):
    # From a neutral directory (not the repo root, which holds the triton_kernels/ folder), the
    # installed package must not provide a top-level `triton_kernels` (OpenAI's name, used by
    # vLLM); it provides `moe_fp4.triton_kernels`.
    code = (
        "import importlib.util as u\n"
        "print(u.find_spec('triton_kernels') is None, u.find_spec('moe_fp4.triton_kernels') is not None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"], r.stdout


def test_version_and_exports():
    assert moe_fp4.__version__
    for name in ("fused_moe", "NvFp4Experts", "quantize_nvfp4", "dequantize_nvfp4", "swizzle_scales",
                 "unswizzle_scales", "global_scale_for", "available_backends", "explain_backend"):
        assert hasattr(moe_fp4, name) and name in moe_fp4.__all__, name
    for name in moe_fp4.__all__:  # every advertised name resolves
        assert hasattr(moe_fp4, name), name


def test_every_subcommand_has_help():
    for command in ("info", "demo", "verify", "bench"):
        r = _run(command, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: moe-fp4 {command}"), r.stdout + r.stderr


def test_a_subcommand_that_cannot_be_imported_says_why(monkeypatch, capsys):
    monkeypatch.setitem(cli._COMMANDS, "broken", ("moe_fp4._no_such_module", "a command whose module is missing"))
    assert cli.main(["broken"]) == 2
    assert "moe-fp4 broken: unavailable (No module named 'moe_fp4._no_such_module')" in capsys.readouterr().err
    assert cli.main(["info"]) == 0  # the other commands are unaffected
