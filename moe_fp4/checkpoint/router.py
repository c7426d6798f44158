"""The router of a Qwen3-MoE block: ``mlp.gate.weight`` logits, softmax, top-k, optional renormalisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_tensor

__all__ = ["Router", "route"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_top_k(top_k: object, num_experts: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an integer in [1, {num_experts}] (the number of experts), got {top_k!r}")


def route(
    hidden_states: torch.Tensor, gate_weight: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing of ``hidden_states [M, H]`` with ``gate_weight [E, H]``.

    1. ``logits = hidden_states @ gate_weight.T`` in the hidden-state dtype (the model's
       bf16 ``nn.Linear``: fp32 accumulation, rounded to bf16);
    2. ``p = softmax(float32(logits))`` over the E experts;
    3. the ``top_k`` largest ``p`` (ties: torch.topk's order);
    4. with ``renormalize`` (the config's ``norm_topk_prob``) the k weights are divided by
       their sum, in float32.

    Returns ``(topk_weights float32 [M, top_k], topk_ids int32 [M, top_k])``, as
    :func:`moe_fp4.fused_moe` takes them. The weights stay float32 (as vLLM's ``fused_topk``
    keeps them) rather than being rounded to the hidden-state dtype.
    """
    check_tensor("hidden_states", hidden_states, dtypes=_DTYPES, ndim=2)
    check_tensor("gate_weight", gate_weight, dtypes=_DTYPES, ndim=2, device=hidden_states.device)
    E, H = gate_weight.shape
    if hidden_states.shape[1] != H:
        raise ValueError(
            f"hidden_states: expected shape [M, {H}] (the router's hidden size), got {list(hidden_states.shape)}"
        )
    _check_top_k(top_k, E)
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    logits = torch.nn.functional.linear(hidden_states, gate_weight.to(hidden_states.dtype))
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


@dataclass(frozen=True)
class Router:
    """A Qwen3-MoE router: ``gate_weight [E, H]`` (``mlp.gate.weight``), ``top_k``, ``renormalize``.

    Calling it on ``hidden_states [M, H]`` gives :func:`route`'s ``(topk_weights, topk_ids)``.
    """

    gate_weight: torch.Tensor
    top_k: int
    renormalize: bool

    def __post_init__(self) -> None:
        check_tensor("gate_weight", self.gate_weight, dtypes=_DTYPES, ndim=2)
        _check_top_k(self.top_k, self.gate_weight.shape[0])

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(hidden_states, self.gate_weight, self.top_k, renormalize=self.renormalize)
