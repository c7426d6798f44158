"""Resident weight memory of a prepared layer, per backend and per peer (bytes and x the NVFP4 bytes).

A layer's NVFP4 bytes are the experts' own tensors (codes, block scales, global scales). A
backend that re-lays the weights out for its GEMM caches the prepared copy on the experts
(``NvFp4Experts.prepared``); what a user holding the experts and running that backend keeps
resident is both. A peer holds only its own converted tensors (the bench keeps moe_fp4's too,
but a peer's user would not).
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


def _canonical(experts: NvFp4Experts) -> dict[str, Any]:
    return {k: v for k, v in vars(experts).items() if not k.startswith("_")}


def resident_memory(experts: NvFp4Experts, weights_keys: dict[str, str | None], peers: dict[str, Any]) -> dict:
    """``{"nvfp4_bytes": n, "paths": {name: {"bytes": b, "x_nvfp4": b / n}}}``.

    ``weights_keys[backend]`` is the key under which that backend's stage set caches its
    prepared weights on ``experts`` (None: the backend could not run here); ``peers[name]`` the
    peer's forward object.
    """
    base = tensor_bytes(_canonical(experts))
    paths: dict[str, dict] = {}
    for backend, key in weights_keys.items():
        prepared = experts._prepared.get(("weights", key))  # noqa: SLF001 - the cache this module measures
        extra = tensor_bytes(prepared) if prepared is not None else 0
        # Tensors shared with the experts (a backend that uses them as they are) count once.
        total = tensor_bytes(_canonical(experts), prepared) if prepared is not None else base
        paths[backend] = {"bytes": total, "x_nvfp4": total / base if base else None, "prepared_bytes": extra}
    for name, forward in peers.items():
        b = tensor_bytes(forward)
        paths[name] = {"bytes": b, "x_nvfp4": b / base if base else None}
    return {"nvfp4_bytes": base, "paths": paths}
