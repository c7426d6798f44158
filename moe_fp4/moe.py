"""``fused_moe``: the one public MoE forward, validated once and dispatched to a backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_tensor
from .backends.registry import get_backend_module, select_backend
from .experts import NvFp4Experts

__all__ = ["MoEProblem", "fused_moe"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MoEProblem:
    """One validated ``fused_moe`` call, as every backend receives it.

    hidden_states: bf16/fp16 ``[M, H]``, contiguous, ``M >= 1``.
    experts:       the layer's :class:`NvFp4Experts`, on the same device.
    topk_weights:  float32 ``[M, topk]``, contiguous.
    topk_ids:      int32 ``[M, topk]``, contiguous. ``-1`` means "not served here". Ids
                   outside ``[-1, E)`` were rejected when the call validated them; with
                   validation skipped, backends must treat them as ``-1`` and never index
                   memory with them.
    apply_router_weight_on_input: see :func:`fused_moe`.
    out:           optional preallocated ``[M, H]`` output in the hidden-state dtype.
    """

    hidden_states: torch.Tensor
    experts: NvFp4Experts
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    apply_router_weight_on_input: bool
    out: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_ids.shape[1]

    def output(self) -> torch.Tensor:
        """The tensor to write the result into (``out`` or a new one)."""
        if self.out is not None:
            return self.out
        return torch.empty_like(self.hidden_states)


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_values(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, id_limit: int,
                  expert_map: torch.Tensor | None, num_local: int) -> None:
    """Data-dependent checks (one host synchronization on CUDA)."""
    parts = [
        topk_ids.min() if topk_ids.numel() else torch.tensor(0, device=x.device),
        topk_ids.max() if topk_ids.numel() else torch.tensor(0, device=x.device),
        (~torch.isfinite(x)).any().long(),
        (~torch.isfinite(topk_weights)).any().long(),
    ]
    if expert_map is not None:
        parts += [expert_map.min(), expert_map.max()]
    vals = torch.stack([p.long() for p in parts]).tolist()
    lo, hi, x_bad, w_bad = vals[:4]
    if lo < -1 or hi >= id_limit:
        raise ValueError(f"topk_ids: expected expert ids in [-1, {id_limit}) (-1 = not served here), got values in [{lo}, {hi}]")
    if x_bad:
        raise ValueError("hidden_states: expected finite values, got inf or nan")
    if w_bad:
        raise ValueError("topk_weights: expected finite values, got inf or nan")
    if expert_map is not None:
        mlo, mhi = vals[4:]
        if mlo < -1 or mhi >= num_local:
            raise ValueError(
                f"expert_map: expected local expert ids in [-1, {num_local}) (-1 = not on this rank), got values in [{mlo}, {mhi}]"
            )


def fused_moe(
    hidden_states: torch.Tensor,
    experts: NvFp4Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str = "auto",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """NVFP4 (W4A4) Mixture-of-Experts forward.

    Computes, with ``E = experts.num_experts`` and ``I`` the intermediate size::

        out = zeros(M, H, float32)
        for t in range(M):
            for j in range(topk):                      # in slot order
                e = topk_ids[t, j]
                if e == -1: continue                   # not served here: contributes 0
                x = hidden_states[t]
                if apply_router_weight_on_input:
                    x = dtype(float32(x) * topk_weights[t, j])
                a = quantize_nvfp4(x, experts.a13_gs[e])                        # format core
                h = dtype(alpha13[e] * (a @ w13[e].T))  # fp32 accumulation; alpha per half
                act = dtype(dtype(silu(float32(h[:I]))) * h[I:])
                b = quantize_nvfp4(act, experts.a2_gs[e])
                y = dtype(alpha2[e] * (b @ w2[e].T))    # fp32 accumulation
                out[t] += y if apply_router_weight_on_input else topk_weights[t, j] * y
        return dtype(out)

    where ``alpha13[e, h] = 1 / (a13_gs[e] * w13_gs[e, h])`` (h = gate, up) and
    ``alpha2[e] = 1 / (a2_gs[e] * w2_gs[e])``, and the products ``a @ w.T`` use the
    block-scaled values ``e2m1 * scale`` (exact) so that the global scales enter once.

    Args:
        hidden_states: bf16 or fp16 ``[M, H]``, contiguous. The result has this dtype.
        experts: the layer's :class:`~moe_fp4.NvFp4Experts` (same device).
        topk_weights: ``[M, topk]`` router weights (float32 preferred; 16-bit is upcast).
        topk_ids: int32/int64 ``[M, topk]`` expert ids in ``[-1, E)``; ``-1`` contributes
            nothing (expert parallelism: the expert lives elsewhere).
        backend: ``"auto"``, ``"cutlass"``, ``"triton"`` or ``"reference"``. ``"auto"``
            picks by compute capability (see :func:`moe_fp4.explain_backend`); a named
            backend that cannot run raises :class:`~moe_fp4.BackendUnavailableError`.
        apply_router_weight_on_input: scale each routed row by its weight before
            quantization, then sum without weights (any topk).
        expert_map: optional int ``[E_global]`` map from global to local expert ids
            (``-1`` = not on this rank); ``topk_ids`` are then global ids.
        out: optional preallocated ``[M, H]`` result.
        validate: check data-dependent preconditions (ids in range, finite inputs), which
            costs one host synchronization on CUDA. Skipped automatically while a CUDA
            graph is being captured. With ``validate=False`` no call synchronizes with
            the host; ids outside ``[-1, E)`` are then treated as ``-1`` (never read
            out of bounds) and non-finite inputs give non-finite rows.

    Returns:
        ``[M, H]`` in the dtype of ``hidden_states``.
    """
    if not isinstance(experts, NvFp4Experts):
        raise TypeError(f"experts: expected an NvFp4Experts, got {type(experts).__name__}")
    dev = experts.device
    E, H = experts.num_experts, experts.hidden_size
    check_tensor("hidden_states", hidden_states, dtypes=_HIDDEN_DTYPES, ndim=2, device=dev, contiguous=True)
    M = hidden_states.shape[0]
    if hidden_states.shape[1] != H:
        raise ValueError(f"hidden_states: expected shape [M, {H}] (the experts' hidden size), got {list(hidden_states.shape)}")
    check_tensor("topk_ids", topk_ids, dtypes=_ID_DTYPES, ndim=2, device=dev)
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected shape [{M}, topk] (M from hidden_states), got {list(topk_ids.shape)}")
    if topk < 1:
        raise ValueError(f"topk_ids: expected at least one slot per token, got shape {list(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=_WEIGHT_DTYPES, shape=(M, topk), device=dev)
    if not isinstance(apply_router_weight_on_input, bool):
        raise TypeError(f"apply_router_weight_on_input: expected a bool, got {type(apply_router_weight_on_input).__name__}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    id_limit = E
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=_ID_DTYPES, ndim=1, device=dev)
        id_limit = expert_map.shape[0]
    if topk > id_limit:
        raise ValueError(f"topk_ids: expected topk <= the number of experts ({id_limit}), got topk = {topk}")
    if out is not None:
        check_tensor("out", out, dtypes=(hidden_states.dtype,), shape=(M, H), device=dev, contiguous=True)

    name = select_backend(backend, dev, hidden_states.dtype)
    if M == 0:
        return out if out is not None else hidden_states.new_empty((0, H))
    if validate and not _is_capturing(dev):
        _check_values(hidden_states, topk_weights, topk_ids, id_limit, expert_map, E)

    ids = topk_ids
    if expert_map is not None:
        safe = ids.clamp(0, id_limit - 1).long()
        ids = torch.where((ids >= 0) & (ids < id_limit), expert_map[safe], -1)
    problem = MoEProblem(
        hidden_states=hidden_states,
        experts=experts,
        topk_weights=topk_weights.to(torch.float32).contiguous(),
        topk_ids=ids.to(torch.int32).contiguous(),
        apply_router_weight_on_input=apply_router_weight_on_input,
        out=out,
    )
    return get_backend_module(name).fused_moe(problem)
