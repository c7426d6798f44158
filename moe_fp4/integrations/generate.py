"""Greedy generation from an NVFP4 MoE checkpoint folder, the experts in moe_fp4.

    moe-fp4 generate PATH --prompt TEXT [--max-new-tokens N] [--backend B] [--device D]

loads the model with :func:`moe_fp4.integrations.transformers.load_model`, encodes the
prompt with the checkpoint's tokenizer, generates greedily and prints the continuation and
the decode speed. Needs transformers (``pip install 'moe_fp4[transformers]'``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

__all__ = ["add_arguments", "main", "run", "run_cli"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run(
    path: str | os.PathLike,
    prompt: str,
    max_new_tokens: int = 32,
    backend: str = "auto",
    device: torch.device | str | None = None,
) -> tuple[str, float]:
    """Greedy continuation of ``prompt`` by the checkpoint at ``path``: ``(text, tokens_per_s)``.

    ``text`` is the decoded new tokens only (special tokens skipped); ``tokens_per_s`` is the
    number of new tokens over the wall time of ``model.generate`` (prefill included). Generation
    stops after ``max_new_tokens`` or at the end-of-sequence token.
    """
    from .transformers import _transformers, load_model

    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt: expected a non-empty str, got {prompt!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    dev = torch.device(device if device is not None else _default_device())
    tf = _transformers()
    model = load_model(path, device=dev, backend=backend)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    enc = tokenizer(prompt, return_tensors="pt").to(dev)
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    pad = gen.pad_token_id if gen.pad_token_id is not None else (tokenizer.pad_token_id or eos)
    n_in = enc["input_ids"].shape[1]
    _sync(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             eos_token_id=eos, pad_token_id=pad)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    new = out[0, n_in:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    return text, new.numel() / elapsed if elapsed > 0 else float("inf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``moe-fp4 generate`` arguments."""
    parser.add_argument("path", help="checkpoint folder (compressed-tensors or ModelOpt NVFP4, with a tokenizer)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--backend", default="auto", help="auto (default), cutlass, triton or reference")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``moe-fp4 generate`` for parsed ``args``: print the continuation and the speed; exit status
    (2, with the install command, when transformers is missing)."""
    try:
        text, tps = run(args.path, args.prompt, args.max_new_tokens, args.backend, args.device)
    except ImportError as exc:
        print(f"moe-fp4 generate: {exc}", file=sys.stderr)
        return 2
    print(text)
    print(f"{tps:.2f} tokens/s (greedy, backend {args.backend}, device {args.device or _default_device()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``moe-fp4 generate`` as a standalone entry point (``python -m moe_fp4.integrations.generate``)."""
    parser = argparse.ArgumentParser(prog="moe-fp4 generate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"moe-fp4 generate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
