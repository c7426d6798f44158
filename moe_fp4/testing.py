"""The test kit: comparators, buffer equality, poisoning and routed-id generators.

Used by the project's tests and by the benchmark's output checks, so that every comparison
of a kernel against its reference is made the same way:

* :func:`rel_err` / :func:`errors` / :func:`assert_close`: norm-relative and max errors in
  float64; a failing :func:`assert_close` prints the worst coordinates.
* :func:`assert_same_buffers`: two buffers (tensors or :mod:`moe_fp4.buffers` types) equal
  in shape, dtype and every byte.
* :func:`poison` / :func:`poisoned_like`: fill with 0xFF bytes (NaN in every float view, an
  e4m3 NaN scale, the e2m1 code -6 twice), so anything a kernel leaves unwritten differs.
* :func:`routed_ids`: int32 ``[M, topk]`` expert ids with the edge patterns the tests need.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "ROUTING_PATTERNS",
    "rel_err",
    "errors",
    "assert_close",
    "assert_same_buffers",
    "poison",
    "poisoned_like",
    "routed_ids",
    "served_ids",
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; 0 if both are zero, inf if only ``ref`` is, nan if ``out`` has nan."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: expected shape {list(ref.shape)} (the reference's), got {list(out.shape)}")
    o, r = out.double(), ref.double()
    num, den = torch.stack([(o - r).norm(), r.norm()]).tolist()
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(norm-relative error, max |out - ref| / max |ref|)`` in float64, one host transfer."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: expected shape {list(ref.shape)} (the reference's), got {list(out.shape)}")
    d = out.double() - ref.double()
    r = ref.double()
    num, den, mx, scale = torch.stack([d.norm(), r.norm(), d.abs().max(), r.abs().max()]).tolist() if d.numel() \
        else (0.0, 0.0, 0.0, 0.0)
    rel = (0.0 if num == 0 else float("inf")) if den == 0 else num / den
    worst = (0.0 if mx == 0 else float("inf")) if scale == 0 else mx / scale
    return rel, worst


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, rel: float, max_rel: float | None = None,
                 what: str = "output") -> None:
    """Norm-relative error ``<= rel`` (and max error relative to ``max |ref|`` ``<= max_rel``); NaN fails.

    On failure the message gives both errors and the five worst coordinates with their values.
    """
    r, m = errors(out, ref)
    bad = not (r <= rel) or (max_rel is not None and not (m <= max_rel))
    if bad:
        d = (out.double() - ref.double()).abs().nan_to_num(float("inf")).flatten()
        worst = d.topk(min(5, d.numel())).indices.tolist()
        coords = [tuple(int(i) for i in torch.unravel_index(torch.tensor(w), out.shape)) for w in worst]
        detail = ", ".join(f"{c}: {float(out[c]):.6g} vs {float(ref[c]):.6g}" for c in coords)
        limit = f"rel <= {rel:g}" + (f", max_rel <= {max_rel:g}" if max_rel is not None else "")
        raise AssertionError(f"{what}: rel error {r:.3g}, max error {m:.3g} (want {limit}); worst at {detail}")


def _tensors(name: str, buf: object) -> dict[str, torch.Tensor]:
    if isinstance(buf, torch.Tensor):
        return {name: buf}
    if dataclasses.is_dataclass(buf):
        return {f"{name}.{f.name}": getattr(buf, f.name) for f in dataclasses.fields(buf)
                if isinstance(getattr(buf, f.name), torch.Tensor)}
    if isinstance(buf, (tuple, list)):
        return {f"{name}[{i}]": t for i, t in enumerate(buf)}
    raise TypeError(f"{name}: expected a tensor, a buffer dataclass or a tuple of tensors, got {type(buf).__name__}")


def assert_same_buffers(got: object, want: object, what: str = "buffers") -> None:
    """Every tensor of ``got`` equal to ``want``'s in shape, dtype and bytes (NaN patterns included).

    The message names the first differing tensor, how many bytes differ and where the first ones are.
    """
    g, w = _tensors(what, got), _tensors(what, want)
    if list(g) != list(w):
        raise AssertionError(f"{what}: fields {list(g)} differ from {list(w)}")
    for (name, a), b in zip(g.items(), w.values()):
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            raise AssertionError(f"{name}: {a.dtype} {list(a.shape)}, expected {b.dtype} {list(b.shape)}")
        if a.numel() == 0:  # (an empty tensor may keep zero strides, which cannot be viewed as bytes)
            continue
        ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        if not torch.equal(ab, bb):
            diff = (ab != bb).nonzero()
            raise AssertionError(f"{name}: {diff.shape[0]} of {ab.numel()} bytes differ, first at "
                                 f"{diff[:8].tolist()}")


def poison(*buffers: object, byte: int = 0xFF) -> None:
    """Fill every tensor of ``buffers`` (tensors or buffer dataclasses) with ``byte``, in place.

    0xFF is NaN in every float view, an e4m3 NaN scale and two e2m1 -6 codes; for int32
    metadata, where 0xFF bytes read as -1 (a valid "no slot"), use e.g. ``byte=0x7F``.
    """
    for i, buf in enumerate(buffers):
        for t in _tensors(f"buffers[{i}]", buf).values():
            t.view(torch.uint8).fill_(byte)


def poisoned_like(buf, *, byte: int = 0xFF):
    """A copy of ``buf`` (a tensor or buffer dataclass) whose every byte is ``byte`` (see :func:`poison`)."""
    if isinstance(buf, torch.Tensor):
        return torch.full_like(buf.contiguous().view(torch.uint8), byte).view(buf.dtype)
    tensors = [f.name for f in dataclasses.fields(buf) if isinstance(getattr(buf, f.name), torch.Tensor)]
    return dataclasses.replace(buf, **{name: poisoned_like(getattr(buf, name), byte=byte) for name in tensors})


ROUTING_PATTERNS = ("random", "skip", "one_expert", "minus_one", "out_of_range", "skewed")


def routed_ids(m: int, topk: int, e: int, gen: torch.Generator, pattern: str = "random") -> torch.Tensor:
    """int32 ``[m, topk]`` expert ids, distinct per token (like a top-k router), with edge patterns.

    ``random``: uniform; ``skip``: expert 0 never chosen (an empty expert); ``one_expert``:
    expert 1 in every token; ``minus_one``: every other token's first slot is ``-1``;
    ``out_of_range``: ids outside ``[-1, E)`` (reachable only with ``validate=False``: they
    must count as ``-1``); ``skewed``: router logits with a power-law bias, so a few experts
    take most rows. Needs ``topk <= e``.
    """
    if pattern not in ROUTING_PATTERNS:
        raise ValueError(f"pattern: expected one of {ROUTING_PATTERNS}, got {pattern!r}")
    if not 1 <= topk <= e:
        raise ValueError(f"topk: expected 1 <= topk <= e = {e}, got {topk}")
    logits = torch.randn(m, e, generator=gen)
    if pattern == "skip" and e > topk:
        logits[:, 0] = -1e9
    elif pattern == "one_expert" and e > 1:
        logits[:, 1] = 1e9
    elif pattern == "skewed":
        logits += 4.0 * torch.arange(e, 0, -1).float().log()
    ids = logits.topk(topk, dim=-1).indices.to(torch.int32)
    if pattern == "minus_one":
        ids[::2, 0] = -1
    elif pattern == "out_of_range":
        ids[::3, -1] = e + 7
        ids[1::3, 0] = -9
    return ids


def served_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``ids`` with every id outside ``[0, E)`` replaced by ``-1`` (what a backend must treat them as)."""
    return torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, -1))
