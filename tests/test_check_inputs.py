"""``moe_fp4_check_inputs`` (csrc/check_inputs.cu), the one library call behind ``fused_moe(validate=True)``
on CUDA tensors: its host oracle (``device = MOE_FP4_HOST``, the kernel's very loops run serially)
against torch's own answers, ``moe.py``'s ``_check_values`` forced onto it, and (``gpu``) the
kernel itself, a large input and concurrent callers.

Every answer is compared exactly: the two non-finite flags with ``~torch.isfinite(t).any()``, the
extremes with ``torch.aminmax`` (``INT64_MAX``/``INT64_MIN`` for an empty tensor or no map).
"""

from __future__ import annotations

import threading

import pytest
import torch
from moe_cases import Case, make_experts, make_inputs
from test_moe_reference import BAD_CALLS
from test_native import HEADER, exactly, native_library

from moe_fp4 import _native, fused_moe, moe

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
X_CODES = {torch.bfloat16: _native.BF16, torch.float16: _native.FP16}
INDEX_CODES = {torch.int32: _native.INT32, torch.int64: _native.INT64}
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


@pytest.fixture(scope="module")
def lib() -> _native.NativeLibrary:
    return native_library()


def entry_args(x, w, ids, emap=None, /, **over) -> dict:
    """The entry's arguments for these tensors (result: NULL; `over` replaces any by name)."""
    args = dict(x=x.data_ptr(), x_dtype=X_CODES[x.dtype], x_numel=x.numel(), weights=w.data_ptr(),
                weights_numel=w.numel(), ids=ids.data_ptr(), ids_dtype=INDEX_CODES[ids.dtype],
                ids_numel=ids.numel(), expert_map=None if emap is None else emap.data_ptr(),
                map_dtype=0 if emap is None else INDEX_CODES[emap.dtype], map_numel=0 if emap is None else emap.numel(),
                result=None, device=_native.HOST if x.device.type == "cpu" else x.get_device(),
                stream=None if x.device.type == "cpu" else torch.cuda.current_stream(x.device).cuda_stream)
    args.update(over)
    return args


def checked(lib, x, w, ids, emap=None) -> list[int]:
    """The entry's six results for these tensors."""
    result = torch.full((6,), 12345, dtype=torch.int64)  # host memory, on every device
    lib.call("moe_fp4_check_inputs", **entry_args(x, w, ids, emap, result=result.data_ptr()))
    return result.tolist()


def extremes(t: torch.Tensor | None) -> list[int]:
    if t is None or t.numel() == 0:
        return [INT64_MAX, INT64_MIN]
    return [int(v) for v in torch.stack(torch.aminmax(t.long())).tolist()]


def expected(x, w, ids, emap=None) -> list[int]:
    """torch's answer to the same questions."""
    return [int(bool((~torch.isfinite(x)).any())), int(bool((~torch.isfinite(w)).any())), *extremes(ids),
            *extremes(emap)]


def assert_checks(lib, x, w, ids, emap=None) -> list[int]:
    got = checked(lib, x, w, ids, emap)
    assert got == expected(x, w, ids, emap)
    return got


def inputs(device, dtype=torch.bfloat16, n=1000, slots=24, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(n, generator=gen).to(dtype).to(device)
    w = torch.rand(slots, generator=gen).to(device)
    ids = torch.randint(-1, 32, (slots,), generator=gen, dtype=torch.int32).to(device)
    return x, w, ids


# --------------------------------------------------------------------------- the ABI


def test_the_index_codes_are_the_headers():
    text = HEADER.read_text()
    assert "MOE_FP4_INT32 = 3" in text and "MOE_FP4_INT64 = 4" in text
    assert (_native.INT32, _native.INT64) == (3, 4)


def test_preconditions_name_the_argument(lib):
    x, w, ids = inputs("cpu")
    emap = torch.arange(32)
    cases = [
        (dict(x_dtype=2), "x_dtype: expected MOE_FP4_BF16 (0) or MOE_FP4_FP16 (1), got 2"),
        (dict(x=None), "x: expected a pointer, got NULL"),
        (dict(x_numel=-1), "x_numel: expected a non-negative element count, got -1"),
        (dict(weights=None), "weights: expected a pointer, got NULL"),
        (dict(weights_numel=-3), "weights_numel: expected a non-negative element count, got -3"),
        (dict(ids_dtype=_native.FP32), "ids_dtype: expected MOE_FP4_INT32 (3) or MOE_FP4_INT64 (4), got 2"),
        (dict(ids=None), "ids: expected a pointer, got NULL"),
        (dict(ids_numel=-1), "ids_numel: expected a non-negative element count, got -1"),
        (dict(expert_map=emap.data_ptr(), map_dtype=_native.BF16, map_numel=32),
         "map_dtype: expected MOE_FP4_INT32 (3) or MOE_FP4_INT64 (4), got 0"),
        (dict(map_numel=5), "map_numel: expected 0 without expert_map (NULL), got 5"),
        (dict(result=None), "result: expected a pointer, got NULL"),
        (dict(device=64), "device: expected a CUDA device ordinal in [0, 64) or MOE_FP4_HOST (-1), got 64"),
    ]
    result = torch.empty(6, dtype=torch.int64)
    for over, message in cases:
        args = entry_args(x, w, ids, result=result.data_ptr())
        args.update(over)
        with pytest.raises(ValueError, match=exactly(f"moe_fp4_check_inputs: {message}")):
            lib.call("moe_fp4_check_inputs", **args)
    odd = torch.zeros(8, dtype=torch.uint8)
    misaligned = (("x", odd.data_ptr() + 1, 2), ("weights", x.data_ptr() + 2, 4), ("ids", w.data_ptr() + 2, 4))
    for name, p, align in misaligned:
        with pytest.raises(ValueError, match=f"^moe_fp4_check_inputs: {name}: expected a {align}-byte aligned address"):
            lib.call("moe_fp4_check_inputs", **entry_args(x, w, ids, result=result.data_ptr(), **{name: p}))
    ids64 = ids.long()
    with pytest.raises(ValueError, match="^moe_fp4_check_inputs: ids: expected a 8-byte aligned address"):
        lib.call("moe_fp4_check_inputs", **entry_args(x, w, ids64, result=result.data_ptr(),
                                                      ids=ids64.data_ptr() + 4))


def test_empty_inputs_give_neutral_answers(lib):
    empty16, empty32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)
    none32, none64 = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    assert assert_checks(lib, empty16, empty32, none32) == [0, 0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN]
    assert assert_checks(lib, empty16, empty32, none64, none32) == [0, 0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN]
    result = torch.empty(6, dtype=torch.int64)
    lib.call("moe_fp4_check_inputs", x=None, x_dtype=0, x_numel=0, weights=None, weights_numel=0, ids=None,
             ids_dtype=_native.INT32, ids_numel=0, expert_map=None, map_dtype=0, map_numel=0,
             result=result.data_ptr(), device=_native.HOST, stream=None)
    assert result.tolist() == [0, 0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN]


# --------------------------------------------------------------------------- the host oracle against torch


def unaligned_views(device, dtype, n: int):
    """``n`` elements of x starting at every 2-byte offset from a 16-byte boundary (0..7 elements)."""
    base = torch.randn(n + 16, generator=torch.Generator().manual_seed(n)).to(dtype).to(device)
    start = (-(base.data_ptr() % 16) // 2) % 8  # the first element on a 16-byte boundary
    return [base[start + k:start + k + n] for k in range(8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_position_of_x_is_seen(lib, dtype):
    """One non-finite element at every position of x (the head before the first 16-byte boundary,
    every half-word of every vector, the tail), at every alignment and for short lengths."""
    _, w, ids = inputs("cpu")
    for n in (1, 7, 8, 9, 15, 16, 17, 23, 40):
        for view in unaligned_views("cpu", dtype, n):
            assert assert_checks(lib, view, w, ids)[0] == 0
            for pos in range(n):
                x = view.clone() if pos % 3 else view  # clones are aligned: both layouts
                saved = x[pos].item()
                x[pos] = NON_FINITE[pos % 3]
                assert assert_checks(lib, x, w, ids)[0] == 1, (n, pos, x.data_ptr() % 16)
                x[pos] = saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bit_pattern_is_classified(lib, dtype):
    """All 65536 16-bit patterns: the finite ones together pass; each inf/NaN alone is found."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    finite = torch.isfinite(values)
    _, w, ids = inputs("cpu")
    assert assert_checks(lib, values[finite].clone(), w, ids)[0] == 0
    assert assert_checks(lib, values, w, ids)[0] == 1
    pad = torch.ones(20, dtype=dtype)
    for v in values[~finite]:
        x = pad.clone()
        x[11] = v
        assert checked(lib, x, w, ids)[0] == 1, hex(int(v.view(torch.int16)) & 0xFFFF)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_x(lib, dtype, where, value):
    x, w, ids = inputs("cpu", dtype, n=7168 + 3)
    for view in (x, x[3:], x[1:-2]):
        v = view.clone() if where == "middle" else view
        at = {"first": 0, "middle": v.numel() // 2 + 1, "last": v.numel() - 1}[where]
        saved = v[at].item()
        v[at] = value
        assert assert_checks(lib, v, w, ids)[:2] == [1, 0]
        v[at] = saved
        assert assert_checks(lib, v, w, ids)[:2] == [0, 0]


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_weights(lib, value):
    x, w, ids = inputs("cpu", slots=37)
    for at in (0, 18, 36):
        bad = w.clone()
        bad[at] = value
        assert assert_checks(lib, x, bad, ids)[:2] == [0, 1]
    huge = torch.full_like(w, torch.finfo(torch.float32).max)
    huge[5] = -huge[5]
    assert assert_checks(lib, x, huge, ids)[:2] == [0, 0]
    sub = torch.full_like(w, 1e-45)  # subnormal
    assert assert_checks(lib, x, sub, ids)[:2] == [0, 0]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_id_extremes(lib, id_dtype):
    x, w, _ = inputs("cpu")
    info = torch.iinfo(id_dtype)
    cases = [
        torch.tensor([-1, -1, -1]),
        torch.tensor([0, 5, -1, 7, 3]),
        torch.tensor([-7, 99, 4]),
        torch.tensor([info.min, info.max, 0]),
        torch.arange(-1, 1000),
        torch.tensor([3]),
    ]
    if id_dtype == torch.int64:
        cases += [torch.tensor([2**40, 1]), torch.tensor([-(2**33), 2**31]), torch.tensor([2**31 - 1, 2**31])]
    for ids in cases:
        ids = ids.to(id_dtype)
        got = assert_checks(lib, x, w, ids)
        assert got[2:4] == [int(ids.min()), int(ids.max())]
        assert_checks(lib, x, w, ids[1:])  # an unaligned start (int32: 4 bytes off)
        assert_checks(lib, x, w, ids.flip(0).contiguous())


@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
def test_expert_map_extremes(lib, map_dtype):
    x, w, ids = inputs("cpu")
    assert checked(lib, x, w, ids)[4:] == [INT64_MAX, INT64_MIN]
    for emap in (torch.arange(32), torch.tensor([-1, 0, 3, -1]), torch.tensor([-5, 2]), torch.tensor([2**20])):
        emap = emap.to(map_dtype)
        assert assert_checks(lib, x, w, ids, emap)[4:] == extremes(emap)
    if map_dtype == torch.int64:
        assert assert_checks(lib, x, w, ids, torch.tensor([2**40, -(2**40)]))[4:] == [-(2**40), 2**40]
    empty = torch.empty(0, dtype=map_dtype)
    assert assert_checks(lib, x, w, ids, empty)[4:] == [INT64_MAX, INT64_MIN]


def test_everything_at_once(lib):
    x, w, ids = inputs("cpu", torch.float16, n=4096 + 5, slots=300, gen_seed=4)
    x[4000] = float("inf")
    w[299] = float("nan")
    ids[17] = -9
    ids[250] = 300
    emap = torch.tensor([-1, 4, 2, 7], dtype=torch.int64)
    assert assert_checks(lib, x[1:], w, ids, emap) == [1, 1, -9, 300, -1, 7]


# --------------------------------------------------------------------------- _check_values on the library path


@pytest.fixture
def via_library(lib, monkeypatch):
    """_check_values takes the library path (the host oracle) for CPU tensors; counts its uses."""
    monkeypatch.setattr(moe, "_HOST_ORACLE", True)
    uses = []
    real = moe._library_extremes

    def spy(*args):
        found = real(*args)
        uses.append(found)
        return found

    monkeypatch.setattr(moe, "_library_extremes", spy)
    monkeypatch.setattr(moe, "_torch_extremes", lambda *a: pytest.fail("took the torch path"))
    return uses


@pytest.fixture(scope="module")
def layer():
    """The layer and inputs BAD_CALLS are written for (as test_moe_reference's setup)."""
    case, gen = Case(4, 4, 2, 64, 32), torch.Generator().manual_seed(3)
    return make_experts(case, gen), *make_inputs(case, gen)


VALUE_CALLS = [b for b in BAD_CALLS if b[2] is ValueError and any(
    s in b[3] for s in ("expected finite", "expected expert ids", "expected local expert ids"))]


def test_the_value_cases_are_there():
    assert len(VALUE_CALLS) >= 7


@pytest.mark.parametrize("what,mutate,exc,pattern", VALUE_CALLS, ids=[b[0] for b in VALUE_CALLS])
def test_library_path_raises_the_same_errors(via_library, layer, what, mutate, exc, pattern):
    ex, x, w, ids = layer
    kwargs = dict(hidden_states=x, experts=ex, topk_weights=w, topk_ids=ids)
    kwargs.update(mutate(ex, x, w, ids))
    with pytest.raises(exc, match=pattern):
        fused_moe(**kwargs)
    assert via_library and all(found is not None for found in via_library)


def test_library_path_passes_valid_and_huge_finite_inputs(via_library, layer):
    ex, x, w, ids = layer
    want = fused_moe(x, ex, w, ids, validate=False)
    assert torch.equal(fused_moe(x, ex, w, ids), want)
    fused_moe(torch.full_like(x, 1e38), ex, torch.full_like(w, 1e30), ids, backend="reference")
    fused_moe(x, ex, w, ids.long().t().contiguous().t(), expert_map=torch.arange(4).repeat(2)[::2])  # strided
    fused_moe(x, ex, w, torch.full_like(ids, -1), expert_map=torch.tensor([-1, -1, 0, 3], dtype=torch.int32))
    assert len(via_library) == 4 and all(found is not None for found in via_library)


def test_both_paths_agree(lib, monkeypatch):
    x, w, ids = inputs("cpu", n=640, slots=16)
    x = x.view(10, 64)
    w, ids = w.view(2, 8).repeat(5, 1), ids.view(2, 8).repeat(5, 1)
    for emap in (None, torch.tensor([0, -1, 5, 2] * 8), torch.tensor([-1, 3, 6, 2] * 16)[1::2]):  # (strided)
        for bad in (None, "x", "w"):
            xx, ww = x.clone(), w.clone()
            if bad == "x":
                xx[3, 7] = float("nan")
            if bad == "w":
                ww[9, 1] = float("-inf")
            torch_answer = moe._torch_extremes(xx, ww, ids, emap)
            monkeypatch.setattr(moe, "_HOST_ORACLE", True)
            lib_answer = moe._library_extremes(xx, ww, ids, emap)
            monkeypatch.setattr(moe, "_HOST_ORACLE", False)
            assert moe._library_extremes(xx, ww, ids, emap) is None  # CPU tensors: torch by default
            assert lib_answer[0] == torch_answer[0] == (bad is None)
            if bad is None:
                assert lib_answer[1:] == tuple(None if v is None else int(v) for v in torch_answer[1:])


# --------------------------------------------------------------------------- the kernel (gpu)


def cuda_inputs(dtype=torch.bfloat16, n=1000, slots=24, gen_seed=0):
    return tuple(t.cuda() for t in inputs("cpu", dtype, n, slots, gen_seed))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_torch(lib, dtype):
    for n in (1, 7, 9, 17, 40, 7168, 7168 * 4 + 3):
        for view in unaligned_views("cuda", dtype, n):
            _, w, ids = cuda_inputs(dtype)
            assert assert_checks(lib, view, w, ids)[0] == 0
            for pos in sorted({0, n // 2, n - 1}):
                for value in NON_FINITE:
                    saved = view[pos].item()
                    view[pos] = value
                    assert assert_checks(lib, view, w, ids)[0] == 1, (n, pos)
                    view[pos] = saved
    x, w, ids = cuda_inputs(dtype, n=8192, slots=4096)
    for value in NON_FINITE:
        bad = w.clone()
        bad[4095] = value
        assert assert_checks(lib, x, bad, ids)[:2] == [0, 1]
    for id_dtype in (torch.int32, torch.int64):
        for extra in ([-1], [-3, 77], [torch.iinfo(id_dtype).min, torch.iinfo(id_dtype).max]):
            ids2 = torch.cat([ids.to(id_dtype), torch.tensor(extra, dtype=id_dtype, device="cuda")])
            assert_checks(lib, x, w, ids2)
            assert_checks(lib, x, w, ids2[1:])
    big = torch.tensor([2**40, -(2**35), 5], dtype=torch.int64, device="cuda")
    assert assert_checks(lib, x, w, big, big)[2:] == [-(2**35), 2**40, -(2**35), 2**40]
    assert assert_checks(lib, x, w, ids, torch.arange(-1, 31, device="cuda", dtype=torch.int32))[4:] == [-1, 30]
    empty = torch.empty(0, dtype=torch.int32, device="cuda")
    assert assert_checks(lib, x, w, empty, empty)[2:] == [INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN]


@pytest.mark.gpu
def test_gpu_large_x_with_one_nan(lib):
    """16384 x 7168 bf16 (the grid at its cap): finite, one NaN somewhere, finite again (the scratch is
    left neutral by every call)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(16384, 7168, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, w, ids = cuda_inputs(slots=16384 * 8)
    assert checked(lib, x, w, ids)[:2] == [0, 0]
    flat = x.view(-1)
    for at in (int(torch.randint(flat.numel(), (1,), generator=torch.Generator().manual_seed(5))), 0, flat.numel() - 1):
        flat[at] = float("nan")
        assert checked(lib, x, w, ids) == expected(x, w, ids)
        assert checked(lib, x[1:], w, ids)[0] == (1 if at >= 7168 else 0)
        flat[at] = 1.0
        assert checked(lib, x, w, ids)[:2] == [0, 0]


@pytest.mark.gpu
def test_gpu_check_values_takes_the_library_path(lib, monkeypatch):
    monkeypatch.setattr(moe, "_torch_extremes", lambda *a: pytest.fail("took the torch path"))
    x, w, ids = cuda_inputs(n=4 * 64, slots=8)
    x = x.view(4, 64)
    assert moe._library_extremes(x, w.view(4, 2), ids.view(4, 2), None) == (True, *extremes(ids), None, None)
    x[2, 3] = float("inf")
    assert moe._library_extremes(x, w.view(4, 2), ids.view(4, 2), None)[0] is False
    with pytest.raises(ValueError, match="hidden_states: expected finite values"):
        moe._check_values(x, w.view(4, 2), ids.view(4, 2).clamp(-1, 3), 4, None, 4)


@pytest.mark.gpu
def test_gpu_concurrent_callers(lib):
    """Eight host threads, each on its own stream, each with its own inputs and answer."""
    failures = []

    def work(seed: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x, w, ids = cuda_inputs(n=50000 + seed, slots=64 + seed, gen_seed=seed)
            if seed % 2:
                x[seed * 100] = float("nan")
            for _ in range(50):
                got, want = checked(lib, x, w, ids), expected(x, w, ids)
                if got != want:
                    failures.append((seed, got, want))
                    return

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.gpu
def test_gpu_refuses_graph_capture(lib):
    x, w, ids = cuda_inputs()
    assert checked(lib, x, w, ids) == expected(x, w, ids)  # the device's buffers exist before the capture
    result = torch.empty(6, dtype=torch.int64)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        w.mul(2)  # something to capture
        with pytest.raises(ValueError, match="^moe_fp4_check_inputs: stream: is capturing a CUDA graph"):
            lib.call("moe_fp4_check_inputs", **entry_args(x, w, ids, result=result.data_ptr(),
                                                          stream=stream.cuda_stream))
    assert checked(lib, x, w, ids) == expected(x, w, ids)  # and works again afterwards


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_keeps_the_current_device(lib):
    with torch.cuda.device(0):
        x, w, ids = (t.to("cuda:1") for t in inputs("cpu"))
        with torch.cuda.device(1):
            stream = torch.cuda.current_stream().cuda_stream
        result = torch.empty(6, dtype=torch.int64)
        lib.call("moe_fp4_check_inputs", **entry_args(x, w, ids, result=result.data_ptr(), stream=stream))
        assert torch.cuda.current_device() == 0
        assert result.tolist() == expected(x, w, ids)

