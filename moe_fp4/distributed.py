"""Expert parallelism over ``torch.distributed``: shard a layer's experts, run the MoE across ranks.

Sharding (no communication)::

    local, expert_map = shard_experts(experts, rank, world_size)                 # from loaded experts
    local, expert_map = load_expert_shard(path, layer, rank, world_size)         # reads only this rank's experts
    table = expert_maps(num_experts, world_size)        # every rank's expert_map, [world_size, E]

``expert_map`` is int32 ``[E_global]``: global id -> local id on this rank, ``-1`` where the
expert lives on another rank (vLLM's and SGLang's convention, and ``fused_moe``'s).

The forward, :func:`ep_fused_moe`, in two modes:

* ``"all_reduce"``: the tokens are replicated (identical on every rank). Each rank runs
  ``fused_moe(..., expert_map=...)`` on its experts and the float32 partials are summed with
  one ``all_reduce``. Not bitwise equal to one process: see :func:`ep_fused_moe` for the bound.
* ``"all_to_all"``: the tokens are data-parallel (each rank has its own). Each (token, slot)
  row goes to the rank owning its expert, runs there as a top-1 row, comes back, and the
  top-k slots are reduced on the token's rank in slot order in float32, rounded once: with
  the reference backend the result is **bitwise equal** to single-process ``fused_moe`` on
  the whole layer over all ranks' tokens.

``"all_to_all"`` is composed of three phase functions, ``_dispatch`` (the row-count exchange,
then the rows), ``_local_experts`` and ``_combine_back`` (the outputs back, then the slot-order
reduce); ``"all_reduce"`` of ``fused_moe`` with the ``expert_map`` and ``_reduce_partials``.
They take :func:`ep_fused_moe`'s checked, normalized arguments and check nothing themselves;
``moe-fp4 bench --ep`` (:mod:`moe_fp4.bench.ep`) times them one by one.

Both modes are collective: every rank of ``group`` calls with the same ``mode``, topk,
hidden size, dtype, ``apply_router_weight_on_input`` and ``validate`` (``"all_reduce"``: the
same tokens, too). Argument errors found locally (types, shapes) raise on the rank that sees
them before any communication; the data-dependent checks (ids in range, finite inputs,
expert maps) travel with the row-count exchange (``"all_to_all"``) or in the ``all_reduce``
buffer (``"all_reduce"``), so that bad inputs on any rank
raise ``ValueError`` on every rank and no rank is left waiting.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors import safe_open

from ._checks import check_tensor
from .backends.registry import check_precision, resolve_backend
from .checkpoint.loader import Checkpoint, _Linear
from .experts import NvFp4Experts
from .moe import fused_moe

__all__ = ["ep_fused_moe", "expert_maps", "free_port", "init_local_group", "load_expert_shard", "shard_experts"]

_MODES = ("all_to_all", "all_reduce")
_ID_DTYPES = (torch.int32, torch.int64)
_HIDDEN_DTYPES = (torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Placement = Sequence[Sequence[int]] | torch.Tensor


# --------------------------------------------------------------------------- placement


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        want = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}: expected an int {want}, got {value}")
    return value


def _placement(num_experts: int, world_size: int, placement: Placement | None) -> list[list[int]]:
    """The global expert ids of each rank, in local order (local id i = position i)."""
    E, W = num_experts, world_size
    if placement is None:
        if W > E:
            raise ValueError(f"world_size: expected at most {E} ranks (the layer's experts; every rank needs "
                             f"at least one), got {W}")
        q, rem = divmod(E, W)
        start = [r * q + min(r, rem) for r in range(W + 1)]
        return [list(range(start[r], start[r + 1])) for r in range(W)]
    if isinstance(placement, torch.Tensor):
        if placement.dtype.is_floating_point or placement.dtype.is_complex or placement.dtype == torch.bool:
            raise TypeError(f"placement: expected an integer tensor of owner ranks, got dtype {placement.dtype}")
        if tuple(placement.shape) != (E,):
            raise ValueError(f"placement: expected an owner-rank tensor of shape [{E}], got {list(placement.shape)}")
        owners = placement.tolist()
        bad = sorted({o for o in owners if not 0 <= o < W})
        if bad:
            raise ValueError(f"placement: expected owner ranks in [0, {W}), got {bad[:8]}")
        lists = [[e for e, o in enumerate(owners) if o == r] for r in range(W)]
    elif isinstance(placement, Sequence) and not isinstance(placement, (str, bytes)):
        if len(placement) != W:
            raise ValueError(f"placement: expected one list of global expert ids per rank ({W}), got {len(placement)}")
        lists = []
        for r, ids in enumerate(placement):
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            if not isinstance(ids, Sequence) or not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
                raise TypeError(f"placement[{r}]: expected a sequence of int global expert ids, got {ids!r}")
            lists.append(list(ids))
        count = Counter(e for ids in lists for e in ids)
        outside = sorted(e for e in count if not 0 <= e < E)
        twice = sorted(e for e, n in count.items() if n > 1)
        missing = sorted(set(range(E)) - set(count))
        got = [f"{what} {ids[:8]}" for what, ids in (("out of range", outside), ("placed twice", twice),
                                                       ("unplaced", missing)) if ids]
        if got:
            raise ValueError(f"placement: expected every expert id in [0, {E}) exactly once over the ranks, "
                             f"got {', '.join(got)}")
    else:
        raise TypeError("placement: expected None, a list of global expert ids per rank or an int tensor "
                        f"[E] of owner ranks, got {type(placement).__name__}")
    empty = [r for r, ids in enumerate(lists) if not ids]
    if empty:
        raise ValueError(f"placement: rank(s) {empty} own no expert; every rank needs at least one")
    return lists


def _local_map(ids: list[int], num_experts: int, device: torch.device | str) -> torch.Tensor:
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[ids] = torch.arange(len(ids), dtype=torch.int32)
    return m.to(device)


def expert_maps(num_experts: int, world_size: int, placement: Placement | None = None) -> torch.Tensor:
    """int32 ``[world_size, num_experts]`` on the CPU: row ``r`` is rank ``r``'s ``expert_map``.

    ``placement`` as for :func:`shard_experts`. Passed as ``expert_map`` to
    :func:`ep_fused_moe` (moved to the device), it spares ``"all_to_all"`` its per-call
    ``all_gather`` of the ranks' maps.
    """
    E = _int("num_experts", num_experts, 1)
    lists = _placement(E, _int("world_size", world_size, 1), placement)
    return torch.stack([_local_map(ids, E, "cpu") for ids in lists])


def shard_experts(
    experts: NvFp4Experts, rank: int, world_size: int, placement: Placement | None = None
) -> tuple[NvFp4Experts, torch.Tensor]:
    """This rank's experts of a layer and its ``expert_map``.

    Args:
        experts: the whole layer (``E`` experts).
        rank, world_size: this rank and the number of ranks sharing the layer.
        placement: which rank holds which experts:

            * ``None``: contiguous blocks, vLLM's rule: with ``q, r = divmod(E, world_size)``
              the first ``r`` ranks hold ``q + 1`` experts, the others ``q``; rank ``k``'s
              block starts at ``k * q + min(k, r)``. Needs ``world_size <= E``.
            * a list of ``world_size`` lists of global expert ids: rank ``k`` holds
              ``placement[k]``, local id ``i`` being ``placement[k][i]``; every expert exactly once.
            * an int tensor ``[E]`` of owner ranks: rank ``k`` holds the experts with owner
              ``k`` in ascending global order.

            Every rank must hold at least one expert (an :class:`NvFp4Experts` has ``E >= 1``);
            replicated (redundant) experts are not supported.

    Returns:
        ``(local_experts, expert_map)``: an :class:`NvFp4Experts` of this rank's experts (copies,
        on ``experts.device``) and int32 ``[E]`` on that device, the local id of each global
        expert or ``-1``.
    """
    if not isinstance(experts, NvFp4Experts):
        raise TypeError(f"experts: expected an NvFp4Experts, got {type(experts).__name__}")
    W = _int("world_size", world_size, 1)
    rank = _int("rank", rank, 0, W)
    ids = _placement(experts.num_experts, W, placement)[rank]
    idx = torch.tensor(ids, dtype=torch.long, device=experts.device)
    # Canonical weights without keeping a restored copy on a re-laid-out source (index_select copies).
    fields = {**experts._canonical_tensors(hand_out=False), "w13_gs": experts.w13_gs, "w2_gs": experts.w2_gs,
              "a13_gs": experts.a13_gs, "a2_gs": experts.a2_gs}
    local = NvFp4Experts(**{k: fields[k].index_select(0, idx) for k in NvFp4Experts._fields()}, own=True)
    return local, _local_map(ids, experts.num_experts, experts.device)


# --------------------------------------------------------------------------- checkpoint shards


def _runs(ids: list[int]) -> Iterator[tuple[int, int]]:
    """``[begin, end)`` runs of consecutive ids, in the order of ``ids``."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield ids[start], ids[i - 1] + 1
            start = i


class _RowStore:
    """A checkpoint's ``TensorStore`` that reads only the expert rows ``rows[name]`` of some tensors.

    The headers (``info``) stay those of the file, so the loader's shape checks see the
    whole tensor; ``get`` returns the selected rows of the leading (expert) dimension, read
    from the file slice by slice.
    """

    def __init__(self, store, rows: dict[str, list[int]]) -> None:
        self._store, self._rows = store, rows

    def __contains__(self, name: str) -> bool:
        return name in self._store

    def names(self) -> list[str]:
        return self._store.names()

    def info(self, name: str):
        return self._store.info(name)

    def get(self, name: str) -> torch.Tensor:
        ids = self._rows.get(name)
        if ids is None:
            return self._store.get(name)
        with safe_open(self._store.info(name).file, framework="pt") as f:
            rows = f.get_slice(name)
            return torch.cat([rows[a:b] for a, b in _runs(ids)])


def _read_selected_experts(ckpt: Checkpoint, base: str, ids: list[int]) -> dict[str, _Linear]:
    """The per-expert tensors of experts ``ids`` only, each checked as ``Checkpoint.load_experts`` checks it."""
    H, I = ckpt.moe.hidden_size, ckpt.moe.intermediate_size
    out = {}
    for proj, packed_shape in (("gate_proj", (I, H // 2)), ("up_proj", (I, H // 2)), ("down_proj", (H, I // 2))):
        modules = [f"{base}.{e}.{proj}" for e in ids]
        per = [ckpt._read_linear(m, ckpt.format.tensor_names(m), packed_shape, ((), (1,)), 1) for m in modules]
        packed, scale, wgs, igs = zip(*((q.packed, q.scale, q.weight_gs, q.input_gs) for q in per))
        out[proj] = _Linear(torch.stack(packed), torch.stack(scale), torch.cat(wgs), torch.cat(igs))
    return out


def _read_selected_fused(view: Checkpoint, base: str, ids: list[int]) -> dict[str, _Linear]:
    """Fused 3-D expert tensors: the packed codes and block scales of experts ``ids`` only."""
    names = [view.format.fused_tensor_names(f"{base}.{p}") for p in ("gate_up_proj", "down_proj")]
    view.store = _RowStore(view.store, {n[role]: ids for n in names for role in ("packed", "block_scale")})
    idx = torch.tensor(ids, dtype=torch.long)
    parts = Checkpoint._read_fused(view, base)
    return {p: dataclasses.replace(q, weight_gs=q.weight_gs[idx], input_gs=q.input_gs[idx]) for p, q in parts.items()}


def load_expert_shard(
    path: str | os.PathLike | Checkpoint,
    layer: int,
    rank: int,
    world_size: int,
    *,
    placement: Placement | None = None,
    device: torch.device | str = "cpu",
) -> tuple[NvFp4Experts, torch.Tensor]:
    """This rank's experts of MoE layer ``layer`` of a checkpoint, reading only their tensors.

    Returns ``(local_experts, expert_map)`` as :func:`shard_experts` does (``placement`` the
    same, over the ``E`` of ``config.json``); the experts follow
    :meth:`Checkpoint.load_experts`'s conventions and checks, tensor for tensor. Per-expert
    layouts read only the selected experts' tensors; fused 3-D layouts read only their rows
    of the codes and block scales (the global scales, ``E`` floats, are read whole).

    One difference from ``shard_experts(load_experts(...))``: whether ``w13_gs`` is ``[E]``
    or ``[E, 2]`` is decided over this rank's experts, so a shard whose experts all have equal
    gate and up scales gets ``[E_local]`` where the whole layer has ``[E, 2]``. The values
    and the forward are the same.

    This uses the loader's per-tensor readers (``Checkpoint._read_linear``/``_read_fused``) on
    a shallow copy of the :class:`Checkpoint`; the loader itself has no selective load.
    """
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    W = _int("world_size", world_size, 1)
    rank = _int("rank", rank, 0, W)
    E = ckpt.moe.num_experts
    ids = _placement(E, W, placement)[rank]
    view = copy.copy(ckpt)  # the original keeps its store and methods
    view._read_per_expert = lambda base, layout: _read_selected_experts(ckpt, base, ids)
    view._read_fused = lambda base: _read_selected_fused(view, base, ids)
    experts = view.load_experts(layer, device)
    return experts, _local_map(ids, E, experts.device)


# --------------------------------------------------------------------------- forward


def _problem_word(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, num_experts: int,
                  local_map: torch.Tensor, num_local: int) -> torch.Tensor:
    """This rank's validation word, int64 0-d, without a host synchronization.

    Bits: 1 topk_ids out of range, 2 hidden_states not finite, 4 topk_weights not finite,
    8 expert_map out of range; the callers add 16: some expert not on exactly one rank.
    """
    flags = torch.stack([
        ((ids < -1) | (ids >= num_experts)).any(),
        ~torch.isfinite(x).all(),
        ~torch.isfinite(w).all(),
        ((local_map < -1) | (local_map >= num_local)).any(),
    ])
    return (flags.long() << torch.arange(4, device=x.device)).sum()


def _raise_problems(words: list[int], rank: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                    num_experts: int, local_map: torch.Tensor, num_local: int,
                    owners: torch.Tensor) -> None:
    """Raise on every rank when any rank's validation word is non-zero: the rank's own error first."""
    bad = [r for r, b in enumerate(words) if b]
    if not bad:
        return
    mine = words[rank]
    if mine & 1:
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
        raise ValueError(f"topk_ids: expected global expert ids in [-1, {num_experts}) (-1 = no expert), "
                         f"got values in [{lo}, {hi}]")
    if mine & 2:
        raise ValueError("hidden_states: expected finite values, got inf or nan")
    if mine & 4:
        raise ValueError("topk_weights: expected finite values, got inf or nan")
    if mine & 8:
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(local_map)).tolist())
        raise ValueError(f"expert_map: expected local expert ids in [-1, {num_local}) (-1 = not on this rank, "
                         f"which holds {num_local} experts), got values in [{lo}, {hi}]")
    if mine & 16:
        owners = owners.tolist()
        none = [e for e, n in enumerate(owners) if n == 0]
        several = [e for e, n in enumerate(owners) if n > 1]
        raise ValueError("expert_map: expected every global expert on exactly one rank of the group, got "
                         f"expert(s) {none[:8]} on none and {several[:8]} on several")
    raise ValueError(f"ep_fused_moe: the inputs of rank(s) {bad} failed validation (the error raised there names "
                     "the argument); the call fails on every rank")


def _combine(slots: torch.Tensor, w: torch.Tensor, apply_router_weight_on_input: bool) -> torch.Tensor:
    """``[M, topk, H]`` expert outputs -> ``[M, H]``: fused_moe's reduce, slot order, float32, rounded once."""
    out = torch.zeros((slots.shape[0], slots.shape[2]), dtype=torch.float32, device=slots.device)
    for j, y in enumerate(slots.unbind(1)):
        out += y.float() if apply_router_weight_on_input else y.float() * w[:, j, None]
    return out.to(slots.dtype)


def _all_reduce(x, experts, w, ids, local_map, num_experts, rank, W, group, backend, on_input, validate, precision):
    y = fused_moe(x, experts, w, ids, backend=backend, apply_router_weight_on_input=on_input,
                  expert_map=local_map, validate=False, precision=precision)
    return _reduce_partials(y, x, w, ids, local_map, num_experts, experts.num_experts, rank, W, group, validate)


def _reduce_partials(y, x, w, ids, local_map, num_experts, num_local, rank, W, group, validate):
    """``"all_reduce"``'s combine: this rank's partial ``y`` summed over the ranks in float32, rounded once.

    With ``validate``, each rank's validation word and each expert's owner count travel in the same buffer.
    """
    M, H = y.shape
    n = M * H
    buf = torch.zeros(n + (W + num_experts if validate else 0), dtype=torch.float32, device=y.device)
    buf[:n] = y.reshape(-1)
    if validate:
        buf[n + rank] = _problem_word(x, w, ids, num_experts, local_map, num_local).float()
        buf[n + W:] = (local_map >= 0).float()
    dist.all_reduce(buf, group=group)
    if validate:
        tail = [int(v) for v in buf[n:].tolist()]
        words = tail[:W]
        if any(c != 1 for c in tail[W:]):
            words = [b | 16 for b in words]
        _raise_problems(words, rank, x, w, ids, num_experts, local_map, num_local, buf[n + W:])
    return buf[:n].view(M, H).to(y.dtype)


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """What ``"all_to_all"``'s dispatch brought to this rank, and how the outputs go back."""

    rows: torch.Tensor  # [R, H] the (token, slot) rows this rank's experts serve, in the senders' rank order
    local_ids: torch.Tensor  # int32 [R, 1] their local expert ids
    weights: torch.Tensor  # float32 [R, 1]: their router weights when applied on the input, else ones
    sel: torch.Tensor  # the flat (token, slot) indices t * topk + j this rank sent, in send order
    send_split: list[int]  # rows sent to each rank
    recv_split: list[int]  # rows received from each rank


def _dispatch(x, w, ids, table, num_experts, num_local, rank, W, group, on_input, validate) -> _Dispatched:
    """``"all_to_all"`` phase 1: the row-count exchange (with the validation words), then the rows."""
    H = x.shape[1]
    topk = ids.shape[1]
    local_map = table[rank]
    owned = table >= 0
    owner = owned.int().argmax(0)  # [E] the rank holding each expert
    local_of = table.gather(0, owner.unsqueeze(0)).squeeze(0)  # [E] its local id there
    flat = ids.reshape(-1)  # (token, slot) rows, t * topk + j
    served = (flat >= 0) & (flat < num_experts)
    # Rows by destination rank (stable: ascending t * topk + j within one), unserved ones last (key W).
    dest = torch.where(served, owner[flat.clamp(0, num_experts - 1)], W)
    dest, order = torch.sort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=W + 1)[:W]

    # Exchange 1: row counts, each with the sender's validation word.
    word = torch.zeros((), dtype=torch.long, device=x.device)
    if validate:
        word = _problem_word(x, w, ids, num_experts, local_map, num_local)
        word = word | ((owned.sum(0) != 1).any().long() << 4)
    meta = torch.stack([send_counts, word.expand(W)], 1)
    recv_meta = torch.empty_like(meta)
    dist.all_to_all_single(recv_meta, meta, group=group)
    host = torch.cat([send_counts, recv_meta.reshape(-1)]).tolist()  # the one host synchronization
    send_split, recv_split, words = host[:W], host[W::2], host[W + 1::2]
    sel = order[: sum(send_split)]
    if validate:
        _raise_problems(words, rank, x, w, ids, num_experts, local_map, num_local, owned.sum(0))

    # Exchange 2: each row with its local expert id (and weight when applied on the input), as bytes.
    payload = [x[sel // topk].view(torch.uint8), local_of[flat[sel]].to(torch.int32).unsqueeze(1).view(torch.uint8)]
    if on_input:
        payload.append(w.reshape(-1)[sel].unsqueeze(1).view(torch.uint8))
    send = torch.cat(payload, 1)
    recv = send.new_empty((sum(recv_split), send.shape[1]))
    dist.all_to_all_single(recv, send, recv_split, send_split, group=group)
    rows = recv[:, : 2 * H].contiguous().view(x.dtype)
    lid = recv[:, 2 * H : 2 * H + 4].contiguous().view(torch.int32)
    ones = torch.ones_like(lid, dtype=torch.float32)
    rw = recv[:, 2 * H + 4 :].contiguous().view(torch.float32) if on_input else ones
    return _Dispatched(rows, lid, rw, sel, send_split, recv_split)


def _local_experts(d: _Dispatched, experts, backend, on_input, precision) -> torch.Tensor:
    """``"all_to_all"`` phase 2: this rank's experts on the rows it received, as top-1 rows."""
    # Top-1 rows with weight 1 return the expert output y exactly (dtype(0 + 1 * y) == y).
    return fused_moe(d.rows, experts, d.weights, d.local_ids, backend=backend, apply_router_weight_on_input=on_input,
                     validate=False, precision=precision)


def _combine_back(d: _Dispatched, y: torch.Tensor, w: torch.Tensor, group, on_input) -> torch.Tensor:
    """``"all_to_all"`` phase 3: the outputs ``y`` back to the tokens' ranks, then the slot-order reduce."""
    M, topk = w.shape
    H = y.shape[1]
    # Exchange 3: the outputs go back to the tokens' ranks, in the order they were sent.
    back = y.new_empty((d.sel.numel(), H))
    dist.all_to_all_single(back.view(torch.uint8), y.view(torch.uint8), d.send_split, d.recv_split, group=group)
    slots = y.new_zeros((M * topk, H))
    slots[d.sel] = back
    return _combine(slots.view(M, topk, H), w, on_input)


def _all_to_all(x, experts, w, ids, table, num_experts, rank, W, group, backend, on_input, validate, precision):
    d = _dispatch(x, w, ids, table, num_experts, experts.num_experts, rank, W, group, on_input, validate)
    y = _local_experts(d, experts, backend, on_input, precision)
    return _combine_back(d, y, w, group, on_input)


def ep_fused_moe(
    hidden_states: torch.Tensor,
    local_experts: NvFp4Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    mode: str = "all_to_all",
    backend: str = "auto",
    apply_router_weight_on_input: bool = False,
    validate: bool = True,
    precision: str = "w4a4",
) -> torch.Tensor:
    """Expert-parallel :func:`moe_fp4.fused_moe`: this rank holds ``local_experts``, ``group`` the rest.

    Args:
        hidden_states: bf16/fp16 ``[M, H]``, contiguous, on ``local_experts.device``. ``M = 0``
            is allowed (the rank still takes part).
        local_experts: this rank's experts (:func:`shard_experts`, :func:`load_expert_shard`).
        topk_weights: ``[M, topk]`` router weights (converted to float32, as ``fused_moe`` does).
        topk_ids: int32/int64 ``[M, topk]`` **global** expert ids in ``[-1, E)``; ``-1`` contributes nothing.
        expert_map: int ``[E]``, this rank's global -> local map (``-1`` = elsewhere), or int
            ``[world_size, E]``, every rank's map (:func:`expert_maps`; identical on every rank),
            which spares ``"all_to_all"`` an ``all_gather`` of the maps per call.
        group: the process group (default: the world). Tensors must suit its backend (gloo:
            CPU, NCCL: CUDA).
        mode: ``"all_to_all"`` (data-parallel tokens) or ``"all_reduce"`` (replicated tokens).
        backend, apply_router_weight_on_input, precision: as for ``fused_moe`` (same on every rank);
            the backend is resolved for the precision before any communication.
        validate: check ids, finiteness and the expert maps (every expert on exactly one rank)
            on every rank, raising ``ValueError`` on all ranks when any rank fails.

    Returns:
        ``[M, H]`` in the dtype of ``hidden_states``: this rank's tokens' MoE output.

    ``"all_to_all"``: one ``all_to_all_single`` of the row counts (with the validation words;
    its read-back is the call's one host synchronization), one of the rows (each (token, slot)
    row as bytes with its local expert id, and its float32 weight when
    ``apply_router_weight_on_input``), one of the expert outputs back. The owner runs its rows
    as top-1 rows with weight 1, which returns each expert output ``y`` exactly as ``fused_moe``
    rounds it (with the weight applied to the row before quantization when
    ``apply_router_weight_on_input``); the token's rank then sums ``w[t, j] * y`` (or ``y``) over
    ``j = 0..topk-1`` in float32, in slot order, and rounds once: ``fused_moe``'s reduce, op for
    op. The result is bitwise equal to single-process ``fused_moe`` over the concatenated tokens
    when each expert output row does not depend on the other rows of its expert's batch: true
    of the reference backend (rows are quantized one by one, or not at all with ``"w4a16"``, and
    its float64 GEMM sums of the products are exact, whatever the row count, barring extreme
    block-scale ranges); the GPU
    backends' GEMM tiling depends on the row count, so they agree within their own rounding.

    ``"all_reduce"``: no host synchronization unless ``validate``. Rank ``r``'s partial is
    ``P_r = dtype(sum_{j on r} T_j)`` (its slots in slot order, float32, rounded to the dtype,
    ``T_j = w_j * y_j`` or ``y_j``); the result is ``dtype(sum_r P_r)`` summed in float32 in the
    collective's order, where ``fused_moe`` computes ``dtype(sum_j T_j)``. Elementwise, with
    ``u`` the dtype's unit roundoff (bf16 ``2**-8``, fp16 ``2**-11``), ``S = sum_j |T_j|`` and
    ``eta`` the dtype's smallest subnormal::

        |ep - single| <= (3 * u + (2 * topk + world_size) * 2**-24) * (1 + 2 * u) * S + (world_size + 2) * eta

    (one rounding of each partial, of each result, and the float32 sums). It is exact when
    all of a token's experts are on one rank.
    """
    if not isinstance(local_experts, NvFp4Experts):
        raise TypeError(f"local_experts: expected an NvFp4Experts, got {type(local_experts).__name__}")
    for name, flag in (("apply_router_weight_on_input", apply_router_weight_on_input), ("validate", validate)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    for name, value in (("mode", mode), ("backend", backend)):
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    check_precision(precision)
    dev, H = local_experts.device, local_experts.hidden_size
    x = check_tensor("hidden_states", hidden_states, dtypes=_HIDDEN_DTYPES, ndim=2, device=dev, contiguous=True)
    if x.shape[1] != H:
        raise ValueError(f"hidden_states: expected shape [M, {H}] (the experts' hidden size), got {list(x.shape)}")
    M = x.shape[0]
    check_tensor("topk_ids", topk_ids, dtypes=_ID_DTYPES, ndim=2, device=dev)
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != M or topk < 1:
        raise ValueError(f"topk_ids: expected shape [{M}, topk >= 1] (M from hidden_states), "
                         f"got {list(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=_WEIGHT_DTYPES, shape=(M, topk), device=dev)
    check_tensor("expert_map", expert_map, dtypes=_ID_DTYPES, ndim=(1, 2), device=dev)
    E = expert_map.shape[-1]
    if topk > E:
        raise ValueError(f"topk_ids: expected topk <= the number of experts ({E}), got topk = {topk}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    if expert_map.dim() == 2 and expert_map.shape[0] != W:
        raise ValueError(f"expert_map: expected [E] or [world_size = {W}, E], got {list(expert_map.shape)}")

    # A backend that cannot run it, or cannot take the layer, raises here on every rank (not only on the ranks
    # that receive rows: the others would wait in the next collective).
    resolve_backend(backend, dev, x.dtype, precision, (H, local_experts.intermediate_size))
    w = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.long()
    args = (backend, apply_router_weight_on_input, validate, precision)
    if mode == "all_reduce":
        local_map = expert_map if expert_map.dim() == 1 else expert_map[rank]
        return _all_reduce(x, local_experts, w, ids, local_map.long(), E, rank, W, group, *args)
    if expert_map.dim() == 2:
        table = expert_map.long()
    else:
        parts = [torch.empty(E, dtype=torch.long, device=dev) for _ in range(W)]
        dist.all_gather(parts, expert_map.long().contiguous(), group=group)
        table = torch.stack(parts)
    return _all_to_all(x, local_experts, w, ids, table, E, rank, W, group, *args)


# --------------------------------------------------------------------------- one machine's process group


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for :func:`init_local_group`'s rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_local_group(rank: int, world_size: int, port: int, device: str = "cpu",
                     timeout_s: float = 60.0) -> torch.device:
    """Joins a process group of ``world_size`` ranks on this machine (TCP rendezvous on
    ``127.0.0.1:port``): NCCL with GPU ``rank`` for ``device="cuda"`` (NVLink multicast off,
    ``NCCL_NVLS_ENABLE=0``), gloo over the loopback interface for ``"cpu"``. Returns the rank's device.
    For tests and ``moe-fp4 bench --ep``; a serving engine brings its own group."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL reads its environment
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev, backend = torch.device("cuda", rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
        if "lo" in {name for _, name in socket.if_nameindex()}:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return dev
