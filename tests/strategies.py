"""Hypothesis strategies for the property tests (tests/test_properties.py).

A drawn MoE configuration is a :class:`MoECase`: plain ints, strings and bools, so its
``repr`` is a valid Python call that rebuilds exactly the same tensors (they come from
``torch.Generator`` streams seeded by the drawn ``seed``; nothing is seeded with ``hash``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from moe_cases import Case, make_experts

from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.testing import routed_ids

__all__ = ["DTYPES", "PATTERNS", "PRIMES", "SIZES", "MoECase", "MoEInputs", "moe_cases", "token_subsets"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# moe_fp4.testing.routed_ids patterns; "out_of_range" (ids outside [-1, E)) runs with validate=False.
PATTERNS = ("random", "skewed", "skip", "one_expert", "minus_one", "out_of_range")
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 61, 127, 251, 293)
SIZES = tuple(range(16, 129, 16))  # H and I: multiples of 16 (the NVFP4 block)


@dataclass(frozen=True)
class MoEInputs:
    """The tensors of one case. ``ids`` are what the caller passes (global ids when ``expert_map``
    is set); ``local_ids`` are the served local ids (``-1`` elsewhere), derived independently."""

    experts: NvFp4Experts | None
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    expert_map: torch.Tensor | None
    local_ids: torch.Tensor

    @property
    def stage_ids(self) -> torch.Tensor:
        """The int32 ids the backends receive: ``fused_moe`` translates mapped ids, passes others as they are."""
        return self.local_ids if self.expert_map is not None else self.ids

    def tokens(self, rows: list[int]) -> MoEInputs:
        """The same call restricted to the tokens ``rows`` (in that order)."""
        sel = torch.tensor(rows, dtype=torch.long, device=self.x.device)
        return MoEInputs(self.experts, self.x[sel].contiguous(), self.weights[sel].contiguous(),
                         self.ids[sel].contiguous(), self.expert_map, self.local_ids[sel].contiguous())


@dataclass(frozen=True)
class MoECase:
    """One drawn configuration; ``MoECase(...)`` as printed rebuilds the same tensors.

    pattern: a ``routed_ids`` pattern over the ``e + remote`` global experts; drop: percent of
    slots additionally set to ``-1``; remote: global experts not on this rank (``> 0`` gives an
    ``expert_map`` that scatters the ``e`` local experts among them); split_gate_up: gate and up
    with different global scales; on_input: apply_router_weight_on_input; signed_weights: router
    weights ~ N(0, 1) instead of U(0, 1); x_log2: the hidden states are scaled by ``2**x_log2``
    (saturated or tiny block scales).
    """

    m: int
    e: int
    topk: int
    h: int
    i: int
    dtype: str = "bf16"
    pattern: str = "random"
    drop: int = 0
    remote: int = 0
    split_gate_up: bool = False
    on_input: bool = False
    signed_weights: bool = False
    x_log2: int = 0
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def validate(self) -> bool:
        """Out-of-range ids are only reachable with validation skipped."""
        return self.pattern != "out_of_range"

    def generator(self, part: int) -> torch.Generator:
        """The case's random stream ``part`` (0: experts, 1: inputs, 2: global scales, 3: free)."""
        return torch.Generator().manual_seed(self.seed * 4 + part)

    def experts(self, device: torch.device | str = "cpu") -> NvFp4Experts:
        spec = Case(max(self.m, 1), self.e, self.topk, self.h, self.i, self.torch_dtype,
                    split_gate_up=self.split_gate_up)
        return make_experts(spec, self.generator(0), device)

    def global_scales(self, amax_lo: float, amax_span: float, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 ``[E]`` quantize-direction scales ``2688 / amax``, amax in ``[amax_lo, amax_lo + amax_span)``."""
        return (2688.0 / (amax_lo + amax_span * torch.rand(self.e, generator=self.generator(2)))).to(device)

    def inputs(self, device: torch.device | str = "cpu", *, with_experts: bool = True) -> MoEInputs:
        """The call's tensors on ``device`` (``experts`` None unless ``with_experts``)."""
        gen = self.generator(1)
        n_global = self.e + self.remote
        ids = routed_ids(self.m, self.topk, n_global, gen, self.pattern)
        if self.drop:
            ids[torch.rand(ids.shape, generator=gen) * 100 < self.drop] = -1
        x = (torch.randn(self.m, self.h, generator=gen) * 0.3 * 2.0**self.x_log2).to(self.torch_dtype)
        weights = (torch.randn if self.signed_weights else torch.rand)(self.m, self.topk, generator=gen)
        emap, table = None, list(range(n_global))
        if self.remote:
            here = torch.randperm(n_global, generator=gen)[: self.e].tolist()
            table = [-1] * n_global
            for local, g in enumerate(here):
                table[g] = local
            emap = torch.tensor(table, dtype=torch.int32)
        local = [[table[g] if 0 <= g < n_global else -1 for g in row] for row in ids.tolist()]
        local_ids = torch.tensor(local, dtype=torch.int32).reshape(self.m, self.topk)
        ex = self.experts(device) if with_experts else None
        return MoEInputs(ex, x.to(device), weights.to(device), ids.to(device),
                         None if emap is None else emap.to(device), local_ids.to(device))

    def call(self, inp: MoEInputs, backend: str, **kwargs) -> torch.Tensor:
        """``fused_moe`` of the case on ``inp``."""
        return fused_moe(inp.x, inp.experts, inp.weights, inp.ids, backend=backend,
                         apply_router_weight_on_input=self.on_input, expert_map=inp.expert_map,
                         validate=self.validate, **kwargs)


@st.composite
def moe_cases(draw, *, max_e: int = 300, max_m: int = 40, min_m: int = 0, max_topk: int = 16,
              sizes: tuple[int, ...] = SIZES, max_weights: int = 2**18,
              patterns: tuple[str, ...] = PATTERNS) -> MoECase:
    """A :class:`MoECase`. E in ``1..max_e`` (primes drawn often), topk in ``1..min(E, max_topk)``,
    H and I from ``sizes`` with ``E * H * I <= max_weights`` (the smallest pair always allowed)."""
    e = draw(st.one_of(st.integers(1, max_e), st.sampled_from([p for p in PRIMES if p <= max_e])))
    topk = draw(st.integers(1, min(e, max_topk)))
    h = draw(st.sampled_from([s for s in sizes if s == sizes[0] or e * s * sizes[0] <= max_weights]))
    i = draw(st.sampled_from([s for s in sizes if s == sizes[0] or e * h * s <= max_weights]))
    return MoECase(
        m=draw(st.integers(min_m, max_m)),
        e=e,
        topk=topk,
        h=h,
        i=i,
        dtype=draw(st.sampled_from(tuple(DTYPES))),
        pattern=draw(st.sampled_from(patterns)),
        drop=draw(st.one_of(st.just(0), st.integers(0, 100))),
        remote=draw(st.one_of(st.just(0), st.integers(1, 2 * e))),
        split_gate_up=draw(st.booleans()),
        on_input=draw(st.booleans()),
        signed_weights=draw(st.booleans()),
        x_log2=draw(st.one_of(st.just(0), st.integers(-24, 8))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def token_subsets(draw, case: MoECase) -> tuple[int, list[int]]:
    """``(token, subset)`` for a case with ``m >= 1``: a token and the tokens of a sub-batch
    containing it, in a drawn order."""
    token = draw(st.integers(0, case.m - 1))
    others = draw(st.sets(st.integers(0, case.m - 1), max_size=case.m))
    return token, draw(st.permutations(sorted(others | {token})))
