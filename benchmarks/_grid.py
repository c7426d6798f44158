"""The parameter grid of the suite: every layer, every M, ids such as ``qwen3-30b-a3b-M64-triton``."""

from __future__ import annotations

from moe_fp4.bench.shapes import DEFAULT_TOKENS, MODELS


def grid(names: tuple[str, ...]) -> tuple[list[tuple[str, int, str]], list[str]]:
    """``(params, ids)`` over layers, then M, then ``names`` (so each layer is built once per file)."""
    params = [(model, M, name) for model in MODELS for M in DEFAULT_TOKENS for name in names]
    return params, [f"{model}-M{M}-{name.replace('/', '.')}" for model, M, name in params]
