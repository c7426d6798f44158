"""``moe-fp4 bench``: time fused_moe per backend, its stages and the peers, against the roofline.

Plugged into :mod:`moe_fp4.cli`, which imports this module to build its parser, so the
top-level imports stay light (argparse only); the engine is imported when the command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from .shapes import DEFAULT_TOKENS, MODELS, ModelShape, parse_shape

__all__ = ["add_arguments", "run", "parse_tokens", "parse_names", "resolve_models", "have_matplotlib"]


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` to ``(1, 4, 16)``: positive integers, no repeats."""
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,16,256, got {text!r}") from None
    if any(t < 1 for t in tokens) or len(set(tokens)) != len(tokens):
        raise argparse.ArgumentTypeError(f"expected distinct positive token counts, got {text!r}")
    return tokens


def parse_names(text: str) -> tuple[str, ...]:
    """``"triton,cutlass"`` to ``("triton", "cutlass")`` (checked against the registry when the command runs)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated backend names, got {text!r}")
    return names


def _positive(kind: type):
    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v

    return convert


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Check, then time (CUDA-graph replays, cold L2, median and p20/p80) moe_fp4's fused_moe per backend and each "
        "stage of its pipeline, beside vLLM's Marlin NVFP4 MoE and a bf16 torch._grouped_mm MoE on the same tensors, "
        "against the roofline measured on the same GPU. Writes <gpu>-<date>.{json,md,png} into --out. With --ep N, "
        "instead: expert parallelism over N ranks (ep_fused_moe's dispatch, local experts and combine per M, against "
        "fused_moe on one GPU), written to <gpu>-ep<N>-<date>.{json,md}."
    )
    p.add_argument("--model", action="append", choices=[*MODELS, "all"], default=None,
                   help="layer to run (repeatable; default: all three)")
    p.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="E,TOPK,H,I",
                   help="an extra custom layer (repeatable); with --shape and no --model only the custom layers run")
    p.add_argument("--backends", type=parse_names, default=None, metavar="LIST",
                   help="comma-separated moe_fp4 backends (default: every one but reference; those that cannot run "
                        "here are reported as n/a)")
    p.add_argument("--tokens", type=parse_tokens, default=DEFAULT_TOKENS, metavar="LIST",
                   help=f"comma-separated token counts M (default: {','.join(map(str, DEFAULT_TOKENS))}); with --ep: "
                        "tokens per rank")
    p.add_argument("--no-stages", action="store_true", help="time only the whole forwards, not each stage")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the eager host overhead (wall time of a synchronized call minus GPU time) at M = 1, 64")
    p.add_argument("--peer-lib", default=None, metavar="FILE",
                   help="vLLM 0.26.0 _moe_C library (.so or .so.xz) from the peer kit's prepare_marlin.sh: enables "
                        "the Marlin peer")
    p.add_argument("--peer-kit", default=None, metavar="DIR",
                   help="folder holding the peer kit's marlin_moe.py (default: the folder of --peer-lib)")
    p.add_argument("--out", default=".", metavar="DIR", help="folder for the JSON, Markdown and PNG (default: .)")
    p.add_argument("--name", default=None, metavar="STEM",
                   help="file name stem (default: <gpu>-<date>; with --ep: <gpu>-ep<N>-<date>)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG (no matplotlib needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, activations and routing")
    p.add_argument("--check-tokens", type=_positive(int), default=256, metavar="N",
                   help="tokens per M whose outputs are checked against the references (default 256)")
    p.add_argument("--budget-ms", type=_positive(float), default=250.0, metavar="MS",
                   help="timing budget per path and M; reps stay within 10..200 (default 250)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default) or cuda:N; cpu only checks the plumbing with the host clock")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD, if there is a .git)")
    p.add_argument("--render", default=None, metavar="FILE.json",
                   help="rewrite the Markdown and PNG of an earlier run's JSON into --out (no GPU needed)")
    p.add_argument("--ep", type=_positive(int), default=None, metavar="N",
                   help="expert parallelism instead of the normal benchmark: N ranks (NCCL, one GPU each, GPUs 0..N-1, "
                        "NCCL_NVLS_ENABLE=0; --device cpu: N gloo processes, plumbing only) each hold 1/N of the "
                        "experts; per M (tokens per rank) times ep_fused_moe and its dispatch, local experts and "
                        "combine, max over ranks, against fused_moe on one GPU. Uses --model/--shape, --tokens, "
                        "--backends, --budget-ms, --seed, --device, --out, --name, --commit; ignores the rest")
    p.add_argument("--ep-mode", choices=("all_to_all", "all_reduce", "both"), default=None,
                   help="with --ep: all_to_all (data-parallel tokens), all_reduce (replicated tokens) or both "
                        "(default)")


def resolve_models(names: list[str] | None, shapes: list[ModelShape]) -> tuple[ModelShape, ...]:
    """``--model`` names (``all`` or none given: the three layers, unless ``--shape`` was given) plus custom shapes."""
    if names is None:
        names = [] if shapes else ["all"]
    chosen = list(MODELS) if "all" in names else list(dict.fromkeys(names))
    return tuple(MODELS[n] for n in chosen) + tuple(shapes)


def have_matplotlib() -> bool:
    """Whether the PNG can be written here (matplotlib is an optional dependency)."""
    return importlib.util.find_spec("matplotlib") is not None


class _TextProgress:
    """The progress bar's plain stand-in where tqdm is not installed: one ``[k/N]`` line per case."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def write(self, text: str) -> None:
        print(text, flush=True)

    def update(self, n: int) -> None:
        self.done += n
        print(f"[{self.done}/{self.total} cases, {time.perf_counter() - self.t0:.0f} s]", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int):
    """A tqdm bar over the (layer, M) cases, or :class:`_TextProgress` without tqdm (an optional dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextProgress(total)
    return tqdm(total=total, unit="case", desc="moe-fp4 bench", file=sys.stderr, dynamic_ncols=True)


def _render(args: argparse.Namespace) -> int:
    from .report import load_json, render_markdown, terminal_summary, write_png

    report = load_json(args.render)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or Path(args.render).stem
    (out / f"{stem}.md").write_text(render_markdown(report))
    written = [out / f"{stem}.md"]
    if not args.no_plot:
        written.append(write_png(report, out / f"{stem}.png"))
    print(terminal_summary(report))
    print("wrote " + ", ".join(map(str, written)))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.ep_mode is not None and args.ep is None:
        raise ValueError("--ep-mode: only with --ep N")
    if args.ep is not None and args.render:
        raise ValueError("--ep: not with --render (an --ep run writes its Markdown itself)")
    if args.render:
        return _render(args)
    if args.ep is not None:
        from .ep import run_cli

        return run_cli(args)
    import torch

    from ..backends.registry import BACKENDS
    from .engine import BenchConfig, default_backends, environment, file_stem, run_bench
    from .peers import PeerConfig
    from .report import format_row, terminal_summary, write_all
    from .timing import GpuTimer, WallTimer, measure_ceilings

    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: expected a visible CUDA GPU for timing, found none (--device cpu only checks "
                         "the plumbing)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backends = args.backends or default_backends()
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"--backends: expected names from {list(BACKENDS)}, got {unknown}")
    if args.peer_lib and not Path(args.peer_lib).is_file():
        raise ValueError(f"--peer-lib: expected the Marlin op library file, {args.peer_lib} does not exist")
    config = BenchConfig(
        models=resolve_models(args.model, args.shape), tokens=tuple(args.tokens), backends=tuple(backends),
        device=device, stages=not args.no_stages, peers=PeerConfig.from_args(args.peer_kit, args.peer_lib),
        seed=args.seed, check_tokens=args.check_tokens, overhead=not args.no_overhead)
    meta = environment(device, args.commit)
    stem = args.name or file_stem(meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if device.type == "cuda":
        torch.cuda.set_device(device)
        timer = GpuTimer(device, budget_s=args.budget_ms / 1e3)
        ceilings, how = measure_ceilings(timer, device)
    else:
        timer = WallTimer()
        ceilings, how = measure_ceilings(timer, device, copy_bytes=8 << 20, matmul_n=128)
    print(f"ceilings: read {ceilings.read_tbps:.3f} TB/s (copy {ceilings.copy_tbps:.3f}, stream "
          f"{ceilings.stream_tbps:.3f}), bf16 matmul {ceilings.bf16_tflops:.1f} TFLOP/s", file=sys.stderr)

    bar = _progress(len(config.models) * len(config.tokens))
    partial: dict = {}

    def on_case(report: dict) -> None:
        partial["report"] = report
        write_all(report, out, stem, plot=False)  # a CUDA error or a time limit ends the run: keep what is done
        bar.update(1)

    try:
        report = run_bench(config, timer, ceilings, meta=meta, ceilings_method=how,
                           on_row=lambda row: bar.write(format_row(row)), on_case=on_case)
    except BaseException as exc:
        if "report" in partial:
            partial["report"]["notes"].append(f"run stopped early: {type(exc).__name__}: {exc}")
            write_all(partial["report"], out, stem, plot=False)
            print(f"partial results in {out / stem}.{{json,md}}", file=sys.stderr)
        raise
    finally:
        bar.close()
    plot = not args.no_plot and have_matplotlib()
    if not args.no_plot and not plot:
        print(f"matplotlib is not installed here, so no PNG: run `moe-fp4 bench --render {out / stem}.json --out DIR` "
              "where it is", file=sys.stderr)
    written = write_all(report, out, stem, plot=plot)
    print(terminal_summary(report))
    print("wrote " + ", ".join(map(str, written)))
    bad = [r for r in report["rows"] if r["status"] in ("failed", "error")]
    if bad:
        print(f"{len(bad)} rows failed their check or raised (see the report)", file=sys.stderr)
    return 1 if bad else 0
