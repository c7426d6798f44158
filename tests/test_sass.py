"""The built library's machine code, read with cuobjdump (PyPI nvidia-cuda-cuobjdump).

No SM100 or SM120 GPU is available to this project: the Blackwell grouped GEMMs are compiled
and disassembled here, never executed. These checks are what stands between a build and a
silent stub (CUTLASS 4.2 compiles its block-scaled kernels to 24-register no-ops for plain
sm_100/sm_120):

* the cubins are exactly the targets the library reports, none of them plain Blackwell, and
  the only PTX is compute_90 (the forward-compatible copy of the pipeline kernels);
* every SM120/SM121 GEMM kernel issues block-scaled FP4 MMAs (OMMA.SF ... E2M1.E2M1.UE4M3)
  and every SM100 one tcgen05 block-scaled MMAs (UTCOMMA) with its scale-factor copies to
  tensor memory (UTCCP), with the register count of a real kernel;
* bf16 and fp16 outputs are separate kernels that convert to their own type;
* the pipeline kernels exist for every target and quantize with the hardware e4m3 conversion.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_native import native_library, skip_or_fail

from moe_fp4 import _native

pytestmark = pytest.mark.slow  # two cuobjdump passes over the library: about 10 s

PLAIN_BLACKWELL = re.compile(r"^sm_1[0-9]{2}$")  # sm_100, sm_120, ...: no a/f suffix
STUB_REGISTERS = 24  # what CUTLASS's arch-guarded stub compiles to
GEMM_MARKERS = ("GemmUniversal", "gemm_sm90_cu")  # CUTLASS's kernels; the library's own sm_90a GEMM


@dataclass(frozen=True)
class Kernel:
    arch: str
    name: str
    sass: str
    registers: int
    local_bytes: int = 0
    stack_bytes: int = 0

    @property
    def is_gemm(self) -> bool:
        return any(m in self.name for m in GEMM_MARKERS)

    @property
    def output(self) -> str:
        """The GEMM's output type, from its mangled name (CUTLASS's or CUDA's 16-bit types)."""
        if "10bfloat16_t" in self.name or "13__nv_bfloat16" in self.name:
            return "bf16"
        return "fp16" if "6half_t" in self.name or "6__half" in self.name else "?"


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one of the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for entry in sys.path:
        for sub in ("nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin"):
            candidate = Path(entry) / sub / "cuobjdump"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def split_sections(text: str) -> list[tuple[str, str, str]]:
    """cuobjdump output -> [(kind "elf"/"ptx", arch, body)] per fatbin entry."""
    parts = re.split(r"^Fatbin (elf|ptx) code:\s*$", text, flags=re.M)[1:]
    out = []
    for kind, body in zip(parts[0::2], parts[1::2]):
        arch = re.search(r"^arch = (\S+)", body, flags=re.M)
        out.append((kind, arch.group(1) if arch else "?", body))
    return out


def parse_kernels(sass: str, usage: str) -> list[Kernel]:
    """Kernels of every ELF section of ``--dump-sass``, with registers from ``--dump-resource-usage``."""
    registers = {}
    arch = name = "?"
    for line in usage.splitlines():
        m = re.match(r"^arch = (\S+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"^\s*Function (\S+):$", line)
        if m:
            name = m.group(1)
        m = re.match(r"^\s*REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", line)
        if m:
            registers[(arch, name)] = (int(m.group(1)), int(m.group(3)), int(m.group(2)))
    kernels = []
    for kind, arch, body in split_sections(sass):
        if kind != "elf":
            continue
        parts = re.split(r"^\s*Function : (\S+)\s*$", body, flags=re.M)
        for name, code in zip(parts[1::2], parts[2::2]):
            reg, local, stack = registers.get((arch, name), (-1, -1, -1))
            kernels.append(Kernel(arch, name, code, reg, local, stack))
    return kernels


@pytest.fixture(scope="module")
def disassembly():
    lib = native_library()
    tool = find_cuobjdump()
    if tool is None:
        skip_or_fail("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm: the test extra)")
    env = dict(os.environ, PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))  # nvdisasm beside it

    def dump(flag: str) -> str:
        return subprocess.run([tool, flag, str(lib.path)], capture_output=True, text=True, check=True, env=env).stdout

    sass = dump("--dump-sass")
    return lib, split_sections(sass), parse_kernels(sass, dump("--dump-resource-usage"))


def test_cubins_are_exactly_the_reported_targets(disassembly):
    lib, sections, _ = disassembly
    elf = {arch for kind, arch, _ in sections if kind == "elf"}
    ptx = {arch for kind, arch, _ in sections if kind == "ptx"}
    reported = set(lib.archs(_native.PIPELINE))
    assert elf == {a for a in reported if a.startswith("sm_")}, (elf, reported)
    assert ptx == {"sm_90"} and "compute_90" in reported, ptx  # cuobjdump names compute_90 PTX "sm_90"
    assert set(lib.archs(_native.GEMM)) <= elf


def test_no_plain_blackwell_code(disassembly):
    _, sections, _ = disassembly
    plain = sorted({arch for kind, arch, _ in sections if kind == "elf" and PLAIN_BLACKWELL.match(arch)})
    assert not plain, f"plain Blackwell cubins (CUTLASS stubs there): {plain}"


def test_the_plain_target_check_would_fire():
    """The parser tells sm_120f from plain sm_120 (cuobjdump's list-elf names both 'sm_120')."""
    text = "Fatbin elf code:\n================\narch = sm_120\ncode version = [1,8]\n\n\tFunction : k\n  NOP ;\n"
    [(kind, arch, _)] = split_sections(text)
    assert kind == "elf" and PLAIN_BLACKWELL.match(arch)
    assert not PLAIN_BLACKWELL.match("sm_120f") and not PLAIN_BLACKWELL.match("sm_100a")


def _gemms(kernels: list[Kernel], arch: str) -> list[Kernel]:
    found = [k for k in kernels if k.arch == arch and k.is_gemm]
    assert {k.output for k in found} == {"bf16", "fp16"}, (arch, [k.name[:120] for k in found])
    return found


# What a real (non-stub) grouped GEMM kernel of each family must contain, with what it proves.
GEMM_SIGNATURES = {
    "sm_12": [  # SM120/SM121: mma.sync ... kind::mxf4nvf4.block_scale, operands through TMA
        (r"OMMA\.SF\.\S*E2M1\.E2M1\.UE4M3", "block-scaled FP4 MMA (OMMA.SF ... E2M1.E2M1.UE4M3)"),
        (r"UTMALDG", "TMA loads"),
    ],
    "sm_90": [  # SM90: 16-bit warpgroup MMA on weights dequantized in registers (RS form), TMA activations
        (r"HGMMA\.64x\d+x16\.F32", "16-bit warpgroup MMA (HGMMA.64xNx16.F32; .BF16 for bf16)"),
        (r"UTMALDG", "TMA loads of the activation tiles"),
    ],
    "sm_10": [  # SM100: tcgen05 block-scaled MMA, scale factors copied to tensor memory
        (r"UTCOMMA\.\S*4X", "tcgen05 block-scaled MMA (UTCOMMA ... 4X)"),
        (r"UTCCP", "scale-factor copies to tensor memory (UTCCP)"),
    ],
}


def test_every_gemm_target_has_a_signature(disassembly):
    """A GEMM target outside the families below would pass test_gemm_kernels_are_real unchecked."""
    lib, _, _ = disassembly
    unchecked = [a for a in lib.archs(_native.GEMM) if not any(a.startswith(f) for f in GEMM_SIGNATURES)]
    assert not unchecked, f"GEMM targets without a SASS signature in GEMM_SIGNATURES (add one): {unchecked}"


@pytest.mark.parametrize("family", sorted(GEMM_SIGNATURES), ids=["SM100", "SM120-SM121", "SM90"])
def test_gemm_kernels_are_real(disassembly, family):
    lib, _, kernels = disassembly
    archs = [a for a in lib.archs(_native.GEMM) if a.startswith(family)]
    if not archs:
        pytest.skip(f"this build has no {family}x GEMM")
    for arch in archs:
        for k in _gemms(kernels, arch):
            for pattern, what in GEMM_SIGNATURES[family]:
                assert re.search(pattern, k.sass), f"{arch} {k.output}: no {what} (a stub?)"
            assert k.registers > 2 * STUB_REGISTERS, f"{arch} {k.output}: {k.registers} registers (a stub has ~24)"
            assert k.local_bytes == 0, f"{arch} {k.output}: {k.local_bytes} bytes of local memory (register spills)"
            # No sm_90a GEMM kernel has a stack. One came with 11-18 % slower wide tiles on the H100 when the
            # SiLU epilogue was a runtime branch of every kernel (session 31), and 40 bytes, with slower forwards
            # at 8-16 rows per expert when the 16- and 32-token tiles' kernels held it (session 32); the
            # 8-token tile's kernels, the only ones that hold it, have none.
            if family == "sm_90":
                assert k.stack_bytes == 0, f"{arch} {k.output}: {k.stack_bytes} bytes of stack"
            pack = "F2FP.BF16.F32.PACK_AB" if k.output == "bf16" else "F2FP.F16.F32.PACK_AB"
            assert pack in k.sass, f"{arch} {k.output}: the epilogue does not convert to its output type"


# routing_single_kernel: counters in shared memory (E < 4096) or in the workspace; QuantizeUnit
# writes codes and scales (Blackwell), QuantizeValuesUnit the values only (Hopper), per source
# (gather, SiLU-mul) and dtype; routing_quantize_values_kernel routes and writes the gathered
# values in one launch (decode), per dtype.
PIPELINE_KERNELS = {"routing_single_kernel": 2, "routing_count_kernel": 1, "routing_scan_kernel": 1,
                    "routing_scatter_kernel": 1, "QuantizeUnit": 4, "QuantizeValuesUnit": 4, "ReduceUnit": 6,
                    "routing_quantize_values_kernel": 2}


def test_pipeline_kernels_exist_for_every_target(disassembly):
    lib, _, kernels = disassembly
    for arch in (a for a in lib.archs(_native.PIPELINE) if a.startswith("sm_")):
        names = [k.name for k in kernels if k.arch == arch]
        counts = {stem: sum(stem in n for n in names) for stem in PIPELINE_KERNELS}
        assert counts == PIPELINE_KERNELS, (arch, counts)
        for k in kernels:
            if k.arch == arch and any(q in k.name for q in ("QuantizeUnit", "QuantizeValuesUnit",
                                                            "routing_quantize_values_kernel")):
                # The e4m3 scale is the hardware round-to-nearest-even conversion (cvt.rn.satfinite.e4m3x2.f32).
                assert "F2FP.SATFINITE.E4M3.F32" in k.sass, (arch, k.name)
