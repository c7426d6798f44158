"""``moe-fp4 bench --ep N`` on the CPU: 2 gloo ranks, a tiny layer, the reference backend.

One run of the command (both modes, two M) is judged on its files: every row's times are
finite and positive, the EP outputs are those of single-process ``fused_moe`` recomputed here
(bitwise for ``"all_to_all"``, by their SHA-256), and the machine is recorded. Bad arguments
are refused before any process starts. The numbers themselves mean nothing on the CPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_fp4 import fused_moe
from moe_fp4.bench import ep
from moe_fp4.bench.shapes import ModelShape
from moe_fp4.bench.workload import random_experts
from moe_fp4.cli import build_parser, main

SHAPE = "8,2,64,64"
TINY = ModelShape("custom-E8-top2-H64-I64", E=8, topk=2, H=64, I=64)
TOKENS = (1, 3)
WORLD = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    code = main(["bench", "--ep", str(WORLD), "--device", "cpu", "--shape", SHAPE, "--tokens",
                 ",".join(map(str, TOKENS)), "--backends", "reference", "--out", str(out), "--name", "run",
                 "--commit", "abc123"])
    assert code == 0
    return json.loads((out / "run.json").read_text()), (out / "run.md").read_text()


def positive(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_every_row_has_finite_positive_times_per_phase_and_rank(run):
    report, _ = run
    rows = report["rows"]
    assert [(r["M"], r["mode"]) for r in rows] == [(m, mode) for m in TOKENS for mode in ep.MODES]
    for r in rows:
        assert r["status"] == "ok" and r["backend"] == "reference", r
        assert r["global_M"] == (WORLD * r["M"] if r["mode"] == "all_to_all" else r["M"])
        timed = ("experts", "combine", "total") if r["mode"] == "all_reduce" else (*ep.PHASES, "total")
        for p in timed:
            assert positive(r[f"{p}_us"]) and len(r["phases"][p]["median_us"]) == WORLD
            assert r[f"{p}_us"] == max(r["phases"][p]["median_us"])  # the slowest rank
            assert r["phases"][p]["reps"] == ep.CPU_REPS
        assert (r["dispatch_us"] is None) == (r["mode"] == "all_reduce")  # replicated tokens: no dispatch
        assert positive(r["one_gpu_us"]) and r["ratio"] == pytest.approx(r["one_gpu_us"] / r["total_us"])
        assert r["check"]["phases_match_whole"], "the phase functions do not compose into ep_fused_moe"


def test_ep_outputs_equal_single_process_fused_moe(run):
    report, _ = run
    experts = random_experts(TINY, torch.device("cpu"), 0)
    for r in report["rows"]:
        x, w, ids = ep.layer_inputs(TINY, WORLD * r["M"], torch.device("cpu"), 0)
        if r["mode"] == "all_reduce":
            x, w, ids = x[: r["M"]], w[: r["M"]], ids[: r["M"]]
        single = ep._digest(fused_moe(x, experts, w, ids, backend="reference"))
        c = r["check"]
        assert c["one_gpu_sha256"] == single
        if r["mode"] == "all_to_all":  # bitwise, as tests/test_distributed.py establishes
            assert c["bitwise_equal"] and c["ep_sha256"] == single, c
        else:  # one rounding more per rank (the bound in ep_fused_moe's docstring)
            assert c["ranks_agree"] and c["rel_err"] <= c["tol"], c


def test_the_machine_and_method_are_recorded(run):
    report, md = run
    meta = report["meta"]
    assert meta["world_size"] == WORLD and meta["process_group"] == "gloo" and len(meta["devices"]) == WORLD
    assert meta["NCCL_NVLS_ENABLE"] == "0" and meta["commit"] == "abc123"
    assert meta["torch"] == torch.__version__ and "triton" in meta and meta["date"]
    assert "not measurements" in report["method"]["timing"]
    assert f"**{ep._CPU_WARNING}.**" in md and "NCCL_NVLS_ENABLE=0" in md


def test_markdown_table_has_every_column_filled(run):
    report, md = run
    lines = md.splitlines()
    head = lines.index("| " + " | ".join(ep._HEADERS) + " |")
    body = [ln.strip("|").split("|") for ln in lines[head + 2:head + 2 + len(report["rows"])]]
    assert len(body) == len(TOKENS) * len(ep.MODES)
    for cells in body:
        m, mode, global_m, *times, ratio, check = (c.strip() for c in cells)
        assert int(m) in TOKENS and mode in ep.MODES and int(global_m) >= int(m)
        if mode == "all_reduce":
            assert times[0] == "–"
            times = times[1:]
        assert all(float(t) > 0 for t in (*times, ratio)), cells
        assert check == "bitwise" if mode == "all_to_all" else check.startswith(("bitwise", "rel "))


def test_ep_arguments_parse():
    args = build_parser().parse_args(["bench", "--ep", "4", "--ep-mode", "all_reduce"])
    assert args.ep == 4 and args.ep_mode == "all_reduce"
    assert build_parser().parse_args(["bench"]).ep is None


@pytest.mark.parametrize("argv", [["--ep", "0"], ["--ep", "-2"], ["--ep", "x"], ["--ep", "2", "--ep-mode", "ring"]])
def test_malformed_ep_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "bench: error: argument --ep" in err and ("expected a positive int" in err or "--ep-mode" in err)


@pytest.mark.parametrize("argv, message", [
    (["--ep", str(torch.cuda.device_count() + 1), "--device", "cuda"],
     f"expected {torch.cuda.device_count() + 1} CUDA GPUs (one per rank), found {torch.cuda.device_count()}"),
    (["--ep", "2", "--device", "cuda:1"], "--device: with --ep, expected cuda"),
    (["--ep", "9", "--device", "cpu"], "--ep 9: expected at most E ranks (every rank holds at least one expert), "
                                       "but custom-E8-top2-H64-I64 has E=8"),
    (["--ep", "2", "--device", "cpu", "--backends", "nope"], "--backends: expected names from"),
    (["--ep-mode", "all_to_all", "--device", "cpu"], "--ep-mode: only with --ep N"),
    (["--ep", "2", "--render", "x.json"], "--ep: not with --render"),
])
def test_bad_ep_values_are_refused_before_any_rank_starts(argv, message, capsys, tmp_path):
    assert main(["bench", "--shape", SHAPE, "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
