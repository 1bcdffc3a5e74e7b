"""A cell's tactic space (planning/space.py): K-split bases and the twins of the fastest."""

import dataclasses

import pytest

from warpsplitk.planning.choose import default_tactic
from warpsplitk.planning.selection import REPRESENTATIVE_MS
from warpsplitk.planning.tune import candidates
from warpsplitk.tactics import PREFETCH_ALL, WarpSplitKTactic, ctas_per_sm, grid_ctas, is_legal

T = WarpSplitKTactic


def test_k_split_candidates_only_where_the_grid_leaves_sms_idle():
    # 1536 rows: 96 CTAs of 16 at M = 1, under 132 SMs
    split = [t for t in candidates(1, 1536, 7168, 132, k_splits=(1, 2)) if t.k_split == 2]
    assert split and all(is_legal(t, 1536, 7168) for t in split)
    assert all((1536 // t.output_tile) < 132 for t in split)
    assert candidates(1, 1536, 7168, 132, (1,)) == [t for t in candidates(1, 1536, 7168, 132)
                                                  if t.k_split == 1]
    # 7168 rows: 448 CTAs of 16 or 224 of 32 cover the GPU; only 64-row tiles
    # (112 CTAs) leave SMs idle
    split = [t for t in candidates(1, 7168, 768, 132, k_splits=(1, 2)) if t.k_split == 2]
    assert split and all(t.output_tile == 64 for t in split)
    # the split in two is in the default space; the split in four is retired
    assert {t.k_split for t in candidates(1, 1536, 7168, 132)} == {1, 2}


@pytest.mark.parametrize("n,k", [(16, 128), (112, 640), (256, 16384), (8192, 1024), (48, 8448),
                                 (4096, 4096), (11008, 4096)])
def test_candidates_for_shapes_outside_the_table(n, k):
    """Users tune their own shapes: every candidate is legal, the default is
    one, and each has its early-trigger twin."""
    for m in REPRESENTATIVE_MS:
        found = candidates(m, n, k, 132)
        assert default_tactic(m, n, k, 132) in found
        assert all(is_legal(t, n, k) for t in found)
        late = {t for t in found if not t.early_launch}
        assert {dataclasses.replace(t, early_launch=True) for t in late} == \
            {t for t in found if t.early_launch}


def test_prefetch_twins_of_the_fastest_small_weights_only():
    from warpsplitk.planning.space import PREFETCH_MAX_BYTES, PREFETCH_TOP, prefetch_twins
    n, k = 768, 7168  # 11 MB, 28 K tiles of 256
    times = {WarpSplitKTactic(32, 8, 256, s, 1): 4.0 + s / 100 for s in (4, 6, 8, 10, 12)}
    times[WarpSplitKTactic(32, 8, 256, 28, 1)] = 1.0  # fastest, but its ring holds all of K
    twins = prefetch_twins(times, n, k)
    assert twins == [WarpSplitKTactic(32, 8, 256, s, 1, l2_prefetch=PREFETCH_ALL) for s in (4, 6)]
    # all but the illegal: 28 stages (nor 12 of 32 x 256: too much shared memory)
    assert [t.stages for t in prefetch_twins(times, n, k, top=10)] == [4, 6, 8, 10]
    assert PREFETCH_TOP == 3
    # a twin already measured is not measured again; nor twins of twins
    times[twins[0]] = 3.0
    assert prefetch_twins(times, n, k) == [twins[1]]
    # weights over the limit: the prefetch lost there
    assert n * 7168 * 2 <= PREFETCH_MAX_BYTES < 3216 * 7168 * 2
    assert prefetch_twins(times, 3216, 7168) == []


def test_bounded_prefetch_twins_of_the_fastest_any_size():
    """Each cell's two fastest without a prefetch, with the prefetch bounded
    to 1-4 tiles past the ring where that leaves part of the K share out;
    any weight size (2-6% on the 22-61 MB weights)."""
    from warpsplitk.planning.space import (BOUNDED_PREFETCH_DEPTHS, BOUNDED_PREFETCH_TOP,
                                           bounded_prefetch_twins)
    n, k = 4224, 2048  # 8 K tiles of 256
    a, b = WarpSplitKTactic(32, 8, 256, 3, 1, early_launch=True), WarpSplitKTactic(32, 8, 256, 6, 1)
    times = {a: 13.0, b: 13.1, WarpSplitKTactic(32, 8, 256, 2, 1): 14.0,
             # a prefetch: no parent
             WarpSplitKTactic(32, 8, 256, 4, 1, l2_prefetch=PREFETCH_ALL): 12.0}
    assert BOUNDED_PREFETCH_TOP == 2 and BOUNDED_PREFETCH_DEPTHS == (1, 2, 3, 4)
    twins = bounded_prefetch_twins(times, n, k)
    # b's ring (6 of 8 tiles) leaves room for one tile past it
    assert twins == [dataclasses.replace(a, l2_prefetch=p) for p in (1, 2, 3, 4)] + \
        [dataclasses.replace(b, l2_prefetch=1)]
    times[twins[0]] = 12.5  # measured: not again, and not a parent
    assert bounded_prefetch_twins(times, n, k) == twins[1:]


def test_tma_twins_of_the_fastest():
    from warpsplitk.planning.space import TMA_TOP, tma_twins
    n, k = 4224, 7168
    times = {WarpSplitKTactic(16, 32, 256, s, 2): 15.0 + s / 10 for s in (2, 3, 4, 5)}
    times[WarpSplitKTactic(32, 32, 256, 4, 1, x_copy="tma")] = 1.0  # boxes already: never a source
    twins = tma_twins(times, n, k)
    assert twins == [WarpSplitKTactic(16, 32, 256, s, 1, x_copy="tma") for s in (2, 3, 4)]
    assert TMA_TOP == 3
    # bulk copies become boxes; a K split keeps its split; one activation warp
    small = {WarpSplitKTactic(32, 8, 256, 8, 1, x_copy="bulk"): 2.0,
             WarpSplitKTactic(32, 8, 256, 4, 2, 2): 2.1}
    assert tma_twins(small, 2048, 2048) == [WarpSplitKTactic(32, 8, 256, 8, 1, x_copy="tma"),
                                            WarpSplitKTactic(32, 8, 256, 4, 1, 2, x_copy="tma")]
    # measured twins are not measured again, nor twins of twins
    times.update({t: 14.0 for t in twins[:2]})
    assert tma_twins(times, n, k) == [twins[2]]
    # illegal twins are left out: a narrow token tile takes no TMA boxes
    assert tma_twins({WarpSplitKTactic(16, 1, 256, 12, 1, x_copy="bulk"): 7.0}, 2112, 7168) == []


def test_mixed_twins_balance_uneven_grids_only():
    from warpsplitk.planning.space import balanced_half_tiles, mixed_twins
    assert balanced_half_tiles(3216, 32, 132) == 63      # 69 x 32 + 63 x 16
    assert balanced_half_tiles(3216, 64, 132) is None    # 100.5 64-row tiles
    assert balanced_half_tiles(2048, 32, 132) is None    # 128 tiles: no half tile fits
    # 201 CTAs of 16 rows on 132 SMs: 69 SMs with two -> one mixed grid of
    # 132, with 16-byte activation copies as the parent and with TMA boxes
    times = {WarpSplitKTactic(16, 32, 256, 4, 2): 14.6}
    twins = mixed_twins(times, 3216, 7168, 32)
    assert [(t.output_tile, t.half_tiles, t.x_copy == "tma", t.b_loader_warps) for t in twins] == [
        (32, 63, False, 2), (32, 63, True, 1)]
    assert all(is_legal(t, 3216, 7168) and grid_ctas(t, 32, 3216) == 132 for t in twins)
    # the deepest ring one CTA per SM holds (here the one over the reduction buffer)
    assert twins[0].stages == 7
    for t in twins:
        deeper = dataclasses.replace(t, stages=t.stages + 1)
        assert ctas_per_sm(t) == 1
        assert not is_legal(deeper, 3216, 7168) or ctas_per_sm(deeper) == 0
    # a TMA parent has one twin, itself with TMA boxes
    boxes = {WarpSplitKTactic(16, 32, 256, 4, 1, x_copy="tma"): 13.9}
    assert [t.short() for t in mixed_twins(boxes, 3216, 7168, 32)] == [twins[1].short()]
    # fewer CTAs than SMs (2624 rows: 82 CTAs of 32) -> 32 x 32 + 100 x 16 rows
    idle = mixed_twins({WarpSplitKTactic(32, 32, 256, 7, 2): 10.0}, 2624, 6144, 32)
    assert {(t.half_tiles, grid_ctas(t, 32, 2624)) for t in idle} == {(100, 132)}
    # 7168 rows of 32 (224 CTAs, two on 92 SMs) -> 92 x 64 + 40 x 32 rows,
    # with the 128-wide K tiles 64-row tiles take
    wide = mixed_twins({WarpSplitKTactic(32, 32, 256, 2, 2): 4.0}, 7168, 768, 32)
    assert {(t.output_tile, t.k_tile, t.half_tiles) for t in wide} == {(64, 128, 40)}
    assert all(is_legal(t, 7168, 768) and grid_ctas(t, 32, 7168) == 132 for t in wide)
    # 4224 rows: 132 CTAs of 32 already fill the SMs evenly -> nothing
    assert mixed_twins({WarpSplitKTactic(32, 32, 256, 7, 2): 14.8}, 4224, 7168, 32) == []
    # weights under MIXED_MIN_BYTES: launch-bound, nothing (1536 rows of 128)
    assert mixed_twins({WarpSplitKTactic(32, 8, 128, 1, 1): 1.2}, 1536, 128, 16) == []
    # measured twins are not proposed again
    assert mixed_twins({**times, **dict.fromkeys(twins, 15.0)}, 3216, 7168, 32) == []


def test_narrow_twins_give_rows_past_m_to_ring_depth():
    from warpsplitk.planning.space import NARROW_TOP, narrow_twins
    n, k = 2112, 7168  # 132 CTAs of 16 rows: one per SM
    parent = WarpSplitKTactic(16, 8, 256, 16, 1)
    times = {parent: 7.4, WarpSplitKTactic(32, 8, 256, 10, 2, 2, x_copy="cp.async"): 7.5,
             WarpSplitKTactic(32, 16, 256, 4, 2): 1.0}  # not an 8-token tile: never a parent
    twins = narrow_twins(times, n, k, 1)
    assert NARROW_TOP == 3 and all(is_legal(t, n, k) for t in twins)
    assert {t.token_tile for t in twins} == {1}
    # each parent at two depths: as resident as the parent, and one CTA more per SM
    same = [t for t in twins if t.output_tile == 16 and ctas_per_sm(t) == ctas_per_sm(parent)]
    more = [t for t in twins if t.output_tile == 16 and ctas_per_sm(t) == ctas_per_sm(parent) + 1]
    assert len(same) == len(more) == 1
    # one token row's stage is 8.5 KB, not 12: the same residency runs deeper
    assert same[0].stages > 16 and same[0].smem_bytes < 227 * 1024
    assert more[0].stages >= 12 and ctas_per_sm(more[0]) == 2
    # a 1 x 256 stage is 32 copies: one activation warp, whatever the parent had
    assert all(t.b_loader_warps == 1 for t in twins)
    # M = 3 and 4 take 4-row tiles; from M = 5 on there is nothing narrower than 8
    assert {t.token_tile for t in narrow_twins(times, n, k, 3)} == {4}
    assert narrow_twins(times, n, k, 5) == []
    # a TMA parent's twins copy by 16 bytes (narrow tiles take no TMA boxes)
    boxes = {WarpSplitKTactic(32, 8, 256, 11, 1, x_copy="tma", early_launch=True): 13.3}
    twin = narrow_twins(boxes, 4224, 7168, 4)[0]
    assert twin.x_copy != "tma" and twin.early_launch and twin.token_tile == 4
    assert not any(t.x_copy == "tma" for t in narrow_twins(boxes, 4224, 7168, 4))
    # a bulk parent's twins: by 16 bytes and by bulk rows, each at both depths
    bulk = {WarpSplitKTactic(16, 8, 256, 16, 1, x_copy="bulk"): 7.4}
    bulk_twins = narrow_twins(bulk, n, k, 1)
    assert {t.x_copy == "bulk" for t in bulk_twins} == {False, True}
    assert all(is_legal(t, n, k) and t.token_tile == 1 for t in bulk_twins)
    by_rows = [t for t in bulk_twins if t.x_copy == "bulk"]
    assert len(by_rows) == 2 and {ctas_per_sm(t) for t in by_rows} == {1, 2}
    # measured twins are not proposed again
    assert narrow_twins({**times, **dict.fromkeys(twins, 7.0)}, n, k, 1) == []


@pytest.mark.parametrize("n,k", [(768, 128), (256, 512), (4096, 4096), (4096, 14336),
                                 (28672, 4096), (256, 16384), (48, 8448)])
def test_the_fp8_space_is_the_fp8_kernels_and_holds_the_fp8_default(n, k):
    """What an FP8 tune measures first: tactics check_tactic(fp8=True) takes,
    the FP8 default among them, each with its early-trigger twin, each ring
    the deepest that keeps its CTAs per SM at one byte per weight."""
    from warpsplitk.planning.space import base_candidates
    for m in REPRESENTATIVE_MS:
        for kind in ("channel", "block128"):  # each kind's default among them
            found = candidates(m, n, k, 132, fp8_scales=kind)
            assert default_tactic(m, n, k, 132, fp8=True, fp8_scales=kind) in found
            assert all(is_legal(t, n, k, fp8=True) for t in found)
            late = {t for t in found if not t.early_launch}
            assert {dataclasses.replace(t, early_launch=True) for t in late} == \
                {t for t in found if t.early_launch}
        for t in base_candidates(m, n, k, 132, early_launches=(False,), fp8=True):
            deeper = dataclasses.replace(t, stages=t.stages + 1)
            assert (t.stages == 16 or not is_legal(deeper, n, k, fp8=True)
                    or ctas_per_sm(deeper, fp8=True) < ctas_per_sm(t, fp8=True)), t


def test_fp8_rings_are_sized_by_the_fp8_kernels_shared_memory():
    # 4096 x 4096 at M = 16: rings a BF16 weight's stages would not fit
    found = candidates(16, 4096, 4096, 132, fp8_scales="channel")
    assert any(not is_legal(t, 4096, 4096) for t in found)
    deepest = max(found, key=lambda t: t.stages)
    assert deepest.smem_plan_for(fp8=True).total < deepest.smem_bytes
    assert ctas_per_sm(deepest, fp8=True) >= ctas_per_sm(deepest)


def test_fp8_twins_are_the_fp8_kernels():
    from warpsplitk.planning.space import bounded_prefetch_twins, narrow_twins, prefetch_twins
    n, k = 4096, 4096
    parents = {t: 1.0 + i for i, t in enumerate(candidates(1, n, k, 132, fp8_scales="tensor"))}
    twins = (narrow_twins(parents, n, k, 1, 132, fp8=True)
             + prefetch_twins(parents, n, k, fp8=True)
             + bounded_prefetch_twins(parents, n, k, fp8=True))
    assert twins and all(is_legal(t, n, k, fp8=True) for t in twins)
    assert any(t.token_tile < 8 for t in twins) and any(t.l2_prefetch for t in twins)
