"""Bitwise comparison of two source trees' outputs on the same inputs (a refactor must change no bit).

``python tests/bitwise_forward.py dump OUT.pt`` runs, with whatever ``moe_fp4`` is importable
(put the tree to test first on ``PYTHONPATH``), the whole forward of every GPU backend that
can run here and every CUDA-library pipeline stage on a fixed set of seeded inputs, and
saves the outputs; ``python tests/bitwise_forward.py compare A.pt B.pt`` says, for every output both produced,
whether the two are identical byte for byte (exit status 1 if any differs), and lists the
outputs only one tree produced (a backend that runs in one tree only).

The inputs are made with torch alone (seeded CPU generators, then moved to the GPU) and
``NvFp4Experts.quantize``, so both trees see identical bytes. The stage calls adapt to
either stage API (before and after the typed stage buffers).
"""

from __future__ import annotations

import json
import os
import sys

import torch

# (M, E, topk, H, I, dtype, routing): decode, an empty expert and -1 ids, prefill, fp16, gate != up.
CASES = [
    (1, 128, 8, 2048, 768, torch.bfloat16, "random"),
    (7, 17, 3, 256, 128, torch.bfloat16, "minus_one"),
    (64, 40, 6, 1024, 512, torch.float16, "random"),
    (600, 64, 8, 2048, 768, torch.bfloat16, "skip"),
    (33, 8, 8, 512, 256, torch.bfloat16, "split"),
]


def _inputs(case, device):
    from moe_fp4 import NvFp4Experts

    M, E, topk, H, I, dtype, routing = case
    gen = torch.Generator().manual_seed(M * 1000 + E)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / 15
    if routing == "split":
        w13[:, I:] *= 3.0
    w2 = torch.randn(E, H, I, generator=gen) / 15
    ex = NvFp4Experts.quantize(w13.to(dtype).to(device), w2.to(dtype).to(device),
                               a13_gs=(2688.0 / (0.4 + torch.rand(E, generator=gen))).to(device),
                               a2_gs=(2688.0 / (0.1 + torch.rand(E, generator=gen))).to(device),
                               separate_gate_up_scales=routing == "split")
    x = (torch.randn(M, H, generator=gen) / 3).to(dtype).to(device)
    logits = torch.randn(M, E, generator=gen)
    if routing == "skip":
        logits[:, 0] = -1e9
    w, ids = torch.softmax(logits, -1).topk(topk, -1)
    ids = ids.to(torch.int32)
    if routing == "minus_one":
        ids[::2, 0] = -1
    return ex, x, w.to(device), ids.to(device)


def _cutlass_stages(ex, x, w, ids) -> dict[str, torch.Tensor]:
    """The CUDA library's pipeline stages (routing, quantize, SiLU-mul-quantize, reduce) on these inputs."""
    from moe_fp4 import stages
    from moe_fp4.backends import cutlass

    E, topk = ex.num_experts, ids.shape[1]
    h = (torch.randn(ids.numel(), 2 * ex.intermediate_size, generator=torch.Generator().manual_seed(1)) * 2)
    h = h.to(x.dtype).to(x.device)
    y = torch.randn(ids.numel(), ex.hidden_size, generator=torch.Generator().manual_seed(2)).to(x.dtype).to(x.device)
    r = cutlass.routing(ids, E)
    if hasattr(stages, "STAGES"):  # typed stage buffers
        q = cutlass.quantize_rows(x, ex.a13_gs, r, row_scale=w.reshape(-1).contiguous())
        q2 = cutlass.silu_mul_quantize(h, ex.a2_gs, r)
        red = cutlass.moe_reduce(y, r, w.contiguous(), x.shape[0], x.dtype)
        q, q2 = (q.packed, q.scales), (q2.packed, q2.scales)
    else:
        offs, bso = r.expert_offsets, r.blockscale_offsets
        q = cutlass.quantize_rows(x, ex.a13_gs, offs, bso, r.slot_to_flat, topk, w.reshape(-1).contiguous())
        q2 = cutlass.silu_mul_quantize(h, ex.a2_gs, offs, bso)
        red = cutlass.moe_reduce(y, r.flat_to_slot, w.contiguous(), x.shape[0], x.dtype)
    out = {f"routing.{f}": getattr(r, f) for f in ("expert_offsets", "blockscale_offsets", "slot_to_flat",
                                                    "flat_to_slot")}
    valid = int(r.expert_offsets[-1])
    out.update({"quantize.packed": q[0], "quantize.scales": q[1].view(torch.uint8),
                # scale rows past the bound may differ in count between the two trees' allocations
                "silu_mul_quantize.packed": q2[0][:valid], "silu_mul_quantize.scales": q2[1].view(torch.uint8),
                "moe_reduce": red})
    return out


def dump(path: str) -> int:
    from moe_fp4 import available_backends, fused_moe

    device = torch.device("cuda")
    results, notes = {}, []
    backends = [b for b in ("triton", "cutlass") if b in available_backends(device)]
    # BITWISE_CASES=N limits the run to the first N cases (a short GPU session).
    for case in CASES[: int(os.environ.get("BITWISE_CASES", len(CASES)))]:
        name = "-".join(str(v).replace("torch.", "") for v in case)
        ex, x, w, ids = _inputs(case, device)
        for b in backends:
            results[f"{name}/fused_moe/{b}"] = fused_moe(x, ex, w, ids, backend=b).cpu()
        try:
            for k, v in _cutlass_stages(ex, x, w, ids).items():
                results[f"{name}/cutlass/{k}"] = v.cpu()
        except Exception as exc:  # noqa: BLE001 - recorded: the comparison then reports the missing outputs
            notes.append(f"{name}: cutlass stages: {type(exc).__name__}: {exc}")
    torch.save({"results": results, "notes": notes, "backends": backends}, path)
    print(json.dumps({"outputs": len(results), "backends": backends, "notes": notes}))
    return 0


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    rows, bad = [], 0
    common = sorted(set(a["results"]) & set(b["results"]))
    for key in common:
        ta, tb = a["results"][key], b["results"][key]
        same = ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(
            ta.contiguous().view(torch.uint8), tb.contiguous().view(torch.uint8))
        bad += not same
        rows.append({"output": key, "bitwise_equal": same})
    only = {"A": sorted(set(a["results"]) - set(b["results"])), "B": sorted(set(b["results"]) - set(a["results"]))}
    summary = {"compared": len(rows), "differing": bad, "rows": rows, "only_in": only,
               "backends": {"A": a["backends"], "B": b["backends"]}, "notes": {"A": a["notes"], "B": b["notes"]}}
    print(json.dumps(summary, indent=1))
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        sys.exit(dump(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    sys.exit("usage: bitwise_forward.py dump OUT.pt | compare A.pt B.pt")
