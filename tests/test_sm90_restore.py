"""moe_fp4_sm90_restore_weights (``cutlass.sm90_restore``): the exact inverse of the sm_90a weight
re-layout (``cutlass.sm90_weights``, ``csrc/include/moe_fp4/sm90_layout.cuh``), on the host oracle.

Every comparison here is exact, byte for byte, and that is the right tolerance: the re-layout does
no arithmetic. It moves code bits (a permutation per register slot), re-encodes each scale byte
one-to-one (e4m3 -> q, a bijection on the non-negative bytes) and zeroes the codes of zero-scale
blocks, so restore(prepare(x)) must reproduce every byte of x but those zeroed codes. The host
oracle runs the kernel bodies themselves (``for_each_unit`` with ``device = MOE_FP4_HOST``), so
these tests check the kernels' indexing; the GPU test at the end adds the device launch.
Without the library these tests skip or fail as test_native.py's do.
"""

from __future__ import annotations

import pytest
import torch
from test_native import FAKE, MISALIGNED, NULL, native_library

from moe_fp4 import _native
from moe_fp4.backends import cutlass

F8 = torch.float8_e4m3fn
BLOCK = 16  # elements per e4m3 block scale: 8 code bytes
SUBNORMALS = list(range(0x01, 0x08))  # the e4m3 subnormals m * 2^-9, m = 1..7
LARGEST = 0x7E  # 448, the largest finite e4m3 byte
POISONS = (0x5A, 0xA5)  # output fill bytes: a byte the kernel does not write keeps one of them


@pytest.fixture(scope="module")
def lib() -> _native.NativeLibrary:
    return native_library()


def random_weights(E: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes uint8 [E, n, k/2] and scale bytes uint8 [E, n, k/16] in 0x00..0x7E: about 15 %
    zero, 15 % subnormal, the rest any normal byte; zero, every subnormal and 0x7E at least once,
    and at least one zero-scale block whose codes are all nonzero (prepare must zero them)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0x08, LARGEST + 1, (E, n, k // BLOCK), dtype=torch.uint8, generator=gen)
    pick = torch.rand(scales.shape, generator=gen)
    scales[pick < 0.3] = torch.randint(0x01, 0x08, scales.shape, dtype=torch.uint8, generator=gen)[pick < 0.3]
    scales[pick < 0.15] = 0
    flat = scales.view(-1)  # numel >= 16 for every shape below: room for the 9 forced bytes
    forced = torch.tensor([0x00, *SUBNORMALS, LARGEST], dtype=torch.uint8)
    where = torch.randperm(flat.numel(), generator=gen)[: forced.numel()]
    flat[where] = forced
    codes.view(E, n, k // BLOCK, 8).view(-1, 8)[where[0]] = 0x77  # the forced zero block: nonzero codes
    return codes, scales


def restored_want(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The codes restore must give back: the inputs with every zero-scale block's 8 bytes zeroed."""
    E, n, half_k = codes.shape
    want = codes.clone()
    want.view(E, n, half_k // 8, 8)[scales == 0] = 0
    return want


def round_trip(codes: torch.Tensor, scales: torch.Tensor, poison: int = POISONS[0], sections: int = 1):
    """restore(prepare(codes, scales)) into outputs filled with ``poison``: (codes, scale bytes)."""
    E = codes.shape[0]
    w = cutlass.sm90_weights(codes, scales.view(F8), torch.ones(E, sections))
    out_codes = torch.full_like(codes, poison)
    out_scales = torch.full_like(scales, poison).view(F8)
    got_codes, got_scales = cutlass.sm90_restore(w.packed, w.scales, out_codes, out_scales, sections=sections)
    return got_codes, got_scales.view(torch.uint8)


def gate_up_rows(n: int) -> torch.Tensor:
    """The canonical row of each prepared row of w13 (sections = 2), as the header defines the layout:
    16-row block b holds gate rows 8b .. 8b+7, then up rows n/2 + 8b .. n/2 + 8b+7."""
    b, i = torch.arange(n) // 16, torch.arange(n) % 16
    return torch.where(i < 8, 8 * b + i, n // 2 + 8 * b + i - 8)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {want.numel()} bytes differ, first at {bad[0].tolist()}: "
                              f"got {int(got[tuple(bad[0])]):#04x}, want {int(want[tuple(bad[0])]):#04x}")


# --------------------------------------------------------------------------- round trips

# n % 64 != 0 (48, 80) leaves a last group of fewer than 4 row blocks; 16 has only that group.
# k % 64 != 0 (16, 48, 80, 96) has a tail chunk of 1, 3, 1, 2 steps, 16 and 48 nothing else.
@pytest.mark.parametrize("sections", [1, 2])
@pytest.mark.parametrize("k", [16, 48, 64, 80, 96, 256])
@pytest.mark.parametrize("n", [16, 48, 64, 80, 192])
@pytest.mark.parametrize("E", [1, 3])
def test_round_trip_is_exact(lib, E, n, k, sections):
    codes, scales = random_weights(E, n, k, seed=E * 100_003 + n * 1009 + k)
    want_codes = restored_want(codes, scales)
    assert (want_codes != codes).any(), "the case has no zero-scale block with nonzero codes"
    for poison in POISONS:  # two fills: a byte left unwritten differs from the wanted byte under one of them
        got_codes, got_scales = round_trip(codes, scales, poison, sections)
        assert_bytes_equal(got_scales, scales, f"[{E}, {n}, {k}] scales (fill {poison:#04x})")
        assert_bytes_equal(got_codes, want_codes, f"[{E}, {n}, {k}] codes (fill {poison:#04x})")


@pytest.mark.parametrize("n, k", [(32, 80), (48, 64), (192, 96)])  # n = 16 would be the identity
def test_gate_up_layout_is_the_plain_layout_of_interleaved_rows(lib, n, k):
    """sections = 2 lays out w13 as sections = 1 lays out its rows permuted by gate_up_rows (8 gate rows,
    then the 8 up rows of the same columns, per 16-row block): byte for byte, codes and scales."""
    E = 2
    codes, scales = random_weights(E, n, k, seed=n + k)
    gate_up = cutlass.sm90_weights(codes, scales.view(F8), torch.ones(E, 2))
    rows = gate_up_rows(n)
    plain = cutlass.sm90_weights(codes[:, rows].contiguous(), scales[:, rows].contiguous().view(F8), torch.ones(E))
    assert not torch.equal(rows, torch.arange(n))
    assert_bytes_equal(gate_up.packed, plain.packed, "codes")
    assert_bytes_equal(gate_up.scales, plain.scales, "scales")


def test_every_finite_nonnegative_scale_byte_comes_back(lib):
    """The scale decode over all 127 bytes 0x00..0x7E (zero, the 7 subnormals, the 119 normals), each
    in full chunks and in the tail chunk: [1, 128, 144] has 2 full chunks (scale columns 0..7) and a
    1-step tail (column 8) per row block."""
    n, k = 128, 144
    scales = torch.empty(1, n, k // BLOCK, dtype=torch.uint8)
    scales[0, :, :8] = (torch.arange(n * 8) % 0x7F).view(n, 8)  # every byte at least 8 times
    scales[0, :, 8] = torch.arange(n).clamp(max=0x7E)  # every byte once (0x7E twice)
    codes = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got_codes, got_scales = round_trip(codes, scales)
    for where, cols in (("full chunks", slice(0, 8)), ("the tail chunk", slice(8, 9))):
        want = scales[..., cols]
        bad = sorted({f"{b:#04x}" for b in want[got_scales[..., cols] != want].tolist()})
        assert not bad, f"scale bytes not restored in {where}: {bad}"
    assert_bytes_equal(got_codes, restored_want(codes, scales), "codes")


def test_a_nan_scale_also_comes_back(lib):
    """0x7F (NaN) is outside the contract (NvFp4Experts rejects it) but round-trips too: prepare keeps
    its codes, q = 0xFF decodes to 0x7F."""
    codes, scales = random_weights(1, 16, 64, seed=5)
    scales[0, 3, 2] = 0x7F
    got_codes, got_scales = round_trip(codes, scales)
    assert_bytes_equal(got_scales, scales, "scales")
    assert_bytes_equal(got_codes, restored_want(codes, scales), "codes")


def test_restore_into_existing_storage(lib):
    """Given outputs are written and returned; the storage around them is left alone."""
    E, n, k = 3, 80, 80
    codes, scales = random_weights(E, n, k, seed=11)
    w = cutlass.sm90_weights(codes, scales.view(F8), torch.ones(E))
    code_store = torch.full((3, E, n, k // 2), POISONS[0], dtype=torch.uint8)
    scale_store = torch.full((3, E, n, k // BLOCK), POISONS[1], dtype=torch.uint8).view(F8)
    got_codes, got_scales = cutlass.sm90_restore(w.packed, w.scales, out_codes=code_store[1], out_scales=scale_store[1])
    assert got_codes.data_ptr() == code_store[1].data_ptr() and got_scales.data_ptr() == scale_store[1].data_ptr()
    assert got_scales.dtype == F8 and got_codes.dtype == torch.uint8
    assert_bytes_equal(code_store[1], restored_want(codes, scales), "codes")
    assert_bytes_equal(scale_store[1].view(torch.uint8), scales, "scales")
    for i in (0, 2):
        assert (code_store[i] == POISONS[0]).all() and (scale_store[i].view(torch.uint8) == POISONS[1]).all()
    # Without outputs: new tensors of the same values.
    new_codes, new_scales = cutlass.sm90_restore(w.packed, w.scales)
    assert new_scales.dtype == F8 and new_codes.shape == codes.shape and new_scales.shape == scales.shape
    assert torch.equal(new_codes, got_codes) and torch.equal(new_scales.view(torch.uint8), scales)


# --------------------------------------------------------------------------- bad arguments

U8 = torch.uint8


def _bad(name: str, error: type, message: str, **changed):
    return pytest.param(changed, error, message, id=f"{name}")


# The wrapper's own checks (shape [1, 16, 32] codes, [1, 16, 4] scales otherwise).
WRAPPER_CASES = [
    _bad("packed-dtype", TypeError, "packed: expected dtype uint8, got int8",
         packed=torch.zeros(1, 16, 16, dtype=torch.int8)),
    _bad("packed-ndim", ValueError, r"packed: expected a 3-D tensor, got shape \(16, 16\)",
         packed=torch.zeros(16, 16, dtype=U8)),
    _bad("packed-strides", ValueError, "packed: expected a contiguous tensor",
         packed=torch.zeros(1, 16, 32, dtype=U8)[:, :, ::2]),
    _bad("scales-dtype", TypeError, "scales: expected dtype uint8, got float8_e4m3fn",
         scales=torch.zeros(1, 16, 2, dtype=U8).view(F8)),
    _bad("scales-shape", ValueError, r"scales: expected shape \[1, 16, 2\], got \[1, 16, 4\]",
         scales=torch.zeros(1, 16, 4, dtype=U8)),
    _bad("out_codes-shape", ValueError, r"out_codes: expected shape \[1, 16, 16\], got \[1, 16, 8\]",
         out_codes=torch.zeros(1, 16, 8, dtype=U8)),
    _bad("out_scales-dtype", TypeError, "out_scales: expected dtype float8_e4m3fn, got uint8",
         out_scales=torch.zeros(1, 16, 2, dtype=U8)),
    _bad("out_codes-device", ValueError, "out_codes: expected a tensor on cpu",
         out_codes=torch.empty(1, 16, 16, dtype=U8, device="meta")),
    # Shapes the tensors agree on but the layout cannot take: the library's checks name k and n.
    _bad("k-not-16", ValueError, r"moe_fp4_sm90_restore_weights: k: expected a positive multiple of 16 .*got 40",
         packed=torch.zeros(1, 16, 20, dtype=U8), scales=torch.zeros(1, 16, 2, dtype=U8)),
    _bad("n-not-16", ValueError, r"moe_fp4_sm90_restore_weights: n: expected a positive multiple of 16 .*got 24",
         packed=torch.zeros(1, 24, 16, dtype=U8), scales=torch.zeros(1, 24, 2, dtype=U8)),
]


@pytest.mark.parametrize("changed, error, message", WRAPPER_CASES)
def test_wrapper_argument_checks(lib, changed, error, message):
    args = dict(packed=torch.zeros(1, 16, 16, dtype=U8), scales=torch.zeros(1, 16, 2, dtype=U8))
    with pytest.raises(error, match=f"^{message}"):
        cutlass.sm90_restore(**{**args, **changed})


# The C entry's preconditions, shared with moe_fp4_sm90_prepare_weights (one check function). The
# arguments are otherwise valid but point nowhere: every call must fail a check before a read.
C_ARGS = dict(w=FAKE, scales=FAKE + 4096, num_experts=2, n=64, k=64, sections=1, w_out=FAKE + 8192,
              scales_out=FAKE + 12288, device=_native.HOST, stream=NULL)
C_CASES = [
    (dict(sections=3), r"sections: expected 1, or 2 for w13 \(gate rows, then up rows\), got 3"),
    (dict(sections=0), "sections: expected 1, or 2 for w13"),
    (dict(k=40), r"k: expected a positive multiple of 16 \(whole e4m3 scale blocks\), at most 2\^30, got 40"),
    (dict(k=0), "k: expected a positive multiple of 16"),
    (dict(n=24), r"n: expected a positive multiple of 16 \(whole 16-row blocks of the prepared layout\), at most "
                 r"2\^21, got 24"),
    (dict(num_experts=0), "num_experts: expected at least 1, got 0"),
    (dict(w=NULL), "w: expected a pointer, got NULL"),
    (dict(scales=NULL), "scales: expected a pointer, got NULL"),
    (dict(w_out=NULL), "w_out: expected a pointer, got NULL"),
    (dict(scales_out=NULL), "scales_out: expected a pointer, got NULL"),
    (dict(w_out=MISALIGNED), "w_out: expected a 16-byte aligned address"),
    (dict(w_out=FAKE), r"w_out, scales_out: expected buffers distinct from w and scales"),
    (dict(device=99), r"device: expected a CUDA device ordinal in \[0, 64\)"),
]
C_CASE_IDS = [",".join(f"{k}={v}" for k, v in changed.items()) for changed, _ in C_CASES]


@pytest.mark.parametrize("entry", ["moe_fp4_sm90_restore_weights", "moe_fp4_sm90_prepare_weights"])
@pytest.mark.parametrize("changed, message", C_CASES, ids=C_CASE_IDS)
def test_c_entry_preconditions(lib, entry, changed, message):
    with pytest.raises(ValueError, match=f"^{entry}: {message}"):
        lib.call(entry, **{**C_ARGS, **changed})


# --------------------------------------------------------------------------- the device launch

@pytest.mark.gpu
@pytest.mark.parametrize("sections", [1, 2])
@pytest.mark.parametrize("E, n, k", [(3, 80, 80), (2, 192, 256)])
def test_device_round_trip_equals_the_host_oracle(lib, E, n, k, sections):
    """The same round trip on the GPU (the kernel launch): exact, as on the host (see the docstring)."""
    codes, scales = random_weights(E, n, k, seed=3)
    w = cutlass.sm90_weights(codes.cuda(), scales.cuda().view(F8), torch.ones(E, sections, device="cuda"))
    host = cutlass.sm90_weights(codes, scales.view(F8), torch.ones(E, sections))
    assert_bytes_equal(w.packed.cpu(), host.packed, "prepared codes")
    assert_bytes_equal(w.scales.cpu(), host.scales, "prepared scales")
    got_codes, got_scales = cutlass.sm90_restore(w.packed, w.scales, sections=sections)
    assert_bytes_equal(got_scales.view(torch.uint8).cpu(), scales, "scales")
    assert_bytes_equal(got_codes.cpu(), restored_want(codes, scales), "codes")
