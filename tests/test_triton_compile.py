"""The GPU build of every Triton kernel, compiled here for sm_90 and sm_80 (no GPU needed).

CI runs the kernels in Triton's interpreter, which never sees the code paths the GPU takes
(inline assembly, libdevice ``expf``) nor the compiler. So this test captures the launches
the host wrappers make on a representative problem (the GEMM and quantization tables, split-K,
every dequantization mode), compiles each one with Triton's own compiler and ptxas for sm_90
(and the GEMMs also for sm_80) in a subprocess without ``TRITON_INTERPRET``, and checks what
the design relies on: it compiles, no register spills, tensor-core MMAs in the GEMM, 16-byte
asynchronous loads of the packed weights, a K loop of a few SASS instructions per operand
element, an IEEE division in the quantizer and no FMA contraction where the roundings are fixed.
Nothing here executes on a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# (block_r, block_k, num_warps) of the launches compiled with whole blocks per thread.
WHOLE_BLOCK_CONFIGS = ((1, 512, 1), (2, 256, 1), (2, 512, 1), (4, 256, 2), (4, 512, 2), (8, 256, 2), (8, 512, 4))


def _capture_launches() -> list[tuple]:
    """Run the wrappers on CPU tensors with ``kernel[grid](...)`` intercepted; return (fn, args, kwargs)."""
    import torch
    import triton.runtime.jit as jit

    from moe_fp4 import stages
    from moe_fp4.backends import triton as tb
    from moe_fp4.buffers import WeightOperand

    tk = tb.kernels()
    captured = []

    class _Capture:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            captured.append((self.fn, args, kwargs))

    jit.JITFunction.__getitem__ = lambda self, grid: _Capture(self)
    gen = torch.Generator().manual_seed(0)
    M, topk, E, H, I = 64, 8, 40, 1024, 768  # M*topk > 256: the chunked routing path
    ids = torch.randint(0, E, (M, topk), generator=gen, dtype=torch.int32)
    r = stages.routing(ids, E)
    tb.routing(ids[:4], E)
    tb.routing(ids[:32], E)  # n = 256: the largest single-program routing
    tb.routing(ids, E)
    tb.routing(ids, 300)  # E > 256: 1024-wide expert chunks
    x = torch.randn(M, H, generator=gen).bfloat16()
    gs = torch.full((E,), 100.0)
    tb.quantize_rows(x, gs, r, row_scale=torch.rand(M * topk, generator=gen))
    tb.silu_mul_quantize(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs, r)
    tb.silu_mul_quantize(torch.randn(M * topk, 2 * I, generator=gen).half(), gs, r)
    a = stages.quantize_rows(x, gs, r)
    w = torch.randint(0, 255, (E, 2 * I, H // 2), generator=gen, dtype=torch.uint8)
    scales = torch.ones(E, 2 * I, H // 16).to(torch.float8_e4m3fn)
    wt = WeightOperand.build(w, scales, torch.ones(E, 2))
    G = tk.GemmConfig
    configs = [cfg for _, cfg in tk.GEMM_CONFIGS] + [
        G(16, 64, 128, swap_ab=True, num_stages=4, split_k=2),  # split-K: partials and the reduce kernel
        G(16, 64, 128, swap_ab=True, num_stages=4, dequant="bits-plain"),
        G(16, 64, 128, swap_ab=True, num_stages=4, dequant="float"),
    ]
    for cfg in configs:
        tb.grouped_gemm(a, wt, r, torch.bfloat16, config=cfg)
    tb.grouped_gemm(a, wt, r, torch.float16, config=configs[0])
    for _, qcfg in tk.QUANT_CONFIGS:
        tb.quantize_rows(x, gs, r, config=qcfg)
    wide = stages.routing(ids, 300)
    gs300 = torch.full((300,), 100.0)
    tb.quantize_rows(x, gs300, wide)
    wide_w = WeightOperand.build(w[:1].expand(300, -1, -1).contiguous(), scales[:1].expand(300, -1, -1).contiguous(),
                                 torch.ones(300, 2))
    tb.grouped_gemm(stages.quantize_rows(x, gs300, wide), wide_w, wide, torch.bfloat16, config=tk.GEMM_CONFIGS[-1][1])
    tb.moe_reduce(torch.randn(M * topk, H, generator=gen).bfloat16(), r, torch.rand(M, topk), M, torch.bfloat16)
    # The values operand (STAGES_VALUES): fp16 rows from both quantization front ends, K16 weights.
    vals = torch.empty(M * topk, H, dtype=torch.float16)
    tk.quantize_rows_values_launcher(M, H, gs, r.expert_offsets, r.slot_to_flat, True, vals)(
        x, torch.rand(M * topk, generator=gen))
    tk.silu_mul_quantize_values_launcher(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs, r.expert_offsets,
                                         torch.empty(M * topk, I, dtype=torch.float16))()
    # Whole blocks per thread (QuantConfig.whole_blocks) and not, in decode, middle and prefill shapes.
    for fields, whole_blocks in itertools.product(WHOLE_BLOCK_CONFIGS, (False, True)):
        whole = tk.QuantConfig(*fields, whole_blocks=whole_blocks)
        for weighted in (False, True):  # with the router weights (Llama-4-Scout) and without
            tk.quantize_rows_values_launcher(M, H, gs, r.expert_offsets, r.slot_to_flat, weighted, vals, whole)(
                x, torch.rand(M * topk, generator=gen) if weighted else None)
        tk.silu_mul_quantize_values_launcher(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs,
                                             r.expert_offsets, torch.empty(M * topk, I, dtype=torch.float16), whole)()
        # the codes form (packed codes and swizzled scales)
        tb.quantize_rows(x, gs, r, row_scale=torch.rand(M * topk, generator=gen), config=whole)
        tb.silu_mul_quantize(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs, r, config=whole)
    # The values plans' fused routing and first quantization at decode (n <= FUSED_ROUTING_MAX).
    small = stages.routing(ids[:2], E)
    for whole in (None, tk.QuantConfig(*WHOLE_BLOCK_CONFIGS[0], whole_blocks=True)):
        tk.routing_quantize_values_launcher(2, H, gs, *(t.clone() for t in (small.expert_offsets,
                                                                            small.blockscale_offsets,
                                                                            small.slot_to_flat, small.flat_to_slot)),
                                            True, torch.empty(2 * topk, H, dtype=torch.float16), whole)(
            ids[:2], x[:2], torch.rand(2 * topk, generator=gen))
    k16 = tk.k16_codes(wt.packed)
    for cfg in list(tk.GEMM_VALUES_TILES) + configs[len(tk.GEMM_CONFIGS):]:
        tk.grouped_gemm_launcher(vals, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, 2 * I, dtype=torch.bfloat16), cfg)()
    # The first GEMM of a values plan, the SiLU-and-mul quantization in its epilogue (the table's tiles)
    # or in its split-K reduce (the pinned split).
    for cfg in [cfg for _, cfg in tk.GEMM_VALUES_CONFIGS] + configs[len(tk.GEMM_CONFIGS):][:1]:
        tk.grouped_gemm_launcher(vals, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, I, dtype=torch.float16), cfg, silu=(gs, torch.bfloat16))()
    # A plan's second GEMM where it splits K: its K ranges added in the top-k reduce's launch (codes, weighted,
    # bf16; values, plain sum, fp16). Only that launch: the GEMM's is the pinned split one's above.
    split = configs[len(tk.GEMM_CONFIGS)]
    down = WeightOperand.build(w, scales, torch.ones(E, 1))  # one weight section, as a second GEMM has
    for a_ops, b_codes, weighted, dtype in (((a.packed, a.scales), down.packed, True, torch.bfloat16),
                                            ((vals, None), k16, False, torch.float16)):
        _, reduce = tk.grouped_gemm_reduce_launcher(*a_ops, b_codes, down.scales, down.alpha, r.expert_offsets,
                                                    r.blockscale_offsets, torch.empty(M * topk, 2 * I, dtype=dtype),
                                                    r.flat_to_slot, weighted, M, split)
        reduce(torch.rand(M, topk, generator=gen) if weighted else None, torch.empty(M, 2 * I, dtype=dtype))
    # The reduces in the GEMMs' own launches (FUSE_SPLIT_K_IN_GEMM, FUSE_TOPK_IN_GEMM): a split first GEMM adding
    # its K ranges (FIXUP), a second GEMM with the top-k reduce (TOPK), split and not; codes and values.
    unsplit = G(16, 64, 256, swap_ab=True, num_stages=3, split_k=1)  # the values table's decode tile, unsplit
    for a_ops, gate_up, down_codes, weighted, dtype in (
            ((a.packed, a.scales), wt.packed, down.packed, True, torch.bfloat16),
            ((vals, None), k16, k16, False, torch.float16)):
        tk.grouped_gemm_launcher(*a_ops, gate_up, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, 2 * I, dtype=dtype), split, fixup=True)()
        if a_ops[1] is None:  # and with the SiLU-and-mul quantization after the sum (values, gate/up tiles)
            tk.grouped_gemm_launcher(*a_ops, gate_up, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                     torch.empty(M * topk, I, dtype=torch.float16), split, silu=(gs, torch.bfloat16),
                                     fixup=True)()
        for cfg in (split, unsplit):
            _, reduce = tk.grouped_gemm_reduce_launcher(*a_ops, down_codes, down.scales, down.alpha, r.expert_offsets,
                                                        r.blockscale_offsets, torch.empty(M * topk, 2 * I, dtype=dtype),
                                                        r.flat_to_slot, weighted, M, cfg, in_gemm=True)
            reduce(torch.rand(M, topk, generator=gen) if weighted else None, torch.empty(M, 2 * I, dtype=dtype))
    # precision="w4a16" (STAGES_VALUES_W4A16): the values GEMM on bf16 rows (the weight tiles converted to
    # bf16), the values table's decode and prefill rows and its dense tile.
    rows16 = torch.randn(M * topk, H, generator=gen).bfloat16()
    # and its row stages, the quantization kernels' RAW form: the gathered rows with router weights, the SiLU-and-mul
    # product, the fused routing and rows (decode)
    def raw_row_stages():
        tk.quantize_rows_values_launcher(M, H, gs, r.expert_offsets, r.slot_to_flat, True, rows16, raw=True)(
            x, torch.rand(M * topk, generator=gen))
        tk.silu_mul_quantize_values_launcher(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs,
                                             r.expert_offsets, torch.empty(M * topk, I, dtype=torch.bfloat16),
                                             raw=True)()
        fused = (small.expert_offsets, small.blockscale_offsets, small.slot_to_flat, small.flat_to_slot)
        tk.routing_quantize_values_launcher(2, H, gs, *(t.clone() for t in fused), True,
                                            torch.empty(2 * topk, H, dtype=torch.bfloat16), raw=True)(
            ids[:2], x[:2], torch.rand(2 * topk, generator=gen))

    raw_row_stages()
    for cfg in (tk.GEMM_VALUES_CONFIGS[0][1], tk.GEMM_VALUES_CONFIGS[-2][1], tk.GEMM_VALUES_CONFIGS[-1][1]):
        tk.grouped_gemm_launcher(rows16, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, 2 * I, dtype=torch.bfloat16), cfg)()
    # Off Hopper (each set compiled for its targets only, _OFF_HOPPER): precision="w4a16"'s values GEMM on its
    # portable table, bf16 and fp16 rows, its decode tile split with the split-K and top-k reduces, the RAW row
    # stages (8.x, 10.x, 12.x); the codes GEMM's own table on 10.x (GEMM_CONFIGS_SM100) and its table on 12.x,
    # each row unsplit and, where the table lets the plan choose, split in two.
    start = len(captured)
    for (_, cfg), rows in itertools.product(tk.GEMM_VALUES_PORTABLE_CONFIGS, (rows16, rows16.half())):
        tk.grouped_gemm_launcher(rows, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                                 torch.empty(M * topk, 2 * I, dtype=rows.dtype), cfg)()
    split16 = dataclasses.replace(tk.GEMM_VALUES_PORTABLE_CONFIGS[0][1], split_k=2)
    tk.grouped_gemm_launcher(rows16, None, k16, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets,
                             torch.empty(M * topk, 2 * I, dtype=torch.bfloat16), split16)()
    y16 = torch.empty(M * topk, 2 * I, dtype=torch.bfloat16)
    _, reduce = tk.grouped_gemm_reduce_launcher(rows16, None, k16, down.scales, down.alpha, r.expert_offsets,
                                                r.blockscale_offsets, y16, r.flat_to_slot, False, M, split16)
    reduce(None, torch.empty(M, 2 * I, dtype=torch.bfloat16))
    raw_row_stages()
    _OFF_HOPPER.update(dict.fromkeys(range(start, len(captured)), ("w4a16", (80, 100, 120))))
    for name, table, archs in (("codes-sm100", tk.GEMM_CONFIGS_SM100, (100, 103)),
                               ("codes-sm120", tk.GEMM_CONFIGS, (120, 121))):
        start = len(captured)
        for _, cfg in table:
            for split in (1, 2) if cfg.split_k == 0 else (cfg.split_k,):
                tb.grouped_gemm(a, wt, r, torch.bfloat16, config=dataclasses.replace(cfg, split_k=split))
        _OFF_HOPPER.update(dict.fromkeys(range(start, len(captured)), (name, archs)))
    # and the rest of the codes pipeline (W4A4 wherever the values operand does not run: 8.x, 10.x, 12.x): routing
    # (one program and chunked), the codes quantization of rows and of the SiLU-and-mul product, the top-k reduce.
    start = len(captured)
    tb.routing(ids[:4], E)
    tb.routing(ids, E)
    tb.quantize_rows(x, gs, r, row_scale=torch.rand(M * topk, generator=gen))
    tb.silu_mul_quantize(torch.randn(M * topk, 2 * I, generator=gen).bfloat16(), gs, r)
    tb.moe_reduce(torch.randn(M * topk, H, generator=gen).bfloat16(), r, torch.rand(M, topk), M, torch.bfloat16)
    _OFF_HOPPER.update(dict.fromkeys(range(start, len(captured)), ("codes-pipeline", (80, 100, 120))))
    return captured


# The captured launches compiled off Hopper: index -> (the set's name, its targets) (set by the capture).
_OFF_HOPPER: dict[int, tuple[str, tuple[int, ...]]] = {}


def _compile(fn, args, kwargs, arch: int):
    """triton.compile for ``cuda:arch`` with the signature and specializations a launch would get."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr_types = {torch.uint8: "*u8", torch.int32: "*i32", torch.float32: "*fp32", torch.bfloat16: "*bf16",
                 torch.float16: "*fp16"}
    option_names = ("num_warps", "num_stages", "enable_fp_fusion", "enable_reflect_ftz", "launch_pdl", "maxnreg")
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in option_names})
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = values[name] if name in values else param.default  # a constexpr the launch leaves at its default
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = ptr_types[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned on CUDA
        elif isinstance(v, int):
            if v == 1 and not param.do_not_specialize:
                signature[name], constants[name] = "constexpr", 1
            else:
                signature[name] = "i32"
                if v % 16 == 0 and not param.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{fn.__name__}: unexpected argument {name}={v!r}")
    options = {k: kwargs[k] for k in option_names if k in kwargs}
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _sass(cubin: bytes, arg: str) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), arg, f.name], capture_output=True, text=True, check=True).stdout


def _opcodes(sass: str) -> list[str]:
    """Every opcode of the SASS listing, in order."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)[^;]*;", sass)]


def _main_loop(sass: str) -> list[str]:
    """Opcodes of the K loop of a GEMM: the body of the longest backward branch with an MMA in it."""
    instrs = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
              re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    loops = [(int(t.group(1), 16), addr) for addr, op, args in instrs if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", args)] if t and int(t.group(1), 16) <= addr]
    def body(lo_hi):
        return [op for addr, op, _ in instrs if lo_hi[0] <= addr <= lo_hi[1]]

    # (the longest loop holding an MMA: the dense GEMM's K loop is shorter than its tile search)
    with_mma = [ab for ab in loops if any(op.startswith(("HMMA", "HGMMA")) for op in body(ab))]
    return body(max(with_mma or loops, key=lambda ab: ab[1] - ab[0], default=(0, -1)))


def _resource_usage(cubin: bytes) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", _sass(cubin, "-res-usage"))}


def _worker() -> None:
    """Compile every captured launch; print one JSON record per (kernel, arch)."""
    from moe_fp4.backends import _triton_batch

    records = []
    for i, (fn, args, captured) in enumerate(_capture_launches()):
        # The values GEMM of W4A4 (STAGES_VALUES) serves compute capability 9.x only.
        both = fn.__name__ == "grouped_gemm_kernel" and not captured.get("VALUES")
        off_hopper, targets = _OFF_HOPPER.get(i, ("", (90, 80) if both else (90,)))
        for arch in targets:
            # On sm_90 the launchers turn programmatic dependent launch on (PDL; off on the CPU that
            # captured these launches), on sm_80 it stays off.
            kwargs = dict(captured, PDL=arch >= 90, launch_pdl=arch >= 90) if "PDL" in captured else captured
            constexprs = {k: getattr(v, "value", v) for k, v in kwargs.items() if k.isupper()}
            constexprs = {k: v if isinstance(v, (int, bool)) else str(v) for k, v in constexprs.items()}
            kernel = _compile(fn, args, kwargs, arch)
            ptx = kernel.asm["ptx"]
            # (Triton 3.6's cuobjdump disassembles no sm_103 or sm_121 code; their checks read the PTX and -res-usage)
            sass = "" if arch in (103, 121) else _sass(kernel.asm["cubin"], "-sass")
            loop = _main_loop(sass) if fn.__name__ == "grouped_gemm_kernel" else []
            body = _opcodes(sass) if fn.__name__ == "dequantize_k16_kernel" else []
            # the quantization kernels: static instructions per element of a program (no loop over K)
            quant = fn.__name__ in ("quantize_grouped_kernel", "routing_quantize_kernel")
            per_thread = constexprs.get("BLOCK_R", 1) * constexprs.get("BLOCK_K", 1) / (32 * kwargs.get("num_warps", 4))
            records.append({
                "kernel": fn.__name__, "arch": arch, "constexprs": constexprs, "off_hopper": off_hopper,
                "shared": kernel.metadata.shared,
                "options": {k: kwargs[k] for k in ("enable_fp_fusion", "num_warps") if k in kwargs},
                "usage": _resource_usage(kernel.asm["cubin"]),
                "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                "tcgen05": ptx.count("tcgen05.mma"), "trap": len(re.findall(r"^\s*trap;", ptx, re.M)),
                "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (?:16|0x10)", ptx)),
                "div_rn": ptx.count("div.rn.f32"), "div_approx": len(re.findall(r"div\.(?:approx|full)", ptx)),
                "fma": len(re.findall(r"\bfma\.r[nmpz]", ptx)), "ld_v4": ptx.count("ld.global.v4"),
                "asm_hmul": ptx.count("mul.rn.f16x2"), "loop": len(loop),
                "loop_mma": sum(op.startswith(("HMMA", "HGMMA")) for op in loop),
                "loop_prmt": sum(op.startswith("PRMT") for op in loop),
                # the operand construction: integer bit work and the fp16 scale multiplies
                "loop_alu": sum(op.startswith(("LOP3", "SHF", "IMAD", "LEA", "PRMT", "HMUL2")) for op in loop),
                # the dense GEMM's dequantization kernel (no loop): its whole body
                "body": len(body),
                "body_alu": sum(op.startswith(("LOP3", "SHF", "IMAD", "LEA", "PRMT", "HMUL2")) for op in body),
                "per_element": round(len(_opcodes(sass)) / per_thread, 2) if quant else 0,
                "cvt_bf16": len(re.findall(r"cvt\.rn\.bf16(?:x2)?\.f32", ptx)),
                "rows": kernel.src.signature.get("a_ptr") if fn.__name__ == "grouped_gemm_kernel" else None,
                "ptx_params": _triton_batch.ptx_param_sizes(ptx),
                "launcher_params": _triton_batch.launcher_param_sizes(list(kernel.src.signature.values())),
                "gdc_wait": ptx.count("griddepcontrol.wait"),
                "gdc_launch": ptx.count("griddepcontrol.launch_dependents"),
                "atom_acq_rel": len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
                "ld_cg": len(re.findall(r"ld\.global\.cg\.", ptx)),
                # an acquire-release atom after a bar.sync with no global memory access between them
                "bar_then_atom": len(re.findall(r"bar\.sync[^\n]*\n(?:(?![^\n]*(?:ld|st)\.global)[^\n]*\n){0,12}?"
                                                r"[^\n]*atom\.global\.gpu\.acq_rel", ptx)),
            })
    print(json.dumps(records))


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _quant_table() -> tuple:
    from moe_fp4.backends import triton as tb

    return tb.kernels().QUANT_CONFIGS


def _gemm_table(values: bool = False) -> tuple:
    from moe_fp4.backends import triton as tb

    return tb.kernels().GEMM_VALUES_CONFIGS if values else tb.kernels().GEMM_CONFIGS


def _values_tiles() -> tuple:
    """Every tile the values table can choose (its rows' and the narrow-grid one)."""
    from moe_fp4.backends import triton as tb

    return tb.kernels().GEMM_VALUES_TILES


def _pick(records, kernel, w4a16: bool = False, off_hopper: str = "", **constexprs):
    """The records of ``kernel`` with these constexprs: those of W4A4, or with ``w4a16`` those of
    ``precision="w4a16"`` (the GEMMs of bf16 rows, the quantization kernels' RAW form); with ``off_hopper`` those
    of that set of launches compiled off Hopper only (``"w4a16"``, ``"codes-sm100"``, ``"codes-sm120"``), without
    it none of them."""
    return [r for r in records
            if r["kernel"] == kernel and all(r["constexprs"].get(k) == v for k, v in constexprs.items())
            and r["off_hopper"] == off_hopper
            and (off_hopper or (r.get("rows") == "*bf16" or bool(r["constexprs"].get("RAW"))) == w4a16)]


def test_every_kernel_compiles_without_spills(compiled):
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"routing_small_kernel", "routing_count_kernel", "routing_scan_kernel", "routing_scatter_kernel",
                       "quantize_grouped_kernel", "routing_quantize_kernel", "grouped_gemm_kernel",
                       "split_k_reduce_kernel", "moe_reduce_kernel", "dequantize_k16_kernel",
                       "split_k_topk_reduce_kernel"}
    spilled = [(r["kernel"], r["arch"], r["constexprs"], r["usage"]) for r in compiled if r["usage"].get("STACK", 0)]
    assert not spilled, spilled


def test_every_kernel_waits_for_its_predecessor_under_pdl(compiled):
    """With PDL (sm_90) every pipeline kernel waits for the kernel before it, then lets the next one
    be scheduled (triton_kernels/_gdc.py); without (sm_80) neither instruction is there."""
    for r in compiled:
        assert "PDL" in r["constexprs"], r["kernel"]  # every launcher passes it
        want = 1 if r["arch"] >= 90 else 0
        assert (r["gdc_wait"], r["gdc_launch"]) == (want, want), r


def test_every_kernel_takes_the_parameters_a_batched_launch_passes(compiled):
    """moe_fp4_launch_kernels passes what Triton's launcher passes (backends/_triton_batch.py): the
    kernel's own parameter list, as its PTX entry declares it, is exactly that, for every kernel."""
    for r in compiled:
        assert r["launcher_params"] is not None and r["ptx_params"] == r["launcher_params"], r


def test_gemm_uses_tensor_cores_and_16_byte_weight_loads(compiled):
    gemms = _pick(compiled, "grouped_gemm_kernel")
    # codes: the table + 3 pinned + fp16 + E > 256, for sm_90 and sm_80; values: its tiles + 3, and its
    # table + the split one with the SiLU-and-mul quantization in the epilogue, sm_90; the reduces in the GEMMs'
    # launches: 3 codes (sm_90 and sm_80) and 4 values
    assert len(gemms) == 2 * (len(_gemm_table()) + 5) + len(_values_tiles()) + len(_gemm_table(values=True)) + 4 + 10
    for r in gemms:
        assert r["wgmma"] + r["mma_sync"] > 0, r  # bf16 MMAs with float32 accumulation
        if r["arch"] == 80:
            assert r["wgmma"] == 0 and r["mma_sync"] > 0
        if not r["constexprs"]["SWAP_AB"]:
            assert r["cp_async_16"] > 0, r  # packed weights and activations stream in 16-byte copies
    _, prefill = _gemm_table()[-1]
    big = _pick(compiled, "grouped_gemm_kernel", BM=prefill.block_m, BN=prefill.block_n, SWAP_AB=prefill.swap_ab)
    assert any(r["arch"] == 90 and r["wgmma"] > 0 for r in big)  # Hopper's warpgroup MMA for prefill tiles


def test_gemm_operands_cost_few_instructions_per_element(compiled):
    """sm_90 K loops: about 4-5 SASS instructions per operand element (the bf16 float32-decode kernel took 14-21).

    Per K step a thread builds ``(BM + BN) * BK / threads`` operand elements (activations and
    weights); the loop holds that work, the loads and the MMAs. 6 per element leaves room for
    compiler noise and catches a return of the interleave / float32 path or of the PRMT pair
    swaps around the fp16 multiplies (which ``mul_f16``'s inline assembly avoids).
    """
    fast = [r for r in _pick(compiled, "grouped_gemm_kernel", FAST=True, ASM=True) if r["arch"] == 90
            and not r["constexprs"].get("DENSE")]  # (the dense GEMM builds no operand: test_dense_gemm_...)
    assert fast
    for r in fast:
        c = r["constexprs"]
        elements = (c["BM"] + c["BN"]) * c["BK"] / (32 * r["options"]["num_warps"])
        assert r["loop_mma"] > 0 and r["asm_hmul"] > 0, r
        assert r["loop"] <= 6 * elements, (r["loop"] / elements, r)
        assert r["loop_prmt"] <= elements / 2, r


def _codes_twin(compiled, values_record) -> dict | None:
    """The codes-operand GEMM compiled with the same configuration as a values-operand one (None for
    the values table's own tiles, which the codes table does not have)."""
    same = ("BM", "BN", "BK", "SWAP_AB", "SPLIT", "FAST", "ASM")
    twins = [r for r in _pick(compiled, "grouped_gemm_kernel", VALUES=False, **{k: values_record["constexprs"][k]
                                                                               for k in same})
             if r["arch"] == values_record["arch"] and r["options"] == values_record["options"]]
    return twins[0] if twins else None


def test_values_gemm_dequantizes_only_the_weights_cheaply(compiled):
    """The values-operand GEMM (STAGES_VALUES: fp16 activations, K16 weights) on sm_90: its K loop
    builds only the weight operand, so its operand work (integer bit operations, PRMTs and the
    fp16 scale multiplies) per weight element is below that of the codes GEMM of the same
    configuration, which also builds the activation operand, and its whole loop is no longer.

    Measured at this commit (benchmarks/results/triton-sass-2026-12-01.md): 2.2-2.4 operations per
    weight element with the inline-assembly multiply (3.8-5.9 for the codes GEMM). The bound of
    2.8 catches a return of the canonical nibble extraction (15 integer operations per word
    instead of 11) or of scale bytes picked per tile through shared memory (2.6-3.1); the goal
    is 2 (1.5 + one multiply per pair, hopper_gemm.md section 3).
    """
    values = [r for r in _pick(compiled, "grouped_gemm_kernel", VALUES=True) if r["arch"] == 90
              and not r["constexprs"].get("SILU")]
    # its tiles, the 3 pinned ones, the split one whose reduce takes the SiLU-and-mul quantization and the 3
    # with the reduces in their launch
    assert len(values) == len(_values_tiles()) + 4 + 3
    twins = 0
    for r in values:
        c = r["constexprs"]
        weights = c["BN"] * c["BK"] / (32 * r["options"]["num_warps"])
        twin = _codes_twin(compiled, r)
        assert r["loop_mma"] > 0 and r["cp_async_16"] > 0, r  # tensor cores; 16-byte copies of the values too
        if twin is not None:
            twins += 1
            assert r["loop_alu"] < twin["loop_alu"] and r["loop"] <= twin["loop"], (r, twin)
        if c["FAST"] and c["ASM"]:
            assert r["loop_alu"] <= 2.8 * weights, (r["loop_alu"] / weights, r)
    assert twins >= 3 + sum(cfg in dict(_gemm_table()).values() for cfg in _values_tiles())


def test_dense_gemm_multiplies_copies_and_its_dequantization_is_cheap(compiled):
    """The dense GEMM (GemmConfig.dense_mib, the values table past DENSE_FROM rows per expert) on sm_90:
    its K loop is wgmma on 16-byte asynchronous copies of both fp16 operands with no operand work (only
    address arithmetic: 0.20 integer operations per weight element at this commit, 107 SASS instructions
    per 128 x 256 x 64 step, against 2.20 and 472 for the in-loop 64 x 256 x 64 values tile; the bound
    of 0.5 catches a dequantization in the loop), and the kernel that
    dequantizes the weights for it builds the operand as the in-loop GEMM does (the K16 masks and one
    fp16x2 multiply per pair, inline assembly, 16-byte loads of the codes). Its whole body, not a loop,
    holds 4.05 integer operations and multiplies per weight element at this commit (5.75 instructions),
    the address arithmetic of its stores in natural K order included; the bound of 5 catches a return
    of the float32 decode. It is memory-bound (~2.6 bytes per element) all the same."""
    dense = [r for r in _pick(compiled, "grouped_gemm_kernel", DENSE=True) if r["arch"] == 90]
    assert len(dense) == 2  # the table's tile, with and without the SiLU-and-mul quantization epilogue
    for r in dense:
        c = r["constexprs"]
        weights = c["BN"] * c["BK"] / (32 * r["options"]["num_warps"])
        assert r["wgmma"] > 0 and r["loop_mma"] > 0 and r["cp_async_16"] > 0 and r["asm_hmul"] == 0, r
        assert r["loop_alu"] <= 0.5 * weights, (r["loop_alu"] / weights, r)
    deq = _pick(compiled, "dequantize_k16_kernel")
    assert len(deq) == 3, deq  # the dense GEMM's launches above: W4A4 (2) and W4A16 (1)
    for r in deq:
        c = r["constexprs"]
        weights = c["BN"] * c["BK"] / (32 * r["options"]["num_warps"])
        assert r["arch"] == 90 and r["asm_hmul"] > 0 and r["ld_v4"] > 0, r
        assert r["body_alu"] <= 5 * weights, (r["body_alu"] / weights, r)


def test_w4a16_gemm_multiplies_bf16_rows_on_wgmma_at_a_conversion_per_weight(compiled):
    """The values GEMM on bf16 rows (``precision="w4a16"``) on sm_90: wgmma on bf16 operands, the weight tiles
    built as for fp16 rows (the same integer work in the K loop) and then converted to bf16, which the
    fp16 rows' twin does not do. Measured at this commit: +1.5 SASS instructions per weight element in the
    decode (16 x 64 x 256, 495 -> 687 per loop) and prefill (64 x 256 x 64, 472 -> 664) tiles, +1.9 in the
    dense tile (107 -> 226), registers 72 / 235 / 250 (fp16 rows: 72 / 216 / 199), no spills. The bound of 2
    per weight element catches a conversion through float32 of both operands or of the whole tile; building
    bf16 weight bits directly would save the conversion (not done)."""
    rows = [r for r in _pick(compiled, "grouped_gemm_kernel", w4a16=True)]
    assert len(rows) == 3 and all(r["arch"] == 90 for r in rows), rows  # the decode, prefill and dense tiles
    same = ("BM", "BN", "BK", "SWAP_AB", "SPLIT", "FAST", "ASM", "VALUES", "DENSE")
    for r in rows:
        c = r["constexprs"]
        weights = c["BN"] * c["BK"] / (32 * r["options"]["num_warps"])
        twins = [t for t in _pick(compiled, "grouped_gemm_kernel", **{k: c.get(k) for k in same})
                 if t["arch"] == 90 and t["rows"] == "*fp16" and t["options"] == r["options"]
                 and not t["constexprs"].get("SILU") and not t["constexprs"].get("FIXUP")
                 and not t["constexprs"].get("TOPK")]
        assert twins, r
        twin = twins[0]
        assert r["wgmma"] > 0 and r["loop_mma"] == twin["loop_mma"] and r["cp_async_16"] > 0, (r, twin)
        assert r["loop_alu"] == twin["loop_alu"], (r, twin)
        assert twin["loop"] < r["loop"] <= twin["loop"] + 2 * weights, ((r["loop"] - twin["loop"]) / weights, r)


def test_w4a16_off_hopper_compiles_for_sm80_sm100_and_sm120(compiled):
    """``precision="w4a16"`` off Hopper: the values GEMM's portable table (``GEMM_VALUES_PORTABLE_CONFIGS``) on
    bf16 and fp16 rows, its decode tile split in two with the split-K and top-k reduces, and the RAW row stages,
    compiled for sm_80, sm_100 and sm_120: tensor-core MMAs (``mma.sync`` on sm_80 and sm_120, ``tcgen05.mma`` on
    sm_100; none has wgmma), 16-byte asynchronous loads on sm_80 and sm_120 where the tile is not swapped, no
    spills (with every other launch, in :func:`test_every_kernel_compiles_without_spills`) and at most 99 KiB of
    shared memory a block on sm_80 and sm_120, which is what sm_86, sm_89 and sm_120 give one (the Hopper
    table's dense 128 x 256 tile takes more; sm_100 gives 227 KiB). Compiled only: no GPU of those generations
    exists here."""
    from moe_fp4.backends import triton as tb

    tk = tb.kernels()
    archs = (80, 100, 120)
    ported = [r for r in compiled if r["off_hopper"] == "w4a16"]
    assert {(r["kernel"], r["arch"]) for r in ported} == {
        (k, a) for k in ("grouped_gemm_kernel", "split_k_reduce_kernel", "split_k_topk_reduce_kernel",
                         "quantize_grouped_kernel", "routing_quantize_kernel") for a in archs}
    limit = {80: tk.PORTABLE_SHARED_BYTES, 100: 227 * 1024, 120: tk.PORTABLE_SHARED_BYTES}
    over = [(r["kernel"], r["arch"], r["constexprs"], r["shared"]) for r in ported if r["shared"] > limit[r["arch"]]]
    assert not over, over
    gemms = _pick(compiled, "grouped_gemm_kernel", off_hopper="w4a16")
    assert len(gemms) == 3 * (2 * len(tk.GEMM_VALUES_PORTABLE_CONFIGS) + 1)  # per target: each tile x 2 dtypes, split
    for (_, cfg), arch in itertools.product(tk.GEMM_VALUES_PORTABLE_CONFIGS, archs):
        tile = [r for r in gemms if r["arch"] == arch and not r["constexprs"]["SPLIT"]
                and (r["constexprs"]["BM"], r["constexprs"]["BN"], r["constexprs"]["BK"]) ==
                (cfg.block_m, cfg.block_n, cfg.block_k)]
        assert {r["rows"] for r in tile} == {"*bf16", "*fp16"}, (cfg, arch)
    for r in gemms:
        assert r["wgmma"] == 0, r
        if r["arch"] == 100:
            assert r["tcgen05"] > 0, r
        else:
            assert r["mma_sync"] > 0 and r["loop_mma"] > 0, r
            if not r["constexprs"]["SWAP_AB"]:
                assert r["cp_async_16"] > 0, r


def test_the_codes_gemm_compiles_for_blackwell_without_traps_or_spills(compiled):
    """The codes GEMM (W4A4 on the Triton backend, where ``backend="auto"`` falls back to it on Blackwell without the
    CUDA library) compiled with its tables for sm_100 (``GEMM_CONFIGS_SM100``) and sm_120 (``GEMM_CONFIGS``), each
    row unsplit and split, also for sm_103 (B300) and sm_121 (DGX Spark): tensor-core MMAs (``tcgen05.mma`` on
    sm_100/sm_103, ``mma.sync`` on sm_120/sm_121), no spills (in :func:`test_every_kernel_compiles_without_spills`)
    and no ``trap``: Triton 3.6 compiles the codes GEMM's 128 x 128 tiles for sm_100 and sm_103 to a lone ``trap``
    (the whole kernel), which the sm_100 table avoids. (Triton 3.6's ptxas does not know sm_110: 11.x is not
    compiled.) Compiled only: no Blackwell GPU exists here."""
    from moe_fp4.backends import triton as tb

    tk = tb.kernels()
    for name, table, archs, mma in (("codes-sm100", tk.GEMM_CONFIGS_SM100, (100, 103), "tcgen05"),
                                    ("codes-sm120", tk.GEMM_CONFIGS, (120, 121), "mma_sync")):
        gemms = _pick(compiled, "grouped_gemm_kernel", off_hopper=name)
        assert len(gemms) == len(archs) * sum(2 if cfg.split_k == 0 else 1 for _, cfg in table), name
        for arch in archs:
            assert {(r["constexprs"]["BM"], r["constexprs"]["BN"], r["constexprs"]["BK"]) for r in gemms
                    if r["arch"] == arch} == {(cfg.block_m, cfg.block_n, cfg.block_k) for _, cfg in table}
        for r in gemms:
            assert r["arch"] in archs and r["trap"] == 0 and r[mma] > 0 and r["wgmma"] == 0, r


def test_no_kernel_compiles_to_a_trap(compiled):
    """No compiled kernel holds a ``trap`` (what Triton emits for a kernel it cannot lower: the codes GEMM's 128 x 128
    tiles on sm_100). The codes pipeline's other kernels are compiled for sm_80, sm_100 and sm_120 too."""
    trapped = [(r["kernel"], r["arch"], r["constexprs"]) for r in compiled if r["trap"]]
    assert not trapped, trapped
    pipeline = {(r["kernel"], r["arch"]) for r in compiled if r["off_hopper"] == "codes-pipeline"}
    assert pipeline == {(k, a) for a in (80, 100, 120)
                        for k in ("routing_small_kernel", "routing_count_kernel", "routing_scan_kernel",
                                  "routing_scatter_kernel", "quantize_grouped_kernel", "moe_reduce_kernel")}


def test_every_kernel_for_sm80_and_sm120_fits_the_shared_memory_of_a_consumer_gpu(compiled):
    """Every kernel compiled for sm_80, sm_120 or sm_121 takes at most 99 KiB of shared memory a block: what sm_86,
    sm_89 (RTX 30xx/40xx, L40S: they run sm_80-family code) and sm_120/sm_121 (RTX 50xx, RTX PRO 6000, DGX Spark)
    give one."""
    from moe_fp4.backends import triton as tb

    limit = tb.kernels().PORTABLE_SHARED_BYTES
    over = [(r["kernel"], r["arch"], r["constexprs"], r["shared"]) for r in compiled
            if r["arch"] in (80, 120, 121) and r["shared"] > limit]
    assert not over, over
    assert any(r["arch"] == 80 for r in compiled) and any(r["arch"] == 120 for r in compiled)


def test_gemm_with_the_silu_quantization_keeps_its_loop_and_quantizes_exactly(compiled):
    """The values plans' first GEMM with the SiLU-and-mul quantization fused (in the epilogue, or in the
    split-K reduce): its K loop is the plain values GEMM's (the paired rows change addresses only), and
    the fused quantization is compiled as the quantization kernel is (no contraction, IEEE division). A
    split GEMM takes pairs only with FIXUP (its last K ranges quantize); otherwise its reduce does."""
    fused = _pick(compiled, "grouped_gemm_kernel", VALUES=True, SILU=True)
    # the table's tiles, and a split one whose last K ranges add the sums (FIXUP) before the quantization
    assert len(fused) == len(_gemm_table(values=True)) + 1
    assert all(r["constexprs"].get("FIXUP", False) == r["constexprs"]["SPLIT"] for r in fused), fused
    same = ("BM", "BN", "BK", "SWAP_AB", "SPLIT", "FAST", "ASM")

    def launch_options(rec) -> dict:  # but the fused quantization's compile options
        return {k: v for k, v in rec["options"].items() if k not in ("enable_fp_fusion", "enable_reflect_ftz")}

    for r in fused:
        plain = [p for p in _pick(compiled, "grouped_gemm_kernel", VALUES=True, **{k: r["constexprs"][k] for k in same})
                 if not p["constexprs"].get("SILU") and launch_options(p) == launch_options(r)]
        assert plain, r
        assert r["loop"] <= plain[0]["loop"] + 8, (r["loop"], plain[0]["loop"])
        assert r["options"]["enable_fp_fusion"] is False and r["div_rn"] > 0 and r["div_approx"] == 0, r
    reduce = _pick(compiled, "split_k_reduce_kernel", SILU=True)
    assert len(reduce) == 1
    assert reduce[0]["options"]["enable_fp_fusion"] is False and reduce[0]["div_rn"] > 0, reduce


def test_gemm_takes_its_reduces_after_a_barrier_and_an_acquire_release_count(compiled):
    """The GEMMs with the reduces in their own launch (``FIXUP``: a split GEMM's K ranges; ``TOPK``: the top-k
    reduce): each counter is one thread's ``atom.global.gpu.acq_rel.add`` right after a ``bar.sync`` (every
    thread's stores of the program ordered before its count), what other programs wrote is read through the
    L2 (``ld.global.cg``), the K loop is the plain GEMM's, and the top-k sum is compiled as ``moe_reduce_kernel``
    is (no FMA contraction: the same bits). The memory ordering itself is exercised only on a GPU. (Triton 3.6
    puts a ``bar.sync`` before a scalar atomic anyway, for the shared memory that broadcasts its result: the
    kernel's own barrier does not rely on that, and this check cannot tell the two apart.)"""
    gemms = [r for r in _pick(compiled, "grouped_gemm_kernel") if r["constexprs"].get("FIXUP")
             or r["constexprs"].get("TOPK")]
    # FIXUP alone: codes (sm_90, sm_80) and values (also with SILU); TOPK split (with FIXUP) and unsplit, the same
    assert len(gemms) == 10 and sum(bool(r["constexprs"].get("TOPK")) for r in gemms) == 6, gemms
    same = ("BM", "BN", "BK", "SWAP_AB", "SPLIT", "FAST", "ASM", "VALUES")
    for r in gemms:
        c = r["constexprs"]
        sites = bool(c.get("FIXUP")) + bool(c.get("TOPK"))
        assert r["atom_acq_rel"] == sites and r["bar_then_atom"] == sites and r["ld_cg"] > 0, r
        plain = [p for p in _pick(compiled, "grouped_gemm_kernel", **{k: c[k] for k in same})
                 if p["arch"] == r["arch"] and not p["constexprs"].get("FIXUP") and not p["constexprs"].get("TOPK")
                 and not p["constexprs"].get("SILU") and p["options"]["num_warps"] == r["options"]["num_warps"]]
        assert plain, r
        # the same loop: -6 to +8 instructions of scheduling at this commit (385 against 377 the most), 2 of slack
        assert r["loop"] <= plain[0]["loop"] + 10, (r["loop"], plain[0]["loop"], r)
        if c.get("TOPK"):
            assert r["options"]["enable_fp_fusion"] is False and r["fma"] == 0, r
    assert any(p for r in gemms for p in [r] if r["arch"] == 80)  # sm_80 compiles them too


def test_quantizer_divides_exactly_and_never_contracts(compiled):
    quant = _pick(compiled, "quantize_grouped_kernel")
    # + the two values front ends; in WHOLE_BLOCK_CONFIGS' shapes, with whole blocks per thread and not, the
    # values gather with and without router weights, the values SiLU and both codes front ends
    assert len(quant) == 6 + len(_quant_table()) + 10 * len(WHOLE_BLOCK_CONFIGS)
    for r in quant:
        assert r["options"]["enable_fp_fusion"] is False
        assert r["div_rn"] > 0 and r["div_approx"] == 0, r
        assert r["ld_v4"] > 0  # 16-byte loads of the 16-bit rows
    fused = _pick(compiled, "routing_quantize_kernel")  # the same quantizer, fused with the routing
    assert len(fused) == 2
    for r in fused:
        assert r["options"]["enable_fp_fusion"] is False and r["div_rn"] > 0 and r["div_approx"] == 0, r
    gather = _pick(compiled, "quantize_grouped_kernel", MODE=1)
    # (the SiLU variant's FMAs are libdevice expf's own)
    assert len(gather) == 3 + len(_quant_table()) + 6 * len(WHOLE_BLOCK_CONFIGS)
    assert all(r["fma"] == 0 for r in gather)
    reduce = _pick(compiled, "moe_reduce_kernel")
    assert len(reduce) == 1 and reduce[0]["fma"] == 0 and reduce[0]["options"]["enable_fp_fusion"] is False
    # the second GEMM's K ranges and the top-k reduce in one launch: the same roundings, never contracted
    reduce = _pick(compiled, "split_k_topk_reduce_kernel")
    assert len(reduce) == 2 and all(r["fma"] == 0 and r["options"]["enable_fp_fusion"] is False for r in reduce)


def test_w4a16_row_stages_copy_without_quantizing(compiled):
    """The quantization kernels' RAW form (``precision="w4a16"``): no quantizer (no division but the SiLU's
    IEEE one, never contracted), 16-byte loads of the rows, the 16-wide form (never whole blocks)."""
    raw = _pick(compiled, "quantize_grouped_kernel", w4a16=True) + _pick(compiled, "routing_quantize_kernel",
                                                                        w4a16=True)
    assert len(raw) == 3, raw  # the gather with router weights, the SiLU-and-mul, the fused routing
    for r in raw:
        c = r["constexprs"]
        assert c["RAW"] and not c["WHOLE"] and r["options"]["enable_fp_fusion"] is False and r["ld_v4"] > 0, r
        assert r["div_approx"] == 0 and (r["div_rn"] > 0) == (c.get("MODE") == 2), r


def test_whole_block_quantization_takes_fewer_instructions(compiled):
    """``QuantConfig.whole_blocks``: each 16-element block in one thread (its maximum, scale and division
    that thread's alone), the e2m1 rounding (values) or code (codes) on the bits, the SiLU's and router
    weight's bf16 roundings by the hardware's conversion. Per element of a program (static SASS, the
    quantization kernels have no loop), the values form: at most 42 instructions for the gather (router
    weights or not) and 68 for the SiLU in every shape compiled (one block per thread at decode: 40.5 and
    67.0), 34 and 62 from two blocks per thread on (33.25 and 61.0), a few percent of headroom for the
    compiler's scheduling (2 more for rows of 256 columns, whose row arithmetic is shared by fewer elements:
    8 x 256 35.25 and 63.0, 2 x 256 on 1 warp, the values SiLU table's row for 65-4096 slots since the
    twenty-fifth session, 43.0 and 69.0); and at most 65% of the 16-wide form's in the same shape (sm_90, prefill shape
    8 x 512, 4 warps: 33.25 and 61.0 against 67.5 and 100.5). The codes form (packed codes, swizzled scales
    and the scale padding's zeroing branch in the same kernel): at most 85% (47.0 and 75.25 against 69.5
    and 102.25 there; 114.5 against 142.0 for the SiLU at decode). benchmarks/README.md, twenty-third
    session."""
    wholes = [r for r in _pick(compiled, "quantize_grouped_kernel") if r["constexprs"].get("WHOLE")]
    # values: gather with and without weights, SiLU; codes: 2; and the values tables' own (whole from 65 slots)
    # for the two values front ends captured without a configuration
    assert len(wholes) == 5 * len(WHOLE_BLOCK_CONFIGS) + 2
    for whole in wholes:
        keys = ("VALUES", "MODE", "HAS_ROW_SCALE", "BLOCK_R", "BLOCK_K")
        shape = {k: whole["constexprs"].get(k, False) for k in keys}
        if shape["VALUES"]:
            two_blocks = shape["BLOCK_R"] * shape["BLOCK_K"] >= 2 * 16 * 32 * whole["options"]["num_warps"]
            limit = (62 if two_blocks else 68) if shape["MODE"] == 2 else (34 if two_blocks else 42)
            if shape["BLOCK_K"] == 256 and shape["BLOCK_R"] > 1:  # rows of 256: more row arithmetic per element
                limit += 2  # (weighted gather and SiLU: 8 x 256 35.25 and 63.0, 2 x 256 43.0 and 69.0)
            assert whole["per_element"] <= limit, whole
        # the bf16 rounding of the SiLU (MODE 2) or the router weight by the hardware
        assert (whole["cvt_bf16"] > 0) == (shape["MODE"] == 2 or shape["HAS_ROW_SCALE"]), whole
        split = [r for r in _pick(compiled, "quantize_grouped_kernel", **shape)
                 if not r["constexprs"].get("WHOLE") and r["options"]["num_warps"] == whole["options"]["num_warps"]]
        assert len(split) == 1, (shape, split)
        assert whole["per_element"] <= (0.65 if shape["VALUES"] else 0.85) * split[0]["per_element"], (whole, split)
        assert split[0]["cvt_bf16"] == 0, split  # the 16-wide form rounds on the bits


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.path.insert(0, str(ROOT))
    _worker()
