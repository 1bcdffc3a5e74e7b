"""Option effects read off the nearest measured pairs
(warpsplitk.planning.measured_options): the descriptor, the pairs taken from
timings, the estimate and when it abstains, and the options applied. CPU
only; synthetic pairs as fixtures."""

import dataclasses
import math

import pytest

from warpsplitk.planning import cost_model, measured_options
from warpsplitk.tactics import WarpSplitKTactic as T, check_tactic

BASE = T(32, 8, 256, 6, 1)


def test_descriptor_counts_factors_of_two():
    a = measured_options.describe(BASE, 8, 4096, 4096)
    b = measured_options.describe(BASE, 8, 8192, 4096)
    assert b[0] - a[0] == pytest.approx(1.0)  # N doubled
    assert b[8] - a[8] == pytest.approx(1.0)  # the weight's bytes doubled
    assert b[7] - a[7] == pytest.approx(1.0)  # twice the CTAs: twice the occupancy
    c = measured_options.describe(dataclasses.replace(BASE, stages=12), 16, 4096, 4096)
    assert c[2] - a[2] == pytest.approx(1.0) and c[6] - a[6] == pytest.approx(1.0)


def test_pairs_are_the_twins_measured_in_one_cell():
    tma = measured_options.TWINS["tma"](BASE, 8, 4096, 4096)
    assert tma.x_copy == "tma" and tma.b_loader_warps == 1
    cells = {(4096, 4096, 8): {BASE: 10.0, tma: 9.0, T(16, 8, 256, 6, 1): 11.0}}
    found = measured_options.pairs(cells)
    assert len(found["tma"]) == 1 and not found["k_split"]
    row = found["tma"][0]
    assert row[:-1] == pytest.approx(measured_options.describe(BASE, 8, 4096, 4096), abs=1e-4)
    assert row[-1] == pytest.approx(math.log(0.9), abs=1e-4)
    # a tactic that has the option, or cannot take it, has no twin
    assert measured_options.TWINS["tma"](tma, 8, 4096, 4096) is None
    # no TMA box below 8 rows
    assert measured_options.TWINS["tma"](T(32, 4, 256, 6, 1), 4, 4096, 4096) is None
    split = dataclasses.replace(BASE, k_split=2)
    assert measured_options.TWINS["k_split"](split, 8, 4096, 4096) is None


def test_k_split_twin_only_while_the_doubled_grid_fits_one_wave():
    # 4096 rows / 32 = 128 CTAs, 2 resident per SM: 256 split CTAs fit 264 slots
    small = T(32, 8, 256, 4, 1)
    assert measured_options.TWINS["k_split"](small, 8, 4096, 7168).k_split == 2
    # 3216 rows / 16 = 201 CTAs, 2 per SM: 402 split CTAs would need a second wave
    wide = T(16, 8, 256, 9, 2)
    assert measured_options.TWINS["k_split"](wide, 1, 3216, 7168) is None
    # ... which on a GPU of twice the SMs they fit
    assert measured_options.TWINS["k_split"](wide, 1, 3216, 7168, 264).k_split == 2
    # a second token tile doubles the grid too
    assert measured_options.TWINS["k_split"](small, 16, 4096, 7168) is None


def test_k_split_twin_shortens_a_ring_deeper_than_its_half_of_k():
    # 768x7168: 28 K tiles; an 18-stage ring is deeper than a CTA's 14 after
    # the split, so the twin keeps 14 (an 18-stage twin would be illegal and
    # the option silently lost)
    deep = T(16, 8, 256, 18, 2)
    twin = measured_options.TWINS["k_split"](deep, 8, 768, 7168)
    assert (twin.k_split, twin.stages) == (2, 14)
    check_tactic(twin, 768, 7168)
    # a ring that fits keeps its depth
    assert measured_options.TWINS["k_split"](T(16, 8, 256, 6, 2), 8, 768, 7168).stages == 6
    # no split where a CTA would stream fewer than K_SPLIT_MIN_TILES K tiles
    assert 7168 // 2 // 256 >= measured_options.K_SPLIT_MIN_TILES > 2048 // 2 // 256
    assert measured_options.TWINS["k_split"](T(16, 8, 256, 4, 2), 8, 768, 2048) is None


def test_k_split_and_narrow_tiles_compete_in_one_step():
    # at M <= 4 both apply to an 8-token tactic, and each excludes the other:
    # the one whose pairs gain more is taken
    m, n, k = 1, 768, 7168
    parent = T(16, 8, 256, 12, 1)
    d = measured_options.describe(parent, m, n, k)
    for split, narrow in ((0.8, 0.9), (0.9, 0.8)):
        chosen, factor = measured_options.apply_options(parent, m, n, k, {
            "k_split": _rows(d, split, 9), "narrow": _rows(d, narrow, 9)})
        assert factor == pytest.approx(0.8)
        assert (chosen.k_split == 2) == (split < narrow)
        assert (chosen.token_tile < 8) == (narrow < split)
        check_tactic(chosen, n, k)


def _rows(descriptor, ratio, count, shift=0.0):
    return [[x + shift * (i % 2) for x in descriptor] + [math.log(ratio)] for i in range(count)]


def test_estimate_is_the_median_of_the_nearest_and_abstains_when_few():
    d = measured_options.describe(BASE, 8, 4096, 4096)
    near = _rows(d, 0.9, measured_options.NEIGHBOURS)
    far = _rows([x + 10 for x in d], 1.5, 50)
    assert measured_options.estimate(near + far, d) == pytest.approx(math.log(0.9))
    # too few pairs within the radius: no estimate, whatever lies farther
    assert measured_options.estimate(near[:-1] + far, d) is None
    # the median, not the mean: one outlier among the nearest does not decide
    mixed = near[:-1] + [list(d) + [math.log(3.0)]]
    assert measured_options.estimate(mixed, d) == pytest.approx(math.log(0.9))


def test_options_apply_only_where_their_pairs_gain():
    m, n, k = 8, 4096, 4096
    d = measured_options.describe(BASE, m, n, k)
    gains = {"tma": _rows(d, 0.9, measured_options.NEIGHBOURS)}
    chosen, factor = measured_options.apply_options(BASE, m, n, k, gains)
    assert chosen == measured_options.TWINS["tma"](BASE, 8, 4096, 4096)
    assert factor == pytest.approx(0.9)
    check_tactic(chosen, n, k)
    # a gain inside the margin, a loss, or pairs measured far away: unchanged
    for rows in (_rows(d, 1 - measured_options.MARGIN / 2, 9), _rows(d, 1.1, 9),
                 _rows([x + 3 for x in d], 0.8, 9)):
        assert measured_options.apply_options(BASE, m, n, k, {"tma": rows}) == (BASE, 1.0)
    # of the prefetch depths, the one whose pairs gain most
    pf = {"prefetch2": _rows(d, 0.95, 9), "prefetch4": _rows(d, 0.9, 9)}
    chosen, factor = measured_options.apply_options(BASE, m, n, k, pf)
    assert (chosen.l2_prefetch, factor) == (4, pytest.approx(0.9))
    # an option the shape makes illegal is never applied: a 16-tile K with a
    # 6-stage ring leaves no room for a 4-tile prefetch after a K split
    chosen, _ = measured_options.apply_options(BASE, m, n, 4096, {
        "k_split": _rows(d, 0.8, 9), "prefetch4": _rows(d, 0.5, 50, shift=0.5)})
    check_tactic(chosen, n, 4096)


def test_shipped_options_cross_validate():
    """Shape-grouped cross-validation of the shipped rule (the fit's meta):
    the twins the other folds' pairs accept are faster in median, and at
    most one in ten is more than 3% slower."""
    options = cost_model.shipped_model().meta["cross_validation"]["options"]
    assert set(options) == set(measured_options.TWINS)
    for name in ("tma", "prefetch2", "prefetch3", "prefetch4"):
        cv = options[name]
        assert cv["accepted"] >= 20
        assert cv["accepted_ratio_median"] < 0.99
        assert cv["accepted_over_1_03"] <= 0.1 * cv["accepted"]
