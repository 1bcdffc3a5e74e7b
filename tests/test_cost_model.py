"""The cost model (warpsplitk.planning.cost_model): features, the fit, the shipped
coefficients against the records they are fitted to, and the choices made
from them. CPU only."""

import dataclasses
import json
import math
import random

import pytest

from script_loader import load_script
from warpsplitk import models
from warpsplitk.planning import choose, cost_model, measured_options
from warpsplitk.planning.plans import CUBLAS, default_choice
from warpsplitk.tactics import WarpSplitKTactic as T
from warpsplitk.planning.choose import default_tactic, reference_tactic
from warpsplitk.tactics import check_tactic, ctas_per_sm

fit_script = load_script("fit_cost_model")


def _named(tactic, m, n, k):
    return dict(zip(cost_model.FEATURES, cost_model.features(tactic, m, n, k)))


def test_features_are_named_and_physical():
    assert len(cost_model.features(T(32, 8, 256, 11, 1), 8, 4096, 4096)) == len(cost_model.FEATURES)
    f = _named(T(32, 8, 256, 11, 1), 8, 4096, 4096)
    assert f["fixed"] == 1.0
    # the weight's bytes at the measured read bandwidth
    assert f["hbm_us"] == pytest.approx(4096 * 4096 * 2 / cost_model.BYTES_PER_US)
    # 128 CTAs on 132 SMs: one each, the busiest reads one tile of 32 + 8 rows
    assert f["busiest_sm_us"] == pytest.approx(
        (32 + 8) * 4096 * 2 / (cost_model.BYTES_PER_US / 132))
    assert f["bound_us"] == max(f["hbm_us"], f["busiest_sm_us"], f["latency_us"])
    assert f["idle_sm_hbm_us"] == f["hbm_us"]  # 128 < 132 SMs
    assert f["waves"] == 1 and f["token_tiles"] == 1
    assert f["log_stages"] == pytest.approx(math.log(11))
    assert not any(f[name] for name in ("early", "tma", "bulk", "k_split", "narrow",
                                        "prefetch_all", "prefetch_bounded", "half_tiles"))


def test_feature_flags_follow_the_tactic():
    f = _named(T(32, 8, 256, 5, 1, 2, early_launch=True, l2_prefetch=2,
                 x_copy="tma"), 8, 4096, 4096)
    assert f["early"] == f["tma"] == f["k_split"] == f["prefetch_bounded"] == 1.0
    assert f["prefetch_all"] == 0.0 and f["prefetch_depth"] == 2.0
    assert f["activation_copies"] == 0.0  # TMA boxes, no 16-byte copies
    # a shallower ring holds fewer bytes in flight: more round trips
    deep = _named(T(16, 8, 256, 16, 1), 1, 4096, 4096)
    shallow = _named(T(16, 8, 256, 2, 1), 1, 4096, 4096)
    assert shallow["latency_us"] > deep["latency_us"]
    # two token tiles re-read the weight through L2
    assert _named(T(16, 8, 256, 4, 2), 16, 4096, 4096)["l2_reads_us"] > \
        _named(T(16, 16, 256, 4, 2), 16, 4096, 4096)["l2_reads_us"]


def test_sparse_tail_factor_marks_a_nearly_empty_second_wave():
    one_per_sm = T(64, 32, 128, 9, 2)
    assert ctas_per_sm(one_per_sm) == 1
    model = cost_model.shipped_model()
    # 9728 rows in 64-row tiles: 152 CTAs, 20 of them a second wave
    assert cost_model.sparse_tail_factor(one_per_sm, 32, 9728) == cost_model.SPARSE_TAIL_FACTOR
    linear = cost_model._dot(model.coefficients, cost_model.features(one_per_sm, 32, 9728, 2560))
    assert model.predict_us(one_per_sm, 32, 9728, 2560) == pytest.approx(
        linear * cost_model.SPARSE_TAIL_FACTOR)
    # one wave (132 CTAs), a full second one (264), a second a third full
    for n in (8448, 16896, 64 * 176):
        assert cost_model.sparse_tail_factor(one_per_sm, 32, n) == 1.0
    # below M = 16; and where an SM holds more CTAs, the tail shares the SMs
    assert cost_model.sparse_tail_factor(T(64, 8, 128, 9, 2), 8, 9728) == 1.0
    several_per_sm = T(16, 16, 256, 4, 2)
    assert ctas_per_sm(several_per_sm) > 1
    assert cost_model.sparse_tail_factor(several_per_sm, 16, 16 * 140) == 1.0


def test_sparse_tail_factor_is_what_the_records_measure():
    cells, _ = fit_script.load_records()
    model = cost_model.shipped_model()
    ratios = [us / model.predict_us(t, m, n, k) * cost_model.SPARSE_TAIL_FACTOR
              for (n, k, m), timings in cells.items() for t, us in timings.items()
              if cost_model.sparse_tail_factor(t, m, n) > 1.0]
    assert len(ratios) >= 5
    # the linear terms' under-prediction there, within 5%
    assert abs(sorted(ratios)[len(ratios) // 2] / cost_model.SPARSE_TAIL_FACTOR - 1) < 0.05


def test_least_squares_recovers_exact_coefficients():
    rng = random.Random(1)
    truth = [2.0, -0.5, 0.25]
    rows = [[1.0, rng.uniform(0, 10), rng.uniform(-3, 3)] for _ in range(40)]
    targets = [sum(a * c for a, c in zip(row, truth)) for row in rows]
    solved = cost_model.solve_least_squares(rows, targets, [1.0] * len(rows))
    assert solved == pytest.approx(truth, rel=1e-9)
    with pytest.raises(ValueError, match="no data"):
        cost_model.solve_least_squares([[1.0, 0.0]] * 3, [1.0] * 3, [1.0] * 3)


def test_fit_recovers_a_model_from_its_own_timings():
    """Timings made by a known model (fixtures, not a GPU) are fitted back to
    predictions within the ridge's pull."""
    truth = cost_model.shipped_model()
    shapes = [(4096, 4096), (1536, 7168), (14336, 4096), (2048, 2048), (7168, 384),
              (1024, 256), (5120, 5120), (28672, 5120)]
    cells, cublas = {}, {}
    for n, k in shapes:
        for m in (1, 4, 8, 16, 32):
            ranked = choose.ranked(m, n, k, model=truth)
            cells[(n, k, m)] = {t: truth.predict_us(t, m, n, k) for t, _ in ranked}
            cublas[(n, k, m)] = truth.predict_cublas_us(m, n, k)
    fitted = cost_model.fit(cells, cublas)
    errors = [fitted.predict_us(t, m, n, k) / us - 1
              for (n, k, m), timings in cells.items() for t, us in timings.items()]
    assert max(abs(e) for e in errors) < 0.05
    assert fitted.predict_cublas_us(8, 4096, 4096) == pytest.approx(
        truth.predict_cublas_us(8, 4096, 4096), rel=0.02)


def test_shipped_model_is_the_fit_of_the_records():
    # the coefficients, inputs and cross-validation in the package are what
    # scripts/fit_cost_model.py computes from bench/results today
    assert fit_script.main(["--check"]) == 0


def test_shipped_model_ranks_measured_tactics_well():
    meta = cost_model.shipped_model().meta
    cv = meta["cross_validation"]
    # shape-grouped cross-validation: the first-ranked measured tactic is a
    # median within 3% of the cell's fastest, over 150+ cells
    assert cv["cells"] >= 200
    assert cv["pick_over_fastest_median"] < 1.03
    assert cv["pick_over_fastest_p90"] < 1.15
    assert 0.95 < cv["cublas_predicted_over_measured_median"] < 1.05


def test_held_out_models_never_enter_the_fit():
    held = fit_script.held_out_shapes()
    cells, cublas = fit_script.load_records()
    assert held and not ({key[:2] for key in cells} & held)
    assert not ({key[:2] for key in cublas} & held)
    everything = set()
    for name in models.model_names():
        for tp in (1, 2, 4, 8):
            try:
                everything |= {(p["n"], p["k"]) for p in models.projections(name, tp)}
            except ValueError:
                continue
    # about a fifth of the model table's shapes
    assert 0.15 < len(held & everything) / len(everything) < 0.3


def test_model_file_errors_are_clear():
    good = cost_model.shipped_model().to_json()
    assert cost_model.CostModel.from_json(json.loads(json.dumps(good))) == \
        cost_model.shipped_model()
    with pytest.raises(ValueError, match="not a warpsplitk cost model"):
        cost_model.CostModel.from_json({"format": "other"})
    broken = json.loads(json.dumps(good))
    del broken["features"]["hbm_us"]
    with pytest.raises(ValueError, match="every feature"):
        cost_model.CostModel.from_json(broken)
    with pytest.raises(ValueError, match="no cost model 'a100'"):
        cost_model.shipped_model("a100")


@pytest.mark.parametrize("n,k", [(4096, 4096), (4608, 1536), (1024, 4096), (48, 16384),
                                 (128256, 4096), (16, 128), (5120, 7168)])
def test_choices_are_legal_ranked_and_stable(n, k):
    model = cost_model.shipped_model()
    for m in (1, 3, 8, 13, 32):
        chosen = default_tactic(m, n, k, sm_count=132)
        check_tactic(chosen, n, k)
        assert default_tactic(m, n, k, sm_count=132) == chosen  # the same answer every call
        tactic, us = choose.choose(m, n, k, 132)
        assert chosen == tactic
        # the ranked first, or the reference heuristic's tactic where the
        # first is not predicted REFERENCE_MARGIN faster; then the options
        # its nearest measured pairs accept
        # (an HBM-bound cell: of rings HBM_BOUND_MIN_STAGES deep or more)
        streaming = choose.hbm_bound(m, n, k)
        reference = reference_tactic(m, n, k, 132)
        first, first_us = next((t, t_us) for t, t_us in choose.ranked(m, n, k, 132)
                               if not streaming or t == reference
                               or t.stages >= choose.HBM_BOUND_MIN_STAGES)
        reference_us = choose.rank_us(model, reference, m, n, k)
        start = first if first_us <= reference_us * (1 - choose.REFERENCE_MARGIN) \
            else reference
        # (as its mixed grid where the grid leaves a third of the SMs idle)
        balanced = choose.balanced_grid(start, m, n, k, 132, model)
        steps = (measured_options.STEPS_WITHOUT_PREFETCH if streaming
                 else measured_options.OPTION_STEPS)
        optioned, factor = measured_options.apply_options(balanced, m, n, k, model.option_pairs,
                                                          132, steps)
        # and the early trigger where the grid pipelines with the next call's
        # (an HBM-bound cell takes neither it nor the L2 prefetch)
        assert chosen.early_launch == (not streaming and (
            choose.early_trigger_pays(optioned, m, n, 132)
            or choose.short_wave(optioned, m, n, k, 132)))
        assert not (streaming and (chosen.l2_prefetch or chosen.stages < choose.HBM_BOUND_MIN_STAGES and chosen != reference))
        assert (tactic, pytest.approx(us)) == (
            dataclasses.replace(optioned, early_launch=chosen.early_launch),
            choose.rank_us(model, start, m, n, k) * factor)
        # what the default leaves to measurement
        assert chosen.x_copy != "bulk"
        # with the SwiGLU epilogue: the same without the mixed grid
        unbalanced = default_tactic(m, n, k, sm_count=132, swiglu=True)
        check_tactic(unbalanced, n, k, swiglu=True)
        if balanced == start:
            assert unbalanced == chosen
        # never predicted slower than the reference heuristic's tactic
        assert us <= reference_us
        choice = default_choice(m, n, k, sm_count=132)
        prefers = (k <= choose.CUBLAS_MAX_K and model.predict_cublas_us(m, n, k)
                   < us * (1 - choose.CUBLAS_MARGIN))
        assert choice == (CUBLAS if prefers else chosen)


def test_k_split_candidates_are_ranked_only_where_they_pay():
    # (M, N, K, whether some split fits one wave with >= 8 K tiles per CTA)
    for m, n, k, expected in ((8, 1536, 7168, True), (16, 768, 7168, True),
                              (32, 1536, 7168, False),  # M above K_SPLIT_BASE_MAX_M
                              (8, 4096, 4096, True),  # 32-row tiles: 256 CTAs, 2 per SM
                              (1, 4224, 7168, False),  # 264 CTAs of one per SM
                              (4, 256, 2048, False)):  # 4 K tiles per CTA
        splits = [t for t, _ in choose.ranked(m, n, k, 132) if t.k_split > 1]
        for t in splits:
            assert t.output_tile <= choose.K_SPLIT_BASE_MAX_TILE
            assert m <= choose.K_SPLIT_BASE_MAX_M
            assert measured_options.k_split_pays(t, m, n, k, 132)
        assert bool(splits) == expected, (m, n, k)


def test_short_wave_class_ranks_with_the_early_gain():
    # 7168 x 384: 32-row tiles make 224 CTAs of 3 K tiles, two per SM (a
    # short wave); 64-row tiles make 112, fewer than the SMs
    short, wide = T(32, 8, 128, 3, 1), T(64, 8, 128, 3, 1)
    assert choose.short_wave(short, 4, 7168, 384, 132)
    assert not choose.short_wave(wide, 4, 7168, 384, 132)
    assert not choose.short_wave(T(16, 8, 128, 3, 1), 4, 7168, 384, 132)  # 16-row tiles
    assert not choose.short_wave(short, 4, 7168, 4096, 132)  # 32 K tiles: a long call
    assert choose.short_wave(short, 4, 7168, 896, 132)  # 7 K tiles
    assert not choose.short_wave(short, 4, 7168, 1024, 132)  # 8
    assert not choose.short_wave(T(32, 8, 128, 1, 1), 4, 7168, 128, 132)  # 1
    assert not choose.short_wave(short, 32, 7168, 384, 132)  # 896 CTAs: past one wave
    assert not choose.short_wave(short, 4, 4224, 384, 132)  # 132 CTAs: one per SM
    model = cost_model.shipped_model()
    assert choose.rank_us(model, short, 4, 7168, 384) == pytest.approx(
        model.predict_us(short, 4, 7168, 384) * choose.SHORT_WAVE_EARLY_GAIN)
    assert choose.rank_us(model, wide, 4, 7168, 384) == model.predict_us(wide, 4, 7168, 384)
    chosen = default_tactic(4, 7168, 384, 132)
    assert chosen.output_tile == 32 and chosen.early_launch


def test_balanced_grid_where_the_grid_leaves_a_third_of_the_sms_idle():
    from warpsplitk.tactics import grid_ctas, sm_balance
    model = cost_model.shipped_model()
    # 5120 x 7168 (73 MB) in 64-row tiles: 80 CTAs on 132 SMs
    wide = T(64, 8, 128, 12, 2)
    mixed = choose.balanced_grid(wide, 8, 5120, 7168, 132, model)
    check_tactic(mixed, 5120, 7168)
    assert mixed.half_tiles and grid_ctas(mixed, 8, 5120) == 132
    assert sm_balance(mixed, 8, 5120) < sm_balance(wide, 8, 5120)
    assert mixed.x_copy != "tma"  # row copies below BALANCE_BOXES_MIN_M...
    assert choose.balanced_grid(T(64, 32, 128, 9, 2), 32, 5120, 7168, 132, model).x_copy == "tma"
    # the default takes it; with the SwiGLU epilogue (no mixed grids) not
    assert default_tactic(8, 5120, 7168, 132).half_tiles
    assert not default_tactic(8, 5120, 7168, 132, swiglu=True).half_tiles
    # from M = 24 (TMA boxes) grids of up to 3/4 of the SMs take it too:
    # 3072 x 3072 in 32-row tiles is 96 CTAs (73% of 132)
    narrow = T(32, 32, 256, 7, 1)
    assert choose.balanced_grid(narrow, 23, 3072, 3072, 132, model) == narrow
    mixed = choose.balanced_grid(narrow, 24, 3072, 3072, 132, model)
    check_tactic(mixed, 3072, 3072)
    assert mixed.half_tiles and grid_ctas(mixed, 24, 3072) == 132
    assert mixed.x_copy == "tma"
    assert default_tactic(32, 3072, 8192, 132).half_tiles
    assert not default_tactic(16, 3072, 8192, 132).half_tiles
    # a 48-row parent's 32-row mixed grid may take 256-wide K tiles
    assert choose.balanced_grid(T(48, 32, 128, 11, 2), 32, 3216, 7168, 132,
                                    model).k_tile == 256
    for tactic, m, n, k in (
            (T(32, 8, 256, 6, 1), 8, 2304, 1536),  # 72 CTAs, but a 7 MB weight
            (T(32, 16, 256, 9, 2), 16, 3584, 7168),  # 112 CTAs: 85% of the SMs
            (T(32, 8, 256, 11, 2, k_split=2), 8, 2560, 8192),  # a K split fills them
            (T(16, 8, 256, 9, 2), 8, 3216, 7168),  # 201 CTAs
            (T(64, 8, 128, 12, 2, half_tiles=104), 8, 5120, 7168)):  # mixed already
        assert choose.balanced_grid(tactic, m, n, k, 132, model) == tactic, (n, k)


#: forms of a tactic to compare two tactics in where they were not timed as
#: chosen (the exhaustive tune timed base tactics late, without the prefetch)
_FORMS = (
    lambda t: t,
    lambda t: dataclasses.replace(t, l2_prefetch=0),
    lambda t: dataclasses.replace(t, l2_prefetch=0, x_copy="cp.async"),
    lambda t: dataclasses.replace(t, l2_prefetch=0,
                                  early_launch=not t.early_launch),
    lambda t: dataclasses.replace(t, l2_prefetch=0, x_copy="cp.async",
                                  early_launch=not t.early_launch),
)


def test_balanced_grid_is_what_the_records_measure():
    # the calibration cells where the default is a mixed grid: its time over
    # the tactic it replaces (the SwiGLU epilogue's default), both in the
    # first form of _FORMS timed for both
    cells, _ = fit_script.load_records()
    ratios = []
    for (n, k, m), timings in cells.items():
        mixed = default_tactic(m, n, k, 132)
        if not mixed.half_tiles:
            continue
        before = default_tactic(m, n, k, 132, swiglu=True)
        for form in _FORMS:
            if form(mixed) in timings and form(before) in timings:
                ratios.append(timings[form(mixed)] / timings[form(before)])
                break
    ratios.sort()
    assert len(ratios) >= 20
    assert ratios[len(ratios) // 2] < 0.9 and ratios[-1] < 1.0


def test_cublas_rule_is_what_the_records_measure():
    # the calibration cells whose default tactic and cuBLAS were both
    # measured, where cuBLAS is predicted CUBLAS_MARGIN faster: up to
    # CUBLAS_MAX_K cuBLAS measured faster, past it the kernel
    cells, cublas = fit_script.load_records()
    model = cost_model.shipped_model()
    below, above = [], []
    for (n, k, m), timings in cells.items():
        tactic, us = choose.choose(m, n, k, 132, model)
        if (n, k, m) not in cublas or tactic not in timings:
            continue
        if model.predict_cublas_us(m, n, k) < us * (1 - choose.CUBLAS_MARGIN):
            faster = cublas[(n, k, m)] < timings[tactic]
            (below if k <= choose.CUBLAS_MAX_K else above).append(faster)
    assert len(below) >= 2 and all(below)
    assert len(above) >= 3 and not any(above)


def test_a_chained_call_takes_cublas_only_past_the_pdl_overlap_it_forfeits():
    model = cost_model.shipped_model()
    # the model tables' cells the default gives cuBLAS: each predicted less
    # than CHAIN_CUBLAS_US faster, so between kernel calls the kernel runs
    for n, k in ((9728, 2560), (10240, 2560), (9472, 3584), (8704, 5120), (10240, 5120)):
        assert default_choice(32, n, k, 132) == CUBLAS
        assert default_choice(32, n, k, 132, chained=True) == default_tactic(32, n, k, sm_count=132)
    checked = 0
    for name in models.model_names():
        for tp in (1, 2, 4, 8):
            try:
                chain = models.layer_chain(name, tp)
            except ValueError:
                continue
            for p in chain:
                n, k = p["n"], p["k"]
                for m in (8, 24, 32):
                    try:
                        plain = default_choice(m, n, k, 132)
                    except ValueError:  # a shape the kernel refuses
                        continue
                    chained = default_choice(m, n, k, 132, chained=True)
                    _, us = choose.choose(m, n, k, 132, model)
                    four_ctas = (m > choose.FOUR_CTA_CUBLAS_MIN_M
                                 and choose.needed_k_split(k) == 4)
                    expected = four_ctas or (
                        k <= choose.CUBLAS_MAX_K and model.predict_cublas_us(m, n, k)
                        + choose.CHAIN_CUBLAS_US < us * (1 - choose.CUBLAS_MARGIN))
                    assert (chained == CUBLAS) == expected, (name, tp, n, k, m)
                    assert chained == plain or (plain == CUBLAS and chained != CUBLAS)
                    checked += 1
    assert checked > 500


def test_shortlist_holds_the_default_the_reference_and_early_twins():
    for m, n, k in ((1, 2048, 2048), (8, 4096, 4096), (32, 7168, 384), (4, 3216, 7168)):
        short = choose.shortlist(m, n, k, 132)
        assert len(short) == len(set(short)) <= choose.SHORTLIST * 2 + 2 + 2
        for t in short:
            check_tactic(t, n, k)
        assert default_tactic(m, n, k, 132) in short
        assert reference_tactic(m, n, k, 132) in short
        late = [t for t in short[:choose.SHORTLIST] if not t.early_launch]
        assert all(t.__class__(**{**t.__dict__, "early_launch": True}) in short for t in late)


def test_early_trigger_where_the_grid_holds_one_cta_per_sm_on_most_sms():
    deep = T(32, 8, 256, 11, 1)  # one resident CTA per SM
    assert cost_model.ctas_per_sm(deep) == 1
    # 4224 / 32 = 132 CTAs: one per SM, every SM
    assert choose.early_trigger_pays(deep, 8, 4224, 132)
    # 2112 / 32 = 66 CTAs: half the SMs idle, the next grid streams beside it
    assert not choose.early_trigger_pays(deep, 8, 2112, 132)
    # 67 CTAs: more than half
    assert choose.early_trigger_pays(deep, 8, 2144, 132)
    # 133 CTAs: one SM holds two
    assert not choose.early_trigger_pays(deep, 8, 4256, 132)
    # two token tiles double the grid
    assert not choose.early_trigger_pays(T(32, 16, 256, 9, 2), 32, 4224, 132)
    shallow = T(32, 8, 256, 2, 1)  # several resident CTAs: room for the next grid
    assert cost_model.ctas_per_sm(shallow) > 1
    assert not choose.early_trigger_pays(shallow, 8, 4224, 132)


def test_hbm_bound_cells_stream_in_deep_rings_without_overlap_devices():
    # from 64 MiB of weight at M <= 8
    assert choose.hbm_bound(8, 4096, 8192) and choose.hbm_bound(1, 4096, 8192)
    assert not choose.hbm_bound(9, 4096, 8192) and not choose.hbm_bound(8, 4096, 8190)
    assert measured_options.STEPS_WITHOUT_PREFETCH == (("k_split", "narrow"), ("tma",))
    for n, k in ((30720, 3840), (3840, 15360), (28672, 4096), (262208, 3840), (5120, 7168)):
        for m in (1, 4, 8):
            chosen = default_tactic(m, n, k, 132)
            assert not chosen.early_launch and not chosen.l2_prefetch, (n, k, m)
            assert chosen.stages >= choose.HBM_BOUND_MIN_STAGES, (n, k, m)
    # the reference heuristic's deep ring where the model ranked a 2-stage one first
    assert default_tactic(8, 30720, 3840, 132) == reference_tactic(8, 30720, 3840, 132)
    assert choose.ranked(8, 30720, 3840, 132)[0][0].stages == 2
    # the options that are no overlap device stay (3840 x 15360 at M = 1: narrow rows;
    # 5120 x 7168 at M = 8: the mixed grid)
    assert default_tactic(1, 3840, 15360, 132).token_tile == 1
    assert default_tactic(8, 5120, 7168, 132).half_tiles
    # past M = 8 the default is the model's as anywhere
    assert default_tactic(16, 3840, 15360, 132).early_launch


def test_shallow_rings_of_hbm_bound_cells_are_what_the_records_measure():
    # the calibration timings of 2- and 3-stage rings (one CTA per tile along
    # K, no option) that the model ranks above the reference heuristic's
    # tactic on an HBM-bound cell, over the reference's time in that cell
    cells, _ = fit_script.load_records()
    model = cost_model.shipped_model()
    ratios = []
    for (n, k, m), timings in cells.items():
        reference = reference_tactic(m, n, k, 132)
        if not choose.hbm_bound(m, n, k) or reference not in timings:
            continue
        for tactic, us in timings.items():
            plain = dataclasses.replace(tactic, stages=reference.stages, output_tile=16,
                                        token_tile=8, k_tile=256, b_loader_warps=1)
            if (tactic.stages < choose.HBM_BOUND_MIN_STAGES and tactic.token_tile >= 8
                    and plain == T(16, 8, 256, reference.stages, 1)
                    and choose.rank_us(model, tactic, m, n, k)
                    < choose.rank_us(model, reference, m, n, k)):
                ratios.append(us / timings[reference])
    ratios.sort()
    assert len(ratios) >= 30
    assert ratios[len(ratios) // 2] > 1.01 and sum(r > 1.0 for r in ratios) > 0.7 * len(ratios)
