"""Writers of a benchmark report (:mod:`.engine`): JSON, Markdown, a PNG plot and terminal tables.

All of them read only the report dict, so ``moe-fp4 bench --render FILE.json`` can rewrite
the Markdown and the plot of an earlier run without a GPU. matplotlib is optional and
imported only by :func:`write_png`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .workload import STAGES

__all__ = ["load_json", "write_json", "render_markdown", "write_png", "terminal_summary", "format_row", "write_all"]

_STATUS_CELL = {"failed": "FAILED", "error": "error", "unavailable": "n/a", "not_run": "not run"}


def load_json(path: str | Path) -> dict:
    """A report written by :func:`write_json` (checks that it is one)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--render: {path} is not JSON ({exc})") from None
    if not isinstance(report, dict) or report.get("schema") != 1 or "rows" not in report:
        raise ValueError(f"--render: {path} is not a moe-fp4 bench report (expected schema 1 with rows)")
    return report


def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    return path


# ----------------------------------------------------------------------------- tables


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _rows_of(report: dict, model: str, **match: Any) -> list[dict]:
    return [r for r in report["rows"] if r["model"] == model and all(r.get(k) == v for k, v in match.items())]


def _paths(report: dict, model: str, kinds: tuple[str, ...]) -> list[str]:
    seen: dict[str, None] = {}
    for r in report["rows"]:
        if r["model"] == model and r["kind"] in kinds:
            seen.setdefault(r["path"])
    return list(seen)


def _cell(row: dict | None, spread: bool) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return _STATUS_CELL.get(row["status"], row["status"])
    text = f"{row['us']:.1f}"
    if spread:
        text += f" [{row['p20_us']:.1f}-{row['p80_us']:.1f}]"
    return text + ("*" if row.get("mode") == "eager" else "")


def _forward_table(report: dict, model: str, spread: bool) -> tuple[list[str], list[list[str]]]:
    paths = _paths(report, model, ("backend", "peer"))
    headers = ["M", "experts", "floor us", "bound", *paths]
    body = []
    for case in (c for c in report["cases"] if c["model"] == model):
        by_path = {r["path"]: r for r in _rows_of(report, model, M=case["M"])}
        body.append([str(case["M"]), str(case["experts_touched"]), _fmt(case["floor_us"]), case["bound"],
                     *(_cell(by_path.get(p), spread) for p in paths)])
    return headers, body


def _metrics_table(report: dict, model: str) -> tuple[list[str], list[list[str]]]:
    peers = [p for p in _paths(report, model, ("peer",))]
    headers = ["M", "path", "us", "TFLOP/s", "weight TB/s", "% roofline", *(f"x {p}" for p in peers)]
    body = []
    # Whole forwards and peers against the layer's floor; GEMM stages against their own GEMM's floor.
    for r in (r for r in report["rows"] if r["model"] == model and r["kind"] in ("backend", "peer", "stage")):
        if r["status"] == "ok" and "pct_roofline" in r:
            body.append([str(r["M"]), r["path"], _fmt(r["us"]), _fmt(r.get("tflops")), _fmt(r.get("weight_tbps"), 2),
                         _fmt(r.get("pct_roofline")), *(_fmt(r.get(f"vs_{p}"), 2) for p in peers)])
    return headers, body


def _stage_table(report: dict, model: str, provider: str) -> tuple[list[str], list[list[str]]]:
    headers = ["M", *STAGES, "sum of stages", "whole forward"]
    body = []
    for case in (c for c in report["cases"] if c["model"] == model):
        rows = _rows_of(report, model, M=case["M"])
        by_stage = {r["stage"]: r for r in rows if r["kind"] == "stage" and r["provider"] == provider}
        fused = next((r for r in rows if r["kind"] == "backend" and r["path"] == provider), None)
        total = case.get("stage_sum_us", {}).get(provider)
        cells = [_cell(by_stage.get(s), False) for s in STAGES]
        body.append([str(case["M"]), *cells, _fmt(total), _cell(fused, False)])
    return headers, body


def _overhead_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["M", "path", "validate", "wall", "GPU", "host", "returns"]
    body = [[str(r["M"]), r["path"], "" if r["validate"] is None else str(r["validate"]), _fmt(r["wall_us"]),
             _fmt(r["gpu_us"]), _fmt(r["host_us"]), _fmt(r.get("returns_us"))] for r in rows]
    return headers, body


def _markdown_table(headers: list[str], body: list[list[str]]) -> list[str]:
    right = ["---:" if h not in ("path", "bound") else "---" for h in headers]
    return ["| " + " | ".join(headers) + " |", "| " + " | ".join(right) + " |",
            *("| " + " | ".join(row) + " |" for row in body)]


def _text_table(headers: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(headers)]
    return ["  ".join(h.rjust(w) for h, w in zip(row, widths)) for row in [headers, *body]]


def _not_timed(report: dict, model: str) -> list[str]:
    """One line per (status, reason, token counts), naming every path it applies to."""
    by_path: dict[tuple[str, str, str], list[int]] = {}
    for r in _rows_of(report, model):
        if r["status"] != "ok":
            why = r.get("note") or r.get("check") or ""
            by_path.setdefault((r["path"], r["status"], why), []).append(r["M"])
    groups: dict[tuple[str, str, tuple[int, ...]], list[str]] = {}
    for (path, status, why), ms in by_path.items():
        groups.setdefault((status, why, tuple(ms)), []).append(f"`{path}`")
    return [f"- {', '.join(paths)} {status} at M={','.join(map(str, ms))}: {why}"
            for (status, why, ms), paths in groups.items()]


def _eager_notes(report: dict, model: str) -> list[str]:
    notes = {(r["path"], r.get("note", "")) for r in _rows_of(report, model) if r.get("mode") == "eager"}
    return [f"- `{p}` timed eagerly (*): {n}" for p, n in sorted(notes)]


def _providers(report: dict, model: str) -> list[str]:
    """Providers with at least one stage that ran (checked), in report order."""
    rows = _rows_of(report, model, kind="stage")
    return list(dict.fromkeys(r["provider"] for r in rows if r["status"] in ("ok", "failed")))


def _tolerances(tol: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in tol.items())


def render_markdown(report: dict) -> str:
    """The report as Markdown: environment, method, then per layer the tables and what was not timed."""
    meta, method = report["meta"], report["method"]
    ce = method["ceilings"]
    gpu = meta.get("gpu") or "no GPU"
    lines = [f"# moe_fp4 benchmark: {gpu}, {meta['date'][:10]}", "", "| | |", "|---|---|"]
    if meta.get("gpu"):
        lines.append(f"| GPU | {gpu} (sm {meta.get('cc')}, {meta.get('sms')} SMs, {meta.get('memory_gib')} GiB), "
                     f"driver {meta.get('driver')} |")
    lines += [
        f"| software | torch {meta['torch']}, CUDA {meta['cuda']}, triton {meta['triton']}, Python {meta['python']} |",
        f"| moe_fp4 | {meta['moe_fp4']}, commit `{meta['commit']}` |",
        f"| date | {meta['date']} |",
        f"| ceilings | read {ce['read_tbps']:.3g} TB/s (copy {ce['copy_tbps']:.3g}, read-only stream "
        f"{ce['stream_tbps']:.3g}); bf16 matmul {ce['bf16_tflops']:.3g} TFLOP/s |",
        f"| roofline | {method['roofline']} |",
        f"| timing | {method['timing']} |",
        f"| checks | every timed output, before and after timing; tolerances: {_tolerances(method['tolerances'])}; "
        f"up to {method['check_tokens']} tokens per M |",
        f"| data | {method['routing']}; seed {method['seed']} |",
        "",
        "Times in µs: median [p20-p80]. `x peer` = peer µs / row µs (above 1: faster than the peer). "
        "% roofline = 100 * floor / µs. FAILED: the output did not pass its check, so no time is shown; "
        "n/a: cannot run here. * = timed eagerly (not capturable in a CUDA graph).",
    ]
    for model, info in report["models"].items():
        lines += ["", f"## {model} (E={info['E']}, top-{info['topk']}, H={info['H']}, I={info['I']})", ""]
        missing = info.get("peers_unavailable") or {}
        if missing:
            lines += ["Peers not run: " + "; ".join(f"{k}: {v}" for k, v in missing.items()), ""]
        lines += ["### Whole forward, µs", "", *_markdown_table(*_forward_table(report, model, spread=True))]
        overhead = [r for r in report.get("overhead", []) if r["model"] == model]
        if overhead:
            lines += ["", "### Eager host overhead, µs (wall time of a synchronized eager call minus its "
                      "graph-replayed GPU time; warm L2. returns: time until the call returns, before the "
                      "synchronize. floor: one small torch kernel and the synchronize)", "",
                      *_markdown_table(*_overhead_table(overhead))]
        resident = info.get("resident")
        if resident and resident.get("paths"):
            gib = resident["nvfp4_bytes"] / 2**30
            cells = ", ".join(f"{k} {v['x_nvfp4']:.2f}x" for k, v in resident["paths"].items()
                              if v.get("x_nvfp4") is not None)
            lines += ["", f"Resident weight memory of the prepared layer, x its NVFP4 bytes ({gib:.3f} GiB): {cells}."]
        lines += ["", "### Rates, roofline and peer ratios (GEMM stages: against that GEMM's own floor)", "",
                  *_markdown_table(*_metrics_table(report, model))]
        for provider in _providers(report, model):
            lines += ["", f"### Stages of the {provider} pipeline, µs (each captured and timed alone)", "",
                      "Each stage is the pipeline's stage call, unfused (a cutlass GEMM whose plan splits K through "
                      "a workspace gets a zeroed one for the call, so it runs the plan's split), so the stages can "
                      "differ from what the whole forward runs.", "",
                      *_markdown_table(*_stage_table(report, model, provider))]
        extra = _not_timed(report, model) + _eager_notes(report, model)
        if extra:
            lines += ["", "### Not timed or timed eagerly", "", *extra]
    if report.get("notes"):
        lines += ["", "## Notes", "", *(f"- {n}" for n in report["notes"])]
    return "\n".join(lines) + "\n"


def terminal_summary(report: dict) -> str:
    """Plain-text tables for the terminal: whole-forward µs and moe_fp4's rates per layer."""
    out = []
    for model in report["models"]:
        out += ["", f"{model}: whole forward, median us (floor = roofline)",
                *_text_table(*_forward_table(report, model, False))]
        headers, body = _metrics_table(report, model)
        if body:
            out += ["", f"{model}: rates and ratios", *_text_table(headers, body)]
        for provider in _providers(report, model):
            out += ["", f"{model}: {provider} stages, median us", *_text_table(*_stage_table(report, model, provider))]
    return "\n".join(out)


def format_row(row: dict) -> str:
    """One line per finished row, for progress output."""
    head = f"{row['model']} M={row['M']} {row['path']}"
    if row["status"] != "ok":
        return f"{head}: {row['status'].upper()} {row.get('note') or row.get('check') or ''}"
    extra = f", {row['pct_roofline']:.0f}% of roofline" if "pct_roofline" in row else ""
    return f"{head}: {row['us']:.1f} us [{row['p20_us']:.1f}-{row['p80_us']:.1f}] ({row['mode']}){extra}"


# ----------------------------------------------------------------------------- plot


def write_png(report: dict, path: str | Path) -> Path:
    """Time per M for each backend and peer, one panel per layer, with the roofline floor drawn."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("writing the PNG plot needs matplotlib (pip install matplotlib, or moe_fp4's 'test' "
                           "extra); pass --no-plot to skip it") from None
    models = list(report["models"])
    fig = Figure(figsize=(6 * len(models), 5), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        cases = [c for c in report["cases"] if c["model"] == model]
        ax.plot([c["M"] for c in cases], [c["floor_us"] for c in cases], "k:", lw=2, label="roofline floor")
        for p in _paths(report, model, ("backend", "peer")):
            pts = [(r["M"], r["us"]) for r in _rows_of(report, model, path=p) if r["status"] == "ok"]
            if pts:
                kind = _rows_of(report, model, path=p)[0]["kind"]
                style, label = ("o-", p) if kind == "backend" else ("s--", f"{p} (peer)")
                ax.plot(*zip(*pts), style, label=label)
        info = report["models"][model]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([c["M"] for c in cases], [str(c["M"]) for c in cases])
        ax.set(xlabel="tokens M", ylabel="µs per forward (median)",
               title=f"{model}\nE={info['E']}, top-{info['topk']}, H={info['H']}, I={info['I']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    meta = report["meta"]
    fig.suptitle(f"moe_fp4 MoE forward: {meta.get('gpu') or 'no GPU'}, {meta['date'][:10]}, "
                 f"commit {str(meta.get('commit'))[:12]}", fontsize="medium")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def write_all(report: dict, out_dir: str | Path, stem: str, plot: bool = True) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with ``plot``) ``<stem>.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(report, out / f"{stem}.json")]
    md = out / f"{stem}.md"
    md.write_text(render_markdown(report))
    written.append(md)
    if plot:
        written.append(write_png(report, out / f"{stem}.png"))
    return written
