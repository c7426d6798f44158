"""libmoe_fp4_cuda on a machine without a GPU: the C ABI (the header against the ctypes table),
its preconditions, the host oracle of the pipeline kernels against moe_fp4.stages (bit for bit)
and the GEMM wiring against the format core's swizzled layout.

The host oracle (``device = MOE_FP4_HOST``) runs the very kernel bodies of quantize.cu and
reduce.cu serially on the host, so these tests check the kernels' indexing, padding, gather,
router-weight and SiLU arithmetic in CI; the GPU tests (test_cuda_pipeline.py) add the
parallel launch and the device conversion instructions.

Without the library these tests fail where the install should have built it (nvcc on PATH and
``MOE_FP4_BUILD_CUDA`` not ``0``, as in CI) and skip elsewhere; ``MOE_FP4_REQUIRE_LIB=1`` or
``=0`` overrides that choice. The header tests need no library.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path

import pytest
import torch
from moe_cases import EDGE_CASES, Case, make_experts, make_inputs, sm90_row_order_stages

from moe_fp4 import _native, fused_moe, stages
from moe_fp4.backends import cutlass
from moe_fp4.buffers import Quantized, RoutingData, WeightOperand
from moe_fp4.errors import BackendUnavailableError, LibraryUnavailable
from moe_fp4.format import (
    E2M1_VALUES,
    grouped_scale_rows_bound,
    swizzled_offset,
    swizzled_shape,
    unpack_e2m1,
    unswizzle_scales_grouped,
)
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, cached_workspace, run_pipeline
from moe_fp4.testing import assert_same_buffers, poison, poisoned_like, routed_ids

ENV_REQUIRE = "MOE_FP4_REQUIRE_LIB"
HEADER = Path(__file__).resolve().parents[1] / "csrc" / "include" / "moe_fp4" / "moe_fp4.h"


def library_required() -> bool:
    """Must the CUDA library (and its test tools) be present? See the module docstring."""
    forced = os.environ.get(ENV_REQUIRE)
    if forced in ("0", "1"):
        return forced == "1"
    build = os.environ.get("MOE_FP4_BUILD_CUDA", "auto").lower() not in ("0", "off", "no", "false")
    return build and (shutil.which("nvcc") is not None or bool(os.environ.get("CUDACXX")))


def skip_or_fail(reason: str) -> None:
    if library_required():
        pytest.fail(f"{reason} (nvcc is available, so the install should have built and checked the library; "
                    f"{ENV_REQUIRE}=0 allows skipping)")
    pytest.skip(reason)


def native_library() -> _native.NativeLibrary:
    """The built library, else skip or fail (see :func:`library_required`)."""
    try:
        return _native.library()
    except LibraryUnavailable as exc:
        skip_or_fail(f"the CUDA library is unusable: {exc}")


@pytest.fixture(scope="module")
def lib() -> _native.NativeLibrary:
    return native_library()


def gemm_archs(lib: _native.NativeLibrary) -> list[int]:
    """The GEMM translation units this build holds (100 and/or 120)."""
    return sorted({100 if a.startswith("sm_10") else 120 for a in lib.archs(_native.GEMM)})


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for the whole of ``message``."""
    return "^" + re.escape(message) + "$"


def assert_stage_exact(stage: str, *args, **kwargs):
    """cutlass's stage ``stage`` writes into poisoned buffers exactly the bytes of the reference stage
    (stages.STAGES), every padding byte included; returns its result."""
    ref = getattr(stages.STAGES, stage)(*args, **kwargs)
    out = poisoned_like(ref)
    got = getattr(cutlass.STAGES, stage)(*args, **kwargs, out=out)
    assert got is out, f"{stage}: the result is not the buffer passed as out="
    assert_same_buffers(got, ref, what=stage)
    return got


def assert_values_only_exact(stage: str, want_set: StageSet, shape: tuple[int, int, int], *args,
                             got_set: StageSet = cutlass.STAGES_SM90, **kwargs):
    """An sm_90a stage set's ``stage`` (``got_set``'s, values only: the kernel runs over the slots, no codes or
    scales) writes exactly the values ``want_set``'s stage writes, and leaves the poisoned codes and scales
    of its output as they were."""
    n, K, E = shape  # noqa: N806
    like = args[0]
    want = getattr(want_set, stage)(*args, **kwargs, out=Quantized.empty(n, K, E, like.device, values=like.dtype))
    out = poisoned_like(Quantized.empty(n, K, E, like.device, values=like.dtype))
    untouched = poisoned_like(out)
    got = getattr(got_set, stage)(*args, **kwargs, out=out)
    assert got is out, f"{stage}: the result is not the buffer passed as out="
    assert_same_buffers(got.values, want.values, what=f"{stage} values")
    assert_same_buffers((got.packed, got.scales), (untouched.packed, untouched.scales), what=f"{stage} codes")


# --------------------------------------------------------------------------- the header against the ctypes table

# The C types of the ABI and their ctypes types (pointers are handled in ctype_of).
C_SCALARS = {"int": c_int, "int32_t": c_int32, "int64_t": c_int64, "size_t": c_size_t}
C_WORDS = {*C_SCALARS, "void", "char", "const", "unsigned", "signed", "long", "short", "struct", "enum"}


@dataclasses.dataclass(frozen=True)
class CEntry:
    """One ``MOE_FP4_API`` declaration: C types normalized (``const int32_t *``), typedefs resolved."""

    name: str
    returns: str
    params: tuple[tuple[str, str], ...]


def _normalize(c_type: str) -> str:
    """``const int32_t *`` -> ``const int32_t*``."""
    return re.sub(r"\s*\*\s*", "*", " ".join(c_type.split()))


def _strip_c(text: str) -> str:
    """``text`` without comments and preprocessor directives (continuation lines included)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)


def parse_header(text: str) -> dict[str, CEntry]:
    """Every ``MOE_FP4_API <ret> <name>(<params>);`` of a C header, by name.

    Enum typedefs become ``int``, other typedefs (``typedef struct CUstream_st* moe_fp4_stream_t``)
    their underlying type. A declaration this parser cannot read raises, naming it.
    """
    code = _strip_c(text)
    typedefs = {}
    for m in re.finditer(r"\btypedef\s+enum\b[^{};]*\{[^}]*\}\s*(\w+)\s*;", code):
        typedefs[m.group(1)] = "int"
    for m in re.finditer(r"\btypedef\s+(?!enum\b)([^;{}]+?)\s*\b(\w+)\s*;", code):
        typedefs[m.group(2)] = _normalize(m.group(1))

    def resolve(c_type: str) -> str:
        return _normalize(re.sub(r"\w+", lambda w: typedefs.get(w.group(), w.group()), c_type))

    entries = {}
    for chunk in code.split(";"):
        if "MOE_FP4_API" not in chunk:
            continue
        m = re.fullmatch(r"\s*MOE_FP4_API\s+([^(){}]*?)\s*\b([A-Za-z_]\w*)\s*\(([^(){}]*)\)\s*", chunk)
        if m is None:
            raise ValueError(f"cannot parse the declaration {' '.join(chunk.split())!r}")
        ret, name, plist = m.groups()
        params = []
        if plist.strip() not in ("", "void"):
            for i, p in enumerate(plist.split(",")):
                pm = re.fullmatch(r"\s*(\S.*?[\s*])([A-Za-z_]\w*)\s*", p)
                if pm is None or pm.group(2) in C_WORDS or pm.group(2) in typedefs:  # a type without a name
                    raise ValueError(f"{name}: cannot parse parameter {i} {p.strip()!r}")
                params.append((pm.group(2), resolve(pm.group(1))))
        entries[name] = CEntry(name, resolve(ret), tuple(params))
    return entries


def ctype_of(c_type: str, *, result: bool = False) -> type | None:
    """The ctypes type a normalized C type travels as (None when there is no rule for it).

    Pointers are addresses (``c_void_p``), but a ``size_t*`` is a size the entry writes
    (``POINTER(c_size_t)``) and a returned ``const char*`` a string (``c_char_p``).
    """
    stars = c_type.count("*")
    base = " ".join(w for w in c_type.replace("*", " ").split() if w != "const")
    if stars == 0:
        return C_SCALARS.get(base)
    if stars == 1 and result and base == "char":
        return c_char_p
    if c_type == "size_t*":
        return POINTER(c_size_t)
    return c_void_p


def _ctype_name(t: type) -> str:
    return f"POINTER({t._type_.__name__})" if hasattr(t, "contents") else t.__name__


def table_mismatches(entries: dict[str, CEntry], table: dict[str, tuple[type, tuple[tuple[str, type], ...]]]):
    """Every difference between the header's ``entries`` and a ctypes ``table`` ``{name: (restype, params)}``,
    one line each, naming the entry and the parameter."""
    problems = [f"{name}: declared in the header, missing from _native's table" for name in entries
                if name not in table]
    problems += [f"{name}: in _native's table, not declared in the header" for name in table if name not in entries]
    for name in (n for n in entries if n in table):
        entry, (restype, params) = entries[name], table[name]
        want = ctype_of(entry.returns, result=True)
        if want is not restype:
            problems.append(f"{name}: returns {entry.returns} ({_ctype_name(want) if want else 'no ctypes rule'}), "
                            f"the table says {_ctype_name(restype)}")
        c_names, t_names = [p for p, _ in entry.params], [p for p, _ in params]
        if c_names != t_names:
            i = next(i for i, (a, b) in enumerate(zip([*c_names, None], [*t_names, None])) if a != b)
            c_at = f"`{dict(entry.params)[c_names[i]]} {c_names[i]}`" if i < len(c_names) else "past the end"
            t_at = f"`{t_names[i]}`" if i < len(t_names) else "past the end"
            problems.append(
                f"{name}: parameter {i} is {c_at} in the header, {t_at} in the table "
                f"(header only: {[p for p in c_names if p not in t_names]}, "
                f"table only: {[p for p in t_names if p not in c_names]})"
            )
        table_types = dict(params)
        for pname, c_type in entry.params:
            if pname not in table_types:
                continue
            want = ctype_of(c_type)
            if want is None:
                problems.append(f"{name}: parameter `{pname}` has C type {c_type}, which no ctypes rule maps")
            elif want is not table_types[pname]:
                problems.append(f"{name}: parameter `{pname}` is {c_type} in the header ({_ctype_name(want)}), "
                                f"{_ctype_name(table_types[pname])} in the table")
    return problems


def test_the_ctypes_table_is_the_header():
    """_native's table declares exactly the header's entries: names, order and types of the parameters."""
    entries = parse_header(HEADER.read_text())
    table = _native.entries()
    problems = table_mismatches(entries, table)
    assert not problems, f"{HEADER.name} and moe_fp4/_native.py disagree:\n  " + "\n  ".join(problems)


# The header's constants that _native restates, by the name _native gives them.
HEADER_CONSTANTS = {
    "MOE_FP4_ABI_VERSION": "ABI_VERSION", "MOE_FP4_HOST": "HOST",
    "MOE_FP4_OK": "OK", "MOE_FP4_ERROR_INVALID_ARGUMENT": "INVALID_ARGUMENT",
    "MOE_FP4_ERROR_UNSUPPORTED": "UNSUPPORTED", "MOE_FP4_ERROR_CUDA": "CUDA_ERROR",
    "MOE_FP4_ERROR_INTERNAL": "INTERNAL",
    "MOE_FP4_BF16": "BF16", "MOE_FP4_FP16": "FP16", "MOE_FP4_FP32": "FP32",
    "MOE_FP4_PIPELINE": "PIPELINE", "MOE_FP4_GEMM": "GEMM",
    "MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS": "ROUTING_QUANTIZE_MAX_SLOTS",
}


def test_the_constants_are_the_headers():
    """ABI version, host ordinal, status, dtype and component codes: as the header defines them."""
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    found = {m.group(1): int(m.group(2)) for m in
             re.finditer(r"\b(MOE_FP4_\w+)(?:\s*=\s*|\s+)\(?(-?\d+)\)?\s*[,}\n]", text)}
    problems = [f"{c}: {'not defined' if c not in found else found[c]} in the header, "
                f"_native.{py} = {getattr(_native, py)}"
                for c, py in HEADER_CONSTANTS.items() if found.get(c) != getattr(_native, py)]
    assert not problems, "\n".join(problems)


SAMPLE_HEADER = """
/* MOE_FP4_API int commented_out(int x); */
#define MOE_FP4_API __attribute__((visibility("default")))
#define LONG_MACRO(a) \\
  MOE_FP4_API int in_a_macro(void);
typedef struct CUstream_st* sample_stream_t;
typedef enum sample_dtype { SAMPLE_A = 0, SAMPLE_B = 1 } sample_dtype;
MOE_FP4_API int sample_call(const void* x, int64_t n, sample_dtype dtype,  // a line comment
                            int32_t* out, size_t* bytes, sample_stream_t stream);
MOE_FP4_API const char* sample_text(void);
MOE_FP4_API int sample_none();
"""


def test_the_header_parser_reads_declarations():
    entries = parse_header(SAMPLE_HEADER)
    assert list(entries) == ["sample_call", "sample_text", "sample_none"]
    call = entries["sample_call"]
    assert call.returns == "int" and call.params == (
        ("x", "const void*"), ("n", "int64_t"), ("dtype", "int"), ("out", "int32_t*"), ("bytes", "size_t*"),
        ("stream", "struct CUstream_st*"))
    assert [ctype_of(t) for _, t in call.params] == [c_void_p, c_int64, c_int, c_void_p, POINTER(c_size_t), c_void_p]
    assert entries["sample_text"].params == entries["sample_none"].params == ()
    assert ctype_of(entries["sample_text"].returns, result=True) is c_char_p
    with pytest.raises(ValueError, match=re.escape(
            "cannot parse the declaration 'MOE_FP4_API int broken(int (*f)(void))'")):
        parse_header("MOE_FP4_API int broken(int (*f)(void));")
    for unnamed in ("int", "const int", "int32_t*"):
        with pytest.raises(ValueError, match=re.escape(f"broken: cannot parse parameter 1 {unnamed!r}")):
            parse_header(f"MOE_FP4_API int broken(int a, {unnamed});")


def test_a_table_that_differs_from_the_header_is_named():
    entries = parse_header(SAMPLE_HEADER)
    good = {
        "sample_call": (c_int, (("x", c_void_p), ("n", c_int64), ("dtype", c_int), ("out", c_void_p),
                                ("bytes", POINTER(c_size_t)), ("stream", c_void_p))),
        "sample_text": (c_char_p, ()),
        "sample_none": (c_int, ()),
    }
    assert table_mismatches(entries, good) == []
    restype, params = good["sample_call"]
    inserted = {**good, "sample_call": (restype, params[:1] + (("values", c_void_p),) + params[1:])}
    assert table_mismatches(entries, inserted) == [
        "sample_call: parameter 1 is `int64_t n` in the header, `values` in the table "
        "(header only: [], table only: ['values'])"]
    retyped = {**good, "sample_call": (restype, params[:1] + (("n", c_int32),) + params[2:]),
               "sample_text": (c_int, ())}
    # ctypes names its fixed-width types by their C aliases (c_int64 is c_long here).
    assert table_mismatches(entries, retyped) == [
        f"sample_call: parameter `n` is int64_t in the header ({c_int64.__name__}), {c_int32.__name__} in the table",
        f"sample_text: returns const char* (c_char_p), the table says {c_int.__name__}"]
    assert table_mismatches(entries, {k: v for k, v in good.items() if k != "sample_none"} | {"gone": (c_int, ())}) == [
        "sample_none: declared in the header, missing from _native's table",
        "gone: in _native's table, not declared in the header"]


# --------------------------------------------------------------------------- the library itself


def test_library_targets(lib):
    pipeline, gemm = lib.archs(_native.PIPELINE), lib.archs(_native.GEMM)
    # The H200 path: SASS for sm_90a, plus compute_90 PTX for any newer GPU without SASS here.
    assert "sm_90a" in pipeline and "compute_90" in pipeline, pipeline
    for target in pipeline + gemm:
        number = target.split("_")[1]
        assert number[-1] in "af" or target == "compute_90", f"{target}: plain Blackwell targets compile to stubs"
    assert set(gemm) <= {"sm_90a", "sm_100a", "sm_100f", "sm_120a", "sm_120f", "sm_121a", "sm_121f"}, gemm
    assert set(gemm) <= set(pipeline), "every GEMM target also carries the pipeline kernels"


def test_a_library_of_another_abi_version_is_refused(lib, monkeypatch):
    built = lib._lib.moe_fp4_abi_version()
    monkeypatch.setattr(_native, "ABI_VERSION", built + 1)
    with pytest.raises(LibraryUnavailable, match=exactly(
            f"library not usable: {lib.path} has ABI version {built}, this moe_fp4 needs {built + 1}")):
        _native.NativeLibrary(lib.path)


def test_call_takes_the_headers_parameter_names(lib):
    name = "moe_fp4_routing_workspace_size"
    params = [p for p, _ in _native.signature(name)]
    with pytest.raises(TypeError, match=exactly(
            f"{name}: expected the parameters {params}, missing ['num_experts'], unexpected ['experts']")):
        lib.call(name, num_slots=1, experts=2, bytes=None)
    with pytest.raises(TypeError, match=re.escape("missing ['bytes'], unexpected []")):
        lib.call(name, num_slots=1, num_experts=2)


@pytest.mark.parametrize(
    "capability, pipeline_ok",
    [((9, 0), True), ((10, 0), True), ((12, 0), True), ((12, 1), True), ((8, 9), False), ((8, 0), False)],
)
def test_pipeline_serves_every_gpu_from_sm90(lib, capability, pipeline_ok):
    why = lib.serves(_native.PIPELINE, capability)
    if pipeline_ok:
        assert why is None
    else:
        assert f"does not run on sm_{capability[0]}{capability[1]}" in why and "9.0 or newer" in why


def test_gemm_served_only_where_built(lib):
    gemm = lib.archs(_native.GEMM)
    for cap in ((8, 9), (9, 1)):
        why = lib.serves(_native.GEMM, cap)
        assert why.startswith(f"no NVFP4 GEMM path on sm_{cap[0]}{cap[1]}") and "use backend='triton'" in why
    expect = {
        (9, 0): "sm_90a" in gemm,  # the library's own 16-bit wgmma GEMM on dequantized weights
        (10, 0): bool({"sm_100a", "sm_100f"} & set(gemm)),
        (10, 3): "sm_100f" in gemm,  # sm_100a SASS does not run on 10.3
        (12, 0): bool({"sm_120a", "sm_120f"} & set(gemm)),
        (12, 1): bool({"sm_121a", "sm_120f", "sm_121f"} & set(gemm)),
        (11, 0): False,
    }
    for cap, ok in expect.items():
        why = lib.serves(_native.GEMM, cap)
        assert (why is None) == ok, (cap, why)


def test_why_unavailable_and_summary(lib):
    assert cutlass.why_unavailable(torch.device("cpu"), None) == "runs on CUDA devices only"
    reason = cutlass.why_unavailable(torch.device("cuda", 0), (8, 9))
    assert reason.startswith("no NVFP4 GEMM path on sm_89"), reason
    assert (cutlass.why_unavailable(torch.device("cuda", 0), (9, 0)) is None) == ("sm_90a" in lib.archs(_native.GEMM))
    summary = cutlass.library_summary()
    assert str(lib.path) in summary and "sm_90a" in summary


def test_missing_library_is_explained(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libmoe_fp4_cuda.so"
    monkeypatch.setenv("MOE_FP4_LIB", str(missing))
    expected = f"library not built: {missing} does not exist (MOE_FP4_LIB points to it)"
    assert cutlass.why_unavailable(torch.device("cuda", 0), (12, 0)) == expected
    assert cutlass.library_summary() == f"CUDA library: unavailable: {expected}"
    r = stages.routing(torch.zeros(1, 1, dtype=torch.int32), 1)
    with pytest.raises(LibraryUnavailable, match=exactly(expected)):
        cutlass.quantize_rows(torch.zeros(1, 16, dtype=torch.bfloat16), torch.ones(1), r)


def test_a_file_that_is_not_the_library_is_explained(monkeypatch, tmp_path):
    bogus = tmp_path / "libmoe_fp4_cuda.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv("MOE_FP4_LIB", str(bogus))
    assert cutlass.why_unavailable(torch.device("cuda", 0), (12, 0)).startswith("library not loadable:")


# --------------------------------------------------------------------------- preconditions of the C entries

NULL = None
FAKE = 0x10000  # an aligned address that is never dereferenced: every call below fails a check first
MISALIGNED = 0x10004

# Arguments that pass every check, by the header's names; each case below breaks one of them.
ENTRY_ARGS = {
    "moe_fp4_routing": dict(
        topk_ids=FAKE, num_slots=8, num_experts=4, expert_offsets=FAKE, blockscale_offsets=FAKE, slot_to_flat=FAKE,
        flat_to_slot=FAKE, workspace=FAKE, workspace_bytes=1 << 20, device=0, stream=NULL),
    "moe_fp4_quantize_rows": dict(
        x=FAKE, x_dtype=_native.BF16, x_rows=4, k=64, slot_to_flat=NULL, topk=1, row_scale=NULL, num_slots=4, gs=FAKE,
        expert_offsets=FAKE, blockscale_offsets=FAKE, num_experts=2, packed=FAKE, scales=FAKE, scale_rows=384,
        values=NULL, device=0, stream=NULL),
    "moe_fp4_quantize_values_by_token": dict(
        x=FAKE, x_dtype=_native.BF16, x_rows=4, k=64, flat_to_slot=FAKE, topk=2, row_scale=NULL, num_slots=8, gs=FAKE,
        expert_offsets=FAKE, num_experts=2, values=FAKE, device=0, stream=NULL),
    "moe_fp4_routing_quantize_values": dict(
        topk_ids=FAKE, x=FAKE, x_dtype=_native.BF16, x_rows=8, k=64, topk=8, row_scale=NULL, gs=FAKE, num_experts=4,
        expert_offsets=FAKE, blockscale_offsets=FAKE, slot_to_flat=FAKE, flat_to_slot=FAKE, values=FAKE, device=0,
        stream=NULL),
    "moe_fp4_silu_mul_quantize": dict(
        h=FAKE, h_dtype=_native.BF16, num_slots=4, inter=32, gs=FAKE, expert_offsets=FAKE, blockscale_offsets=FAKE,
        num_experts=2, packed=FAKE, scales=FAKE, scale_rows=384, values=NULL, device=0, stream=NULL),
    "moe_fp4_moe_reduce": dict(
        y=FAKE, y_dtype=_native.BF16, y_rows=8, hidden=64, flat_to_slot=FAKE, topk_weights=NULL, num_tokens=4, topk=2,
        out=FAKE, out_dtype=_native.BF16, device=0, stream=NULL),
    "moe_fp4_grouped_gemm": dict(
        a=FAKE, a_scales=FAKE, a_rows=8, a_scale_rows=256, b=FAKE, b_scales=FAKE, alpha=FAKE, num_experts=2,
        sections=2, n=64, k=64, expert_offsets=FAKE, blockscale_offsets=FAKE, out=FAKE, out_dtype=_native.BF16,
        workspace=FAKE, workspace_bytes=1 << 20, device=0, stream=NULL),
}


def precondition(entry: str, message: str, **changed):
    label = "-".join(f"{k}={v}" for k, v in changed.items())
    return pytest.param(entry, changed, message, id=f"{entry.removeprefix('moe_fp4_')}-{label}")


PRECONDITIONS = [
    precondition("moe_fp4_routing", "num_experts: expected at least 1, got 0", num_experts=0),
    precondition("moe_fp4_routing", r"num_slots: expected a count in \[0, 2\^31\), got -1", num_slots=-1),
    precondition("moe_fp4_routing", "topk_ids: expected a pointer, got NULL", topk_ids=NULL),
    precondition("moe_fp4_routing", "topk_ids: expected a 4-byte aligned address", topk_ids=MISALIGNED + 2),
    precondition("moe_fp4_routing", r"workspace_bytes: expected at least 20 \(moe_fp4_routing_workspace_size\), got 4",
                 workspace_bytes=4),
    precondition("moe_fp4_routing", r"device: expected a CUDA device ordinal in \[0, 64\)", device=99),
    precondition("moe_fp4_quantize_rows", r"x_dtype: expected MOE_FP4_BF16 \(0\) or MOE_FP4_FP16 \(1\), got 2",
                 x_dtype=_native.FP32),
    precondition("moe_fp4_quantize_rows", r"k: expected a positive multiple of 16 \(at most 2\^30\), got 40", k=40),
    precondition("moe_fp4_quantize_rows", "x: expected a 16-byte aligned address", x=MISALIGNED),
    precondition("moe_fp4_quantize_rows", "num_slots: expected x_rows = 4 without slot_to_flat", num_slots=5),
    precondition("moe_fp4_quantize_rows", "row_scale: expected NULL without slot_to_flat", row_scale=FAKE),
    precondition("moe_fp4_quantize_rows", r"num_slots: expected x_rows \* topk = 4 \* 2 slots",
                 slot_to_flat=FAKE, topk=2, num_slots=7),
    precondition("moe_fp4_quantize_rows", "topk: expected at least 1, got 0", slot_to_flat=FAKE, topk=0),
    precondition("moe_fp4_quantize_rows", r"scale_rows: expected a multiple of 128 of at least 384 \(the grouped "
                 r"bound for 4 slots over 2 experts\), got 128", scale_rows=128),
    precondition("moe_fp4_quantize_rows", "scale_rows: expected a multiple of 128", scale_rows=400),
    precondition("moe_fp4_quantize_rows", "num_experts: expected at least 1, got 0", num_experts=0),
    precondition("moe_fp4_quantize_rows", r"gs: expected a pointer \(NULL only for the unquantized W4A16 rows: "
                 r"values given, packed and scales NULL\), got NULL", gs=NULL),
    precondition("moe_fp4_quantize_rows", r"gs: expected a pointer \(NULL only", gs=NULL, values=FAKE),
    precondition("moe_fp4_quantize_rows", "gs: expected a 4-byte aligned address", gs=MISALIGNED + 2),
    precondition("moe_fp4_quantize_rows", "packed: expected a 16-byte aligned address", packed=MISALIGNED),
    precondition("moe_fp4_quantize_values_by_token", r"num_slots: expected x_rows \* topk = 4 \* 2 slots", num_slots=7),
    precondition("moe_fp4_quantize_values_by_token", "topk: expected at least 1, got 0", topk=0),
    precondition("moe_fp4_quantize_values_by_token", "flat_to_slot: expected a pointer, got NULL", flat_to_slot=NULL),
    precondition("moe_fp4_quantize_values_by_token", "flat_to_slot: expected a 4-byte aligned address",
                 flat_to_slot=MISALIGNED + 2),
    precondition("moe_fp4_quantize_values_by_token", "values: expected a 16-byte aligned address", values=MISALIGNED),
    precondition("moe_fp4_quantize_values_by_token", "expert_offsets: expected a pointer, got NULL",
                 expert_offsets=NULL),
    precondition("moe_fp4_quantize_values_by_token", "num_experts: expected at least 1, got 0", num_experts=0),
    precondition("moe_fp4_quantize_values_by_token", r"k: expected a positive multiple of 16", k=40),
    precondition("moe_fp4_routing_quantize_values", r"x_rows: expected x_rows \* topk <= 256 slots "
                 r"\(MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS; more take moe_fp4_routing and moe_fp4_quantize_rows\), "
                 r"got 33 rows \* topk 8", x_rows=33),
    precondition("moe_fp4_routing_quantize_values", "topk: expected at least 1, got 0", topk=0),
    precondition("moe_fp4_routing_quantize_values", r"x_dtype: expected MOE_FP4_BF16 \(0\) or MOE_FP4_FP16 \(1\)",
                 x_dtype=_native.FP32),
    precondition("moe_fp4_routing_quantize_values", "k: expected a positive multiple of 16", k=40),
    precondition("moe_fp4_routing_quantize_values", "num_experts: expected at least 1, got 0", num_experts=0),
    precondition("moe_fp4_routing_quantize_values", "values: expected a 16-byte aligned address", values=MISALIGNED),
    precondition("moe_fp4_routing_quantize_values", "row_scale: expected a 4-byte aligned address",
                 row_scale=MISALIGNED + 2),
    precondition("moe_fp4_routing_quantize_values", "flat_to_slot: expected a pointer, got NULL", flat_to_slot=NULL),
    precondition("moe_fp4_routing_quantize_values", "gs: expected a 4-byte aligned address", gs=MISALIGNED + 2),
    precondition("moe_fp4_silu_mul_quantize", "inter: expected a positive multiple of 16", inter=24),
    precondition("moe_fp4_silu_mul_quantize", "h: expected a pointer, got NULL", h=NULL),
    precondition("moe_fp4_silu_mul_quantize", r"gs: expected a pointer \(NULL only", gs=NULL, values=FAKE,
                 packed=NULL),
    precondition("moe_fp4_moe_reduce", "hidden: expected a positive multiple of 8", hidden=60),
    precondition("moe_fp4_moe_reduce", r"out_dtype: expected MOE_FP4_BF16 \(0\), MOE_FP4_FP16 \(1\) or MOE_FP4_FP32 "
                 r"\(2\), got 7", out_dtype=7),
    precondition("moe_fp4_moe_reduce", "topk: expected at least 1, got 0", topk=0),
    precondition("moe_fp4_moe_reduce", "topk_weights: expected a 4-byte aligned address", topk_weights=MISALIGNED + 2),
    precondition("moe_fp4_grouped_gemm", r"k: expected a positive multiple of 32 \(16-byte rows of packed e2m1, as TMA "
                 r"needs\), got 48", k=48),
    precondition("moe_fp4_grouped_gemm", "n: expected each of the 2 sections to be a positive multiple of 8 columns",
                 n=72),
    precondition("moe_fp4_grouped_gemm", r"sections: expected 1 \(w2\) or 2 \(w13: gate, up\), got 3", sections=3),
    precondition("moe_fp4_grouped_gemm", "a_scale_rows: expected a multiple of 128", a_scale_rows=200),
    precondition("moe_fp4_grouped_gemm", r"out_dtype: expected MOE_FP4_BF16 \(0\) or MOE_FP4_FP16 \(1\), got 2",
                 out_dtype=_native.FP32),
    precondition("moe_fp4_grouped_gemm", "b_scales: expected a 16-byte aligned address", b_scales=MISALIGNED),
    precondition("moe_fp4_grouped_gemm", "workspace: expected a pointer, got NULL", workspace=NULL),
    precondition("moe_fp4_grouped_gemm", "num_experts: expected at least 1, got 0", num_experts=0),
]


@pytest.mark.parametrize("entry, changed, message", PRECONDITIONS)
def test_precondition_messages(lib, entry, changed, message):
    with pytest.raises(ValueError, match=f"^{entry}: ({message})"):
        lib.call(entry, **{**ENTRY_ARGS[entry], **changed})


def sm90_plan(lib: _native.NativeLibrary, a_rows: int, num_experts: int, n: int, k: int,
              with_workspace: bool = False) -> tuple[int, ...]:
    """(tile tokens, K slices per CTA, CTAs per tile) the sm_90a GEMM's heuristics pick on 132 SMs (an H200)
    without a workspace; with one, also the K splits through it (1: none). ``lib``: the library under test,
    which cutlass.sm90_gemm_plan queries."""
    from moe_fp4.backends import cutlass

    assert _native.library() is lib
    plan = cutlass.sm90_gemm_plan(a_rows, num_experts, n, k, None, with_workspace)
    if not with_workspace:
        assert plan.gs_splits == 1, "no K split through a workspace without one"
        return tuple(plan)[:3]
    return tuple(plan)


# The configurations the H200 sweeps of sessions 18 and 20 chose (csrc/tests/sm90_gemm_check --sweep-splits,
# tests/results/h200-2026-12-04-s18/call1/splits.log, tests/results/h200-2026-12-04-s20/call2): K split
# across a cluster only for the long-K decode of Llama-4-Scout, where the grid is short of CTAs; Qwen3
# decode keeps its two slices per CTA, DeepSeek-V3 (GEMM1's 256 CTAs at M = 1, GEMM2's 448) and every
# fuller grid one CTA per tile.
SM90_PLANS = [
    # (a_rows, E, n, k) -> plan
    ((1, 16, 5120, 8192), (8, 1, 8)),  # Llama-4-Scout GEMM2, M = 1: 40 tiles x 8 CTAs (16 chunks each)
    ((4, 16, 5120, 8192), (8, 1, 2)),  # M = 4: ~145 CTAs
    ((16, 16, 5120, 8192), (8, 1, 1)),  # M = 16: ~412 CTAs, the grid is full
    ((24, 16, 5120, 8192), (8, 1, 1)),  # M = 24: ~504
    ((32, 16, 5120, 8192), (8, 1, 1)),  # M = 32: ~560
    ((64, 16, 5120, 8192), (8, 1, 1)),  # M = 64: 4 rows per expert, the 8-token tile
    ((1, 16, 16384, 5120), (8, 1, 2)),  # Llama-4-Scout GEMM1, M = 1: 128 CTAs
    ((4, 16, 16384, 5120), (8, 1, 1)),  # M = 4: ~465 CTAs
    ((8, 256, 7168, 2048), (8, 1, 1)),  # DeepSeek-V3 GEMM2, M = 1: K too short to split
    ((8, 256, 4096, 7168), (8, 1, 1)),  # DeepSeek-V3 GEMM1, M = 1: 256 CTAs
    ((16, 256, 4096, 7168), (8, 1, 1)),  # M = 2: ~496
    ((8, 128, 1536, 2048), (8, 2, 1)),  # Qwen3-30B-A3B GEMM1, M = 1: K (32 chunks) below 40 stays whole
    ((8, 128, 2048, 768), (8, 2, 1)),  # Qwen3-30B-A3B GEMM2, M = 1
    ((512, 128, 1536, 2048), (8, 1, 1)),  # M = 64: 4 rows per expert
    ((1024, 128, 1536, 2048), (16, 1, 1)),  # M = 128: 8
    # Prefill: the token tile sized to the experts' rows (session 17, csrc/gemm_sm90.cu sm90_tile_tokens)
    ((6144, 256, 7168, 2048), (32, 1, 1)),  # DeepSeek-V3 M = 768: 24 rows per expert, one 32-token tile
    ((4096, 128, 1536, 2048), (48, 1, 1)),  # M = 512: 32 rows per expert, one 48-token tile
    ((8192, 256, 7168, 2048), (48, 1, 1)),  # DeepSeek-V3 M = 1024: 32
    ((5120, 128, 1536, 2048), (64, 1, 1)),  # M = 640: 40
    ((8192, 128, 1536, 2048), (80, 1, 1)),  # M = 1024: 64, one 80-token tile holds most experts
    ((12288, 128, 1536, 2048), (112, 1, 1)),  # M = 1536: 96
    ((16384, 128, 1536, 2048), (80, 1, 1)),  # M = 2048: 128, two 80-token tiles
    ((32768, 128, 1536, 2048), (96, 1, 1)),  # M = 4096: 256, three 96-token tiles
    ((131072, 128, 1536, 2048), (112, 1, 1)),  # M = 16384
    ((2, 4, 8192, 8192), (8, 1, 2)),  # K = 128 chunks, 2 experts x 64 tiles: a cluster of 2 (GS with a workspace)
    # tests/test_cutlass_sm90.py's long-K decode cases: clusters of 4, then 2 (GEMM2 only)
    ((1, 4, 8192, 4096), (8, 1, 4)),
    ((1, 4, 4096, 4096), (8, 1, 4)),
    ((6, 8, 8192, 4096), (8, 1, 1)),
    ((6, 8, 4096, 4096), (8, 1, 2)),
]


# With a workspace (moe_fp4_sm90_grouped_gemm_ws, the cutlass plans), the clusters of 2 to 4 CTAs of the
# 8- and 16-token tiles over a K of at least 96 chunks become as many K splits through it (session 21:
# Llama-4-Scout M = 4's whole forward 111.1 -> 103.2 us; its GEMM1 at M = 1, K = 80 chunks, lost in the
# forward and keeps its cluster); the rest is the plan without one.
SM90_GS = {
    (4, 16, 5120, 8192): 2,  # Llama-4-Scout GEMM2, M = 4
    (2, 4, 8192, 8192): 2,  # a long-K decode GEMM with a cluster of 2 (SM90_PLANS)
    # An expected grid of (3, 4] CTAs per SM, K of at least 128 chunks: only the tiles of the last round split,
    # up to 8 ways (gs_tail; the query reports the bound, the kernel counts the tail's tiles). Llama-4-Scout GEMM2
    # at M = 16: ~412 expected tiles on 396 CTAs; at M = 32 (~560) and 64 (~629) it runs unsplit.
    # DeepSeek-V3's GEMM1 at M = 2 (K of 112 chunks, ~3.8 CTAs per SM) runs unsplit.
    (16, 16, 5120, 8192): 8,
    (24, 16, 5120, 8192): 8,
}


@pytest.mark.parametrize("shape, plan", SM90_PLANS, ids=[f"rows{s[0]}-e{s[1]}-n{s[2]}-k{s[3]}" for s, _ in SM90_PLANS])
def test_sm90_gemm_plan(lib, shape, plan):
    if "sm_90a" not in lib.archs(_native.GEMM):
        pytest.skip("this build has no sm_90a GEMM")
    assert sm90_plan(lib, *shape) == plan
    gs = SM90_GS.get(shape, 1)
    assert sm90_plan(lib, *shape, with_workspace=True) == ((plan[0], 1, 1, gs) if gs > 1 else (*plan, 1))


def test_the_silu_epilogue_is_fused_exactly_where_the_gemm_takes_the_8_token_tile(lib):
    """cutlass.fuses_silu (at most 4 rows per expert) and the library's tile heuristic agree: a plan binds
    moe_fp4_sm90_gemm_silu exactly where the GEMM takes the 8-token tile it is built for, which the entry
    refuses to run wider (tests/test_cutlass_sm90.py::test_gemm_silu_refuses_the_wide_tiles)."""
    from moe_fp4.backends import cutlass

    if "sm_90a" not in lib.archs(_native.GEMM):
        pytest.skip("this build has no sm_90a GEMM")
    tile = ctypes.c_int32(0)
    for num_experts in (1, 3, 8, 16, 128, 256, 5000):
        for slots in (*range(1, 70), 127, 128, 129, 255, 256, 257, 511, 512, 513, 2047, 2048, 2049, 4096, 4097,
                      65536, 1 << 20):
            lib.call("moe_fp4_sm90_gemm_tile_tokens", a_rows=slots, num_experts=num_experts,
                     tile_tokens=ctypes.addressof(tile))
            assert cutlass.fuses_silu(slots, num_experts) == (tile.value == 8), (slots, num_experts, tile.value)
    assert not cutlass.fuses_silu(0, 8)


def test_the_second_gemm_splits_k_through_its_workspace_only_at_llama_4_scout_decode(lib):
    """Of the three layers' decode shapes on 132 SMs only Llama-4-Scout's second GEMM (K = 8192) splits K
    through the workspace, at M = 2 to 4 and 15 to 27 (SM90_GS): the plans whose fused first GEMM the library
    runs in the GS kernel (launch_small in gemm_sm90.cu; tests/test_cutlass_sm90.py holds it to the unfused
    forward). Those plans fuse the SiLU epilogue like every other one of at most 4 rows per expert."""
    from moe_fp4.backends import cutlass

    if "sm_90a" not in lib.archs(_native.GEMM):
        pytest.skip("this build has no sm_90a GEMM")
    cpu = torch.device("cpu")
    for m in range(1, 129):  # GS at M = 2 to 4, the tail split from 15 to 27
        assert (cutlass.sm90_gemm_plan(m, 16, 5120, 8192, cpu).gs_splits > 1) == (2 <= m <= 4 or 15 <= m <= 27), m
        assert cutlass.fuses_silu(m, 16) == (m <= 64), m
    for m in range(1, 65):  # Qwen3-30B-A3B and DeepSeek-V3 (top-8): K of 12 and 32 chunks, never split
        assert cutlass.sm90_gemm_plan(8 * m, 128, 2048, 768, cpu).gs_splits == 1, m
        assert cutlass.sm90_gemm_plan(8 * m, 256, 7168, 2048, cpu).gs_splits == 1, m


def test_sm90_gemm_workspace_size(lib):
    if "sm_90a" not in lib.archs(_native.GEMM):
        pytest.skip("this build has no sm_90a GEMM")
    query = "moe_fp4_sm90_gemm_workspace_size"
    # Llama-4-Scout GEMM2 at M = 4, 2 splits: the counters' fixed region (16384 int32), then
    # min(ceil(4/8) + 4, 4) token tiles x 40 weight tiles of two 128 x 8 fp32 partial tiles each.
    assert lib.size_query(query, a_rows=4, num_experts=16, n=5120, k=8192, tile_tokens=0, sm_count=132) == (
        16384 * 4 + 160 * 2 * 128 * 8 * 4)
    # Llama-4-Scout GEMM2 at M = 16, the tail's tiles split: one partial tile per CTA of the grid (3 per SM).
    assert lib.size_query(query, a_rows=16, num_experts=16, n=5120, k=8192, tile_tokens=0, sm_count=132) == (
        16384 * 4 + 396 * 128 * 8 * 4)
    # No split through the workspace: Qwen3 GEMM1 at M = 1, a forced 32-token tile, no rows.
    assert lib.size_query(query, a_rows=8, num_experts=128, n=1536, k=2048, tile_tokens=0, sm_count=132) == 0
    assert lib.size_query(query, a_rows=4, num_experts=16, n=5120, k=8192, tile_tokens=32, sm_count=132) == 0
    assert lib.size_query(query, a_rows=0, num_experts=16, n=5120, k=8192, tile_tokens=0, sm_count=132) == 0
    with pytest.raises(ValueError, match=f"^{query}: sm_count: expected a positive SM count, got 0"):
        lib.size_query(query, a_rows=4, num_experts=16, n=5120, k=8192, tile_tokens=0, sm_count=0)
    with pytest.raises(ValueError, match=f"^{query}: tile_tokens: expected 0 \\(heuristic\\)"):
        lib.size_query(query, a_rows=4, num_experts=16, n=5120, k=8192, tile_tokens=24, sm_count=132)


def test_sm90_gemm_plan_and_config_checks(lib):
    if "sm_90a" not in lib.archs(_native.GEMM):
        pytest.skip("this build has no sm_90a GEMM")
    assert sm90_plan(lib, 0, 4, 8192, 4096)[0] == 8  # no rows: a valid plan (the GEMM itself returns at once)
    with pytest.raises(ValueError, match=r"a_rows: expected a count in \[0, 2\^31\), got 2147483648"):
        sm90_plan(lib, 2**31, 4, 64, 64)
    with pytest.raises(ValueError, match="sm_count: expected a positive SM count, got 0"):
        lib.call("moe_fp4_sm90_gemm_plan", a_rows=1, num_experts=1, n=64, k=64, sm_count=0, with_workspace=0,
                 tile_tokens=FAKE, slices=FAKE, cta_splits=FAKE, gs_splits=FAKE)
    with pytest.raises(ValueError, match="with_workspace: expected 0 or 1, got 2"):
        lib.call("moe_fp4_sm90_gemm_plan", a_rows=1, num_experts=1, n=64, k=64, sm_count=132, with_workspace=2,
                 tile_tokens=FAKE, slices=FAKE, cta_splits=FAKE, gs_splits=FAKE)
    gemm = dict(a=FAKE, a_dtype=_native.BF16, a_rows=8, k=64, w=FAKE, w_scales=FAKE, alpha=FAKE, num_experts=2,
                sections=1, n=64, expert_offsets=FAKE, out=FAKE, tile_tokens=0, slices=0, cta_splits=0, gs_splits=0,
                workspace=NULL, workspace_bytes=0, device=0, stream=NULL)
    for changed, message in (({"cta_splits": 9}, r"cta_splits: expected 0 \(heuristic\) or 1 to 8, got 9"),
                             ({"slices": 4}, r"slices: expected 0 \(heuristic\), 1 or 2, got 4"),
                             ({"gs_splits": 17}, r"gs_splits: expected 0 \(heuristic\) or 1 to 16, got 17"),
                             ({"gs_splits": 2, "tile_tokens": 32},
                              r"gs_splits: a K split through the workspace \(2\) needs tile_tokens 8 or 16 and no "
                              r"cluster split, got tile_tokens 32, cta_splits 0"),
                             ({"gs_splits": 2, "tile_tokens": 8, "cta_splits": 2},
                              r"gs_splits: a K split through the workspace \(2\) needs tile_tokens 8 or 16"),
                             ({"gs_splits": 2, "tile_tokens": 8},
                              "workspace: gs_splits = 2 splits K through the workspace, got NULL"),
                             ({"workspace": MISALIGNED}, "workspace: expected a 16-byte aligned address"),
                             ({"tile_tokens": 24},
                              "tile_tokens: expected 0 \\(heuristic\\), 8, 16, 32, 48, 64, 80, 96, 112 or 128")):
        with pytest.raises(ValueError, match=f"^moe_fp4_sm90_grouped_gemm_config: {message}"):
            lib.call("moe_fp4_sm90_grouped_gemm_config", **{**gemm, **changed})


def test_workspace_queries(lib):
    query = "moe_fp4_routing_workspace_size"
    assert lib.size_query(query, num_slots=100, num_experts=7) == 8 * 4  # one row of E+1 counters
    # 100000 ids: one row of counters per chunk of whole 256-id tiles, plus the totals row.
    big = lib.size_query(query, num_slots=100_000, num_experts=7)
    assert big >= 3 * 8 * 4 and big % (8 * 4) == 0
    with pytest.raises(ValueError, match=f"^{query}: num_experts: expected at least 1"):
        lib.size_query(query, num_slots=10, num_experts=0)


def test_the_fused_routing_limit_is_within_the_librarys():
    """The cutlass plans fuse the routing and the first quantization up to a limit the entry accepts."""
    from moe_fp4.backends import cutlass

    assert 0 < cutlass.FUSED_ROUTING_MAX <= _native.ROUTING_QUANTIZE_MAX_SLOTS


def test_host_mode_is_pipeline_only(lib):
    with pytest.raises(BackendUnavailableError, match="^moe_fp4_routing: .*routing has no host mode"):
        lib.call("moe_fp4_routing", **{**ENTRY_ARGS["moe_fp4_routing"], "device": _native.HOST})
    with pytest.raises(BackendUnavailableError, match="^moe_fp4_routing_quantize_values: .*fused routing has no host"):
        lib.call("moe_fp4_routing_quantize_values",
                 **{**ENTRY_ARGS["moe_fp4_routing_quantize_values"], "device": _native.HOST})
    with pytest.raises(BackendUnavailableError, match="^moe_fp4_grouped_gemm: .*the grouped GEMM has no host mode"):
        lib.call("moe_fp4_grouped_gemm", **{**ENTRY_ARGS["moe_fp4_grouped_gemm"], "device": _native.HOST})


# --------------------------------------------------------------------------- the Python stage functions' checks


def routing_of(counts: list[int], device: torch.device | str = "cpu") -> RoutingData:
    """The routing of ``sum(counts)`` top-1 slots, ``counts[e]`` of them on expert ``e``."""
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(torch.int32)
    return stages.routing(ids.reshape(-1, 1).to(device), len(counts))


def zero_gemm_operands(device: torch.device | str = "cpu", sections: int = 1) -> tuple[Quantized, WeightOperand]:
    """Four rows of width 64 and one expert's ``16 * sections`` weight rows, all zero."""
    a = Quantized(torch.zeros(4, 32, dtype=torch.uint8, device=device),
                  torch.zeros(256, 4, dtype=torch.float8_e4m3fn, device=device))
    w = WeightOperand(torch.zeros(1, 16 * sections, 32, dtype=torch.uint8, device=device),
                      torch.zeros(1, sections, 128, 4, dtype=torch.float8_e4m3fn, device=device),
                      torch.ones(1, sections, device=device))
    return a, w


X4, ONE, R4 = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(1), routing_of([4])
A4, W1 = zero_gemm_operands()
_, W3 = zero_gemm_operands(sections=3)

# (call, exception, the whole message): the checks of pipeline.py and buffers.py, and cutlass's own.
STAGE_CHECKS = {
    "x-dtype": (lambda: cutlass.quantize_rows(X4.float(), ONE, R4), TypeError,
                "x: expected dtype one of bfloat16, float16, got float32"),
    "gs-shape": (lambda: cutlass.quantize_rows(X4, torch.ones(2), R4), ValueError, "gs: expected shape [1], got [2]"),
    "routing-type": (lambda: cutlass.quantize_rows(X4, ONE, (R4.expert_offsets, R4.blockscale_offsets)), TypeError,
                     "routing: expected a RoutingData, got tuple"),
    "row-scale-without-gather": (
        lambda: cutlass.quantize_rows(X4, ONE, R4, gather=False, row_scale=torch.ones(4)), ValueError,
        "row_scale: expected None without gather (it is indexed by a slot's flat index)"),
    "slots-without-gather": (lambda: cutlass.quantize_rows(X4[:2], ONE, R4, gather=False), ValueError,
                             "routing: expected 2 slots (x.shape[0], the grouped rows), got 4"),
    "scale-columns": (lambda: Quantized(torch.empty(4, 32, dtype=torch.uint8), torch.empty(256, 8, dtype=torch.uint8)),
                      ValueError, "scales: expected 4 columns (ceil(K/64)*4 for K = 64), got shape [256, 8]"),
    "scale-rows": (
        lambda: cutlass.quantize_rows(X4, ONE, R4, out=Quantized(torch.empty(4, 32, dtype=torch.uint8),
                                                                 torch.empty(128, 4, dtype=torch.uint8))),
        ValueError, "out: expected at least 256 scale rows (grouped_scale_rows_bound for 4 rows over 1 experts), "
                    "got shape [128, 4]"),
    "width": (lambda: cutlass.quantize_rows(X4[:, :40].contiguous(), ONE, R4), ValueError,
              "x: the quantized width must be a multiple of 16, got 40"),
    "config": (lambda: cutlass.quantize_rows(X4, ONE, R4, config=1), TypeError,
               "config: the cutlass stages take no launch configuration, got int"),
    "routing-on-cpu": (lambda: cutlass.routing(torch.zeros(2, 2, dtype=torch.int32), 4), ValueError,
                       "topk_ids: expected a CUDA tensor (routing runs on the GPU; stages.routing is the CPU "
                       "reference), got one on cpu"),
    "silu-odd-row": (lambda: cutlass.silu_mul_quantize(torch.zeros(4, 33, dtype=torch.float16), ONE, R4), ValueError,
                     "h: expected an even row length (gate half, then up half), got shape [4, 33]"),
    "reduce-slots": (lambda: cutlass.moe_reduce(torch.zeros(6, 64, dtype=torch.bfloat16), routing_of([6]), None, 4,
                                                torch.bfloat16), ValueError,
                     "routing: expected num_tokens * topk slots (a positive multiple of num_tokens = 4), got 6"),
    "gemm-on-cpu": (lambda: cutlass.grouped_gemm(A4, W1, R4, torch.bfloat16), ValueError,
                    "a: expected a CUDA tensor (the grouped GEMM runs on SM100/SM120 GPUs), got one on cpu"),
    "gemm-out-dtype": (lambda: cutlass.grouped_gemm(A4, W1, R4, torch.float32), TypeError,
                       "out_dtype: expected bfloat16 or float16, got float32"),
    "gemm-sections": (lambda: cutlass.grouped_gemm(A4, W3, R4, torch.bfloat16), ValueError,
                      "w: expected 1 (w2) or 2 (w13: gate, up) sections in the CUTLASS GEMM, got 3 "
                      "(scales of shape [1, 3, 128, 4])"),
    "gemm-experts": (lambda: cutlass.grouped_gemm(A4, W1, routing_of([2, 2]), torch.bfloat16), ValueError,
                     "w: expected weights of the routing's 2 experts, got 1"),
}


@pytest.mark.parametrize("check", STAGE_CHECKS)
def test_stage_argument_checks(check):
    call, exc, message = STAGE_CHECKS[check]
    with pytest.raises(exc, match=exactly(message)):
        call()


# --------------------------------------------------------------------------- the host oracle of the pipeline kernels

# Each case names what it covers: (M, topk, E, K, dtype, routed_ids pattern)
GATHER_CASES = [
    pytest.param(5, 2, 3, 64, torch.bfloat16, "minus_one", id="small-bf16-minus-one-ids"),
    pytest.param(9, 3, 7, 80, torch.float16, "skip", id="fp16-K80-not-a-multiple-of-64-prime-E-an-empty-expert"),
    # one_expert: expert 1 takes every one of the 140 tokens, two 128-row scale regions.
    pytest.param(140, 2, 5, 48, torch.bfloat16, "one_expert", id="an-expert-over-128-rows-K48"),
    pytest.param(3, 2, 1031, 32, torch.bfloat16, "random", id="E-over-1024-mostly-empty"),
]


@pytest.mark.parametrize("M, topk, E, K, dtype, pattern", GATHER_CASES)
@pytest.mark.parametrize("router_weight", [False, True], ids=["plain", "router-weight-on-input"])
@pytest.mark.parametrize("values_only", [False, "token", "slot"], ids=["codes", "values-only", "values-slot-order"])
def test_quantize_rows_host_oracle_is_exact(lib, M, topk, E, K, dtype, pattern, router_weight, values_only):
    """The codes-and-scales kernel byte for byte, and the values-only kernels on their values, against the
    reference stage: in token order (moe_fp4_quantize_values_by_token, the sm_90a stage set's) and in slot
    order (moe_fp4_quantize_rows without codes)."""
    gen = torch.Generator().manual_seed(1)
    r = stages.routing(routed_ids(M, topk, E, gen, pattern), E)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    x[0, :16] = 0  # an all-zero block: scale 0, codes 0
    x[1, 3] = -0.0
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen) * 8)
    row_scale = torch.rand(M * topk, generator=gen) if router_weight else None
    if values_only:
        got_set = sm90_row_order_stages("w4a4", values_only)
        assert_values_only_exact("quantize_rows", stages.STAGES, (M * topk, K, E), x, gs, r, row_scale=row_scale,
                                 got_set=got_set)
    else:
        assert_stage_exact("quantize_rows", x, gs, r, row_scale=row_scale)


def test_token_order_quantization_of_many_rows_host_oracle(lib):
    """Enough rows (140000 x 4 blocks, past the 2 x 2048 x 132 units of token_groups) that each unit takes all of
    its row's topk copies (one group), where the cases above split them one per unit: the values still the
    reference stage's, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    M, topk, E, K = 140_000, 2, 5, 64  # noqa: N806
    r = stages.routing(routed_ids(M, topk, E, gen, "minus_one"), E)
    x = (torch.randn(M, K, generator=gen) * 3).to(torch.bfloat16)
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen) * 8)
    assert cutlass.quantizes_by_token(M, K, topk, x.device), "the plans take token order here"
    assert_values_only_exact("quantize_rows", stages.STAGES, (M * topk, K, E), x, gs, r,
                             got_set=sm90_row_order_stages("w4a4", "token"))


@pytest.mark.parametrize("x_rows, k, topk, by_token", [
    (4096, 2048, 8, True),    # Qwen3-30B-A3B M = 4096: 524288 units of 270336 (132 SMs x 2048)
    (2048, 2048, 8, False),   # M = 2048: 262144
    (1024, 7168, 8, True),    # DeepSeek-V3 M = 1024: 458752
    (256, 7168, 8, False),
    (16384, 5120, 1, False),  # Llama-4-Scout: one copy per row, the same work in either order
])
def test_the_row_stage_takes_token_order_from_a_wave_of_units(x_rows, k, topk, by_token):
    """cutlass.quantizes_by_token's bound on an H100's or H200's 132 SMs (the measured crossover is in its
    docstring)."""
    assert cutlass.quantizes_by_token(x_rows, k, topk, torch.device("cpu")) == by_token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_quantize_values_only_host_oracle(lib, dtype):
    """Against the codes-writing kernel's values (the same host expf; that kernel is checked against the
    reference stage above): bit for bit, rows past the routed ones (NaN inputs) zero."""
    gen = torch.Generator().manual_seed(12)
    E, I = 7, 80  # noqa: N806, E741
    r = stages.routing(routed_ids(12, 3, E, gen, "minus_one"), E)
    h = (torch.randn(36, 2 * I, generator=gen) * 4).to(dtype)
    h[int(r.expert_offsets[-1]):] = float("nan")
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen))
    assert_values_only_exact("silu_mul_quantize", cutlass.STAGES, (36, I, E), h, gs, r)


@pytest.mark.parametrize("M, topk, E, K, dtype, pattern", GATHER_CASES)
@pytest.mark.parametrize("router_weight", [False, True], ids=["plain", "router-weight-on-input"])
@pytest.mark.parametrize("order", ["token", "slot"])
def test_w4a16_rows_host_oracle_is_exact(lib, M, topk, E, K, dtype, pattern, router_weight, order):
    """The W4A16 row stage (the values-only kernel with gs NULL: the rows unquantized) against the
    reference's (stages.w4a16_rows), bit for bit: the same selection, the same product with the router
    weight rounded once to the row's dtype, zeros past the routed slots."""
    gen = torch.Generator().manual_seed(5)
    r = stages.routing(routed_ids(M, topk, E, gen, pattern), E)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    x[1, 3] = -0.0
    x[0, 5] = torch.finfo(dtype).tiny / 4  # a subnormal passes through as it is
    row_scale = torch.rand(M * topk, generator=gen) if router_weight else None
    got_set = sm90_row_order_stages("w4a16", order)
    assert_values_only_exact("quantize_rows", stages.STAGES_W4A16, (M * topk, K, E), x, torch.ones(E), r,
                             row_scale=row_scale, got_set=got_set)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_silu_mul_host_oracle(lib, dtype):
    """The W4A16 SiLU-and-mul row stage (gs NULL) against stages.w4a16_silu_mul: rows past the routed ones
    (NaN inputs) exactly zero, the codes and scales untouched; a routed value differs only where the host's
    expf and torch's CPU exp (about 1 float32 ulp apart) leave silu on different sides of a 16-bit rounding
    boundary (torch's CPU exp itself varies with how a tensor splits into vector lanes, so which values
    differ changes from run to run). Then silu moves by one 16-bit ulp (at most 2^-7 of it in bf16, 2^-10 in
    fp16) and the product, rounded after, by at most that plus one half ulp either way: 2^-6 (bf16) / 2^-9
    (fp16) of |product|, with fp16's smallest subnormal as a floor; and rarely (at most 1 % of the values)."""
    gen = torch.Generator().manual_seed(13)
    E, I = 7, 80  # noqa: N806, E741
    r = stages.routing(routed_ids(12, 3, E, gen, "minus_one"), E)
    h = (torch.randn(36, 2 * I, generator=gen) * 4).to(dtype)
    valid = int(r.expert_offsets[-1])
    h[valid:] = float("nan")
    out = poisoned_like(Quantized.empty(36, I, E, h.device, values=dtype))
    untouched = poisoned_like(out)
    got = cutlass.STAGES_SM90_W4A16.silu_mul_quantize(h, torch.ones(E), r, out=out)
    want = stages.STAGES_W4A16.silu_mul_quantize(h, torch.ones(E), r, out=Quantized.empty(36, I, E, h.device,
                                                                                          values=dtype))
    assert_same_buffers((got.packed, got.scales), (untouched.packed, untouched.scales), what="codes")
    assert_same_buffers(got.values[valid:], want.values[valid:], what="rows past the routed ones (zero)")
    g, w = got.values[:valid].float(), want.values[:valid].float()
    assert not bool(g.isnan().any())
    rel = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-9
    bad = ((g - w).abs() > w.abs() * rel + 2.0**-24).nonzero().tolist()
    assert not bad, [(i, j, float(g[i, j]), float(w[i, j]), float(h[i, j]), float(h[i, I + j])) for i, j in bad[:5]]
    assert float((g != w).float().mean()) <= 0.01


def test_quantize_rows_without_gather_host_oracle_is_exact(lib):
    gen = torch.Generator().manual_seed(2)
    r = routing_of([0, 130, 3, 0, 1])  # an empty first expert, one over 128 rows, an empty one between
    x = torch.randn(r.num_slots, 96, generator=gen).to(torch.bfloat16)
    assert_stage_exact("quantize_rows", x, torch.full((5,), 300.0), r, gather=False)


def test_quantizer_ties_saturation_and_subnormal_scales(lib):
    """One block per row, chosen so every E2M1 tie, the 6.0 saturation and e4m3 subnormal scales occur."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    ties = torch.cat([ties, -ties])
    rows = [ties, ties * 2.0**-8, ties * 2.0**-12, torch.linspace(-7, 7, 16), torch.full((16,), 1e-3)]
    x = torch.stack(rows).to(torch.float16)
    r = routing_of([x.shape[0]])
    for gs in (1.0, 2688.0 / 7.0, 1e4):
        assert_stage_exact("quantize_rows", x, torch.tensor([gs]), r, gather=False)
        # The values-only kernel rounds onto the E2M1 grid without forming codes: the same ties.
        assert_values_only_exact("quantize_rows", stages.STAGES, (x.shape[0], 16, 1), x, torch.tensor([gs]), r,
                                 gather=False)
    # Every multiple of 1/64 in [-6.5, 6.5] onto the grid as it is (a 6.0 in each block: scale 1, gs 1).
    sweep = torch.arange(-416, 417) / 64.0
    sweep = torch.cat([sweep, sweep.new_zeros(-len(sweep) % 15)]).reshape(-1, 15)
    x = torch.cat([torch.full((sweep.shape[0], 1), 6.0), sweep], dim=1).to(torch.bfloat16)
    assert_values_only_exact("quantize_rows", stages.STAGES, (x.shape[0], 16, 1), x, torch.tensor([1.0]),
                             routing_of([x.shape[0]]), gather=False)
    # A global scale past 2^118 with bf16 subnormals and zeros: the block's multiplier gs / scale overflows
    # to inf, where the format core gives code 7 for the nonzero elements and 0 for the zeros (x * inf).
    tiny = torch.tensor([1e-39, -0.0, 0.0, 2e-40, -1e-39, 0.0, 5e-40, -0.0] * 2).to(torch.bfloat16)[None]
    for gs in (1e37, 3e38):
        assert_stage_exact("quantize_rows", tiny, torch.tensor([gs]), routing_of([1]), gather=False)
        assert_values_only_exact("quantize_rows", stages.STAGES, (1, 16, 1), tiny, torch.tensor([gs]),
                                 routing_of([1]), gather=False)
    # An inf block (scale 448) under a global scale so small that gs / 448 underflows to 0: x * 0 is NaN
    # for the infs, code 0 by the comparisons, so every value of the block is a (signed) zero.
    infs = torch.tensor([float("inf"), 1.0, -0.0, -float("inf")] * 4).to(torch.bfloat16)[None]
    assert_stage_exact("quantize_rows", infs, torch.tensor([1e-44]), routing_of([1]), gather=False)
    assert_values_only_exact("quantize_rows", stages.STAGES, (1, 16, 1), infs, torch.tensor([1e-44]),
                             routing_of([1]), gather=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_quantize_host_oracle(lib, dtype):
    """Bit-exact except where the host's expf and torch's CPU exp round differently (see the comparator)."""
    gen = torch.Generator().manual_seed(3)
    E, I = 6, 80
    r = stages.routing(routed_ids(12, 3, E, gen, "minus_one"), E)
    h = (torch.randn(36, 2 * I, generator=gen) * 4).to(dtype)
    h[int(r.expert_offsets[-1]):] = float("nan")  # rows past the routed ones must be ignored
    gs = 2688.0 / (0.5 + torch.rand(E, generator=gen))
    ref = stages.silu_mul_quantize(h, gs, r)
    out = poisoned_like(ref)
    got = cutlass.silu_mul_quantize(h, gs, r, out=out)
    assert got is out
    assert_silu_quantized_close(got, ref, h, gs, r)


def assert_silu_quantized_close(got: Quantized, ref: Quantized, h: torch.Tensor, gs: torch.Tensor, r: RoutingData,
                                max_block_fraction: float = 0.01) -> float:
    """Compare SiLU-mul-quantize outputs; returns the fraction of blocks that are not bit-identical.

    Tolerance: silu's exp comes from different libraries (CUDA expf: at most 2 ulp; torch's
    CPU exp and the host's expf: about 1 ulp). After the float32 division and the rounding of
    silu to 16 bits, a difference survives only for a value within 2 float32 ulp of a 16-bit
    rounding boundary, and then moves one activation by one 16-bit ulp. That can change that
    element's E2M1 code by one step or, if it is the block's maximum, the e4m3 scale by one
    step (re-quantizing the block). So: every byte outside the routed rows' blocks is exact
    (padding, zero rows), at most ``max_block_fraction`` of the blocks differ, and in a
    differing block every dequantized value is within the two quantizations' half steps,
    ``(sf_got + sf_ref) / gs`` (the largest E2M1 gap is 2 scale units), plus that one ulp.
    """
    valid, inter = int(r.expert_offsets[-1]), h.shape[1] // 2
    assert got.packed.shape == ref.packed.shape and got.scales.shape == ref.scales.shape
    assert_same_buffers(got.packed[valid:], ref.packed[valid:], what="packed rows past expert_offsets[E] (zero)")
    C = inter // 16
    sf_got = unswizzle_scales_grouped(got.scales, r.expert_offsets, r.blockscale_offsets, C).float()
    sf_ref = unswizzle_scales_grouped(ref.scales, r.expert_offsets, r.blockscale_offsets, C).float()
    # The padding of the scale buffer, byte for byte: blank the logical scales' bytes in both.
    expert = torch.searchsorted(r.expert_offsets[1:].long(), torch.arange(valid), right=True)
    local = torch.arange(valid) - r.expert_offsets[expert].long()
    cols = torch.arange(C)
    cp = got.scales.shape[1]
    held = (r.blockscale_offsets[expert].long() * cp).unsqueeze(1) + swizzled_offset(local.unsqueeze(1), cols, C)
    pad_got, pad_ref = got.scales.view(torch.uint8).flatten().clone(), ref.scales.view(torch.uint8).flatten().clone()
    pad_got[held.flatten()] = 0
    pad_ref[held.flatten()] = 0
    assert_same_buffers(pad_got, pad_ref, what="scale padding")
    codes_got, codes_ref = unpack_e2m1(got.packed[:valid]), unpack_e2m1(ref.packed[:valid])
    g = gs[expert].unsqueeze(1)
    deq_got = E2M1_VALUES[codes_got.long()].reshape(valid, C, 16) * sf_got.unsqueeze(-1) / g.unsqueeze(-1)
    deq_ref = E2M1_VALUES[codes_ref.long()].reshape(valid, C, 16) * sf_ref.unsqueeze(-1) / g.unsqueeze(-1)
    same = (codes_got.reshape(valid, C, 16) == codes_ref.reshape(valid, C, 16)).all(-1) & (sf_got == sf_ref)
    differing = 1.0 - float(same.float().mean()) if valid else 0.0
    assert differing <= max_block_fraction, f"{differing:.3%} of the blocks differ"
    act = stages.silu_mul(h[:valid]).float().reshape(valid, C, 16)
    ulp = act.abs().clamp_min(2.0**-24) * (2.0**-7 if h.dtype == torch.bfloat16 else 2.0**-10)
    bound = ((sf_got + sf_ref) / g).unsqueeze(-1) + ulp
    excess = ((deq_got - deq_ref).abs() - bound).max() if valid else torch.tensor(-1.0)
    assert float(excess) <= 0, f"a differing block exceeds its bound by {float(excess)}"
    return differing


@pytest.mark.parametrize("weights", [True, False], ids=["weighted", "plain-sum"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("topk", [3, 19], ids=["one-slot-batch", "three-slot-batches"])
def test_moe_reduce_host_oracle_is_exact(lib, weights, out_dtype, topk):
    gen = torch.Generator().manual_seed(4)
    M, E = 7, 23
    r = stages.routing(routed_ids(M, topk, E, gen, "minus_one"), E)
    y = torch.randn(M * topk, 72, generator=gen).to(torch.float16)
    y[int(r.expert_offsets[-1]):] = float("nan")  # never read: only routed slots are summed
    w = torch.rand(M, topk, generator=gen) if weights else None
    assert_stage_exact("moe_reduce", y, r, w, M, out_dtype)


def cutlass_with_reference(*swapped: str) -> StageSet:
    """cutlass.STAGES with the stages named ``swapped`` taken from the torch reference (stages.STAGES)."""
    return dataclasses.replace(cutlass.STAGES, name="cutlass-with-reference-" + "-".join(swapped),
                               **{s: getattr(stages.STAGES, s) for s in swapped})


def fused_against_reference(stage_set: StageSet, case: Case, dev: torch.device) -> float:
    """The MoE on ``stage_set`` (cutlass stages, the GEMM swapped for stages.grouped_gemm: exact, same buffers)
    in a poisoned workspace, against the reference backend; returns the worst row's relative error.

    The only possible difference is SiLU's exp (libm vs torch's exp on CPU; CUDA expf in both on a
    GPU): an intermediate E2M1 code moved by one step changes an output row by far less than 1e-3 of
    its norm, while a wrong row, scale, section or expert, or a byte left unwritten in the workspace,
    moves it by the order of the row itself.
    """
    gen = torch.Generator().manual_seed(5)
    ex = make_experts(case, gen, dev)
    x, w, ids = make_inputs(case, gen, dev)
    problem = MoEProblem(x, ex, w, ids, case.on_input, None)
    workspace = cached_workspace(stage_set, problem)
    poison(*workspace.tensors())
    got = run_pipeline(stage_set, problem, workspace)
    ref = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input)
    err = float(((got.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1).clamp_min(1e-30)).max())
    assert err <= 1e-3, f"worst row relative error {err:.3e}"
    return err


# The shared edge cases whose H and I the CUTLASS GEMM takes (multiples of 32), plus fp16.
CUTLASS_CASES = [c for c in EDGE_CASES if c.h % 32 == 0 and c.i % 32 == 0] + [
    Case(5, 8, 2, 96, 64, dtype=torch.float16, note="fp16; H = 96 is not a multiple of 64"),
]


@pytest.mark.parametrize("case", CUTLASS_CASES, ids=[str(c) for c in CUTLASS_CASES])
def test_fused_moe_on_the_host_oracle(lib, case):
    """The backend's stage sequence on CPU: host-oracle kernels, stages.routing standing in for the
    GPU routing (whose outputs are compared exactly with it on the GPU) and the exact torch GEMM."""
    fused_against_reference(cutlass_with_reference("routing", "grouped_gemm"), case, torch.device("cpu"))


def test_fused_moe_rejects_sizes_the_gemm_cannot_take(lib):
    case = Case(3, 3, 2, 48, 16)
    gen = torch.Generator().manual_seed(6)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    with pytest.raises(ValueError, match=r"^experts: the CUTLASS grouped GEMM needs .* got H = 48, I = 16; "
                                         r"use backend='triton'$"):
        cutlass.fused_moe(MoEProblem(x, ex, w, ids, False, None))


def test_inconsistent_offsets_never_write_out_of_bounds(lib):
    """Corrupt offsets (e.g. from validate=False misuse) may give wrong values, never stray writes."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    i32 = torch.int32
    r = RoutingData(torch.tensor([0, 100, 4], dtype=i32),  # past the 4 rows, and decreasing
                    torch.tensor([0, 4096, 128], dtype=i32),  # past the buffer
                    torch.arange(4, dtype=i32), torch.arange(4, dtype=i32))
    bound = grouped_scale_rows_bound(4, 2)
    guard = 64
    packed = torch.zeros(4 + guard, 16, dtype=torch.uint8)
    scales = torch.zeros(bound + guard, 4, dtype=torch.uint8)
    cutlass.quantize_rows(x, torch.ones(2), r, gather=False, out=Quantized(packed[:4], scales[:bound]))
    assert not packed[4:].any() and not scales[bound:].any()
    values = torch.zeros(4 + guard, 32, dtype=torch.bfloat16)  # the values-only kernel (sm_90a stage set)
    cutlass.STAGES_SM90.quantize_rows(x, torch.ones(2), r, gather=False,
                                      out=Quantized(packed[:4], scales[:bound], values[:4]))
    assert not values[4:].any()


# --------------------------------------------------------------------------- the GEMM wiring, evaluated on the host


@pytest.mark.parametrize("rows, k", [(1, 64), (100, 32), (130, 80), (300, 192), (257, 320)])
@pytest.mark.parametrize("operand", [0, 1], ids=["SFA", "SFB"])
def test_gemm_scale_layout_is_the_swizzled_layout(lib, rows, k, operand):
    """CUTLASS's tile_atom_to_shape_SF{A,B} of the compiled GEMMs reads scale (r, c) at format.swizzled_offset."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    C = k // 16
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(C), indexing="ij")
    expected = swizzled_offset(r, c, C).flatten()
    for arch in archs:
        got = torch.empty(rows * C, dtype=torch.int64)
        lib.call("moe_fp4_gemm_scale_offsets", arch=arch, operand=operand, rows=rows, k=k, offsets=got.data_ptr())
        assert torch.equal(got, expected), f"sm{arch}: first mismatch at {int((got != expected).nonzero()[0])}"


def _expected_group_args(eo, bso, E, S, N, K, a_rows, a_sf_rows):
    rows = []
    ns, cp = N // S, swizzled_shape(1, K // 16)[1]
    nps = swizzled_shape(ns, 1)[0]
    for e in range(E):
        for h in range(S):
            m = eo[e + 1] - eo[e]
            fits = (m > 0 and eo[e] >= 0 and eo[e + 1] <= a_rows
                    and bso[e] >= 0 and bso[e] + -(-m // 128) * 128 <= a_sf_rows)
            m = m if fits else 0
            rows.append([m, ns, K, eo[e] * K // 2 if m else 0, (e * N + h * ns) * K // 2, bso[e] * cp if m else 0,
                         (e * S + h) * nps * cp, (eo[e] * N + h * ns) * 2 if m else 0, N])
    return rows


@pytest.mark.parametrize("sections", [1, 2])
def test_gemm_group_arguments(lib, sections):
    """Per-group sizes and offsets of the device setup kernel (same code, run on the host); groups of
    empty experts and of offsets that do not fit the buffers get M = 0 (no tiles)."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    counts = [3, 0, 130, 1, 0]
    eo = [0] + torch.tensor(counts).cumsum(0).tolist()
    bso = [0] + torch.tensor([-(-c // 128) * 128 for c in counts]).cumsum(0).tolist()
    E, N, K = len(counts), 96, 160
    a_rows, a_sf_rows = eo[-1], grouped_scale_rows_bound(eo[-1], E)
    for eo_case, bso_case, label in ((eo, bso, "consistent"), (eo[:3] + [999] + eo[4:], bso, "expert 2 past a_rows")):
        expected = _expected_group_args(eo_case, bso_case, E, sections, N, K, a_rows, a_sf_rows)
        eo_t, bso_t = torch.tensor(eo_case, dtype=torch.int32), torch.tensor(bso_case, dtype=torch.int32)
        for arch in archs:
            out = torch.empty(E * sections * 9, dtype=torch.int64)
            lib.call("moe_fp4_gemm_group_args", arch=arch, expert_offsets=eo_t.data_ptr(),
                     blockscale_offsets=bso_t.data_ptr(), num_experts=E, sections=sections, n=N, k=K, a_rows=a_rows,
                     a_scale_rows=a_sf_rows, out=out.data_ptr())
            assert out.reshape(-1, 9).tolist() == expected, (arch, label)


@pytest.mark.parametrize("out_dtype", [_native.BF16, _native.FP16], ids=["bf16", "fp16"])
def test_gemm_plan_is_implementable(lib, out_dtype):
    """CUTLASS's can_implement accepts the configuration (host-side), and the workspace grows with the
    groups (per-group arrays) and with the SMs (a tensormap set per persistent CTA)."""
    archs = gemm_archs(lib)
    if not archs:
        pytest.skip("this build has no grouped GEMM")
    for arch in archs:
        size = {(E, S, sms): lib.size_query("moe_fp4_gemm_plan", arch=arch, out_dtype=out_dtype, num_experts=E,
                                            sections=S, sm_count=sms)
                for E, S, sms in ((128, 1, 148), (128, 2, 148), (1031, 2, 148), (128, 2, 188))}
        assert size[1031, 2, 148] > size[128, 2, 148] > size[128, 1, 148] > 0, (arch, size)
        assert size[128, 2, 188] > size[128, 2, 148], (arch, size)


def test_gemm_hooks_reject_missing_arch(lib):
    with pytest.raises(ValueError, match=r"^moe_fp4_gemm_scale_offsets: arch: expected 100 \(SM100\) or 120"):
        lib.call("moe_fp4_gemm_scale_offsets", arch=90, operand=0, rows=4, k=64, offsets=FAKE)
