"""The tuner (planning/tune.py), its log (tune_log.py) and choosing rules
(selection.py): candidates, choices within tolerance, plans from logs,
confirmations, stale records."""

import dataclasses
import json

import pytest

from warpsplitk import shapes
from warpsplitk.runtime import timing
from warpsplitk.planning.plans import builtin_plan, load_plan
from warpsplitk.planning.space import base_candidates
from warpsplitk.planning.choose import default_tactic
from warpsplitk.planning.selection import REPRESENTATIVE_MS, representative
from warpsplitk.planning.tune import candidates
from warpsplitk.tactics import WarpSplitKTactic, is_legal

T = WarpSplitKTactic


def test_representative_buckets():
    assert representative(1) == 1
    # 2..4 take the M = 4 winner: the Ms a 4-row narrow token tile covers
    assert [representative(m) for m in (2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 32)] == [
        4, 4, 4, 8, 8, 16, 16, 24, 24, 32, 32]
    # a plan tuned with other representatives is rebuilt with them
    assert [representative(m, (1, 8, 16, 24, 32)) for m in (2, 4, 9)] == [8, 8, 16]
    for m in range(1, 33):
        assert representative(m) >= m


@pytest.mark.parametrize("m", [1, 8, 16, 24, 32])
@pytest.mark.parametrize("n,k", [(s["n"], s["k"]) for s in shapes.load()["shapes"]])
def test_candidates_are_legal_small_and_include_default(m, n, k):
    found = candidates(m, n, k, 132)
    late = [t for t in found if not t.early_launch]
    # a measurement is ~50 ms, a compile ~1 s of one core: the set stays small
    assert late and len([t for t in late if t.k_split == 1]) <= 32 and len(late) <= 64
    # every candidate is measured with both PDL trigger points, by default
    assert sorted(dataclasses.replace(t, early_launch=True) for t in late) == \
        [t for t in found if t.early_launch]
    assert late == candidates(m, n, k, 132, early_launches=(False,))
    assert found == candidates(m, n, k, 132, k_splits=(1, 2))  # the split of K: on by default
    assert not [t for t in found if t.k_split == 4]  # in four only on request
    default = default_tactic(m, n, k, 132)
    assert default in found
    assert all(is_legal(t, n, k) for t in found)
    cover = min(t for t in (8, 16, 32) if t >= m)
    # the rules of the pruned space (the default tactic is added as it is)
    late_default = dataclasses.replace(default, early_launch=False)
    for t in (t for t in found if dataclasses.replace(t, early_launch=False) != late_default):
        assert t.token_tile in (cover, cover // 2)
        # 8-token tiles: one activation-loader warp, or two when x has
        # real rows past the first (its copies follow the dependency wait)
        assert t.b_loader_warps in ((1, 2) if t.token_tile == 8 and m > 1 else
                                    (1,) if t.token_tile == 8 or t.x_copy == "bulk" else (2,))
    # bulk activation copies at M = 1 only, every candidate family also so;
    # the L2 prefetch is never a candidate of its own (prefetch_twins)
    bulk = [t for t in found if t.x_copy == "bulk"]
    assert bool(bulk) == (m == 1)
    assert not any(t.l2_prefetch for t in found
                   if dataclasses.replace(t, early_launch=False) != late_default)
    assert [t for t in found if t.x_copy != "bulk"] == candidates(m, n, k, 132, bulk_xs=(False,))
    assert set(found) - {late_default, dataclasses.replace(default, early_launch=True)} <= {
        dataclasses.replace(t, early_launch=e) for t in base_candidates(m, n, k, 132)
        for e in (False, True)}


def test_choose_tactics_reuses_within_tolerance():
    from warpsplitk.planning.selection import choose_tactics
    a, b, c = T(16, 8, 256, 9, 1), T(32, 8, 256, 11, 1), T(32, 32, 256, 6, 2)
    times = {32: {c: 15.6, a: 18.0}, 8: {a: 14.0, b: 13.8, c: 14.05}, 1: {a: 13.9, b: 13.7}}
    picks = choose_tactics(times, tolerance=0.02)
    assert picks[32] == (c, 15.6)
    assert picks[8] == (c, 14.05)      # c is within 2% of b's 13.8: reused
    assert picks[1] == (b, 13.7)       # c not measured at M=1: the fastest
    strict = choose_tactics(times, tolerance=0.0)
    assert strict[8] == (b, 13.8)


def test_choose_tactics_takes_the_early_trigger_only_when_clearly_faster():
    from warpsplitk.planning.selection import choose_tactics
    a = T(16, 8, 256, 9, 1)
    early = dataclasses.replace(a, early_launch=True)
    b = T(32, 8, 256, 11, 1)
    # 1.5% faster: within the tolerance, the late trigger stays
    assert choose_tactics({1: {a: 10.0, early: 9.85, b: 10.1}})[1] == (a, 10.0)
    # 5% faster: the early trigger wins
    assert choose_tactics({1: {a: 10.0, early: 9.5, b: 10.1}})[1] == (early, 9.5)
    # nothing else measured: it is the only choice
    assert choose_tactics({1: {early: 9.9}})[1] == (early, 9.9)
    # chosen for M=32 does not make it a candidate for reuse where it is not
    # clearly faster; where it is, it is reused
    picks = choose_tactics({32: {early: 9.0, a: 10.0}, 8: {early: 9.6, a: 9.5, b: 9.45}})
    assert picks[32] == (early, 9.0) and picks[8] == (b, 9.45)
    b_early = dataclasses.replace(b, early_launch=True)
    picks = choose_tactics({32: {early: 9.0, a: 10.0},
                            8: {early: 8.8, b_early: 8.7, a: 9.5, b: 9.1}})
    assert picks[8] == (early, 8.8)


def test_choose_tactics_takes_a_mixed_grid_only_when_clearly_faster():
    from warpsplitk.planning.selection import choose_tactics
    uniform = T(32, 32, 128, 3, 1, early_launch=True, x_copy="tma")
    late = dataclasses.replace(uniform, early_launch=False)
    mixed = T(64, 32, 128, 3, 1, x_copy="tma", half_tiles=40)
    # 1.4% faster than the early uniform grid (7168x384 M = 32): the
    # uniform one stays, and as the early trigger beats the late uniform grid
    # clearly, it is the early one
    assert choose_tactics({32: {mixed: 2.694, uniform: 2.733, late: 2.86}})[32] == (uniform, 2.733)
    # 10% faster: the mixed grid wins
    assert choose_tactics({32: {mixed: 9.14, uniform: 10.0, late: 10.1}})[32] == (mixed, 9.14)
    assert choose_tactics({32: {mixed: 9.14}})[32] == (mixed, 9.14)


def test_choose_tactics_never_picks_outside_tolerance():
    import random

    from warpsplitk.planning.selection import choose_tactics
    rng = random.Random(0)
    tactics = [T(16, 8, 256, s, 1) for s in range(2, 12)]
    for _ in range(200):
        times = {m: {t: rng.uniform(10, 12) for t in rng.sample(tactics, 4)} for m in (1, 8, 16, 32)}
        for m, (tactic, us) in choose_tactics(times, 0.02).items():
            assert us == times[m][tactic]
            assert us <= min(times[m].values()) * 1.02


def _log(path, records):
    """A tuner log of ``(n, k, m, tactic, us or None)``; a K split's records
    carry the current kernel revision (the others none: revision 1)."""
    from warpsplitk.planning.tune_log import KERNEL_REVISION
    with open(path, "w") as f:
        for n, k, m, tactic, us in records:
            rec = {"key": f"{n},{k},{m},{tactic}", "n": n, "k": k, "m": m, "tactic": tactic}
            if WarpSplitKTactic.parse(tactic).k_split > 1:
                rec["rev"] = KERNEL_REVISION
            rec.update({"ok": True, "us": us} if us is not None else
                       {"ok": False, "error": "relative error 0.5"})
            f.write(json.dumps(rec) + "\n")


def test_plan_from_log_makes_the_tuners_choices(tmp_path):
    from warpsplitk.planning.selection import plan_from_log
    a, b = "16,8,256,4,1", "32,8,256,4,1"
    records = [(1024, 4096, r, a, 5.0) for r in REPRESENTATIVE_MS]
    records += [(1024, 4096, r, b, 4.0) for r in (1, 8)]          # faster at small M
    records += [(1024, 4096, 32, b, 1.0)]                         # ... but wrong: ignored
    records[-1] = (1024, 4096, 32, b, None)
    records += [(2048, 4096, r, a, 6.0) for r in (1, 8, 16)]      # stopped mid-shape
    _log(tmp_path / "log.jsonl", records)
    plan, partial = plan_from_log(str(tmp_path / "log.jsonl"), meta={"gpu": "test"})
    assert partial == {(2048, 4096): [4, 24, 32]}
    assert sorted(plan.entries) == [(1024, 4096)]
    by_m = plan.entries[(1024, 4096)]
    assert sorted(by_m) == list(range(1, 33))
    assert by_m[1] == (WarpSplitKTactic.parse(b), 4.0) and by_m[5][0].short() == b
    assert by_m[32] == (WarpSplitKTactic.parse(a), 5.0) and by_m[20] == (WarpSplitKTactic.parse(a), None)
    assert plan.meta["gpu"] == "test" and plan.meta["source"] == "log log.jsonl"


def test_shipped_plan_is_what_its_log_gives():
    """The built-in H200 plan is the tuner's choice from the committed log
    as it stood when the plan was made (its first ``log_records`` lines),
    over the default space."""
    from pathlib import Path

    from warpsplitk.planning.selection import plan_from_log
    log = Path(__file__).resolve().parent.parent / "bench/results/h200-tune-log.jsonl"
    if not log.exists():
        pytest.skip("the tuner log is not in this checkout")
    shipped = builtin_plan("h200")
    narrow = shipped.meta.get("narrow_tiles", False)  # older plans: none
    plan, _ = plan_from_log(str(log), reps=tuple(shipped.meta["representative_ms"]),
                            records=shipped.meta["log_records"], narrow=narrow,
                            stale=shipped.meta.get("async_ring_revision", 1) == 1,
                            revision=shipped.meta.get("kernel_revision",
                                                      shipped.meta.get("async_ring_revision", 1)))
    if not narrow:
        assert not any(t.token_tile < 8 for e in shipped.entries.values() for t, _ in e.values())
    assert {nk: {m: t for m, (t, _) in e.items()} for nk, e in plan.entries.items()} == \
        {nk: {m: t for m, (t, _) in e.items()} for nk, e in shipped.entries.items()}


def test_cli_tune_from_log_without_gpu(tmp_path, capsys):
    """``tune --from-log``: the plan of the whole log; a shape stopped short
    of its larger Ms is left out and said so. (The log-prefix and stale
    options are plan_from_log's ``records`` and ``stale``, tested above.)"""
    from warpsplitk.cli import main
    log = tmp_path / "log.jsonl"
    _log(log, [(1024, 4096, r, "16,8,256,4,1", 5.0) for r in REPRESENTATIVE_MS]
         + [(2048, 4096, r, "16,8,256,4,1", 6.0) for r in REPRESENTATIVE_MS[:2]])
    out = tmp_path / "plan.json"
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0
    plan = load_plan(out)
    assert sorted(plan.entries) == [(1024, 4096)] and plan.meta["sm_count"] == 132
    printed = capsys.readouterr().out
    assert "plan for 1 shapes" in printed and "N=2048 K=4096: left out" in printed
    assert plan.meta["log_records"] == len(REPRESENTATIVE_MS) + 2
    assert main(["tune", "--from-log", "--log", str(tmp_path / "none.jsonl"), "-o", str(out)]) == 2


def test_plan_from_log_counts_confirmations_with_the_median(tmp_path):
    from warpsplitk.planning.selection import plan_from_log
    a, b, c = "16,8,256,4,1", "32,8,256,4,1+early", "64,8,128,4,1"
    records = [(1024, 4096, r, a, 5.0) for r in REPRESENTATIVE_MS]
    records += [(1024, 4096, r, b, 4.0) for r in REPRESENTATIVE_MS]
    _log(tmp_path / "log.jsonl", records)
    with open(tmp_path / "log.jsonl", "a") as f:
        # b's second timing at M = 1 is much slower: the mean (6.0) loses to a
        for tactic, us in ((b, 8.0), (a, 5.0)):
            f.write(json.dumps({"key": f"confirm:1024,4096,1,{tactic}", "n": 1024, "k": 4096,
                                "m": 1, "tactic": tactic, "confirm": True, "ok": True,
                                "us": us}) + "\n")
        # at M = 4, c's first graph was lucky and its two confirmations are
        # not: the median (4.2) loses to b (the mean, 3.17, would not)
        for key, us in (("", 1.0), ("confirm:", 4.2), ("confirm2:", 4.3)):
            f.write(json.dumps({"key": f"{key}1024,4096,4,{c}", "n": 1024, "k": 4096,
                                "m": 4, "tactic": c, "confirm": bool(key), "ok": True,
                                "us": us}) + "\n")
        # a confirmation without a first timing of its own is ignored
        f.write(json.dumps({"key": "confirm:1024,4096,8,64,8,128,4,1", "n": 1024, "k": 4096,
                            "m": 8, "tactic": "64,8,128,4,1", "confirm": True, "ok": True,
                            "us": 1.0}) + "\n")
    plan, partial = plan_from_log(str(tmp_path / "log.jsonl"))
    assert not partial
    by_m = plan.entries[(1024, 4096)]
    assert by_m[1] == (WarpSplitKTactic.parse(a), 5.0)
    assert by_m[4] == (WarpSplitKTactic.parse(b), 4.0)
    assert by_m[8] == (WarpSplitKTactic.parse(b), 4.0)


def test_confirmation_helpers():
    from warpsplitk.planning.selection import cell_times
    from warpsplitk.planning.tune import CONFIRM_ROUNDS, _confirm_candidates
    from warpsplitk.planning.tune_log import confirm_key
    a, b, c = T(16, 8, 256, 4, 1), T(32, 8, 256, 4, 1), T(32, 8, 256, 4, 1, early_launch=True)
    cell = {a: [5.0], b: [4.0, 4.4], c: [3.0]}
    assert _confirm_candidates(cell, 2) == [c, b]
    assert _confirm_candidates(cell, 0) == []
    # the default heuristic's tactic is confirmed too, if it was measured
    assert _confirm_candidates(cell, 2, default=a) == [c, b, a]
    assert _confirm_candidates(cell, 2, default=b) == [c, b]
    assert _confirm_candidates(cell, 2, default=T(64, 8, 256, 4, 1)) == [c, b]
    assert _confirm_candidates(cell, 0, default=a) == []
    # two timings: their mean (as older logs were ranked); three:
    # the median, as the benchmark counts its graphs
    assert cell_times(cell) == {a: 5.0, b: 4.2, c: 3.0}
    assert cell_times({a: [1.24, 1.48, 1.47], b: []}) == {a: 1.47}
    assert confirm_key(1, 2, 8, c) == "confirm:1,2,8,32,8,256,4,1+early"
    assert confirm_key(1, 2, 8, c, 2) == "confirm2:1,2,8,32,8,256,4,1+early"
    assert CONFIRM_ROUNDS + 1 == timing.ROUNDS


def test_confirmations_alternate_round_by_round():
    """The tuner's confirmation timings of a cell: every candidate once per
    round, round after round (as the benchmark alternates), the default
    heuristic's tactic among them; none without ``confirm``."""
    from warpsplitk.planning.tune import CONFIRM_ROUNDS, _confirmations
    a, b, c = T(16, 8, 256, 4, 1), T(32, 8, 256, 4, 1), T(32, 8, 256, 4, 1, early_launch=True)
    cell = {a: [5.0], b: [4.0], c: [3.0]}
    assert _confirmations(cell, 1, default=a, rounds=2) == [(1, c), (1, a), (2, c), (2, a)]
    assert _confirmations(cell, 2, rounds=3) == [(1, c), (1, b), (2, c), (2, b), (3, c), (3, b)]
    assert len(_confirmations(cell, 3)) == 3 * CONFIRM_ROUNDS
    assert _confirmations(cell, 0, default=a) == []


def test_plan_from_log_lets_an_unmeasured_inner_m_inherit(tmp_path):
    """A log from before M = 4 was measured (or a shape whose M = 4 cell
    failed): M 2-4 take the M = 8 winner, as they did then, and the plan
    says so; a shape missing its largest M is still left out."""
    from warpsplitk.planning.selection import plan_from_log
    a, b = "16,8,256,4,1", "32,8,256,4,1"
    records = [(1024, 4096, r, a, 5.0) for r in (1, 16, 24, 32)] + [(1024, 4096, 8, b, 4.0)]
    records += [(2048, 4096, r, a, 6.0) for r in (1, 4, 8, 16, 24)]
    _log(tmp_path / "log.jsonl", records)
    plan, partial = plan_from_log(str(tmp_path / "log.jsonl"))
    assert partial == {(2048, 4096): [32]}
    by_m = plan.entries[(1024, 4096)]
    assert [by_m[m][0].short() for m in (1, 2, 4, 5, 8, 9)] == [a, b, b, b, b, a]
    assert by_m[4][1] is None and by_m[8][1] == 4.0  # only measured Ms carry a time
    assert plan.meta["inherited_ms"] == {"1024,4096": [4]}


def test_plan_from_log_counts_the_default_space_unless_asked(tmp_path):
    """A log holds what any run measured; the plan counts narrow token tiles
    (and rings past 16 stages) unless told not to, and never a split of K in
    four where K does not need it (illegal there), however fast it was."""
    from warpsplitk.planning.selection import in_default_space, plan_from_log
    wide, narrow, deep, four = ("32,8,256,4,1", "32,1,256,13,1", "16,8,256,18,1",
                                "32,8,256,4,1,4")
    assert in_default_space(WarpSplitKTactic.parse(wide))
    assert in_default_space(WarpSplitKTactic.parse(wide), narrow=False)
    assert in_default_space(WarpSplitKTactic.parse(narrow))
    assert not in_default_space(WarpSplitKTactic.parse(narrow), narrow=False)
    assert in_default_space(WarpSplitKTactic.parse(deep))
    assert not in_default_space(WarpSplitKTactic.parse(deep), narrow=False)
    assert in_default_space(WarpSplitKTactic.parse(four))  # where K needs it
    records = [(2112, 7168, r, wide, 9.0) for r in REPRESENTATIVE_MS]
    records += [(2112, 7168, 1, narrow, 7.0), (2112, 7168, 4, deep, 7.0),
                (2112, 7168, 8, four, 7.0)]
    _log(tmp_path / "log.jsonl", records)
    plain, _ = plan_from_log(str(tmp_path / "log.jsonl"), narrow=False)
    assert {t.short() for t, _ in plain.entries[(2112, 7168)].values()} == {wide}
    assert plain.meta["log_records"] == len(records) and plain.meta["narrow_tiles"] is False
    default, _ = plan_from_log(str(tmp_path / "log.jsonl"))
    assert default.meta["narrow_tiles"] is True
    by_m = default.entries[(2112, 7168)]
    assert (by_m[1][0].short(), by_m[4][0].short(), by_m[8][0].short()) == (narrow, deep, wide)
    assert by_m[8][1] == 9.0  # the faster split in four does not count
    # the log as it stood before its last three lines: the wide tactic everywhere
    early, _ = plan_from_log(str(tmp_path / "log.jsonl"), narrow=True,
                             records=len(REPRESENTATIVE_MS))
    assert {t.short() for t, _ in early.entries[(2112, 7168)].values()} == {wide}
    assert early.meta["log_records"] == len(REPRESENTATIVE_MS)


def test_plan_from_log_skips_tactics_this_version_refuses(tmp_path):
    """A log can hold tactics this version refuses (measured by an older
    one, as narrow tiles with bulk rows once were): a plan
    from that log never picks them, however fast they were."""
    from warpsplitk.tactics import is_legal
    from warpsplitk.planning.selection import plan_from_log
    # a 1 x 256 stage is 32 copies: too few for two loader warps
    refused, ok = "32,1,256,13,2+early", "32,1,256,13,1+early"
    assert not is_legal(WarpSplitKTactic.parse(refused), 2624, 6144)
    records = [(2624, 6144, r, "32,8,256,11,1", 9.0) for r in REPRESENTATIVE_MS]
    records += [(2624, 6144, 1, refused, 7.0), (2624, 6144, 1, ok, 8.0)]
    _log(tmp_path / "log.jsonl", records)
    plan, _ = plan_from_log(str(tmp_path / "log.jsonl"), narrow=True)
    assert plan.entries[(2624, 6144)][1][0].short() == ok


def test_timings_of_changed_kernels_are_stale(tmp_path):
    """Records of TMA and bulk-copy tactics made before the release fence
    (no ``rev``) are stale: left out of a plan unless asked for, and of the
    tuner's resume set (so it measures them again); a newer record of the
    same key wins; records of cp.async tactics stay valid."""
    from warpsplitk.planning.selection import plan_from_log
    from warpsplitk.planning.tune_log import ASYNC_RING_REVISION, is_stale, read_log, stale_records
    plain, tma, bulk = "16,8,256,4,1", "16,8,256,4,1+tma", "16,8,256,4,1+bulk"
    assert not is_stale({"tactic": plain})
    assert is_stale({"tactic": tma}) and is_stale({"tactic": bulk, "rev": 1})
    assert not is_stale({"tactic": tma, "rev": ASYNC_RING_REVISION})
    # a K split's kernel changed at revision 3 (the mbarrier hand-over)
    split = "32,8,256,4,1,2"
    assert is_stale({"tactic": split, "rev": 2}) and not is_stale({"tactic": split, "rev": 3})
    assert not is_stale({"tactic": split, "rev": 2}, revision=2)
    assert is_stale({"tactic": split + "+tma", "rev": 1}, revision=2)
    # block-scaled e4m3 timings changed at revision 4 (the fold); other kinds did not
    assert is_stale({"tactic": plain, "rev": 3, "fp8": "block128"})
    assert not is_stale({"tactic": plain, "rev": 4, "fp8": "block128"})
    assert not is_stale({"tactic": plain, "rev": 3, "fp8": "channel"})
    assert not is_stale({"tactic": plain, "rev": 3, "fp8": "block128"}, revision=3)
    # e4m3 uneven splits (row copies, no L2 prefetch) changed at revision 5
    # (one K loop); BF16 ones, even ones and those with the prefetch did not
    four = "32,8,128,7,2,4"
    assert is_stale({"tactic": four, "k": 29568, "rev": 4, "fp8": "channel"})
    assert not is_stale({"tactic": four, "k": 29568, "rev": 5, "fp8": "channel"})
    assert not is_stale({"tactic": four, "k": 29568, "rev": 4, "fp8": "channel"}, revision=4)
    assert not is_stale({"tactic": four, "k": 29568, "rev": 4})
    assert not is_stale({"tactic": four, "k": 29696, "rev": 4, "fp8": "channel"})
    assert not is_stale({"tactic": four + "+prefetch2", "k": 29568, "rev": 4, "fp8": "tensor"})
    log = tmp_path / "log.jsonl"
    _log(log, [(1024, 4096, r, plain, 5.0) for r in REPRESENTATIVE_MS]
         + [(1024, 4096, r, tma, 4.0) for r in REPRESENTATIVE_MS])
    assert stale_records(str(log)) == len(REPRESENTATIVE_MS)
    assert len(read_log(str(log))) == len(REPRESENTATIVE_MS)
    assert len(read_log(str(log), stale=True)) == 2 * len(REPRESENTATIVE_MS)

    def picks(**kw):
        plan, _ = plan_from_log(str(log), **kw)
        return {t.short() for e in plan.entries.values() for t, _ in e.values()}, plan.meta
    fresh, meta = picks()
    assert fresh == {plain} and meta["async_ring_revision"] == ASYNC_RING_REVISION
    old, meta = picks(stale=True)
    assert old == {tma} and meta["async_ring_revision"] == 1
    # measured again with the fence: slower now, and counted
    with open(log, "a") as f:
        for r in REPRESENTATIVE_MS:
            f.write(json.dumps({"key": f"1024,4096,{r},{tma}", "n": 1024, "k": 4096, "m": r,
                                "tactic": tma, "ok": True, "us": 5.5,
                                "rev": ASYNC_RING_REVISION}) + "\n")
    assert stale_records(str(log)) == 0
    assert read_log(str(log))[f"1024,4096,1,{tma}"]["us"] == 5.5
    assert picks()[0] == {plain}


def test_cli_tune_from_log_stale_records(tmp_path, capsys):
    from warpsplitk.cli import main
    log = tmp_path / "log.jsonl"
    _log(log, [(1024, 4096, r, "16,8,256,4,1+tma", 4.0) for r in REPRESENTATIVE_MS])
    out = tmp_path / "plan.json"
    # timings of kernels changed since are left out of the plan
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0
    assert load_plan(out).entries == {}
    assert "plan for 0 shapes" in capsys.readouterr().out


def test_stale_timings_slower_than_the_best_valid_one_are_not_measured_again(tmp_path):
    """The fence only adds work: a stale timing already slower than its
    cell's best valid timing is skipped on resume; a faster one is measured
    again; stale confirmations and failures are judged by nothing (their
    cell's candidates decide)."""
    from warpsplitk.planning.tune_log import dominated_stale_keys
    log = tmp_path / "log.jsonl"
    plain, tma, bulk = "16,8,256,4,1", "16,8,256,4,1+tma", "16,8,256,4,1+bulk"
    _log(log, [(1024, 4096, 1, plain, 5.0), (1024, 4096, 1, tma, 6.0),
               (1024, 4096, 1, bulk, 4.5), (1024, 4096, 4, tma, 3.0),
               (1024, 4096, 8, bulk, None)])
    assert dominated_stale_keys(str(log)) == {f"1024,4096,1,{tma}"}
    # a K split logged before the mbarrier hand-over is faster since: never skipped
    split = "32,8,256,4,1,2"
    with open(log, "a") as f:
        f.write(json.dumps({"key": f"1024,4096,1,{split}", "n": 1024, "k": 4096, "m": 1,
                            "tactic": split, "ok": True, "us": 9.0, "rev": 2}) + "\n")
    assert dominated_stale_keys(str(log)) == {f"1024,4096,1,{tma}"}


def test_fp8_timings_are_a_cell_of_their_own_in_the_log(tmp_path):
    """A stale BF16 timing is judged against the BF16 timings of its cell
    only (an FP8 weight's faster timing is of another kernel); an FP8
    record names scales the kernel takes."""
    from warpsplitk.planning.tune_log import check_log_record, dominated_stale_keys, log_key
    log = tmp_path / "log.jsonl"
    tma = "16,8,256,4,1+tma"
    _log(log, [(1024, 4096, 1, tma, 6.0)])  # stale (revision 1): only a faster BF16 one skips it
    plain = WarpSplitKTactic.parse("16,8,256,4,1")
    with open(log, "a") as f:
        f.write(json.dumps({"key": log_key(1024, 4096, 1, plain, "channel"), "n": 1024,
                            "k": 4096, "m": 1, "tactic": plain.short(), "ok": True, "us": 2.0,
                            "fp8": "channel", "rev": 3}) + "\n")
    assert log_key(1024, 4096, 1, plain, "channel") == "fp8:channel:1024,4096,1,16,8,256,4,1"
    assert dominated_stale_keys(str(log)) == set()
    with pytest.raises(ValueError, match=r"^here: 'fp8' must be one of \('tensor', 'channel', "
                                         r"'block128'\), got 'per-row'$"):
        check_log_record({"key": "x", "n": 1, "k": 1, "m": 1, "tactic": "t", "fp8": "per-row"},
                         "here")


def test_log_records_of_retired_builds_and_tactics_never_count(tmp_path):
    """Records of an experimental build (stamped ``variant`` by versions that
    built them) and of tactics this version no longer parses (a seventh
    comma field: the retired activation multicast) are skipped by
    ``read_log`` and so by plans and resumes, however fast they were; a new
    record carries the kernel revision and no ``variant``."""
    from warpsplitk.planning.selection import plan_from_log
    from warpsplitk.planning.tune_log import KERNEL_REVISION, new_record, read_log
    fresh = new_record(key="a")
    assert fresh["rev"] == KERNEL_REVISION and "variant" not in fresh
    split, multicast = "32,8,256,4,1,2", "16,16,256,4,1,1,2"
    with pytest.raises(ValueError, match=f"a tactic is five integers .*, got '{multicast}'$"):
        WarpSplitKTactic.parse(multicast)
    log = tmp_path / "log.jsonl"
    _log(log, [(1024, 4096, r, split, 5.0) for r in REPRESENTATIVE_MS])
    with open(log, "a") as f:
        # the same key, later in the log (it would win) but from a variant build
        f.write(json.dumps({"key": f"1024,4096,1,{split}", "n": 1024, "k": 4096, "m": 1,
                            "tactic": split, "ok": True, "us": 3.0, "rev": KERNEL_REVISION,
                            "variant": {"split_reduce": "vector"}}) + "\n")
        for r in REPRESENTATIVE_MS:
            f.write(json.dumps({"key": f"1024,4096,{r},{multicast}", "n": 1024, "k": 4096,
                                "m": r, "tactic": multicast, "ok": True, "us": 1.0,
                                "rev": KERNEL_REVISION}) + "\n")
    logged = read_log(str(log))
    assert sorted(logged) == sorted(f"1024,4096,{r},{split}" for r in REPRESENTATIVE_MS)
    assert logged[f"1024,4096,1,{split}"]["us"] == 5.0
    assert len(read_log(str(log), stale=True)) == len(REPRESENTATIVE_MS)
    plan, partial = plan_from_log(str(log))
    assert partial == {}
    assert {(t.short(), us) for t, us in
            (plan.entries[(1024, 4096)][r] for r in REPRESENTATIVE_MS)} == {(split, 5.0)}


def test_tuning_order_is_largest_weight_first():
    from warpsplitk.planning.tune import tuning_order
    assert tuning_order([(1024, 4096), (4096, 14336), (4096, 1024), (14336, 4096),
                         (1024, 4096)]) == [(4096, 14336), (14336, 4096), (1024, 4096),
                                            (4096, 1024)]
    assert tuning_order([]) == []


# ------------------------------------------------ a log a crash or a full disk cut short


def _records(n=3):
    return [{"key": f"1024,4096,{m},16,8,256,4,1", "n": 1024, "k": 4096, "m": m,
             "tactic": "16,8,256,4,1", "ok": True, "us": 5.0} for m in REPRESENTATIVE_MS[:n]]


def _write_log(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


HALF = b'{"key": "1024,4096,24,16,8,256,4,1", "n": 1024, "k": 40'


def test_a_half_written_last_line_is_ignored_on_resume(tmp_path):
    import warnings

    from warpsplitk.planning.selection import plan_from_log
    from warpsplitk.planning.tune_log import read_log, read_log_records
    log = tmp_path / "log.jsonl"
    _write_log(log, _records(), HALF)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert sorted(read_log(str(log))) == sorted(r["key"] for r in _records())
    assert len(record) == 1 and record[0].category is RuntimeWarning
    assert f"{log} line 4: ignoring the unfinished last line" in str(record[0].message)
    with pytest.warns(RuntimeWarning, match="line 4"):
        assert [n for n, _ in read_log_records(log)] == [1, 2, 3]
    # a plan made from it counts the lines it read, not the half one
    with pytest.warns(RuntimeWarning, match="line 4"):
        plan, _ = plan_from_log(str(log))
    assert plan.meta["log_records"] == 3
    # a last line without a newline that parses is a whole record
    _write_log(log, _records(2))
    log.write_bytes(log.read_bytes() + json.dumps(_records(3)[2]).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_log(str(log))) == 3


@pytest.mark.parametrize("text,line", [
    (b"\n".join([json.dumps(_records()[0]).encode(), HALF, json.dumps(_records()[1]).encode()])
     + b"\n", 2),  # a broken line in the middle
    (json.dumps(_records()[0]).encode() + b"\n" + HALF + b"\n", 2),  # ended: not cut short
])
def test_a_broken_line_that_is_not_an_unfinished_tail_stays_an_error(tmp_path, text, line):
    from warpsplitk.planning.tune_log import read_log
    log = tmp_path / "log.jsonl"
    log.write_bytes(text)
    with pytest.raises(ValueError, match=f"^{log} line {line}: not valid JSON"):
        read_log(str(log))


def test_a_key_twice_in_a_log_line_is_an_error_naming_it(tmp_path):
    from warpsplitk.planning.tune_log import read_log
    log = tmp_path / "log.jsonl"
    _write_log(log, _records(1))
    with open(log, "a") as f:
        f.write('{"key": "a", "n": 1024, "k": 4096, "m": 1, "m": 8, "tactic": "cublas"}\n')
    with pytest.raises(ValueError, match=f"^{log} line 2: .*duplicate key 'm'"):
        read_log(str(log))


def _append_all(log, records):
    from warpsplitk.planning.tune_log import append_record
    with open(log, "ab+") as f:  # as tune opens its log
        for record in records:
            append_record(f, record, str(log))


def test_appending_after_a_half_line_removes_it(tmp_path):
    import warnings

    from warpsplitk.planning.tune_log import read_log_records
    log = tmp_path / "log.jsonl"
    _write_log(log, _records(2), HALF)
    with pytest.warns(RuntimeWarning, match=f"{log} line 3: removed the unfinished last line"):
        _append_all(log, _records(4)[2:])
    assert log.read_bytes() == b"".join(json.dumps(r).encode() + b"\n" for r in _records(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid log: nothing to warn of
        assert [r for _, r in read_log_records(log)] == _records(4)


def test_appending_after_a_whole_record_without_newline_keeps_it(tmp_path):
    import warnings
    log = tmp_path / "log.jsonl"
    _write_log(log, _records(1), json.dumps(_records(2)[1]).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _append_all(log, _records(3)[2:])
    assert log.read_bytes() == b"".join(json.dumps(r).encode() + b"\n" for r in _records(3))


def test_appends_are_synced(tmp_path, monkeypatch):
    import os
    log = tmp_path / "log.jsonl"
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        # what was written is on its way to the disk: flushed before the sync
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _append_all(log, _records(3))
    sizes = [len(b"".join(json.dumps(r).encode() + b"\n" for r in _records(i + 1)))
             for i in range(3)]
    assert synced == sizes


# ------------------------------------------------ the measuring loop on a stand-in GPU


@pytest.fixture
def fake_gpu(monkeypatch):
    """The tuner's GPU work on the CPU: a tactic's kernel computes x @ w^T
    (an FP8 kernel's w scaled), but not for ``broken`` (no compile) and
    ``wrong`` (wrong results); it
    times at ``times[tactic]`` (10 us unless given), cuBLAS at
    ``cublas_us[m]``. ``compiled``, ``timed`` and ``built`` record the calls."""
    import types

    import torch

    from warpsplitk.contract import fp8_scale_factors, fp8_scale_shape
    pytest.importorskip("cuda.bindings")
    from warpsplitk.planning import tune as tune_module
    gpu = types.SimpleNamespace(times={}, cublas_us={}, broken=set(), wrong=set(), compiled=[],
                                options=[], timed=[], built=[], last=None)
    tensors = {}
    real_randn, real_empty, real_matmul = torch.randn, torch.empty, torch.matmul

    def keep(t):
        tensors[t.data_ptr()] = t
        return t

    def matmul(a, b, out=None):
        gpu.last = ("cublas", a.shape[0])
        return real_matmul(a, b, out=out)

    def compile_kernel(device, n, k, tactic, **options):
        if tactic in gpu.broken:
            raise RuntimeError("no such kernel")
        gpu.compiled.append(tactic)
        gpu.options.append(options)

        def code(w, x, bias, *rest):  # rest: (scale,) out, m, stream as the kernel's
            weight = tensors[w].float()
            if options.get("fp8_scales"):
                weight = weight * fp8_scale_factors(tensors[rest[0]], n, k)
            result = tensors[x].float() @ weight.t()
            tensors[rest[-3]].copy_(result * (2 if tactic in gpu.wrong else 1))
            gpu.last = tactic
        return code

    def random_fp8(n, k, copies, seed, scales):
        weights = [keep((real_randn(n, k) * 64).clamp(-448, 448).to(torch.float8_e4m3fn))
                   for _ in range(copies)]
        return weights, [keep(torch.rand(fp8_scale_shape(scales, n, k)) + 0.5)
                         for _ in range(copies)]

    def time_calls(calls):
        calls[0]()
        gpu.timed.append(gpu.last)
        us = (gpu.cublas_us[gpu.last[1]] if isinstance(gpu.last, tuple)
              else gpu.times.get(gpu.last, 10.0))
        return timing.Timing(us, us, us, len(calls))

    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **kw: keep(real_randn(*a, **kw)))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: keep(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "matmul", matmul)
    for name, value in (("current_device", lambda: 0),
                        ("get_device_name", lambda device: "NVIDIA H200"),
                        ("get_device_properties",
                         lambda device: types.SimpleNamespace(multi_processor_count=132)),
                        ("synchronize", lambda: None), ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(timing, "require_cuda", lambda what: None)
    monkeypatch.setattr(timing, "copies_for", lambda weight_bytes: 2)
    monkeypatch.setattr(timing, "random_weights", lambda n, k, copies, device, seed: [
        keep(real_randn(n, k, dtype=torch.bfloat16)) for _ in range(copies)])
    monkeypatch.setattr(timing, "time_calls", time_calls)
    monkeypatch.setattr(timing, "random_fp8", random_fp8)
    monkeypatch.setattr(tune_module, "compile_warp_splitk", compile_kernel)
    monkeypatch.setattr(tune_module, "gmem_pointer", lambda address: address)
    monkeypatch.setattr(tune_module, "stream_handle", lambda device: 0)
    monkeypatch.setattr(tune_module, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(tune_module, "precompile",
                        lambda kernels, arch, jobs, progress: gpu.built.append(kernels) or {})
    return gpu


def test_the_tuner_logs_each_measurement_once_and_resumes_from_the_log(fake_gpu, tmp_path):
    from warpsplitk.planning import choose
    from warpsplitk.planning.decode_plan import CUBLAS
    from warpsplitk.planning.tune import SHORTLIST, tune
    from warpsplitk.planning.tune_log import KERNEL_REVISION
    n, k = 256, 512
    work = {m: choose.shortlist(m, n, k, 132, SHORTLIST) for m in (1, 8)}
    broken, wrong, too_fast, fast = work[1][:4]
    fake_gpu.broken.add(broken)
    fake_gpu.wrong.add(wrong)
    fake_gpu.times.update({too_fast: 1e-3, fast: 5.0})  # 1 ns: under any HBM read of the weight
    fake_gpu.cublas_us.update({1: 20.0, 8: 1.0})
    lines, log = [], tmp_path / "log.jsonl"
    plan = tune([(n, k)], [1, 8], log_path=str(log), progress=lines.append)
    assert plan.lookup(n, k, 1) == fast and plan.lookup(n, k, 8) == CUBLAS
    assert plan.entries[(n, k)][1] == (fast, 5.0)
    meta, *records = [json.loads(line) for line in log.read_text().splitlines()]
    assert meta["meta"]["gpu"] == "NVIDIA H200" and meta["meta"]["sm_count"] == 132
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)) and all(r["rev"] == KERNEL_REVISION for r in records)
    # every cell's work timed once, its fastest confirmed, cuBLAS beside them
    assert {r["key"] for r in records if not r.get("confirm") and r["tactic"] != CUBLAS} == {
        f"{n},{k},{m},{t.short()}" for m in work for t in work[m]}
    assert {f"confirm:{n},{k},1,{fast.short()}", f"confirm2:{n},{k},1,{fast.short()}",
            f"{n},{k},1,cublas", f"{n},{k},8,cublas"} <= set(keys)
    failed = {r["tactic"]: r["error"] for r in records if r["m"] == 1 and not r["ok"]}
    assert failed[broken.short()] == "compile: no such kernel"
    assert failed[wrong.short()].startswith("relative error")
    assert "any HBM read of the weight needs" in failed[too_fast.short()]
    assert f"dropped {n},{k},1,{broken.short()}: compile: no such kernel" in lines
    # all of it compiled before the first measurement
    assert {t for _, _, t, *_ in fake_gpu.built[0]} == set(work[1]) | set(work[8])
    # a rerun measures nothing the log holds: it appends its provenance only
    measured, size = (len(fake_gpu.compiled), len(fake_gpu.timed)), len(records) + 1
    again = tune([(n, k)], [1, 8], log_path=str(log), progress=lines.append)
    assert again.entries == plan.entries and fake_gpu.built[-1] == []
    assert (len(fake_gpu.compiled), len(fake_gpu.timed)) == measured
    appended = [json.loads(line) for line in log.read_text().splitlines()][size:]
    assert len(appended) == 1 and "meta" in appended[0]


def test_an_fp8_tune_times_e4m3_weights_into_the_plans_fp8_entries(fake_gpu, tmp_path):
    """Each cell measures the pruned FP8 space (the FP8 default among it)
    with scales of the kind asked, under keys of their own beside a BF16
    tune's in the same log, and no cuBLAS; the plan holds FP8 entries only."""
    from warpsplitk.planning.selection import plan_from_log
    from warpsplitk.planning.tune import tune
    from warpsplitk.planning.tune_log import log_key
    n, k = 256, 512
    log, lines = tmp_path / "log.jsonl", []
    fake_gpu.cublas_us.update({1: 20.0, 8: 20.0})
    bf16 = tune([(n, k)], [1, 8], log_path=str(log), progress=lines.append)
    bf16_size = len(log.read_text().splitlines())
    work = {m: candidates(m, n, k, 132, fp8_scales="block128") for m in (1, 8)}
    fast, wrong = work[8][3], work[1][0]
    fake_gpu.times[fast] = 5.0
    fake_gpu.wrong.add(wrong)
    fake_gpu.compiled.clear(), fake_gpu.options.clear()
    plan = tune([(n, k)], [1, 8], log_path=str(log), progress=lines.append,
                fp8_scales="block128")
    assert plan.entries == {} and plan.meta["fp8_scales"] == "block128"
    entries = plan.fp8_entries["block128"][(n, k)]
    assert plan.lookup(n, k, 8, fp8_scales="block128") == fast and entries[8] == (fast, 5.0)
    assert sorted(entries) == [1, 8] and list(plan.fp8_entries) == ["block128"]
    _, *records = [json.loads(line) for line in log.read_text().splitlines()[bf16_size:]]
    assert all(r["fp8"] == "block128" for r in records)
    assert "cublas" not in {r["tactic"] for r in records}
    # every FP8 candidate measured, none taken for the BF16 timing of its cell
    assert {r["key"] for r in records if not r.get("confirm")} == {
        log_key(n, k, m, t, "block128") for m in work for t in work[m]}
    assert {r["key"] for r in records if r.get("confirm")} >= {
        f"confirm:fp8:block128:{n},{k},8,{fast.short()}"}
    assert next(r for r in records if r["tactic"] == wrong.short() and r["m"] == 1)[
        "error"].startswith("relative error")
    assert {o["fp8_scales"] for o in fake_gpu.options} == {"block128"}
    assert {item[5:] for item in fake_gpu.built[-1]} == {(False, "block128")}
    # the log rebuilds each plan from its own dtype's timings
    assert plan_from_log(str(log), [1, 8], fp8_scales="block128")[0].fp8_entries == \
        plan.fp8_entries
    assert plan_from_log(str(log), [1, 8])[0].entries == bf16.entries
    # a rerun measures nothing the log holds
    measured = len(fake_gpu.timed)
    again = tune([(n, k)], [1, 8], log_path=str(log), progress=lines.append,
                 fp8_scales="block128")
    assert again.fp8_entries == plan.fp8_entries and len(fake_gpu.timed) == measured


@pytest.mark.parametrize("scales", ["channel", "block128"])
def test_an_exhaustive_fp8_tune_measures_fp8_twins_only(fake_gpu, scales):
    from warpsplitk.planning.space import mixed_twins
    from warpsplitk.planning.tune import tune
    # at M = 16 its grid is uneven: mixed grids the FP8 kernel takes are twins
    n, k = 1536, 4096
    first = candidates(16, n, k, 132, fp8_scales=scales)
    assert any(is_legal(t, n, k, fp8=True) for t in mixed_twins(dict.fromkeys(first, 1.0), n, k,
                                                                  16, 132))
    plan = tune([(n, k)], [1, 16], progress=lambda line: None, shortlist=0, fp8_scales=scales)
    measured = set(fake_gpu.compiled)
    assert plan.lookup(n, k, 16, fp8_scales=scales) in measured
    # twins beyond the first candidates (the narrow token tiles of M = 1) ...
    assert measured - set(first) - set(candidates(1, n, k, 132, fp8_scales=scales))
    assert any(t.token_tile < 8 for t in measured)
    # ... each one the FP8 kernel takes; mixed grids only where the scales take them
    assert all(is_legal(t, n, k, fp8=True) for t in measured)
    assert any(t.half_tiles for t in measured) == (scales != "block128")
    with pytest.raises(ValueError, match=r"fp8_scales must be None \(BF16 weights\) or one of "
                                         r"\('tensor', 'channel', 'block128'\), got 'block'"):
        tune([(n, k)], [1], fp8_scales="block")
