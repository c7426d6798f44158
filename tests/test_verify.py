"""``moe-fp4 verify``: the per-layer table, the exit status, and its errors."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from moe_fp4 import _progress, cli
from moe_fp4._progress import Progress
from moe_fp4.backends import reference as reference_backend
from moe_fp4.backends import registry
from moe_fp4.checkpoint import verify
from moe_fp4.cli import verify as verify_cli

DATA = Path(__file__).parent / "data" / "tiny_qwen3_moe"
QUANTIZED = ("nvfp4_ct", "nvfp4_llmc", "nvfp4_modelopt")


def variants():
    """The synthetic-checkpoint helpers of test_checkpoint_variants (imported where a test needs them)."""
    import test_checkpoint_variants

    return test_checkpoint_variants


# layer, backend, error vs fp64, worst, its (token, column), difference from the reference backend, result
ROW = re.compile(r"^\s*(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.e+-]+) at \((\d+), (\d+)\)\s+(-|[\d.e+-]+)\s+(ok|MISMATCH)$")


def run_verify(capsys, *args: str) -> tuple[int, str, str, list[tuple]]:
    rc = cli.main(["verify", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err, [m.groups() for m in map(ROW.match, out.splitlines()) if m]


@pytest.mark.parametrize("name", QUANTIZED)
def test_verify_prints_the_table_and_exits_0(capsys, name):
    rc, out, err, rows = run_verify(capsys, DATA / name, "--backend", "reference")
    assert rc == 0, out + err
    assert f"format {'modelopt' if name == 'nvfp4_modelopt' else 'compressed-tensors'}; 2 MoE layers" in out
    assert "E=8, top-2 (renormalised), H=256, I=128" in out
    assert [(r[0], r[1]) for r in rows] == [("0", "reference"), ("1", "reference")]
    for r in rows:
        # The W4A4 error against the float64 MoE is 0.157-0.164 on these checkpoints (verify's
        # docstring); a value far below would mean the table is not measuring NVFP4 at all.
        assert 0.1 < float(r[2]) <= verify.TOL_FP64 and r[6] == "-" and r[7] == "ok"
    assert out.rstrip().endswith("OK: 2 layers, 1 backend(s) (reference)")
    assert err == ""  # stderr is not a terminal: no progress bar unless asked


@pytest.mark.interpreter
@pytest.mark.parametrize("name", QUANTIZED)
def test_verify_default_backends_at_few_tokens(capsys, name):
    # Every backend available here (the Triton interpreter on CPU, when its backend exists).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = registry.available_backends(device)
    rc, out, err, rows = run_verify(capsys, DATA / name, "--tokens", "6")
    assert rc == 0, out + err
    assert sorted({r[1] for r in rows}) == sorted(names)
    assert all(r[7] == "ok" for r in rows) and len(rows) == 2 * len(names)


def test_verify_as_a_subprocess_with_a_progress_bar():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "moe_fp4", "verify", str(DATA / "nvfp4_modelopt"), "--backend",
                        "reference", "--progress", "--layers", "1", "--tokens", "16"],
                       check=False, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify [##############################] 1/1" in r.stderr  # one line per update off a terminal
    assert [m.group(1) for m in map(ROW.match, r.stdout.splitlines()) if m] == ["1"]


def test_a_second_moe_stack_is_named_as_not_checked(capsys, tmp_path):
    def add_mtp(t):  # an MTP-style extra stack with one MoE layer
        t.update({k.replace("model.layers.1.", "mtp.layers.0."): v.clone() for k, v in list(t.items())
                  if k.startswith("model.layers.1.mlp.")})
    path = variants().make_variant(tmp_path, "nvfp4_ct", edit=add_mtp)
    rc, out, _, rows = run_verify(capsys, path, "--backend", "reference", "--tokens", "8")
    assert rc == 0 and "not checked: MoE blocks under mtp.layers" in out and len(rows) == 2


def test_per_half_gate_up_scales_are_reported(capsys, tmp_path):
    v = variants()
    path = v.make_variant(tmp_path, "nvfp4_ct", edit=v.halve_up_scales("nvfp4_ct", 1, 3))
    rc, out, _, rows = run_verify(capsys, path, "--backend", "reference", "--dtype", "float16")
    assert rc == 0 and len(rows) == 2
    assert out.count("gate and up carry different weight global scales") == 1  # layer 1 only


def broken_backend(monkeypatch, factor: float) -> None:
    """Register a backend "broken" that returns the reference backend's output times ``factor``."""
    mod = types.ModuleType("_moe_fp4_broken_backend")
    mod.__dict__.update({k: v for k, v in vars(reference_backend).items() if not k.startswith("__")})
    mod.fused_moe = lambda problem: (reference_backend.fused_moe(problem).float() * factor).to(
        problem.hidden_states.dtype)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    spec = dataclasses.replace(registry.BACKENDS["reference"], name="broken", module=mod.__name__,
                               summary="test: scaled reference output")
    monkeypatch.setitem(registry.BACKENDS, "broken", spec)


def test_a_backend_off_by_5_percent_is_a_mismatch(capsys, monkeypatch):
    # 5% is well inside the NVFP4 error against float64 but 2.5x the agreement tolerance.
    broken_backend(monkeypatch, 1.05)
    rc, out, _, rows = run_verify(capsys, DATA / "nvfp4_ct", "--backend", "broken", "--tokens", "16")
    assert rc == 1
    by = {(r[0], r[1]): r for r in rows}
    assert by["0", "reference"][7] == "ok" and by["0", "broken"][7] == "MISMATCH"
    assert abs(float(by["0", "broken"][6]) - 0.05) < 0.005 and float(by["0", "broken"][2]) <= verify.TOL_FP64
    assert "MISMATCH in 2 of 2 layers: [0, 1]" in out


def test_the_agreeing_fake_backend_passes(capsys, monkeypatch):
    broken_backend(monkeypatch, 1.0)  # the same harness, with nothing wrong: must pass
    rc, _, _, rows = run_verify(capsys, DATA / "nvfp4_ct", "--backend", "broken", "--tokens", "16")
    assert rc == 0 and {r[1] for r in rows} == {"reference", "broken"}
    assert all(float(r[6]) == 0 for r in rows if r[1] == "broken")


def test_exceeding_the_float64_tolerance_is_a_mismatch(capsys, monkeypatch):
    monkeypatch.setattr(verify, "TOL_FP64", 0.05)  # below the NVFP4 error itself
    rc, out, _, rows = run_verify(capsys, DATA / "nvfp4_llmc", "--backend", "reference", "--layers", "0")
    assert rc == 1 and rows[0][7] == "MISMATCH" and "try a smaller --input-range" in out


@pytest.mark.parametrize("args, message", [
    ((DATA / "bf16",), "not a quantized checkpoint"),
    ((DATA / "nvfp4_ct", "--backend", "nope"), r"backend: expected one of \['auto', 'cutlass', 'triton', 'reference'"),
    ((DATA / "nvfp4_ct", "--layers", "5"), r"layer: expected one of the MoE layers \[0, 1\]"),
    ((DATA / "nvfp4_ct", "--input-range", "2"), r"input_range: expected a fraction .* in \(0, 1\], got 2.0"),
])
def test_errors_exit_2_with_a_message(capsys, args, message):
    rc = cli.main(["verify", *map(str, args)])
    assert rc == 2 and re.search(message, capsys.readouterr().err)


def test_a_named_backend_that_cannot_run_exits_2(capsys):
    assert cli.main(["verify", str(DATA / "nvfp4_ct"), "--backend", "cutlass", "--device", "cpu"]) == 2
    assert "backend='cutlass' cannot run on cpu" in capsys.readouterr().err


@pytest.mark.parametrize("args", [("--tokens", "0"), ("--layers", "a-b"), ("--dtype", "float32")])
def test_bad_options_are_refused_by_the_parser(capsys, args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify", str(DATA / "nvfp4_ct"), *args])
    assert exc.value.code == 2


def test_layers_option_parses_ranges():
    assert verify_cli._layers_arg("0,3, 5-7") == [0, 3, 5, 6, 7]


def test_verify_checkpoint_api_returns_reports():
    reports = verify.verify_checkpoint(DATA / "nvfp4_modelopt", backends=["reference"], tokens=8, device="cpu")
    assert [r.layer for r in reports] == [0, 1] and all(r.ok for r in reports)
    res = reports[0].results[0]
    assert res.backend == "reference" and res.rel_reference is None
    assert 0 <= res.worst_at[0] < 8 and 0 <= res.worst_at[1] < 256 and 0 < res.worst


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _FakeTqdm:
    """Records how Progress drives tqdm (tqdm is optional and may not be installed)."""

    made: ClassVar[list[_FakeTqdm]] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls = kwargs, []
        _FakeTqdm.made.append(self)

    def update(self, n):
        self.calls.append(("update", n))

    def set_postfix_str(self, s, refresh=True):
        self.calls.append(("postfix", s))

    def write(self, s, file=None):
        self.calls.append(("write", s))
        file.write(s + "\n")

    def close(self):
        self.calls.append(("close",))


def test_progress_draws_nothing_off_a_terminal_unless_asked():
    quiet = io.StringIO()
    p = Progress(4, "x", stream=quiet)
    p.update(1)
    p.close()
    assert quiet.getvalue() == ""
    tty = _Tty()
    Progress(4, "x", enabled=False, stream=tty).update(1)
    assert tty.getvalue() == ""


def test_progress_off_a_terminal_writes_one_line_per_update(monkeypatch):
    monkeypatch.setattr(_progress, "_tqdm", lambda: _FakeTqdm)  # tqdm is never used off a terminal
    logged = io.StringIO()
    p = Progress(4, "x", enabled=True, stream=logged)
    p.update(0)
    p.update(2, "layer 1")
    p.update(5)  # clipped at the total
    p.close()
    first, second, third = logged.getvalue().splitlines()
    assert first.startswith("x [..............................] 0/4 (")
    assert second.startswith("x [###############...............] 2/4") and second.endswith("layer 1")
    assert "s left" in second and third.startswith("x [##############################] 4/4 (") and "left" not in third


def test_progress_on_a_terminal_is_a_tqdm_bar_where_tqdm_is_installed(monkeypatch):
    monkeypatch.setattr(_FakeTqdm, "made", [])
    monkeypatch.setattr(_progress, "_tqdm", lambda: _FakeTqdm)
    tty, out = _Tty(), io.StringIO()
    p = Progress(3, "verify", stream=tty, unit="layer")
    p.update(1, "layer 0")
    p.write("a row", file=out)
    p.close()
    p.close()  # closing twice is harmless
    (bar,) = _FakeTqdm.made
    assert bar.kwargs["total"] == 3 and bar.kwargs["desc"] == "verify" and bar.kwargs["file"] is tty
    assert bar.kwargs["unit"] == "layer" and bar.kwargs["leave"] is False
    assert bar.calls == [("postfix", "layer 0"), ("update", 1), ("write", "a row"), ("close",)]
    assert out.getvalue() == "a row\n" and tty.getvalue() == ""


def test_progress_on_a_terminal_without_tqdm_writes_lines(monkeypatch):
    monkeypatch.setattr(_progress, "_tqdm", lambda: None)
    tty, out = _Tty(), io.StringIO()
    p = Progress(2, "x", stream=tty)
    p.update(1)
    p.write("a row", file=out)
    p.close()
    assert tty.getvalue().startswith("x [###############...............] 1/2 (") and out.getvalue() == "a row\n"


def test_progress_finds_tqdm_only_where_it_is_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing it raises ImportError
    assert _progress._tqdm() is None
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_FakeTqdm))
    assert _progress._tqdm() is _FakeTqdm


@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANTIZED)
def test_verify_on_the_gpu_with_every_available_backend(capsys, name):
    # On the H200: the Triton backend (and the reference) on every layer of each checkpoint.
    names = registry.available_backends("cuda")
    rc, out, err, rows = run_verify(capsys, DATA / name, "--device", "cuda", "--tokens", "256")
    assert rc == 0, out + err
    assert {r[1] for r in rows} == set(names) and len(rows) == 2 * len(names)
