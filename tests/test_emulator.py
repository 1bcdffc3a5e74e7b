"""The NumPy emulator of the kernel's data movement: exact on integers, conflict-free,
and able to notice a broken layout."""

import itertools

import numpy as np
import pytest

from warpsplitk.kernel import layout
from warpsplitk.kernel.emulator import bank_conflicts, emulate, round_bf16
from warpsplitk.tactics import (
    B_LOADER_WARPS,
    K_TILES,
    OUTPUT_TILES,
    PREFETCH_ALL,
    TOKEN_TILES,
    WarpSplitKTactic,
    is_legal,
)

#: (output_tile, token_tile, k_tile, b_loader_warps) of every kernel family
FAMILIES = [f for f in itertools.product(OUTPUT_TILES, TOKEN_TILES, K_TILES, B_LOADER_WARPS)
            if is_legal(WarpSplitKTactic(f[0], f[1], f[2], 2, f[3]), 4 * f[0], 2 * f[2])]
MS = (1, 7, 8, 9, 17, 32)


def family_id(f):
    return "o{}-t{}-k{}-b{}".format(*f)


def integer_problem(m, n, k, seed, with_bias=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, size=(m, k)).astype(np.float32)
    w = rng.integers(-4, 5, size=(n, k)).astype(np.float32)
    bias = rng.integers(-64, 65, size=n).astype(np.float32) if with_bias else None
    return x, w, bias


def reference(x, w, bias=None):
    out = x.astype(np.float64) @ w.astype(np.float64).T
    if bias is not None:
        out += bias
    return out.astype(np.float32)


def cases():
    """(family, stages, K tiles, M, N): per family one tile with a one-stage ring, two
    tiles with two stages, and three tiles through a two-stage ring; Ms rotate."""
    out = []
    for i, (o, t, kt, b) in enumerate(FAMILIES):
        for j, (stages, tiles) in enumerate(((1, 1), (2, 2), (2, 3))):
            m = MS[(i + 2 * j) % len(MS)]
            n = o * (1 + (i + j) % 2)
            out.append(pytest.param(WarpSplitKTactic(o, t, kt, stages, b), m, n, tiles * kt,
                                    id=f"{family_id((o, t, kt, b))}-s{stages}-K{tiles}t-M{m}"))
    return out


@pytest.mark.parametrize("tactic,m,n,k", cases())
def test_emulate_exact_on_integers(tactic, m, n, k):
    x, w, _ = integer_problem(m, n, k, seed=m * 1000 + n + k)
    out = emulate(x, w, tactic, round_output=False, check_coverage=True)
    assert out.shape == (m, n) and out.dtype == np.float32
    np.testing.assert_array_equal(out, reference(x, w))


@pytest.mark.parametrize("tactic,m,n,k", [
    (WarpSplitKTactic(16, 8, 128, 1, 1, 2), 1, 32, 256),     # one tile per CTA
    (WarpSplitKTactic(32, 16, 128, 2, 2, 2), 9, 64, 768),    # 3 tiles per CTA, 2-stage ring
    (WarpSplitKTactic(16, 32, 256, 2, 2, 2), 32, 16, 1024),
    (WarpSplitKTactic(64, 8, 128, 2, 1, 2), 7, 128, 512),
    (WarpSplitKTactic(48, 16, 128, 2, 2, 2), 17, 48, 512),
    (WarpSplitKTactic(48, 8, 128, 2, 1, 2), 5, 96, 1024),    # 4 tiles per CTA
    (WarpSplitKTactic(16, 1, 256, 1, 1, 2), 1, 32, 512),     # one tile per CTA, narrow
    (WarpSplitKTactic(16, 16, 256, 6, 2, 2), 16, 16, 66 * 256),  # K past 64 tiles: 33 per CTA
    (WarpSplitKTactic(16, 8, 128, 5, 2, 2), 3, 32, 65 * 128),    # uneven: 33 + 32 tiles
    (WarpSplitKTactic(32, 8, 256, 4, 1, 2, x_copy="tma"), 5, 32, 67 * 256),  # uneven, TMA
    (WarpSplitKTactic(16, 8, 256, 3, 2, 3), 3, 16, 144 * 256),   # K = 36864: three CTAs of 48
    (WarpSplitKTactic(16, 8, 128, 2, 1, 4), 2, 16, 231 * 128),   # K = 29568: 58 + 3 x 57 tiles
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_cluster_split_of_k_exact(tactic, m, n, k):
    """k_split c: each CTA of the cluster takes its share of K; the 4c
    warps' partials meet in the first CTA's buffer (each word written once,
    none read unwritten)."""
    x, w, bias = integer_problem(m, n, k, seed=m + n + k, with_bias=True)
    out = emulate(x, w, tactic, bias, round_output=False, check_coverage=True)
    np.testing.assert_array_equal(out, reference(x, w, bias))


@pytest.mark.parametrize("tactic,m,n,k", [
    (WarpSplitKTactic(16, 1, 256, 3, 1), 1, 32, 768),
    (WarpSplitKTactic(16, 1, 256, 3, 1), 3, 32, 768),                  # three 1-row CTAs
    (WarpSplitKTactic(32, 2, 128, 2, 1), 2, 64, 384),
    (WarpSplitKTactic(16, 4, 256, 2, 2), 3, 48, 512),                  # M inside the tile
    (WarpSplitKTactic(16, 4, 256, 2, 2), 9, 16, 512),                  # ... and past it
    (WarpSplitKTactic(64, 4, 128, 2, 2), 4, 64, 256),
    (WarpSplitKTactic(32, 2, 256, 2, 1, 2), 2, 64, 1024),              # k_split
    (WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=3), 1, 32 * 2 + 16 * 3, 512),
    # bulk rows: a narrow stage is token_tile padded rows
    (WarpSplitKTactic(16, 1, 256, 3, 1, x_copy="bulk"), 3, 32, 768),
    (WarpSplitKTactic(64, 1, 128, 4, 1, x_copy="bulk"), 1, 64, 512),
    (WarpSplitKTactic(32, 4, 128, 3, 1, x_copy="bulk", l2_prefetch=PREFETCH_ALL), 6, 64, 512),
    (WarpSplitKTactic(32, 2, 256, 2, 1, 2, x_copy="bulk"), 2, 64, 1024),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_narrow_token_tiles_exact(tactic, m, n, k):
    """Narrow token tiles (1, 2, 4 rows): the stage holds only the tile's
    rows, the mma's other columns read duplicates and are never stored;
    with a cluster split of K and a mixed grid too."""
    x, w, bias = integer_problem(m, n, k, seed=m * 7 + n + k, with_bias=True)
    out = emulate(x, w, tactic, bias, round_output=False, check_coverage=True)
    np.testing.assert_array_equal(out, reference(x, w, bias))


def test_narrow_tile_must_fold_its_columns_back(monkeypatch):
    """Without ``stage_row``'s fold, the columns past a 1-row tile would
    address rows 1-7 of a stage that has one: reads past the stage, which
    the emulator (a stage is exactly its rows) refuses."""
    import warpsplitk.kernel.emulator as em
    real = em.layout.b_fragment_offset
    tactic = WarpSplitKTactic(16, 1, 256, 2, 1)
    x, w, _ = integer_problem(1, 16, 512, seed=9)
    monkeypatch.setattr(em.layout, "b_fragment_offset",
                        lambda lane, warp, ni, pair, k_tile, kind="swizzle", token_tile=8:
                        real(lane, warp, ni, pair, k_tile, kind, 8))
    with pytest.raises((ValueError, IndexError, AssertionError)):
        out = emulate(x, w, tactic, round_output=False, check_coverage=True)
        np.testing.assert_array_equal(out, reference(x, w))


def test_cluster_halves_must_both_count(monkeypatch):
    """If the reduction read only the first CTA's four slots, the result
    would be half of K: the test above would see it."""
    import warpsplitk.kernel.emulator as em
    real = em.layout.reduction_offset
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1, 2)
    x, w, _ = integer_problem(3, 32, 512, seed=5)
    monkeypatch.setattr(em.layout, "reduction_offset",
                        lambda slot, *a: real(slot % layout.COMPUTE_WARPS, *a))
    with pytest.raises(AssertionError, match="written twice"):
        emulate(x, w, tactic, round_output=False, check_coverage=True)


def test_every_m_covered():
    """Each M of 1..32 against a 16-token tile: partial token tiles load zeros past M."""
    tactic = WarpSplitKTactic(16, 16, 128, 2, 2)
    x, w, _ = integer_problem(32, 16, 256, seed=3)
    for m in range(1, 33):
        out = emulate(x[:m], w, tactic, round_output=False)
        np.testing.assert_array_equal(out, reference(x[:m], w))


@pytest.mark.parametrize("tactic,m,n,k", [
    (WarpSplitKTactic(16, 8, 128, 2, 1), 5, 32, 256),
    (WarpSplitKTactic(32, 32, 256, 2, 2), 32, 64, 768),
    (WarpSplitKTactic(32, 16, 128, 1, 1), 12, 32, 128),
])
def test_emulate_with_bias(tactic, m, n, k):
    x, w, bias = integer_problem(m, n, k, seed=11, with_bias=True)
    out = emulate(x, w, tactic, bias, round_output=False, check_coverage=True)
    np.testing.assert_array_equal(out, reference(x, w, bias))
    # the bias is added once, before rounding
    rounded = emulate(x, w, tactic, bias)
    np.testing.assert_array_equal(rounded, round_bf16(reference(x, w, bias)))


def test_emulate_rounds_to_bf16_by_default():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    exact = emulate(x, w, tactic, round_output=False)
    out = emulate(x, w, tactic)
    np.testing.assert_array_equal(out, round_bf16(exact))
    # of the inputs as the kernel sees them: rounded to BF16
    np.testing.assert_allclose(exact, round_bf16(x) @ round_bf16(w).T, rtol=1e-4, atol=1e-4)


def test_emulate_rejects_bad_input():
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    with pytest.raises(ValueError, match="K="):
        emulate(np.zeros((1, 256)), np.zeros((16, 384)), tactic)
    with pytest.raises(ValueError, match="M must be in 1..32"):
        emulate(np.zeros((33, 256)), np.zeros((16, 256)), tactic)
    with pytest.raises(ValueError, match="N must be a positive multiple"):
        emulate(np.zeros((1, 256)), np.zeros((24, 256)), tactic)


# ----------------------------------------------------------- bank conflicts


@pytest.mark.parametrize("family", FAMILIES, ids=family_id)
def test_no_bank_conflicts(family):
    o, t, kt, b = family
    assert bank_conflicts(WarpSplitKTactic(o, t, kt, 2, b)) == []


# ------------------------------------------- the checks can fail (mutations)


def test_unswizzled_layout_has_bank_conflicts(monkeypatch):
    """Without the XOR every row of a stage starts in bank 0: ldmatrix phases
    conflict. The emulator still computes the right product (the mapping stays
    a consistent bijection), so the two checks are independent."""
    monkeypatch.setattr(layout, "swizzle", lambda row, col, k_tile: row * k_tile + col)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    problems = bank_conflicts(tactic)
    assert problems and any("ldmatrix" in p for p in problems)
    x, w, _ = integer_problem(3, 16, 256, seed=1)
    np.testing.assert_array_equal(emulate(x, w, tactic, round_output=False), reference(x, w))


def test_unpadded_reduction_has_bank_conflicts(monkeypatch):
    monkeypatch.setattr(layout, "REDUCTION_PAD", 0)
    assert any("reduction" in p for p in bank_conflicts(WarpSplitKTactic(32, 16, 128, 2, 1)))


def test_wrong_a_fragment_offset_breaks_emulation(monkeypatch):
    """Swapping the two K halves of operand A's ldmatrix pairs W's columns with
    the wrong activations: the emulated product must disagree with x @ W^T."""
    good = layout.a_fragment_offset

    def swapped(lane, warp, m_iter, step, k_tile):
        return good(lane ^ 16, warp, m_iter, step, k_tile)

    monkeypatch.setattr(layout, "a_fragment_offset", swapped)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    x, w, _ = integer_problem(8, 16, 256, seed=2)
    out = emulate(x, w, tactic, round_output=False)
    assert not np.array_equal(out, reference(x, w))


def test_wrong_b_fragment_offset_breaks_emulation(monkeypatch):
    good = layout.b_fragment_offset

    def shifted(lane, warp, n_iter, pair, k_tile, kind="swizzle", token_tile=0):
        # tokens read one row off
        return good((lane + 1) % 8 + lane // 8 * 8, warp, n_iter, pair, k_tile, kind, token_tile)

    monkeypatch.setattr(layout, "b_fragment_offset", shifted)
    x, w, _ = integer_problem(8, 16, 256, seed=4)
    out = emulate(x, w, WarpSplitKTactic(16, 8, 128, 2, 1), round_output=False)
    assert not np.array_equal(out, reference(x, w))


def test_loader_gap_is_caught_by_coverage(monkeypatch):
    """A loader that writes one chunk twice (and so misses one) fails check_coverage."""
    good = layout.loader_copy

    def overlapping(thread, copy, k_tile, threads, chunk=layout.CHUNK):
        return good(thread - 1 if thread == 1 else thread, copy, k_tile, threads, chunk)

    monkeypatch.setattr(layout, "loader_copy", overlapping)
    x, w, _ = integer_problem(2, 16, 256, seed=6)
    with pytest.raises(AssertionError, match="written"):
        emulate(x, w, WarpSplitKTactic(16, 8, 128, 2, 1), check_coverage=True)


def test_wrong_epilogue_is_caught(monkeypatch):
    monkeypatch.setattr(layout, "epilogue_coords", lambda thread, output_tile: (0, 0))
    x, w, _ = integer_problem(2, 16, 128, seed=7)
    with pytest.raises(AssertionError, match="stored twice"):
        emulate(x, w, WarpSplitKTactic(16, 8, 128, 1, 1))


# ------------------------------------------------------------- round_bf16


def test_round_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    scale = 10.0 ** rng.integers(-40, 39, 20000)  # float64: subnormals to near overflow
    normal = (rng.standard_normal(20000) * scale).astype(np.float32)
    any_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # exact ties between two BF16 values, both parities of the kept bit
    ties = ((np.arange(1, 2000, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 1e-45, -1e-40], np.float32)
    values = np.concatenate([normal, any_bits, ties, special])
    assert values.dtype == np.float32
    ours = round_bf16(values)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    nan = np.isnan(values)
    assert np.array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))
    # and the result is a BF16 value: the low 16 bits are clear
    assert not np.any(ours[~nan].view(np.uint32) & 0xFFFF)


def test_round_bf16_ties_to_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)  # BF16 spacing at 1.0
    ties = np.array([one + ulp / 2, one + 3 * ulp / 2], dtype=np.float32)
    np.testing.assert_array_equal(round_bf16(ties), np.array([one, one + 2 * ulp], np.float32))


# ----------------------------------------- bulk activation copies (bulk_x)

BULK_X = [
    (WarpSplitKTactic(32, 8, 256, 2, 1, x_copy="bulk"), 1, 64, 768),     # M = 1: one copy per stage
    (WarpSplitKTactic(16, 8, 128, 3, 1, x_copy="bulk"), 5, 32, 384),     # rows 5-7 never written
    (WarpSplitKTactic(16, 16, 256, 2, 1, x_copy="bulk"), 9, 32, 512),
    (WarpSplitKTactic(64, 32, 128, 2, 1, x_copy="bulk"), 32, 128, 256),  # one row per lane
    (WarpSplitKTactic(32, 8, 256, 2, 1, 2, x_copy="bulk"), 3, 64, 1024),  # each CTA its K share
    (WarpSplitKTactic(16, 8, 128, 1, 1, x_copy="bulk"), 1, 16, 128),     # one tile
]


@pytest.mark.parametrize("tactic,m,n,k", BULK_X,
                         ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_bulk_x_stages_exact(tactic, m, n, k):
    """bulk_x: one bulk copy per token row inside M fills each row-padded
    stage (every such row exactly once, pads and rows past M never), and the
    stale rows past M (NaN here) reach no output."""
    x, w, bias = integer_problem(m, n, k, seed=3 * m + n + k, with_bias=True)
    out = emulate(x, w, tactic, bias, round_output=False, check_coverage=True)
    np.testing.assert_array_equal(out, reference(x, w, bias))


@pytest.mark.parametrize("tactic", [t for t, *_ in BULK_X], ids=lambda t: t.short())
def test_bulk_x_padded_stage_has_no_bank_conflicts(tactic):
    assert bank_conflicts(tactic) == []


def test_bulk_x_without_the_pad_has_bank_conflicts(monkeypatch):
    """The row pad is what keeps a bulk-copied stage's ldmatrix phases apart."""
    monkeypatch.setattr(layout, "B_ROW_PAD", 0)
    problems = bank_conflicts(WarpSplitKTactic(16, 16, 256, 2, 1, x_copy="bulk"))
    assert problems and all("B ldmatrix" in p for p in problems)


@pytest.mark.parametrize("tactic,n,k,m", [
    (WarpSplitKTactic(32, 8, 256, 2, 1, x_copy="tma"), 64, 768, 3),
    (WarpSplitKTactic(16, 32, 256, 2, 1, x_copy="tma"), 64, 512, 19),
    (WarpSplitKTactic(16, 32, 256, 1, 1, 2, x_copy="tma"), 96, 512, 32),   # one tile per CTA
    (WarpSplitKTactic(16, 16, 128, 2, 1, x_copy="tma"), 64, 384, 16),
    (WarpSplitKTactic(32, 16, 256, 2, 1, 2, x_copy="tma"), 64, 1024, 9),
])
def test_tma_boxes_emulate_exactly(tactic, n, k, m):
    """TMA boxes: every stage element written once, rows past M zeros, the
    same exact sums as the reference."""
    x, w, _ = integer_problem(m, n, k, seed=7)
    out = emulate(x, w, tactic, round_output=False, check_coverage=True)
    assert np.array_equal(out, reference(x, w))
    assert bank_conflicts(tactic) == []


def test_wrong_tma_box_placement_is_caught_by_coverage(monkeypatch):
    """A box whose row 1 lands on row 0 writes those chunks twice (and row
    1's never): check_coverage refuses the stage."""
    good = layout.tma_swizzle
    monkeypatch.setattr(layout, "tma_swizzle",
                        lambda row, col, k_tile, token_tile:
                        good(0 if row == 1 else row, col, k_tile, token_tile))
    x, w, _ = integer_problem(16, 32, 256, seed=8)
    with pytest.raises(AssertionError, match="expected once"):
        emulate(x, w, WarpSplitKTactic(16, 16, 256, 1, 1, x_copy="tma"), check_coverage=True)


@pytest.mark.parametrize("tactic,n,k,m", [
    (WarpSplitKTactic(32, 32, 256, 2, 1, x_copy="tma", half_tiles=3), 112, 512, 19),
    (WarpSplitKTactic(64, 8, 128, 2, 2, half_tiles=1), 96, 384, 5),
    (WarpSplitKTactic(32, 16, 256, 2, 2, early_launch=True, half_tiles=5), 208, 512, 16),
])
def test_mixed_grids_emulate_exactly(tactic, n, k, m):
    """A mixed grid (half_tiles): every output written once, exact sums."""
    x, w, _ = integer_problem(m, n, k, seed=9)
    out = emulate(x, w, tactic, round_output=False, check_coverage=True)
    assert np.array_equal(out, reference(x, w))


def test_refuses_what_is_not_an_x_weight_bias_triple():
    x, w, _ = integer_problem(4, 32, 256, seed=1)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\] must be 2-D, got shapes "
                                         r"\(256,\) and \(32, 256\)"):
        emulate(x[0], w, tactic)
    for bias, shape in ((np.zeros(64), r"\(64,\)"), (np.float32(1.0), r"\(\)")):
        with pytest.raises(ValueError, match=rf"bias must have shape \(32,\), got {shape}$"):
            emulate(x, w, tactic, bias)


def test_takes_torch_tensors_of_any_float_dtype():
    """The kernel's own inputs (BF16 tensors) emulate as the same values in NumPy do."""
    torch = pytest.importorskip("torch")
    x, w, bias = integer_problem(5, 32, 256, seed=3, with_bias=True)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    expected = emulate(x, w, tactic, bias)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        tx, tw, tb = (torch.from_numpy(a).to(dtype) for a in (x, w, bias))
        out = emulate(tx, tw.requires_grad_(), tactic, tb)
        assert out.dtype == np.float32 and np.array_equal(out, expected), dtype
    # a float64 input rounds to float32 as a float64 array does
    fine = np.random.default_rng(4).standard_normal((5, 256))
    assert np.array_equal(emulate(torch.from_numpy(fine), w, tactic, round_output=False),
                          emulate(fine, w, tactic, round_output=False))


def test_refuses_what_is_no_array_or_tensor():
    x, w, _ = integer_problem(4, 32, 256, seed=1)
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    for args, name, given in (((x.tolist(), w, tactic), "x", "list"),
                              ((x, None, tactic), "weight", "NoneType"),
                              ((x, w, tactic, [0.0] * 32), "bias", "list")):
        with pytest.raises(ValueError, match=rf"^{name} must be a NumPy array or a torch\.Tensor, "
                                             rf"got {given}$"):
            emulate(*args)


def test_inputs_are_rounded_to_bf16_as_the_kernel_sees_them():
    """A float32 input computes as its BF16 rounding: what the kernel writes."""
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    assert not np.array_equal(round_bf16(x), x)  # the inputs are not BF16 values
    exact = emulate(round_bf16(x), round_bf16(w), tactic, round_bf16(b), round_output=False)
    assert np.array_equal(emulate(x, w, tactic, b, round_output=False), exact)


# ----------------------------------------------------------- FP8 weights

from warpsplitk.kernel import emulator as _emulator  # noqa: E402


def fp8_problem(m, n, k, seed, scale_kind):
    """Small-integer activations, e4m3 codes of values up to 4 in magnitude
    (subnormals and both zeros among them), power-of-two scales: every sum
    is exact in FP32."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(m, k)).astype(np.float32)
    values = _emulator.e4m3_value(np.arange(256))
    codes = [c for c in range(256) if not np.isnan(values[c]) and abs(values[c]) <= 4]
    w = rng.choice(codes, size=(n, k)).astype(np.uint8)
    if scale_kind == "tensor":
        scale = np.float32(0.5)
    elif scale_kind == "block128":
        scale = (2.0 ** rng.integers(-3, 3, size=layout.fp8_scale_blocks(n, k))).astype(np.float32)
    else:
        scale = (2.0 ** rng.integers(-3, 3, size=n)).astype(np.float32)
    bias = rng.integers(-4, 5, size=n).astype(np.float32)
    return x, w, scale, bias


def fp8_reference(x, w, scale, bias):
    """float64 of ``x @ (scale * w)^T + bias``; 2-D ``scale``: 128 x 128 blocks."""
    n, k = w.shape
    values = _emulator.e4m3_value(w).astype(np.float64)
    if np.ndim(scale) == 2:
        values = values * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
        out = x.astype(np.float64) @ values.T
    else:
        out = (x.astype(np.float64) @ values.T) * np.broadcast_to(scale, (n,))
    return (out + bias).astype(np.float32)


def test_fp8_conversion_is_exact_for_every_code():
    codes = np.arange(256)
    values = _emulator.e4m3_value(codes)
    converted = _emulator.fp8_to_bf16(codes).astype(np.float64)
    finite = ~np.isnan(values)
    assert np.array_equal(converted[finite], values[finite])
    assert values[0x01] == 2.0 ** -9 and values[0x7E] == 448 and values[0x80] == 0  # -0
    assert np.signbit(converted[0x80]) and converted[0x7F] == 480  # NaN codes read as +-480
    assert sorted(layout.fp8_k_of_slot(s) for s in range(16)) == list(range(16))


FP8_CASES = [
    (WarpSplitKTactic(16, 8, 128, 2, 1), 1, 16, 256, "tensor"),
    (WarpSplitKTactic(16, 8, 128, 2, 1), 5, 32, 512, "channel"),
    (WarpSplitKTactic(32, 16, 256, 3, 2), 13, 64, 1024, "channel"),
    (WarpSplitKTactic(64, 32, 128, 2, 2), 32, 64, 512, "channel"),
    (WarpSplitKTactic(48, 8, 128, 4, 1), 7, 96, 512, "tensor"),
    (WarpSplitKTactic(16, 1, 256, 2, 1), 1, 16, 512, "tensor"),          # narrow token tile
    (WarpSplitKTactic(16, 8, 256, 2, 1, 2), 3, 32, 1024, "channel"),     # k_split
    (WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=1), 1, 48, 512, "channel"),  # mixed grid
    # the FP8 default's families: two activation loaders, K split with a
    # narrow tile, two-stage rings at M = 32
    (WarpSplitKTactic(16, 1, 256, 3, 1, 2), 1, 32, 1536, "channel"),
    (WarpSplitKTactic(32, 8, 256, 3, 2), 8, 64, 1024, "tensor"),
    (WarpSplitKTactic(64, 8, 128, 3, 2, 2), 5, 64, 1024, "channel"),
    (WarpSplitKTactic(32, 32, 256, 2, 2, 2), 32, 32, 2048, "channel"),
]


FP8_CASES += [  # 128 x 128 block scales: a warp's quarter of a tile is in one K block
    (WarpSplitKTactic(16, 8, 128, 2, 1), 3, 16, 512, "block128"),
    (WarpSplitKTactic(32, 16, 256, 3, 2), 13, 256, 1024, "block128"),     # two K blocks a tile
    (WarpSplitKTactic(48, 8, 128, 3, 1), 7, 288, 384, "block128"),        # tiles across row blocks
    (WarpSplitKTactic(16, 8, 256, 2, 1, 2), 3, 160, 1024, "block128"),    # k_split, N % 128
    (WarpSplitKTactic(32, 32, 256, 2, 2, 2), 32, 32, 2048, "block128"),
    (WarpSplitKTactic(16, 8, 128, 3, 2, 2), 5, 32, 65 * 128, "block128"),  # uneven split
    (WarpSplitKTactic(16, 8, 128, 3, 2, 2), 5, 32, 65 * 128, "channel"),
    (WarpSplitKTactic(16, 8, 256, 3, 2, 3), 3, 32, 144 * 256, "block128"),  # three CTAs along K
    (WarpSplitKTactic(16, 8, 128, 2, 2, 4), 2, 16, 231 * 128, "channel"),   # four, uneven
]


@pytest.mark.parametrize("tactic,m,n,k,scale_kind", FP8_CASES,
                         ids=[f"{c[0].short()}-{c[1]}x{c[2]}x{c[3]}-{c[4]}" for c in FP8_CASES])
def test_fp8_emulate_exact_on_integers(tactic, m, n, k, scale_kind):
    x, w, scale, bias = fp8_problem(m, n, k, m + n + k, scale_kind)
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, round_output=False,
                                check_coverage=True)
    np.testing.assert_array_equal(out, fp8_reference(x, w, scale, bias))


def test_fp8_block_scales_apply_per_k_block_not_per_column():
    """Scales differing only along K: a per-column reading of them (or a
    block index off by one) would not match the float64 reference."""
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    x, w, _, bias = fp8_problem(4, 16, 512, 5, "tensor")
    scale = np.array([[1.0, 2.0, 0.5, 4.0]], dtype=np.float32)
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, round_output=False)
    np.testing.assert_array_equal(out, fp8_reference(x, w, scale, bias))
    assert not np.array_equal(out, fp8_reference(x, w, np.float32(1.0), bias))
    with pytest.raises(ValueError, match="block scales take no mixed grid"):
        _emulator.emulate_fp8(x[:1], w[:, :512].repeat(3, 0)[:48], np.ones((1, 4), np.float32),
                              WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=1), bias.repeat(3)[:48])
    with pytest.raises(ValueError, match=r"the block scales \(1, 4\)"):
        _emulator.emulate_fp8(x, w, np.ones((2, 4), np.float32), tactic, bias)


def test_fp8_block_scales_fold_into_bf16_weights():
    """A block scale that is no power of two: each weight times it, both
    rounded to BF16 as the kernel's fold (``block_multiplier``) makes them,
    then summed (in FP32: to its rounding); within 2 ** -7 of the exact
    dequantized weight, and measurably not it."""
    tactic = WarpSplitKTactic(32, 8, 256, 2, 2, 2)
    x, w, _, bias = fp8_problem(5, 256, 1024, 9, "tensor")
    scale = np.array([[1.3, 0.7, 3.1, 0.11, 1.0, 2.9, 0.3, 5.7]] * 2, dtype=np.float32)
    scale[1] *= 0.37
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, round_output=False)
    folded = np.vectorize(_emulator.block_multiplier)(scale)
    assert not np.array_equal(folded, scale.astype(np.float64))  # 1.3 is no BF16
    assert np.array_equal(folded, _emulator.round_bf16(scale))
    values = _emulator.e4m3_value(w) * np.repeat(np.repeat(folded, 128, 0), 128, 1)
    weights = _emulator.round_bf16(values.astype(np.float32)).astype(np.float64)
    folded_reference = x.astype(np.float64) @ weights.T + bias
    np.testing.assert_allclose(out, folded_reference, rtol=1e-5, atol=1e-3)
    exact = fp8_reference(x, w, scale, bias).astype(np.float64)
    assert not np.allclose(out, exact, rtol=1e-5, atol=1e-3)
    assert np.abs(out - exact).max() <= 2.0 ** -7 * (np.abs(x) @ np.abs(values.T)).max()


def test_fp8_layouts_have_no_bank_conflicts():
    for tactic, *_ in FP8_CASES:
        assert _emulator.fp8_bank_conflicts(tactic) == [], tactic.short()


def test_fp8_activations_in_bf16_swizzle_would_conflict(monkeypatch):
    # rows 2r and 2r + 1 of the plain swizzle share the banks of a k-step's span
    monkeypatch.setattr(layout, "swizzle_pairs", layout.swizzle)
    assert any(p.startswith("B load") for p in
               _emulator.fp8_bank_conflicts(WarpSplitKTactic(16, 8, 128, 2, 1)))


def test_fp8_unpermuted_slots_break_emulation(monkeypatch):
    # the B registers must follow the weights' k permutation
    x, w, scale, bias = fp8_problem(3, 16, 256, 7, "channel")
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    monkeypatch.setattr(layout, "fp8_k_of_slot", lambda slot: (slot % 8) // 2 * 4 + slot % 2
                        + 2 * (slot // 8))
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, round_output=False)
    assert not np.array_equal(out, fp8_reference(x, w, scale, bias))


def test_fp8_wrong_matrix_order_breaks_emulation(monkeypatch):
    x, w, scale, bias = fp8_problem(3, 16, 256, 8, "tensor")
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    original = layout.fp8_a_fragment_offset

    def steps_swapped(lane, warp, m_iter, pair, k_tile):
        j = lane // 8
        return original((j % 2) * 16 + (j // 2) * 8 + lane % 8, warp, m_iter, pair, k_tile)

    monkeypatch.setattr(layout, "fp8_a_fragment_offset", steps_swapped)
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, round_output=False)
    assert not np.array_equal(out, fp8_reference(x, w, scale, bias))


def test_fp8_emulate_refuses_what_the_kernel_refuses():
    x, w, scale, bias = fp8_problem(2, 16, 256, 9, "channel")
    with pytest.raises(ValueError, match="FP8 weights take x_copy 'cp.async', got 'tma'"):
        _emulator.emulate_fp8(x, w, scale, WarpSplitKTactic(16, 8, 128, 2, 1, x_copy="tma"))
    with pytest.raises(ValueError, match=r"scale must be one value, \[N\] = \(16,\) or the block"):
        _emulator.emulate_fp8(x, w, scale[:4], WarpSplitKTactic(16, 8, 128, 2, 1))
    with pytest.raises(ValueError, match="e4m3 bytes"):
        _emulator.emulate_fp8(x, w.astype(np.float32), scale, WarpSplitKTactic(16, 8, 128, 2, 1))
    torch = pytest.importorskip("torch")
    as_fp8 = torch.from_numpy(w).view(torch.float8_e4m3fn)
    np.testing.assert_array_equal(
        _emulator.emulate_fp8(x, as_fp8, scale, WarpSplitKTactic(16, 8, 128, 2, 1), bias,
                              round_output=False),
        fp8_reference(x, w, scale, bias))


FP8_SWIGLU_CASES = [
    (WarpSplitKTactic(32, 8, 128, 2, 1), 3, 64, 512, "channel"),
    (WarpSplitKTactic(32, 16, 256, 2, 2, 2), 13, 256, 1024, "block128"),  # gate, up: own blocks
    (WarpSplitKTactic(64, 32, 128, 2, 2), 32, 384, 512, "block128"),      # I = 192 mid-block
    (WarpSplitKTactic(32, 1, 256, 2, 1), 1, 32, 512, "tensor"),
    (WarpSplitKTactic(32, 8, 128, 3, 2, 2), 5, 256, 65 * 128, "block128"),  # uneven split
]


@pytest.mark.parametrize("tactic,m,n,k,scale_kind", FP8_SWIGLU_CASES,
                         ids=[f"{c[0].short()}-{c[1]}x{c[2]}x{c[3]}-{c[4]}"
                              for c in FP8_SWIGLU_CASES])
def test_fp8_swiglu_scales_gate_and_up_by_their_own_rows(tactic, m, n, k, scale_kind):
    """An FP8 ``[gate; up]`` weight with the SwiGLU epilogue: each half's
    sums scaled by the scales of its own rows (the up half's N / 2 further
    on), then ``silu(gate) * up``: exact on integers before the SiLU."""
    x, w, scale, bias = fp8_problem(m, n, k, m + n + k + 1, scale_kind)
    out = _emulator.emulate_fp8(x, w, scale, tactic, bias, swiglu=True, round_output=False,
                                check_coverage=True)
    full = fp8_reference(x, w, scale, bias)
    half = n // 2
    np.testing.assert_array_equal(out, _emulator.silu_mul(full[:, :half], full[:, half:]))


def test_fp8_swiglu_takes_tiles_of_32_rows_or_more():
    x, w, scale, bias = fp8_problem(1, 64, 256, 3, "channel")
    with pytest.raises(ValueError, match="SwiGLU epilogue take output_tile 32 or more, got 16"):
        _emulator.emulate_fp8(x, w, scale, WarpSplitKTactic(16, 8, 128, 2, 1), bias, swiglu=True)
