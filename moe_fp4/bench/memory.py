"""Resident weight memory of a prepared layer, per backend and per peer (bytes and x the NVFP4 bytes).

A layer's NVFP4 bytes are the experts' own tensors (codes, block scales, global scales). A
backend that re-lays the weights out for its GEMM does so in place where it can
(``NvFp4Experts.in_layout``: one copy) and otherwise caches its prepared tensors beside them;
see :func:`resident_memory`. A peer holds only its own converted tensors (the bench keeps
moe_fp4's too, but a peer's user would not).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..experts import NvFp4Experts

__all__ = ["tensor_bytes", "resident_memory"]


def _tensors(obj: Any, seen: set[int], depth: int = 0):
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        yield from _tensors(vars(obj), seen, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):  # a peer's forward object
        yield from _tensors(vars(obj), seen, depth + 1)


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct storages of the device tensors reachable from ``objs``."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    for obj in objs:
        for t in _tensors(obj, seen):
            if t.device.type == "meta" or t.numel() == 0:
                continue
            st = t.untyped_storage()
            storages[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(storages.values())


def resident_memory(experts: NvFp4Experts, stage_sets: dict[str, Any], peers: dict[str, Any]) -> dict:
    """``{"nvfp4_bytes": n, "paths": {name: {"bytes": b, "x_nvfp4": b / n, "prepared_bytes": p}}}``.

    A backend's figure is what a user who runs only that backend holds: a fresh canonical copy of
    ``experts`` has ``stage_sets[backend]``'s weights prepared (in place where the layout allows,
    :meth:`NvFp4Experts.in_layout`), then every tensor it holds is counted once (its stored
    tensors, the prepared cache, canonical copies); ``prepared_bytes`` is what that adds to the
    NVFP4 bytes. ``peers[name]`` is a peer's forward object, counted alone.
    """
    base = tensor_bytes(experts.stored())
    paths: dict[str, dict] = {}
    for backend, stages in stage_sets.items():
        fresh = experts.to(experts.device)  # a copy that owns its tensors, canonical
        stages.weights(fresh)
        total = tensor_bytes(fresh.stored(), fresh._prepared, fresh._canonical_copy)  # noqa: SLF001 - measured here
        paths[backend] = {"bytes": total, "x_nvfp4": total / base if base else None, "prepared_bytes": total - base,
                          "in_place": fresh.layout is not None}
        del fresh
    for name, forward in peers.items():
        b = tensor_bytes(forward)
        paths[name] = {"bytes": b, "x_nvfp4": b / base if base else None}
    return {"nvfp4_bytes": base, "paths": paths}
