"""Expert parallelism (moe_fp4.distributed): placement, checkpoint shards, ep_fused_moe across processes.

The distributed checks spawn one group of processes per world size (2 and 4, gloo on
127.0.0.1, the reference backend), which runs every scenario and the error paths once; the
tests then judge the saved outputs: ``"all_to_all"`` bitwise equal to single-process
``fused_moe`` over all ranks' tokens, ``"all_reduce"`` within the bound documented in
:func:`moe_fp4.distributed.ep_fused_moe`. The NCCL variant needs two GPUs.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_fp4
from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.checkpoint import Checkpoint
from moe_fp4.checkpoint._safetensors import TensorStore
from moe_fp4.distributed import ep_fused_moe, expert_maps, free_port, init_local_group, load_expert_shard, shard_experts
from moe_fp4.nn import ExpertParallelMoE

DATA = Path(__file__).parent / "data" / "tiny_qwen3_moe"
H, I = 32, 32
F8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Scenario:
    """One EP problem: ``tokens[r]`` tokens on rank r (``"all_reduce"`` runs all of them on every rank)."""

    name: str
    world: int
    tokens: tuple[int, ...]
    experts: int
    topk: int
    routing: str = "random"  # random | skewed (expert 0 heavy, the last two unused) | minus_one
    on_input: bool = False
    dtype: torch.dtype = torch.bfloat16
    placement: str = "contiguous"  # contiguous | scrambled (lists) | owners (tensor, round robin)
    table: bool = False  # pass every rank's map [W, E] instead of this rank's
    ids32: bool = False

    def __str__(self) -> str:
        return f"w{self.world}-{self.name}"


SCENARIOS = [
    Scenario("skewed", 2, (6, 3), 6, 2, routing="skewed", placement="owners", ids32=True),
    Scenario("rank_without_tokens", 2, (7, 0), 5, 3, routing="minus_one"),
    Scenario("on_input_fp16_lists", 2, (4, 5), 7, 2, on_input=True, dtype=torch.float16, placement="scrambled"),
    Scenario("owner_tensor_table", 2, (3, 4), 6, 2, routing="minus_one", placement="owners", table=True),
    Scenario("skewed_idle_rank", 4, (5, 0, 3, 1), 10, 3, routing="skewed"),
    Scenario("minus_one_on_input", 4, (2, 4, 0, 3), 8, 2, routing="minus_one", on_input=True, placement="scrambled"),
    Scenario("fp16_table_top4", 4, (3, 3, 1, 2), 9, 4, dtype=torch.float16, placement="owners", table=True),
]
WORLDS = (2, 4)


def placement_of(s: Scenario):
    E, W = s.experts, s.world
    if s.placement == "owners":
        return torch.arange(E) % W
    if s.placement == "scrambled":
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(E * 31 + W)).tolist()
        cuts = torch.randperm(E - 1, generator=torch.Generator().manual_seed(W))[: W - 1] + 1
        cut = [0, *sorted(cuts.tolist()), E]
        return [perm[cut[r] : cut[r + 1]] for r in range(W)]
    return None


def problem(s: Scenario) -> tuple[NvFp4Experts, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts, hidden_states, topk_weights, topk_ids) of all ranks' tokens, the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(s).encode()))
    E, M = s.experts, sum(s.tokens)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / 15
    w2 = torch.randn(E, H, I, generator=gen) / 15
    a13_gs, a2_gs = 2688.0 / (0.4 + torch.rand(E, generator=gen)), 2688.0 / (0.05 + 0.2 * torch.rand(E, generator=gen))
    experts = NvFp4Experts.quantize(w13.to(s.dtype), w2.to(s.dtype), a13_gs=a13_gs, a2_gs=a2_gs)
    x = torch.randn(M, H, generator=gen).to(s.dtype)
    logits = torch.randn(M, E, generator=gen)
    if s.routing == "skewed":
        logits[:, 0] += 3.0
        logits[:, -2:] = -float("inf")
    w, ids = torch.softmax(logits, -1).topk(s.topk, -1)
    if s.routing == "minus_one":
        ids[::3, 0] = -1
        ids[1] = -1  # a token with no expert at all
    return experts, x, w, ids.to(torch.int32) if s.ids32 else ids


def all_reduce_bound(s: Scenario, experts, x, w, ids, backend: str) -> torch.Tensor:
    """The documented elementwise bound of "all_reduce" against single-process fused_moe."""
    u, eta = (2.0**-8, 2.0**-133) if s.dtype == torch.bfloat16 else (2.0**-11, 2.0**-24)
    S = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for j in range(s.topk):  # each slot's expert output y_j alone: top-1 with weight 1 (or w_j on the input)
        wj = w[:, j : j + 1] if s.on_input else torch.ones_like(w[:, :1])
        y = fused_moe(x, experts, wj, ids[:, j : j + 1], backend=backend, apply_router_weight_on_input=s.on_input)
        S += (y.double() * (1.0 if s.on_input else w[:, j : j + 1].double())).abs()
    return (3 * u + (2 * s.topk + s.world) * 2.0**-24) * (1 + 2 * u) * S + (s.world + 2) * eta


# --------------------------------------------------------------------------- the worker processes


def run_scenario(s: Scenario, rank: int, dev: torch.device, backend: str) -> dict[str, torch.Tensor]:
    experts, x, w, ids = (t.to(dev) for t in problem(s))
    local, emap = shard_experts(experts, rank, s.world, placement_of(s))
    if s.table:
        emap = expert_maps(s.experts, s.world, placement_of(s)).to(dev)
    lo = sum(s.tokens[:rank])
    part = slice(lo, lo + s.tokens[rank])
    kw = {"expert_map": emap, "backend": backend, "apply_router_weight_on_input": s.on_input}
    out = {
        "all_to_all": ep_fused_moe(x[part], local, w[part], ids[part], mode="all_to_all", **kw),
        "all_reduce": ep_fused_moe(x, local, w, ids, mode="all_reduce", **kw),
    }
    module = ExpertParallelMoE.from_shard(local, emap, mode="all_to_all", backend=backend,
                                          apply_router_weight_on_input=s.on_input)
    out["module_all_to_all"] = module(x[part], w[part], ids[part])
    if rank == 0:
        out["single"] = fused_moe(x, experts, w, ids, backend=backend, apply_router_weight_on_input=s.on_input)
        out["bound"] = all_reduce_bound(s, experts, x, w, ids, backend)
    return {k: v.cpu() for k, v in out.items()}


def error_paths(rank: int, W: int, dev: torch.device) -> dict[str, str]:
    """Bad inputs on one rank: every rank must raise (and stay in step for the next call)."""
    s = Scenario("errors", W, (3,) * W, 2 * W, 2)
    experts, x, w, ids = (t.to(dev) for t in problem(s))
    local, emap = shard_experts(experts, rank, W)
    mine = slice(3 * rank, 3 * rank + 3)
    xs, ws, ids_s = x[mine], w[mine], ids[mine]
    table = expert_maps(2 * W, W).to(dev)
    twice = table.clone()
    twice[1, 0] = 0  # expert 0 on ranks 0 and 1
    cases = {
        "bad_id_last_rank": lambda: ep_fused_moe(xs, local, ws, ids_s if rank != W - 1 else ids_s.clamp_max(0) + 2 * W,
                                                 expert_map=emap),
        "nan_rank0_all_reduce": lambda: ep_fused_moe(x if rank else torch.full_like(x, float("nan")), local, w, ids,
                                                     expert_map=emap, mode="all_reduce"),
        "owned_twice_all_to_all": lambda: ep_fused_moe(xs, local, ws, ids_s, expert_map=twice),
        "owned_twice_all_reduce": lambda: ep_fused_moe(x, local, w, ids, expert_map=twice[rank], mode="all_reduce"),
        "bad_table_rows": lambda: ep_fused_moe(xs, local, ws, ids_s, expert_map=table[:1]),
        "bad_mode": lambda: ep_fused_moe(xs, local, ws, ids_s, expert_map=emap, mode="gather"),
        # triton's W4A16 needs H and I multiples of 64 (here 32): refused on every rank, rank 0 without rows too
        "w4a16_layer": lambda: ep_fused_moe(xs[:0] if rank == 0 else xs, local, ws[:0] if rank == 0 else ws,
                                            ids_s[:0] if rank == 0 else ids_s, expert_map=emap, backend="triton",
                                            precision="w4a16"),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    after = ep_fused_moe(xs, local, ws, ids_s, expert_map=emap)
    single = fused_moe(x, experts, w, ids)[mine]
    out["in_step_after_errors"] = str(torch.equal(after.view(torch.int16), single.view(torch.int16)))
    return out


def worker(rank: int, world: int, port: int, scenarios: list[Scenario], out_dir: str, device: str,
           backend: str) -> None:
    torch.set_num_threads(1)
    dev = init_local_group(rank, world, port, device)
    try:
        results = {str(s): run_scenario(s, rank, dev, backend) for s in scenarios}
        results["errors"] = error_paths(rank, world, dev)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(world: int, out_dir: Path, device: str = "cpu", backend: str = "reference") -> list[dict]:
    scenarios = [s for s in SCENARIOS if s.world == world]
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(worker, args=(world, free_port(), scenarios, str(out_dir), device, backend),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} EP worker processes did not finish in 240 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: the saved results of each rank, one spawn per world size."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = spawn(world, tmp_path_factory.mktemp(f"ep{world}"))
        return cache[world]

    return get


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check_outputs(s: Scenario, ranks: list[dict], bitwise: bool = True) -> None:
    res = [r[str(s)] for r in ranks]
    single = res[0]["single"]
    a2a = torch.cat([r["all_to_all"] for r in res])
    assert all(torch.equal(bits(r["module_all_to_all"]), bits(r["all_to_all"])) for r in res), "the module differs"
    assert [r["all_to_all"].shape[0] for r in res] == list(s.tokens)
    if bitwise:
        assert torch.equal(bits(a2a), bits(single)), (a2a.float() - single.float()).abs().max()
    ar = res[0]["all_reduce"]
    for r in res[1:]:
        assert torch.equal(bits(r["all_reduce"]), bits(ar)), "ranks disagree on the all_reduce result"
    err = (ar.double() - single.double()).abs()
    assert bool((err <= res[0]["bound"]).all()), float((err - res[0]["bound"]).max())


@pytest.mark.parametrize("s", SCENARIOS, ids=str)
def test_ep_modes_against_single_process(runs, s):
    check_outputs(s, runs(s.world))


@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_raise_on_every_rank(runs, world):
    errs = [r["errors"] for r in runs(world)]
    last = world - 1
    for rank, e in enumerate(errs):
        other = f"rank(s) [{last}] failed validation"
        assert e["bad_id_last_rank"].startswith("ValueError: topk_ids:" if rank == last else "ValueError"), e
        assert rank == last or other in e["bad_id_last_rank"]
        nan = e["nan_rank0_all_reduce"]
        assert nan.startswith("ValueError: hidden_states:") if rank == 0 else "rank(s) [0] failed" in nan, nan
        for mode in ("all_to_all", "all_reduce"):
            assert "expected every global expert on exactly one rank" in e[f"owned_twice_{mode}"], e
            assert "[0] on several" in e[f"owned_twice_{mode}"]
        assert e["bad_table_rows"].startswith(f"ValueError: expert_map: expected [E] or [world_size = {world}, E]")
        assert e["bad_mode"].startswith("ValueError: mode:")
        assert e["w4a16_layer"].startswith("ValueError: experts: backend='triton' does not compute "
                                           "precision='w4a16' for this layer: the K16 weight layout"), e
        assert e["in_step_after_errors"] == "True"


@pytest.mark.gpu
def test_nccl_on_gpus(tmp_path):
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {n}")
    world = 4 if n >= 4 else 2
    ref = spawn(world, tmp_path / "reference", device="cuda", backend="reference")
    for s in (s for s in SCENARIOS if s.world == world):
        check_outputs(s, ref)
    auto = spawn(world, tmp_path / "auto", device="cuda", backend="auto")
    for s in (s for s in SCENARIOS if s.world == world):
        res = [r[str(s)] for r in auto]
        a2a, single = torch.cat([r["all_to_all"] for r in res]).double(), res[0]["single"].double()
        assert float((a2a - single).norm() / single.norm()) < 2**-6


# --------------------------------------------------------------------------- placement and sharding (one process)


def test_contiguous_placement_rule():
    # E not divisible by the world size: the first E % W ranks hold one expert more (vLLM's rule).
    table = expert_maps(10, 4)
    owned = [(row >= 0).nonzero().squeeze(1).tolist() for row in table]
    assert owned == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert table.dtype == torch.int32 and table[1].tolist() == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]
    assert expert_maps(4, 4).tolist() == [[0, -1, -1, -1], [-1, 0, -1, -1], [-1, -1, 0, -1], [-1, -1, -1, 0]]


@pytest.mark.parametrize("placement", [None, [[4, 0], [2], [1, 3]], torch.tensor([1, 2, 0, 2, 0])],
                         ids=["contiguous", "lists", "owner-tensor"])
def test_shard_experts_round_trip(placement):
    s = Scenario("shard", 3, (1,), 5, 2, placement="scrambled")
    experts = problem(s)[0]
    seen = torch.zeros(5, dtype=torch.long)
    for rank in range(3):
        local, emap = shard_experts(experts, rank, 3, placement)
        assert emap.dtype == torch.int32 and torch.equal(emap, expert_maps(5, 3, placement)[rank])
        glob = (emap >= 0).nonzero().squeeze(1)
        order = emap[glob].argsort()
        ids = glob[order]  # global id of each local expert
        assert local.num_experts == ids.numel() and torch.equal(emap[ids], torch.arange(ids.numel(), dtype=torch.int32))
        if isinstance(placement, list):
            assert ids.tolist() == placement[rank]
        for k in NvFp4Experts._fields():
            a, b = getattr(local, k), getattr(experts, k)[ids]
            assert torch.equal(a.view(torch.uint8) if a.dtype == F8 else a, b.view(torch.uint8) if b.dtype == F8 else b)
        seen[ids] += 1
    assert seen.tolist() == [1] * 5


@pytest.mark.parametrize("placement, exc, pattern", [
    ([[0, 1], [2]], ValueError, "one list of global expert ids per rank"),
    ([[1], [1, 2], [3, 4]], ValueError, r"got placed twice \[1\], unplaced \[0\]$"),
    ([[0, 1], [2, 7], [3, 4]], ValueError, r"out of range \[7\]"),
    ([[0, 1, 2], [], [3, 4]], ValueError, r"rank\(s\) \[1\] own no expert"),
    ([[0, 1.0], [2], [3, 4]], TypeError, r"placement\[0\]"),
    (torch.tensor([0, 1, 2, 3, 0]), ValueError, r"owner ranks in \[0, 3\), got \[3\]"),
    (torch.tensor([0, 1, 2, 2]), ValueError, r"shape \[5\]"),
    (torch.tensor([0.0, 1, 2, 2, 1]), TypeError, "integer tensor"),
    ("0,1", TypeError, "placement: expected None"),
])
def test_bad_placements(placement, exc, pattern):
    with pytest.raises(exc, match=pattern):
        expert_maps(5, 3, placement)


def test_bad_shard_arguments():
    experts = problem(Scenario("args", 2, (1,), 4, 2))[0]
    with pytest.raises(ValueError, match="world_size: expected at most 4 ranks"):
        shard_experts(experts, 0, 5)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\)"):
        shard_experts(experts, 2, 2)
    with pytest.raises(TypeError, match="experts: expected an NvFp4Experts"):
        shard_experts(experts.w13, 0, 2)
    x, w, ids = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
    emap = torch.arange(4)
    with pytest.raises(ValueError, match="mode: expected one of 'all_to_all', 'all_reduce'"):
        ep_fused_moe(x, experts, w, ids, expert_map=emap, mode="alltoall")
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[M, 32\]"):
        ep_fused_moe(x[:, :16].contiguous(), experts, w, ids, expert_map=emap)
    with pytest.raises(TypeError, match="expert_map: expected dtype"):
        ep_fused_moe(x, experts, w, ids, expert_map=emap.float())
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        ep_fused_moe(x, experts, w, ids, expert_map=emap)


# --------------------------------------------------------------------------- checkpoint shards


def same_experts(a: NvFp4Experts, b: NvFp4Experts) -> bool:
    for k in NvFp4Experts._fields():
        x, y = (a.w13_gs_per_half, b.w13_gs_per_half) if k == "w13_gs" else (getattr(a, k), getattr(b, k))
        if not torch.equal(x.view(torch.uint8) if x.dtype == F8 else x, y.view(torch.uint8) if y.dtype == F8 else y):
            return False
    return True


def reads(monkeypatch) -> list[str]:
    """The names read through TensorStore.get from now on."""
    names: list[str] = []
    get = TensorStore.get
    monkeypatch.setattr(TensorStore, "get", lambda self, name: names.append(name) or get(self, name))
    return names


@pytest.mark.parametrize("name", ["nvfp4_ct", "nvfp4_modelopt"])
def test_load_expert_shard_reads_only_its_experts(monkeypatch, name):
    full = moe_fp4.load_experts(DATA / name, 1)
    read = reads(monkeypatch)
    for W, placement in ((2, None), (3, [[7, 0], [3, 5, 1], [2, 4, 6]])):
        for rank in range(W):
            read.clear()
            local, emap = load_expert_shard(DATA / name, 1, rank, W, placement=placement)
            want, want_map = shard_experts(full, rank, W, placement)
            assert same_experts(local, want) and torch.equal(emap, want_map)
            experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
            assert experts_read == set((want_map >= 0).nonzero().squeeze(1).tolist())


def test_load_expert_shard_of_fused_experts_reads_only_its_rows(tmp_path, monkeypatch):
    from test_checkpoint_variants import MODELOPT, fuse_layer, make_variant

    path = make_variant(tmp_path, MODELOPT, edit=lambda t: fuse_layer(t, 0, ws2_gate_up="per-half"))
    full = moe_fp4.load_experts(path, 0)
    ckpt = Checkpoint(path)  # an open Checkpoint serves too, and stays as it was
    read = reads(monkeypatch)
    for rank, placement in ((0, None), (1, None), (1, [[6, 7, 0], [5, 2, 3, 4, 1]])):
        read.clear()
        local, emap = load_expert_shard(ckpt, 0, rank, 2, placement=placement)
        want, want_map = shard_experts(full, rank, 2, placement)
        assert same_experts(local, want) and torch.equal(emap, want_map)
        # The codes and block scales come by slices, never whole; the global scales are read whole.
        assert not [n for n in read if n.endswith(("gate_up_proj", "down_proj", "_proj_weight_scale"))], read
    assert same_experts(ckpt.load_experts(0), full)


def test_expert_parallel_module_holds_its_shard_as_buffers():
    experts, *_ = problem(Scenario("module", 2, (3, 3), 5, 2))
    local, emap = shard_experts(experts, 1, 2)
    module = ExpertParallelMoE.from_shard(local, emap, mode="all_reduce")
    state = module.state_dict()
    assert torch.equal(state["expert_map"], emap) and torch.equal(state["w13"], local.w13)
    assert module.num_experts == local.num_experts and "mode=all_reduce" in repr(module)
    with pytest.raises(TypeError, match="mode: expected a str"):
        ExpertParallelMoE.from_shard(local, emap, mode=1)
