"""The case lists scripts/sanitize.sh hands to compute-sanitizer
(scripts/reliability.py cases): every tactic feature reaches it, every case
is legal, the rotation covers every ring variant across the tools."""

import pytest

pytest.importorskip("torch")  # the script imports it at the top; nothing here runs on a GPU

from script_loader import load_script
from warpsplitk.tactics import PREFETCH_ALL


@pytest.fixture(scope="module")
def reliability():
    return load_script("reliability")


def _legal(cases):
    from warpsplitk.tactics import is_legal
    return all(is_legal(t, n, k) for t, n, k, _ in cases)


def test_every_case_is_legal_and_covers_its_ms(reliability):
    cases = reliability.family_cases("all", k_splits=(1, 2), bulk_xs=(False, True),
                                     l2_prefetch=True, deep_rings=True, tma_xs=(False, True),
                                     half_tiles=True)
    assert cases and _legal(cases)
    for tactic, _, _, ms in cases:
        assert 1 in ms and 32 in ms and tactic.token_tile in ms


def test_bounded_prefetch_cases_reach_the_sanitizer(reliability):
    """With the prefetch on, every family whose ring leaves tiles of K out
    also runs with the prefetch bounded to one of them, K one tile longer."""
    cases = reliability.family_cases("all", k_splits=(1, 2), l2_prefetch=True)
    bounded = [(t, k) for t, _, k, _ in cases if t.l2_prefetch > 0]
    whole = [(t, k) for t, _, k, _ in cases if t.l2_prefetch == PREFETCH_ALL]
    assert bounded and len(bounded) == len(whole)
    assert all(t.l2_prefetch == 1 for t, _ in bounded)
    assert any(t.k_split == 2 for t, _ in bounded)
    assert not any(t.l2_prefetch for t, *_ in reliability.family_cases("all", k_splits=(1, 2)))


def test_tma_cases_reach_the_sanitizer(reliability):
    cases = reliability.family_cases("rotate", k_splits=(1, 2), tma_xs=(False, True),
                                     deep_rings=True)
    tma = [t for t, *_ in cases if t.x_copy == "tma"]
    assert tma and all(t.b_loader_warps == 1 and t.x_copy != "bulk" for t in tma)
    assert any(t.k_split == 2 for t in tma) and any(t.k_split == 1 for t in tma)
    assert any(t.reduction_aliased for t in tma)
    # without the flag, none
    assert not any(t.x_copy == "tma" for t, *_ in reliability.family_cases("all"))


def test_rotation_covers_every_ring_variant_across_tools(reliability):
    full = {(t, n, k) for t, n, k, _ in reliability.family_cases("all", tma_xs=(False, True))}
    rotated = set()
    for offset in range(3):
        rotated |= {(t, n, k) for t, n, k, _ in
                    reliability.family_cases("rotate", offset, tma_xs=(False, True))}
    assert rotated == full


def test_mixed_grid_cases_reach_the_sanitizer(reliability):
    cases = reliability.family_cases("all", half_tiles=True, tma_xs=(False, True))
    mixed = [(t, n) for t, n, _, _ in cases if t.half_tiles]
    assert mixed and _legal(cases)
    assert {t.output_tile for t, _ in mixed} == {32, 64}
    assert any(t.x_copy == "tma" for t, _ in mixed)
    assert all(n == 2 * t.output_tile + 3 * (t.output_tile // 2) for t, n in mixed)


def test_shipped_cases_cover_every_shipped_tactic_and_refill_every_stage(reliability):
    """SUBSET=shipped: every tactic of the built-in H200 plan and of the
    default heuristic over the shape table, once, legal, on two output tiles
    (a mixed grid: one full tile and its half tiles), K one tile per CTA
    past the ring and its bounded prefetch (a one-stage ring: one tile)."""
    from warpsplitk import builtin_plan, default_tactic
    from warpsplitk.shapes import load
    cases = reliability.family_cases("shipped")
    assert cases == reliability.shipped_cases() and _legal(cases)
    tactics = [t for t, *_ in cases]
    assert len(tactics) == len(set(tactics))
    plan = {t for e in builtin_plan("h200").entries.values() for t, _ in e.values()}
    heuristic = {default_tactic(m, s["n"], s["k"], sm_count=132)
                 for s in load()["shapes"] for m in range(1, 33)}
    long_k = {t for t, *_ in reliability.long_k_cases()}  # K split over 3 and 4 CTAs
    assert {t.k_split for t in long_k} == {3, 4}
    # the tactics the default gives those models' weights, not a small weight's
    assert default_tactic(1, 8192, 29568, sm_count=132) in long_k
    assert set(tactics) == plan | heuristic | long_k
    # the shipped plan's features all reach the sanitizer
    for feature in (lambda t: t.k_split == 2, lambda t: t.early_launch,
                    lambda t: t.x_copy == "bulk", lambda t: t.x_copy == "tma",
                    lambda t: t.l2_prefetch, lambda t: t.l2_prefetch > 0,
                    lambda t: t.half_tiles, lambda t: t.token_tile < 8,
                    lambda t: t.reduction_aliased):
        assert any(feature(t) for t in tactics)
    for t, n, k, ms in cases:
        rows = (2 * t.output_tile if not t.half_tiles
                else t.output_tile + t.half_tiles * (t.output_tile // 2))
        assert n == rows
        if t in long_k:  # the whole of a K that needs the split
            assert k in {k for _, k in reliability.LONG_K_SHAPES}
            continue
        tiles = k // (t.k_split * t.k_tile)
        assert tiles == (1 if t.stages == 1 else t.stages + max(t.l2_prefetch, 0) + 1)
        assert 1 in ms and 32 in ms and t.token_tile in ms


def test_case_filters_name_shipped_features_only(reliability):
    assert set(reliability.CASE_FILTERS) == {"clusters", "x-copies", "aliased", "narrow",
                                             "past-16"}
    cases = reliability.family_cases("all", k_splits=(1, 2))
    clusters = [c for c in cases if reliability.CASE_FILTERS["clusters"][1](c[0])]
    assert clusters and all(c[0].k_split == 2 for c in clusters)


def test_swiglu_cases_reach_the_sanitizer(reliability):
    """SWIGLU=1: every case but the mixed grids, legal with the epilogue
    (the weight read as [gate; up]), and the shipped cases too."""
    from warpsplitk.tactics import is_legal
    for subset in ("all", "shipped"):
        cases = [c for c in reliability.family_cases(subset, k_splits=(1, 2), tma_xs=(False, True),
                                                     l2_prefetch=True)
                 if not c[0].half_tiles]
        assert cases and all(is_legal(t, n, k, swiglu=True) for t, n, k, _ in cases)
    from pathlib import Path
    assert "--swiglu" in (Path(__file__).resolve().parent.parent / "scripts/sanitize.sh").read_text()


@pytest.mark.parametrize("kind", ["tensor", "channel", "block128"])
def test_fp8_cases_are_legal_for_fp8_weights(reliability, kind):
    """``--fp8``: the families an e4m3 weight takes (16-byte activation
    copies; block scales without mixed grids), K splits and narrow tiles
    among them; the shipped subset is the FP8 default's tactics."""
    from warpsplitk.planning.choose import default_tactic
    from warpsplitk.tactics import is_legal
    cases = reliability.family_cases("all", k_splits=(1, 2), bulk_xs=(False, True),
                                     tma_xs=(False, True), half_tiles=True, fp8=kind)
    assert cases and all(is_legal(t, n, k, fp8=True) for t, n, k, _ in cases)
    assert all(t.x_copy == "cp.async" for t, *_ in cases)
    assert any(t.k_split == 2 for t, *_ in cases) and any(t.token_tile < 8 for t, *_ in cases)
    assert any(t.half_tiles for t, *_ in cases) == (kind != "block128")
    shipped = reliability.family_cases("shipped", fp8=kind)
    long_k = {t for t, *_ in reliability.long_k_cases(fp8=True)}
    assert default_tactic(1, 8192, 29568, 132, fp8=True, fp8_scales=kind) in long_k
    assert {t for t, *_ in shipped} == {t for t in set(reliability.shipped_tactics(fp8=True))
                                        | long_k if kind != "block128" or not t.half_tiles}


@pytest.mark.parametrize("kind", ["channel", "block128"])
def test_fp8_swiglu_cases_are_legal_and_hold_the_epilogues_default(reliability, kind):
    """``--fp8 KIND --swiglu``: only tiles the FP8 epilogue takes (32 rows and
    more), and the shipped subset holds the FP8 default for the epilogue."""
    from warpsplitk.planning.choose import default_tactic
    from warpsplitk.tactics import is_legal
    cases = reliability.family_cases("all", k_splits=(1, 2), fp8=kind, swiglu=True)
    assert cases and all(is_legal(t, n, k, fp8=True, swiglu=True) for t, n, k, _ in cases)
    assert min(t.output_tile for t, *_ in cases) == 32
    shipped = {t for t, *_ in reliability.family_cases("shipped", fp8=kind, swiglu=True)}
    assert default_tactic(32, 28672, 4096, sm_count=132, fp8=True, fp8_scales=kind,
                          swiglu=True) in shipped
    assert all(t.output_tile >= 32 for t in shipped)
