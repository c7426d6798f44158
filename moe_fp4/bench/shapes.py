"""The MoE layers and token counts the benchmark runs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape", "MODELS", "DEFAULT_TOKENS", "parse_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The routed experts of one MoE layer (no shared expert), bf16 activations.

    name: the ``--model`` key; E experts, ``topk`` experts per token, H hidden, I expert
    intermediate size (w13 is ``[E, 2I, H]``, w2 ``[E, H, I]``).
    """

    name: str
    E: int
    topk: int
    H: int
    I: int  # the intermediate size, as the MoE literature names it

    def __post_init__(self) -> None:
        for field in ("E", "topk", "H", "I"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{field}: expected a positive int, got {v!r}")
        if self.topk > self.E:
            raise ValueError(f"topk: expected at most E={self.E} experts per token, got {self.topk}")
        for field in ("H", "I"):
            if getattr(self, field) % 64:
                raise ValueError(f"{field}: expected a multiple of 64 (NVFP4 blocks of 16, scale columns of 4), "
                                 f"got {getattr(self, field)}")

    @property
    def weights_per_expert(self) -> int:
        """Weights of one expert: w13 (2I x H) plus w2 (H x I)."""
        return 3 * self.H * self.I


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("qwen3-30b-a3b", E=128, topk=8, H=2048, I=768),
        ModelShape("llama4-scout", E=16, topk=1, H=5120, I=8192),
        ModelShape("deepseek-v3", E=256, topk=8, H=7168, I=2048),
    )
}

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


def parse_shape(text: str) -> ModelShape:
    """``"E,TOPK,H,I"`` (e.g. ``"64,4,1024,512"``) to a custom :class:`ModelShape`."""
    parts = text.split(",")
    try:
        E, topk, H, I = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shape: expected four integers E,TOPK,H,I such as 64,4,1024,512, got {text!r}") from None
    return ModelShape(f"custom-E{E}-top{topk}-H{H}-I{I}", E=E, topk=topk, H=H, I=I)
