"""The tactic rules, the default heuristic and the occupancy model (pure Python)."""

import dataclasses
import itertools
import re

import pytest

from warpsplitk import shapes
from warpsplitk.kernel import layout
from warpsplitk.tactics import (
    B_LOADER_WARPS,
    K_SPLITS,
    K_TILES,
    MAX_K_TILES,
    MAX_STAGES,
    OUTPUT_TILES,
    SMEM_PER_BLOCK,
    TOKEN_TILES,
    MMA_TOKEN_TILES,
    NARROW_TOKEN_TILES,
    PREFETCH_ALL,
    WarpSplitKTactic,
    all_tactics,
    check_tactic,
    ctas_per_sm,
    grid_ctas,
    is_legal,
    legal_tactics,
    needed_k_split,
    shape_refusal,
)
from warpsplitk.planning.choose import FP8_CLUSTER_RESIDENT, FP8_MIN_RESIDENT, default_tactic

T = WarpSplitKTactic
GOOD = T(16, 8, 128, 4, 1)


def test_good_tactic_passes():
    check_tactic(GOOD, 256, 1024)  # no exception
    assert is_legal(GOOD, 256, 1024)


# --------------------------------------------------------------- rejections

REJECTIONS = [
    # (tactic, N, K, regex the message must match)
    (T(8, 8, 128, 4, 1), 256, 1024, r"output_tile must be one of \(16, 32.*\), got 8"),
    (T(128, 8, 128, 4, 1), 256, 1024, r"output_tile must be one of"),
    (T(16, 3, 128, 4, 1), 256, 1024, r"token_tile must be one of \(1, 2, 4, 8, 16, 32\), got 3"),
    (T(16, 64, 128, 4, 1), 256, 1024, r"token_tile must be one of"),
    (T(16, 8, 64, 4, 1), 256, 1024, r"k_tile must be one of \(128, 256\), got 64"),
    (T(16, 8, 512, 2, 1), 256, 1024, r"k_tile must be one of"),
    (T(64, 8, 256, 2, 1), 256, 1024, r"output_tile 64 needs k_tile 128"),
    (T(16, 8, 128, 0, 1), 256, 1024, r"stages must be in 1\.\.32, got 0"),
    (T(16, 8, 128, 33, 1), 256, 8192, r"stages must be in 1\.\.32, got 33"),
    (T(16, 8, 128, 4, 3), 256, 1024, r"b_loader_warps must be one of \(1, 2\), got 3"),
    (T(16, 8, 128, 4, 0), 256, 1024, r"b_loader_warps must be one of"),
    (T(32, 8, 128, 4, 1), 48, 1024, r"N must be a positive multiple of output_tile 32, got N=48"),
    (T(16, 8, 128, 4, 1), 40, 1024, r"N must be a positive multiple of output_tile 16"),
    (T(16, 8, 128, 4, 1), 0, 1024, r"N must be a positive multiple of output_tile"),
    (T(16, 8, 128, 4, 1), -16, 1024, r"N must be a positive multiple of output_tile"),
    (T(16, 8, 128, 4, 1), 2 ** 30, 128, r"N must be below 1073741824 \(32-bit output offsets\)"),
    (T(16, 8, 256, 2, 1), 256, 1152, r"K must be a positive multiple of k_tile 256, got K=1152"),
    (T(16, 8, 128, 2, 1), 256, 1000, r"K must be a positive multiple of k_tile 128"),
    (T(16, 8, 128, 2, 1), 256, 0, r"K must be a positive multiple of k_tile"),
    (T(16, 8, 128, 4, 1), 256, 65 * 128, r"65 tiles of 128.*at most 64"),
    (T(16, 8, 256, 4, 1), 256, 65 * 256, r"65 tiles of 256;.*at most 64 \(K <= 16384; a k_split of 2"),
    (T(16, 8, 256, 4, 1, 2), 256, 130 * 256, r"65 tiles of 256 per CTA, k_split 2;.*\(K <= 32768; a k_split of 3 takes it\)"),
    (T(16, 8, 256, 4, 1, 2), 256, 9 * 256, r"k_split 2 must divide the 9 K tiles.*only past 64"),
    (T(16, 8, 128, 5, 1), 256, 512, r"stages=5 exceeds the 4 K tiles of K=512"),
    (T(16, 8, 256, 2, 1), 256, 256, r"stages=2 exceeds the 1 K tiles"),
    (T(16, 8, 128, 1, 1), 256, 256, r"one-stage ring.*spans 2 tiles, use stages >= 2"),
    (T(32, 32, 256, 16, 2), 256, 4096, r"needs \d+ B of shared memory, over the 232448 B"),
    (T(16, 4, 256, 4, 1, x_copy="tma"), 256, 1024,
     r"narrow token_tile 4 .* does not take x_copy 'tma'"),
    (T(16, 1, 128, 4, 1), 256, 1024, r"token_tile 1 x k_tile 128 is 16 16-byte copies, not a "
                                     r"multiple of the 32 threads"),
    (T(16, 1, 256, 4, 2), 256, 1024, r"is 32 16-byte copies, not a multiple of the 64 threads"),
]

REJECTION_IDS = ['output_tile-8',
                 'output_tile-128',
                 'token_tile-3',
                 'token_tile-64',
                 'k_tile-64',
                 'k_tile-512',
                 'output_tile-64-k_tile-256',
                 'stages-0',
                 'stages-33',
                 'b_loader_warps-3',
                 'b_loader_warps-0',
                 'N-not-multiple-32',
                 'N-not-multiple-16',
                 'N-zero',
                 'N-negative',
                 'N-2-to-the-30',
                 'K-not-multiple-256',
                 'K-not-multiple-128',
                 'K-zero',
                 'K-65-tiles-128',
                 'K-65-tiles-256',
                 'K-65-tiles-256-per-cta',
                 'K-split-odd-tiles',
                 'stages-over-tiles',
                 'stages-over-one-tile',
                 'one-stage-ring',
                 'smem-over-227KB',
                 'narrow-token-tile-tma',
                 'narrow-token-tile-too-few-copies',
                 'narrow-token-tile-too-few-copies-two-warps']


@pytest.mark.parametrize("tactic,n,k,message", REJECTIONS,
                         ids=REJECTION_IDS)
def test_check_tactic_rejects(tactic, n, k, message):
    with pytest.raises(ValueError, match=message):
        check_tactic(tactic, n, k)
    assert not is_legal(tactic, n, k)


def test_rejects_non_tactic():
    with pytest.raises(ValueError, match="expected a WarpSplitKTactic"):
        check_tactic((16, 8, 128, 4, 1), 256, 1024)


def test_rejects_non_integer_shapes():
    with pytest.raises(ValueError, match="N must be"):
        check_tactic(GOOD, 256.0, 1024)
    with pytest.raises(ValueError, match="K must be"):
        check_tactic(GOOD, 256, "1024")


def test_limits_are_inclusive():
    """The edges of each range are legal: MAX_STAGES (32) stages, 64 K tiles, one stage for
    one tile."""
    check_tactic(T(16, 8, 128, MAX_STAGES, 1), 256, MAX_STAGES * 128)
    check_tactic(T(16, 8, 128, 2, 1), 256, MAX_K_TILES * 128)
    check_tactic(T(16, 8, 256, 2, 1), 256, MAX_K_TILES * 256)
    check_tactic(T(16, 8, 256, 1, 1), 16, 256)


def _family_is_legal(t):
    """Whether the tactic's (output_tile, token_tile, k_tile, b_loader_warps) is
    usable at all (a two-stage ring over two K tiles)."""
    return is_legal(dataclasses.replace(t, stages=2), 4 * t.output_tile, 2 * t.k_tile)


def test_shared_memory_limit_is_the_boundary():
    """A tactic of a usable family is rejected for shared memory exactly when
    smem_bytes > 227 KB."""
    seen_over = seen_under = False
    for t in filter(_family_is_legal, all_tactics()):
        k = t.stages * t.k_tile  # exactly as many K tiles as stages: legal but for memory
        if t.smem_bytes > SMEM_PER_BLOCK:
            seen_over = True
            with pytest.raises(ValueError, match="shared memory"):
                check_tactic(t, 192, k)  # 192: a multiple of every output tile
        else:
            seen_under = True
            check_tactic(t, 192, k)  # 192: a multiple of every output tile
    assert seen_over and seen_under


# ------------------------------------------------------- default heuristic

GRID_N = (16, 48, 112, 4096, 65536)
GRID_K = (128, 384, 1024, 7168, 16384)
TABLE = [(s["n"], s["k"]) for s in shapes.load()["shapes"]]


@pytest.mark.parametrize("n,k", TABLE + list(itertools.product(GRID_N, GRID_K)))
def test_default_tactic_legal_for_every_m(n, k):
    for m in range(1, 33):
        for sm_count in (132, 78):
            t = default_tactic(m, n, k, sm_count=sm_count)
            check_tactic(t, n, k)
            cover = min(tile for tile in (8, 16, 32) if tile >= m)
            # an mma-wide tile no wider than the one covering M (narrower
            # ones take M in several token tiles), or a narrow one holding M
            assert (8 <= t.token_tile <= cover) or m <= t.token_tile < 8, (m, t)
            # x is never padded by a whole tile
            assert t.token_tile // 2 < m or t.token_tile == 8, (m, t)
            assert ctas_per_sm(t) >= 1


def test_default_tactic_without_sm_count_on_cpu():
    # no GPU: the model assumes an H200's 132 SMs
    assert default_tactic(8, 4096, 7168) == default_tactic(8, 4096, 7168, sm_count=132)


def test_default_tactic_single_k_tile_uses_one_stage():
    t = default_tactic(1, 256, 128, sm_count=132)
    assert (t.k_tile, t.stages) == (128, 1)


@pytest.mark.parametrize("m,n,k,message", [
    (0, 256, 1024, r"M must be in 1\.\.32, got 0$"),
    (33, 256, 1024, r"M must be in 1\.\.32, got 33$"),
    (1, 40, 1024, r"N must be a positive multiple of 16, got 40$"),
    (1, 256, 1000, r"K must be a positive multiple of 128 up to 32768, or of 256 up to 65536; "
                   r"got 1000$"),
    (1, 256, 257 * 128, r"K must be .*; got 32896$"),
    (1, 256, 65792, r"K must be .*; got 65792$"),
    (1, 0, 1024, r"N must be a positive multiple of 16, got 0$"),
    (1, 2 ** 30, 1024, r"N must be below 1073741824 \(32-bit output offsets\), got N=1073741824$")])
def test_default_tactic_rejects_bad_shapes(m, n, k, message):
    with pytest.raises(ValueError, match=message):
        default_tactic(m, n, k, sm_count=132)


def test_shape_refusal_names_the_rule():
    assert shape_refusal(4096, 4096) is None
    assert shape_refusal(16384, 16384) is None  # K: 64 tiles of 256
    assert "multiple of 128" in shape_refusal(1280, 2880)  # gpt-oss
    assert "multiple of 16, got 1000" in shape_refusal(1000, 4096)
    assert shape_refusal(8192, 28672) is None  # 70B's down at TP 1: 2 x 56 tiles of 256
    assert shape_refusal(4096, 32768) is None  # 2 x 64 tiles of 256
    # past 64 tiles an odd count splits unevenly: the first CTA one tile more
    assert shape_refusal(4096, 8320) is None  # 65 tiles of 128: 33 + 32
    assert shape_refusal(4096, 13696) is None  # GLM-4's down: 107 tiles of 128, 54 + 53
    assert shape_refusal(4096, 16640) is None  # 65 tiles of 256
    assert shape_refusal(4096, 16512) is None  # 129 tiles of 128: 43 x 3
    assert shape_refusal(4096, 33280) is None  # 130 tiles of 256: 44 + 43 + 43
    assert "got 32896" in shape_refusal(4096, 32896)  # 257 tiles of 128: 65 + 64 x 3
    assert "of 256 up to 65536; got 65792" in shape_refusal(4096, 65792)  # 4 x 65 tiles
    assert "below 1073741824" in shape_refusal(2 ** 30, 128)


@pytest.mark.parametrize("n,k,reason", [
    (0, 0, "N must be a positive multiple of 16, got 0"),
    (-16, -128, "N must be a positive multiple of 16, got -16"),
    (16.0, 128.0, "N must be a positive multiple of 16, got 16.0"),
    ("16", 128, "N must be a positive multiple of 16, got '16'"),
    (True, 128, "N must be a positive multiple of 16, got True"),
    (16, 0, "K must be a positive multiple of 128 up to 32768, or of 256 up to 65536; got 0"),
    (16, 128.0, "K must be a positive multiple of 128 up to 32768, or of 256 up to 65536; "
                "got 128.0")])
def test_shape_refusal_of_what_is_no_size(n, k, reason):
    assert shape_refusal(n, k) == reason


def test_default_tactic_takes_exactly_the_shapes_shape_refusal_takes():
    for n in (16, 32, 48, 1000, 4096, 2 ** 30 - 16, 2 ** 30):
        for k in (128, 384, 8192, 8320, 8448, 13696, 16384, 16512, 16640, 16896, 28672,
                  32768, 33280, 32896, 36864, 65536, 65792):
            if shape_refusal(n, k) is None:
                assert check_tactic(default_tactic(1, n, k, sm_count=132), n, k) is None
            else:
                with pytest.raises(ValueError, match=re.escape(shape_refusal(n, k))):
                    default_tactic(1, n, k, sm_count=132)


def test_default_tactic_unsupported_k_is_a_value_error():
    # 257 tiles of 128: a multiple of 128 past 32768 that is not one of 256
    with pytest.raises(ValueError, match=r"K must be .*; got 32896$"):
        default_tactic(1, 256, 257 * 128, sm_count=132)


def test_uneven_splits_only_past_64_tiles_and_without_mixed_grids():
    """An odd count of K tiles splits unevenly only where K needs the split
    (the tactic space of every K that splits evenly is unchanged), never
    with a mixed grid; each CTA holds at most 64 tiles."""
    check_tactic(T(32, 8, 128, 4, 2, 2), 4096, 13696)  # 54 + 53 tiles
    with pytest.raises(ValueError, match="an uneven split only past 64 tiles"):
        check_tactic(T(16, 8, 128, 2, 1, 2), 256, 9 * 128)
    with pytest.raises(ValueError, match="half_tiles is for k_split 1"):  # no mixed grid
        check_tactic(T(32, 8, 128, 4, 2, 2, half_tiles=1), 48, 13696)
    # the smaller share (32 of 65 tiles) bounds the ring's rules
    check_tactic(T(16, 8, 128, 32, 2, 2), 256, 65 * 128)
    with pytest.raises(ValueError, match="already holds all 32"):
        check_tactic(T(16, 8, 128, 32, 2, 2, l2_prefetch=-1), 256, 65 * 128)
    for m in (1, 8, 32):
        for fp8 in (False, True):
            tactic = default_tactic(m, 4096, 13696, sm_count=132, fp8=fp8)
            assert tactic.k_split == 2 and tactic.k_tile == 128
            check_tactic(tactic, 4096, 13696, fp8=fp8)


# ---------------------------------------------------------- legal_tactics


@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (8, 48, 384), (9, 4096, 7168), (32, 256, 16384),
                                   (17, 2112, 7168), (32, 65536, 1024), (1, 256, 28672)])
def test_legal_tactics(m, n, k):
    tactics = legal_tactics(m, n, k)
    assert tactics
    assert tactics == sorted(set(tactics))
    need = min(t for t in MMA_TOKEN_TILES if t >= m)
    for t in tactics:
        check_tactic(t, n, k)
        assert t.token_tile <= need
    assert any(t.token_tile == need for t in tactics)
    # nothing legal is left out
    splits = {1, needed_k_split(k)}  # a long K takes the split it needs
    expected = {t for t in all_tactics(splits) if is_legal(t, n, k) and t.token_tile <= need}
    assert set(tactics) == expected


def test_legal_tactics_rejects_bad_m():
    for m in (0, 33):
        with pytest.raises(ValueError, match="M must be in 1..32"):
            legal_tactics(m, 256, 1024)


def test_all_tactics_is_the_full_space():
    tactics = list(all_tactics())
    # a narrow token tile needs a whole number of 16-byte copies per loader thread
    narrow = sum(1 for t, k, b in itertools.product(NARROW_TOKEN_TILES, K_TILES, B_LOADER_WARPS)
                 if t * k // 8 % (32 * b) == 0)
    assert narrow == 8  # 1 x 256 by one warp; 2 x 128 by one, 2 x 256 by one or two; 4 x any
    assert len(tactics) == len(set(tactics)) == (
        len(OUTPUT_TILES) * MAX_STAGES
        * (len(MMA_TOKEN_TILES) * len(K_TILES) * len(B_LOADER_WARPS) + narrow))
    assert {16, 32} <= set(OUTPUT_TILES) and MMA_TOKEN_TILES == (8, 16, 32)
    assert NARROW_TOKEN_TILES == (1, 2, 4) and TOKEN_TILES == NARROW_TOKEN_TILES + MMA_TOKEN_TILES
    assert K_TILES == (128, 256) and B_LOADER_WARPS == (1, 2) and MAX_STAGES == 32


# ------------------------------------------------------------- parse/short


def test_short_parse_round_trip():
    for t in all_tactics():
        assert T.parse(t.short()) == t
    assert T(32, 16, 256, 7, 2).short() == "32,16,256,7,2"
    assert T.parse("16, 8, 128, 4, 1") == T(16, 8, 128, 4, 1)
    # the cluster split of K: a sixth field, written only when not 1
    for t in all_tactics(k_splits=(1, 2)):
        assert T.parse(t.short()) == t
    assert T(32, 8, 256, 6, 1, 2).short() == "32,8,256,6,1,2"
    assert T.parse("32,8,256,6,1,1") == T(32, 8, 256, 6, 1)
    # every option, in every combination
    from warpsplitk.tactics import L2_PREFETCHES, X_COPIES
    for t in all_tactics((1, 2), (False, True), L2_PREFETCHES, X_COPIES):
        if t.stages % 7 == 1:
            for half in (0, 3):
                u = dataclasses.replace(t, half_tiles=half)
                assert T.parse(u.short()) == u


def test_tactics_sort_by_fields_then_options():
    """The order rankings break ties by: the fields, then no L2 prefetch before
    one, 16-byte before TMA before bulk copies, half_tiles, the prefetch's bound."""
    base = T(32, 8, 256, 10, 1)
    forms = [dataclasses.replace(base, **change) for change in (
        {"l2_prefetch": PREFETCH_ALL, "x_copy": "tma"}, {"l2_prefetch": 4}, {"l2_prefetch": 2},
        {"l2_prefetch": PREFETCH_ALL}, {"x_copy": "bulk"}, {"x_copy": "tma"}, {"half_tiles": 3},
        {})]
    assert sorted(forms) == forms[::-1]
    assert sorted([dataclasses.replace(base, stages=11), dataclasses.replace(base, x_copy="bulk")]
                  )[0].x_copy == "bulk"
    assert base < dataclasses.replace(base, early_launch=True) <= T(32, 8, 256, 10, 2)


def test_k_split_rules():
    t = T(16, 8, 256, 4, 1, 2)
    check_tactic(t, 1536, 7168)                  # 28 tiles: 14 per CTA
    for c in (3, 4):  # wider clusters only where K needs them
        with pytest.raises(ValueError, match=f"k_split {c} (must divide|only where K needs)"):
            check_tactic(T(16, 8, 256, 4, 1, c), 1536, 7168)
    with pytest.raises(ValueError, match=r"k_split must be one of \(1, 2, 3, 4\)"):
        check_tactic(T(16, 8, 256, 4, 1, 5), 1536, 7168)
    with pytest.raises(ValueError, match="k_split 2 must divide the 3 K tiles"):
        check_tactic(T(16, 8, 128, 1, 1, 2), 1536, 384)
    with pytest.raises(ValueError, match="exceeds the 2 K tiles per CTA"):
        check_tactic(T(16, 8, 128, 3, 1, 2), 1536, 512)
    with pytest.raises(ValueError, match="spans 2 tiles per CTA"):
        check_tactic(T(16, 8, 128, 1, 1, 2), 1536, 512)
    check_tactic(T(16, 8, 128, 1, 1, 2), 1536, 256)  # one tile per CTA: one stage is fine


@pytest.mark.parametrize("m,n,k", [(1, 8192, 28672), (8, 8192, 28672), (32, 8192, 28672),
                                   (1, 4096, 32768), (16, 48, 16896), (4, 256, 16384),
                                   (1, 4096, 13696), (32, 4096, 13696)])
def test_long_k_takes_a_split_of_at_most_64_tiles_per_cta(m, n, k):
    """Past 64 tiles of 256 the default, the reference heuristic and every
    tuning candidate split K over two CTAs, each streaming at most 64 tiles."""
    from warpsplitk.planning import choose, space

    picked = [default_tactic(m, n, k, sm_count=132), choose.reference_tactic(m, n, k, 132)]
    picked += space.base_candidates(m, n, k, 132, k_splits=(1,))
    assert picked
    for t in picked:
        check_tactic(t, n, k)
        assert -(-(k // t.k_tile) // t.k_split) <= MAX_K_TILES
        assert t.k_split == (2 if k > 16384 or k % 256 else t.k_split)
    # the first CTA holds the cluster's partial sums: twice the reduction buffer
    one, two = T(32, 32, 128, 2, 2), T(32, 32, 128, 2, 2, 2)
    words = layout.COMPUTE_WARPS * 32 * layout.reduction_row_words(32)
    assert two.smem_bytes - one.smem_bytes >= words * 4
    assert grid_ctas(two, 32, 1536) == 2 * grid_ctas(one, 32, 1536)
    assert two not in legal_tactics(32, 1536, 1024)
    assert two in legal_tactics(32, 1536, 1024, k_splits=(1, 2))


@pytest.mark.parametrize("text", ["", "16,8,128,4", "16,8,128,4,1,1,2,1", "a,b,c,d,e", "16;8;128;4;1",
                                  "16,8,128,4.5,1",
                                  # the retired seventh field (x_multicast)
                                  "16,16,256,4,1,1,2", "16,16,256,4,1,1,2+early"])
def test_parse_errors(text):
    with pytest.raises(ValueError, match="a tactic is five integers"):
        T.parse(text)


# ------------------------------------------------------ resources and model


def test_smem_bytes_matches_plan():
    for t in all_tactics():
        plan = layout.smem_plan(t.output_tile, t.token_tile, t.k_tile, t.stages)
        assert t.smem_bytes == plan.total
        # at least both rings' bytes
        assert t.smem_bytes >= t.stages * (t.output_tile + t.token_tile) * t.k_tile * 2


def test_threads():
    assert T(16, 8, 128, 4, 1).threads == 7 * 32
    assert T(16, 8, 128, 4, 2).threads == 8 * 32


def test_ctas_per_sm_at_least_one_for_every_legal_tactic():
    counted = 0
    for t in all_tactics():
        if is_legal(t, 192, t.stages * t.k_tile):
            counted += 1
            assert ctas_per_sm(t) >= 1, t
    usable = [t for t in all_tactics() if _family_is_legal(t) and t.smem_bytes <= SMEM_PER_BLOCK]
    assert counted == len(usable) > 300


def test_ctas_per_sm_falls_with_ring_depth():
    for o, tt, kt, b in itertools.product(OUTPUT_TILES, TOKEN_TILES, K_TILES, B_LOADER_WARPS):
        counts = [ctas_per_sm(T(o, tt, kt, s, b)) for s in range(1, 17)]
        assert counts == sorted(counts, reverse=True), (o, tt, kt, b, counts)


def test_l2_read_factor():
    from warpsplitk.tactics import l2_read_factor
    t = WarpSplitKTactic
    assert l2_read_factor(t(32, 8, 256, 4, 1), 1) == pytest.approx(1 + 1 / 32)
    # M = 32 on 16-row tiles: x is twice the weight
    assert l2_read_factor(t(16, 32, 256, 4, 2), 32) == pytest.approx(3.0)
    assert l2_read_factor(t(64, 32, 128, 4, 2), 32) == pytest.approx(1.5)
    # two token tiles each read the weight tile
    assert l2_read_factor(t(32, 16, 256, 4, 2), 32) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="M must be in 1..32"):
        l2_read_factor(t(32, 16, 256, 4, 2), 33)


def test_early_launch_text_and_rules():
    t = T(32, 8, 256, 11, 1, early_launch=True)
    assert t.short() == "32,8,256,11,1+early" and T.parse(t.short()) == t
    for tactic in (T(32, 8, 256, 10, 1, 2, early_launch=True),
                   T(16, 16, 256, 4, 1, early_launch=True, x_copy="tma")):
        assert T.parse(tactic.short()) == tactic
    assert T.parse("32,8,256,10,1,2+early").k_split == 2
    assert not T.parse("32,8,256,11,1").early_launch
    for bad in ("32,8,256,11,1+late", "+early", "32,8,256,11,1,+early"):
        with pytest.raises(ValueError, match="a tactic is five integers"):
            T.parse(bad)
    check_tactic(t, 4224, 7168)
    # an integer is not a trigger point: a plan file must say what it means
    with pytest.raises(ValueError, match="early_launch must be one of"):
        check_tactic(T(32, 8, 256, 11, 1, early_launch=1), 4224, 7168)
    # the same shared memory, threads and residency as the late trigger
    assert t.smem_bytes == T(32, 8, 256, 11, 1).smem_bytes
    legal = legal_tactics(8, 4224, 7168, early_launches=(False, True))
    assert sum(x.early_launch for x in legal) * 2 == len(legal)
    assert not any(x.early_launch for x in legal_tactics(8, 4224, 7168))
    # the default takes the early trigger by its grid's rule only
    from warpsplitk.planning.choose import early_trigger_pays
    for m in (1, 8, 16, 32):
        chosen = default_tactic(m, 4224, 7168)
        assert chosen.early_launch == early_trigger_pays(chosen, m, 4224)


def test_l2_prefetch_and_bulk_copies_text_and_rules():
    t = T(32, 8, 256, 10, 1, 2, early_launch=True, l2_prefetch=PREFETCH_ALL, x_copy="bulk")
    assert t.short() == "32,8,256,10,1,2+early+prefetch+bulk" and T.parse(t.short()) == t
    for text in ("32,8,256,11,1+prefetch", "32,8,256,11,1+bulk", "16,16,256,4,1+early+bulk"):
        assert T.parse(text).short() == text
    for bad in ("32,8,256,11,1+bulk+prefetch", "32,8,256,11,1+bulk+early", "32,8,256,11,1+pf"):
        with pytest.raises(ValueError, match="a tactic is five integers"):
            T.parse(bad)
    check_tactic(t, 768, 7168)
    for field, value in (("l2_prefetch", True), ("l2_prefetch", 5), ("x_copy", True),
                         ("x_copy", "bulk_x")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            check_tactic(dataclasses.replace(T(32, 8, 256, 4, 1), **{field: value}), 4224, 7168)
    # nothing to prefetch when the ring holds the CTA's whole K share
    with pytest.raises(ValueError, match="l2_prefetch needs more K tiles"):
        check_tactic(T(32, 8, 256, 8, 1, l2_prefetch=PREFETCH_ALL), 2048, 2048)
    with pytest.raises(ValueError, match=r"l2_prefetch needs more K tiles per CTA \(k_split 2\)"):
        check_tactic(T(32, 8, 256, 4, 1, 2, l2_prefetch=PREFETCH_ALL), 2048, 2048)
    check_tactic(T(32, 8, 256, 3, 1, 2, l2_prefetch=PREFETCH_ALL), 2048, 2048)
    # one lane per token row issues the bulk copies
    with pytest.raises(ValueError, match="x_copy 'bulk' takes b_loader_warps 1"):
        check_tactic(T(32, 8, 256, 4, 2, x_copy="bulk"), 2048, 2048)
    # the bulk-copied stage is row-padded: B_ROW_PAD elements more per token
    # row and stage; the prefetch needs no shared memory
    assert T(16, 16, 256, 4, 1, x_copy="bulk").smem_bytes == (
        T(16, 16, 256, 4, 1).smem_bytes + 4 * 16 * layout.B_ROW_PAD * layout.ELEMENT_BYTES)
    assert T(32, 8, 256, 4, 1, l2_prefetch=PREFETCH_ALL).smem_bytes == \
        T(32, 8, 256, 4, 1).smem_bytes
    bulk = T(32, 8, 256, 4, 1, x_copy="bulk")
    assert bulk.async_activation_ring and bulk.activation_layout == "padded"
    assert not T(32, 8, 256, 4, 1).async_activation_ring
    legal = legal_tactics(1, 2048, 2048, l2_prefetches=(0, PREFETCH_ALL),
                          x_copies=("cp.async", "bulk"))
    assert any(x.x_copy == "bulk" and x.l2_prefetch for x in legal)
    assert all(x.b_loader_warps == 1 for x in legal if x.x_copy == "bulk")
    assert all(x.stages < 2048 // (x.k_tile * x.k_split) for x in legal if x.l2_prefetch)
    assert not any(x.x_copy == "bulk" or x.l2_prefetch for x in legal_tactics(1, 2048, 2048))
    # the default takes the L2 prefetch only bounded (planning.measured_options), bulk rows never
    defaults = [default_tactic(m, 4224, 7168) for m in (1, 8, 16, 32)]
    assert not any(t.x_copy == "bulk" or t.l2_prefetch == PREFETCH_ALL for t in defaults)


def test_tma_copies_text_and_rules():
    t = T(16, 32, 256, 4, 1, 2, early_launch=True, l2_prefetch=PREFETCH_ALL, x_copy="tma")
    assert t.short() == "16,32,256,4,1,2+early+prefetch+tma" and T.parse(t.short()) == t
    check_tactic(t, 4224, 7168)
    assert T.parse("32,8,256,10,1,2+tma") == T(32, 8, 256, 10, 1, 2, x_copy="tma")
    for bad in ("32,8,256,11,1+tma+early", "32,8,256,11,1+tma+bulk", "32,8,256,11,1+bulk+tma",
                "32,8,256,11,1+bulk+tma+x"):
        with pytest.raises(ValueError,
                           match=f"a tactic is five integers .*, got '{re.escape(bad)}'$"):
            T.parse(bad)
    with pytest.raises(ValueError, match="x_copy must be one of"):
        check_tactic(T(32, 8, 256, 4, 1, x_copy="TMA"), 2048, 2048)
    with pytest.raises(ValueError, match="x_copy 'tma' takes b_loader_warps 1"):
        check_tactic(T(32, 8, 256, 4, 2, x_copy="tma"), 2048, 2048)
    check_tactic(T(16, 16, 128, 4, 1, x_copy="tma"), 2 * 16 * 4, 2048)
    check_tactic(T(16, 32, 256, 4, 1, x_copy="tma"), 4224, 7168)
    # TMA boxes land unpadded, in the box layout; bulk rows padded
    box = T(16, 32, 256, 4, 1, x_copy="tma")
    assert box.async_activation_ring and box.activation_layout == "tma"
    assert T(16, 32, 256, 4, 1, x_copy="bulk").activation_layout == "padded"
    assert T(16, 32, 256, 4, 2).activation_layout == "swizzle"
    assert box.smem_bytes == T(16, 32, 256, 4, 2).smem_bytes < T(16, 32, 256, 4, 1,
                                                                  x_copy="bulk").smem_bytes
    legal = legal_tactics(9, 2048, 2048, k_splits=(1, 2), x_copies=("cp.async", "tma"))
    tma = [x for x in legal if x.x_copy == "tma"]
    assert tma and all(x.b_loader_warps == 1 for x in tma)
    assert any(x.k_split == 2 for x in tma) and any(x.k_split == 1 for x in tma)
    assert not any(x.x_copy == "tma" for x in legal_tactics(9, 2048, 2048))


def test_half_tiles_text_and_rules():
    t = T(32, 32, 256, 7, 1, early_launch=True, x_copy="tma", half_tiles=63)
    assert t.short() == "32,32,256,7,1+early+tma+half63" and T.parse(t.short()) == t
    assert T.parse("64,8,128,3,2+half40") == T(64, 8, 128, 3, 2, half_tiles=40)
    check_tactic(t, 3216, 7168)  # 69 x 32 + 63 x 16 rows
    assert grid_ctas(t, 32, 3216) == 132 and grid_ctas(t, 8, 3216) == 132
    with pytest.raises(ValueError, match="63 plus|1008 plus"):
        check_tactic(t, 3200, 7168)
    with pytest.raises(ValueError, match="output_tile in"):
        check_tactic(T(16, 32, 256, 4, 2, half_tiles=3), 16 * 4 + 8 * 3, 7168)
    with pytest.raises(ValueError, match="half_tiles is for k_split 1, got 2"):
        check_tactic(T(32, 8, 256, 4, 1, 2, half_tiles=3), 32 * 4 + 16 * 3, 2048)
    with pytest.raises(ValueError, match="count >= 0"):
        check_tactic(T(32, 8, 256, 4, 1, half_tiles=-1), 2048, 2048)
    # the larger tile's shared memory
    assert t.smem_bytes == T(32, 32, 256, 7, 1, x_copy="tma").smem_bytes
    assert not any(x.half_tiles for x in legal_tactics(8, 2048, 2048))


def test_sm_balance_counts_the_busiest_sms_bytes():
    from warpsplitk.tactics import sm_balance
    # 201 CTAs of 16 rows x 32 tokens: 69 SMs read two CTAs' rows
    assert sm_balance(T(16, 32, 256, 4, 2), 32, 3216) == pytest.approx(96 / (201 * 48 / 132))
    # the mixed grid: one CTA per SM, the 32-row ones the busiest
    mixed = T(32, 32, 256, 7, 1, half_tiles=63)
    assert sm_balance(mixed, 32, 3216) == pytest.approx(64 / ((69 * 64 + 63 * 48) / 132))
    assert sm_balance(T(32, 32, 256, 7, 2), 32, 4224) == pytest.approx(1.0)
    # rows past M are not read: M = 20 is token tiles of 16 tokens and of 4,
    # on SMs 0-65 and 66-131
    assert sm_balance(T(32, 16, 256, 4, 2), 20, 32 * 66) == pytest.approx(48 / ((48 + 36) / 2))


def test_bounded_l2_prefetch_text_and_rules():
    """l2_prefetch P > 0 bounds the L2 prefetch to that many K tiles past
    the ring: written after '+prefetch', in PREFETCH_TILES, and only where
    it leaves part of the K share out (else it is the whole-remainder
    prefetch, PREFETCH_ALL)."""
    from warpsplitk.tactics import L2_PREFETCHES, PREFETCH_TILES
    t = T(32, 8, 256, 10, 1, 2, early_launch=True, l2_prefetch=2, x_copy="tma")
    assert t.short() == "32,8,256,10,1,2+early+prefetch2+tma" and T.parse(t.short()) == t
    for text in ("16,8,256,16,1+early+prefetch4+bulk", "32,8,256,11,2+early+prefetch3+half100",
                 "32,8,256,11,1+prefetch", "32,8,256,11,1+prefetch8"):
        assert T.parse(text).short() == text
    assert T.parse("32,8,256,11,1+prefetch4").l2_prefetch == 4
    assert T.parse("32,8,256,11,1+prefetch").l2_prefetch == PREFETCH_ALL
    for bad in ("32,8,256,11,1+prefetch04", "32,8,256,11,1+prefetchx", "32,8,256,11,1+4prefetch"):
        with pytest.raises(ValueError,
                           match=f"a tactic is five integers .*, got '{re.escape(bad)}'$"):
            T.parse(bad)
    check_tactic(t, 1536, 7168)  # 14 tiles per CTA: 10 in the ring, 2 past it
    with pytest.raises(ValueError, match="reaches the end of the 14 K tiles per CTA"):
        check_tactic(dataclasses.replace(t, l2_prefetch=4), 1536, 7168)  # 10 + 4 = all
    for bad in (5, 9, -2, True, 2.0):
        with pytest.raises(ValueError, match="l2_prefetch must be one of"):
            check_tactic(T(32, 8, 256, 2, 1, l2_prefetch=bad), 2048, 7168)
    # the bound changes no shared memory (L2 holds the prefetched tiles)
    assert t.smem_bytes == dataclasses.replace(t, l2_prefetch=0).smem_bytes
    # in the enumerated space each bound legal
    legal = legal_tactics(8, 2112, 7168, l2_prefetches=L2_PREFETCHES)
    bounded = [x for x in legal if x.l2_prefetch > 0]
    assert {x.l2_prefetch for x in bounded} == set(PREFETCH_TILES)
    assert all(x.stages + x.l2_prefetch < 7168 // (x.k_tile * x.k_split) for x in bounded)
    assert not any(x.l2_prefetch > 0 for x in legal_tactics(8, 2112, 7168,
                                                           l2_prefetches=(0, PREFETCH_ALL)))


def test_narrow_token_tiles_take_bulk_rows():
    """Narrow token tiles with bulk rows are legal (the fenced build: 0 wrong
    in 6,080 launches): a narrow stage is token_tile padded rows."""
    for t, n, k in ((T(16, 1, 256, 12, 1, early_launch=True, x_copy="bulk"), 2112, 7168),
                    (T(32, 4, 128, 23, 1, early_launch=True, l2_prefetch=PREFETCH_ALL,
                       x_copy="bulk"), 768, 7168),
                    (T(32, 2, 256, 6, 1, 2, x_copy="bulk"), 1536, 7168)):
        check_tactic(t, n, k)
        assert t.smem_plan.b_stage_bytes == t.token_tile * (t.k_tile + layout.B_ROW_PAD) * 2
    # the bulk path's own rule still holds: one activation warp
    with pytest.raises(ValueError, match="x_copy 'bulk' takes b_loader_warps 1"):
        check_tactic(T(16, 1, 256, 12, 2, x_copy="bulk"), 2112, 7168)


# an integer field given as a float or a bool compares equal to a legal value
# (16.0 == 16, True == 1): refused by type, before it reaches the compiler
@pytest.mark.parametrize("field,value", [
    ("output_tile", 16.0), ("token_tile", 8.0), ("k_tile", 128.0), ("stages", 4.0),
    ("stages", True), ("b_loader_warps", 1.0), ("b_loader_warps", True), ("k_split", 2.0),
    ("k_split", True), ("half_tiles", 0.0), ("early_launch", 0), ("l2_prefetch", 2.0),
    ("l2_prefetch", False), ("x_copy", 0.0)])
def test_fields_are_refused_by_type_not_only_by_value(field, value):
    tactic = dataclasses.replace(T(16, 8, 128, 4, 1), **{field: value})
    with pytest.raises(ValueError, match=rf"warp split-K tactic: {field} must be .*got "
                                         rf"{re.escape(repr(value))}$"):
        check_tactic(tactic, 4096, 4096)


def test_parse_takes_ascii_digits_only():
    # "²".isdigit() is true, int("²") is not: the text is refused as a whole
    for bad in ("16,8,128,4,1+prefetch²", "32,8,256,11,1+half²"):
        with pytest.raises(ValueError,
                           match=f"a tactic is five integers .*, got '{re.escape(bad)}'$"):
            T.parse(bad)


@pytest.mark.parametrize("sm_count", [0, -1, "132", 132.0, True])
def test_sm_count_is_a_positive_integer(sm_count):
    from warpsplitk.planning.plans import default_choice
    from warpsplitk.planning.choose import reference_tactic
    for choose in (default_tactic, reference_tactic, default_choice):
        with pytest.raises(ValueError, match=rf"sm_count must be a positive integer \(the GPU's "
                                             rf"SMs\), got {re.escape(repr(sm_count))}$"):
            choose(1, 4096, 4096, sm_count)


def test_check_ms():
    from warpsplitk.tactics import check_ms
    assert check_ms([8, 1, 8, 32]) == (1, 8, 32) and check_ms(()) == ()
    assert check_ms(range(1, 33)) == tuple(range(1, 33))
    for bad, given in (([0, 50], "0"), ([1.0], "1.0"), ("ab", "'a'"), ([True], "True")):
        with pytest.raises(ValueError, match=rf"M must be in 1\.\.32, got {re.escape(given)}$"):
            check_ms(bad)
    with pytest.raises(ValueError, match=r"ms must be an iterable of Ms in 1\.\.32, got None$"):
        check_ms(None)


# ------------------------------------------------------ sizes of any integer type


def test_sizes_of_any_integral_type_are_their_int():
    np = pytest.importorskip("numpy")
    from warpsplitk.planning.choose import reference_tactic
    from warpsplitk.tactics import check_ms, l2_read_factor
    n, k = np.int64(4096), np.int32(4096)
    assert default_tactic(np.int64(8), n, k, sm_count=132) == default_tactic(8, 4096, 4096, 132)
    assert reference_tactic(np.uint8(8), n, k, 132) == reference_tactic(8, 4096, 4096, 132)
    assert check_tactic(GOOD, np.int64(256), np.int16(1024)) is None
    assert shape_refusal(n, k) is None
    assert legal_tactics(np.int8(1), n, k) == legal_tactics(1, 4096, 4096)
    assert l2_read_factor(GOOD, np.int64(8)) == l2_read_factor(GOOD, 8)
    ms = check_ms([np.int64(8), 1, np.int16(8)])
    assert ms == (1, 8) and all(type(m) is int for m in ms)
    # a refusal names the value, not its type
    assert shape_refusal(np.int64(1000), k) == "N must be a positive multiple of 16, got 1000"
    with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got 33$"):
        default_tactic(np.int64(33), n, k, sm_count=132)
    with pytest.raises(ValueError, match=r"N must be a positive multiple of output_tile 16, "
                                         r"got N=40$"):
        check_tactic(GOOD, np.int64(40), 1024)
    # a bool is no size, whatever its type
    for flag in (True, np.True_):
        with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got (True|np\.True_)$"):
            default_tactic(flag, 4096, 4096, sm_count=132)
        assert shape_refusal(16, flag).startswith("K must be")
    torch = pytest.importorskip("torch")
    assert default_tactic(torch.tensor(8), torch.tensor(4096), 4096, 132) == \
        default_tactic(8, 4096, 4096, 132)
    with pytest.raises(ValueError, match="M must be in 1..32"):
        check_ms([torch.tensor(True)])


@pytest.mark.parametrize("n,k", [(4095, 4096), (4096, 4000), (2 ** 30, 128), (16.0, 128),
                                 (16, 32896), (16, 65792)])
def test_legal_tactics_refuses_what_default_tactic_refuses(n, k):
    with pytest.raises(ValueError) as refused:
        default_tactic(1, n, k, sm_count=132)
    with pytest.raises(ValueError, match=f"^{re.escape(str(refused.value))}$"):
        legal_tactics(1, n, k)


def test_ctas_per_sm_refuses_what_is_no_tactic():
    for bad, given in ((None, "NoneType"), ([16, 8, 128, 4, 1], "list"),
                       ("16,8,128,4,1", re.escape("str (WarpSplitKTactic.parse('16,8,128,4,1') "
                                                  "reads a short form)"))):
        with pytest.raises(ValueError, match=f"^expected a WarpSplitKTactic, got {given}$"):
            ctas_per_sm(bad)
        with pytest.raises(ValueError, match=f"^expected a WarpSplitKTactic, got {given}$"):
            check_tactic(bad, 256, 1024)
    with pytest.raises(ValueError, match=r"output_tile must be one of \(16, 32, 48, 64\), got 17"):
        ctas_per_sm(T(17, 8, 128, 4, 1))
    with pytest.raises(ValueError, match=r"stages must be in 1\.\.32, got 99"):
        ctas_per_sm(T(16, 8, 128, 99, 1))
    # a combination no weight takes still has an occupancy (the model's space is wider)
    assert ctas_per_sm(T(64, 8, 256, 4, 1)) >= 0


def test_fp8_rules():
    check_tactic(T(16, 8, 128, 4, 1), 256, 1024, fp8=True)
    for x_copy in ("bulk", "tma"):
        with pytest.raises(ValueError, match=f"FP8 weights take x_copy 'cp.async', got '{x_copy}'"):
            check_tactic(T(16, 8, 128, 4, 1, x_copy=x_copy), 256, 1024, fp8=True)
    # with the SwiGLU epilogue, each 16-row MMA block all gate or all up rows
    with pytest.raises(ValueError, match="SwiGLU epilogue take output_tile 32 or more, got 16"):
        check_tactic(T(16, 8, 128, 4, 1), 256, 1024, swiglu=True, fp8=True)
    check_tactic(T(32, 8, 128, 4, 1), 256, 1024, swiglu=True, fp8=True)
    check_tactic(T(16, 8, 128, 4, 1), 256, 1024, swiglu=True)  # BF16 takes 16
    # the BF16 rules hold first
    with pytest.raises(ValueError, match="multiple of output_tile"):
        check_tactic(T(16, 8, 128, 4, 1), 40, 1024, fp8=True)
    assert layout.smem_plan(16, 8, 128, 4, weight_bytes=1).a_stage_bytes == 16 * 128


def test_fp8_rings_may_be_deeper_within_shared_memory():
    """The shared-memory rule counts an FP8 weight's stages at one byte per
    element: a ring too deep for a BF16 weight can fit an e4m3 one."""
    deep = T(32, 8, 256, 12, 2)
    assert deep.smem_plan_for(True).total <= SMEM_PER_BLOCK < deep.smem_bytes
    with pytest.raises(ValueError, match="of shared memory"):
        check_tactic(deep, 4096, 4096)
    check_tactic(deep, 4096, 4096, fp8=True)
    with pytest.raises(ValueError, match="of shared memory"):
        check_tactic(T(32, 8, 256, 19, 2), 4096, 8192, fp8=True)


@pytest.mark.parametrize("n, k", [(768, 128), (1024, 4096), (4096, 14336), (28672, 4096),
                                  (8192, 28672), (6144, 4096), (152064, 3584)])
def test_the_fp8_default_is_legal_for_fp8_weights_at_every_m(n, k):
    from warpsplitk.planning.choose import default_tactic
    for m in range(1, 33):
        tactic = default_tactic(m, n, k, 132, fp8=True)
        check_tactic(tactic, n, k, fp8=True)
        assert tactic.x_copy == "cp.async"
    for m in range(1, 33):  # [gate; up]: the FP8 default for the epilogue
        for kind in ("channel", "block128"):
            check_tactic(default_tactic(m, n, k, 132, fp8=True, fp8_scales=kind, swiglu=True),
                         n, k, swiglu=True, fp8=True)
    for m in range(1, 33):  # block scales: its own rules, as legal
        check_tactic(default_tactic(m, n, k, 132, fp8=True, fp8_scales="block128"), n, k,
                     fp8=True)


@pytest.mark.parametrize("m, n, k, expected", [
    (1, 2560, 9728, "32,8,256,8,2,2"),   # no narrow token tile; two CTAs per SM
    (8, 2624, 6144, "32,8,256,8,2,2"),   # fewer CTAs than SMs: K split in two
    (1, 4608, 4096, "16,8,256,9,2+early"),  # < 1.5x the SMs: 16 rows; > 2 per SM: early
    (8, 8192, 4608, "32,8,256,9,2"),     # 64-row tiles of 128 -> 32 rows of 256
    (1, 30720, 3840, "32,8,256,4,2+early"),  # many waves: four per SM at most
])
def test_the_fp8_default_keeps_several_ctas_on_each_sm(m, n, k, expected):
    """``choose.fp8_resident`` on cells of the tune that set it: the fastest
    tactics measured there have this shape, never one CTA per SM."""
    tactic = default_tactic(m, n, k, 132, fp8=True)
    assert tactic.short() == expected
    assert ctas_per_sm(tactic, fp8=True) >= FP8_MIN_RESIDENT


@pytest.mark.parametrize("m, n, k, expected", [
    (1, 8192, 231 * 128, "32,8,128,7,2,4"),     # five per SM, the ring under the buffer
    (8, 8192, 231 * 128, "32,8,128,7,2,4"),
    (16, 8192, 231 * 128, "32,16,128,5,2,4"),   # no early trigger on four CTAs
    (32, 8192, 231 * 128, "32,32,128,6,2,4"),   # three per SM, as many as any ring leaves
])
def test_the_fp8_default_on_four_ctas_of_k_holds_one_cta_more_per_sm(m, n, k, expected):
    """Where K takes four CTAs the FP8 default keeps ``FP8_CLUSTER_RESIDENT``
    CTAs on an SM where the grid has them, without the early trigger: the
    fastest tactics of an H100 sweep of 8192x29568. Three keep the rules."""
    tactic = default_tactic(m, n, k, 132, fp8=True)
    assert tactic.short() == expected
    if m <= 8:
        assert ctas_per_sm(tactic, fp8=True) == FP8_CLUSTER_RESIDENT
    assert tactic.k_split == needed_k_split(k) == 4 and not tactic.early_launch
    assert default_tactic(m, 4608, 144 * 256, 132, fp8=True).short() == {
        1: "16,8,256,6,2,3+early", 8: "16,8,256,6,2,3+early", 16: "32,16,256,3,2,3+early",
        32: "32,32,256,4,2,3"}[m]


@pytest.mark.parametrize("m, n, k, expected", [
    (16, 4096, 14336, "32,16,256,5,2,2"),
    (16, 16384, 3072, "32,16,256,2,2+early"),
    (32, 6144, 4096, "16,32,256,2,2"),      # no early trigger past 16 tokens
    (32, 3216, 7168, "48,32,128,4,2,2"),    # 48-row tiles: K split, two per SM
])
def test_every_scale_kind_takes_the_same_fp8_default(m, n, k, expected):
    """Block scales cost the kernel no more than channel or tensor ones (each
    is folded into its block's conversion): one default for all three."""
    for kind in ("channel", "tensor", "block128"):
        assert default_tactic(m, n, k, 132, fp8=True, fp8_scales=kind).short() == expected
    with pytest.raises(ValueError, match="fp8_scales must be one of .* got 'row'"):
        default_tactic(m, n, k, 132, fp8=True, fp8_scales="row")


def test_needed_k_split_names_the_k_rule_past_what_any_split_takes():
    assert [needed_k_split(k) for k in (128, 16384, 16640, 32768, 36864)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="K must be a positive multiple of 128 up to 32768, or "
                                         "of 256 up to 65536; got 65792"):
        needed_k_split(65792)


def test_wider_k_splits_only_where_k_needs_them():
    """Clusters of three or four CTAs along K take K past two CTAs of 64
    tiles (Gemma-2-27B's and Qwen2.5-72B's ``down`` at TP 1), and only there:
    a K two CTAs take refuses them."""
    check_tactic(T(16, 8, 256, 8, 2, 3), 4608, 144 * 256)
    check_tactic(T(48, 8, 128, 6, 2, 4), 4608, 231 * 128)     # uneven: 58 + 3 x 57
    assert needed_k_split(144 * 256) == 3 and needed_k_split(231 * 128) == 4
    with pytest.raises(ValueError, match="k_split 4 only where K needs .* K=36864 needs 3"):
        check_tactic(T(16, 8, 256, 6, 2, 4), 4608, 144 * 256)
    with pytest.raises(ValueError, match="k_split 3 only where K needs .* K=16896 needs 2"):
        check_tactic(T(16, 8, 256, 6, 2, 3), 4608, 66 * 256)
    # in tiles of 128 K = 28672 would take four, but tiles of 256 take it in
    # two: the rule is needed_k_split's, whatever the tactic's tile
    with pytest.raises(ValueError, match="k_split 4 only where K needs .* K=28672 needs 2"):
        check_tactic(T(16, 8, 128, 4, 1, 4), 256, 28672)
    with pytest.raises(ValueError, match="a k_split of 3 takes it"):
        check_tactic(T(16, 8, 256, 4, 1, 2), 256, 130 * 256)
    assert shape_refusal(4608, 256 * 256) is None and shape_refusal(4608, 257 * 256) is not None
    assert shape_refusal(4608, 256 * 128) is None and shape_refusal(4608, 257 * 128) is not None
