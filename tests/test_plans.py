"""Decode plans: file round trip, validation, lookup and fallback; the tuner's pruning."""

import dataclasses
import json
import warnings

import pytest

from warpsplitk import shapes
from warpsplitk.measure import timing
from warpsplitk.planning.plans import (
    PLAN_FORMAT,
    PLAN_VERSION,
    DecodePlan,
    builtin_plan,
    load_plan,
    plan_from_json,
)
from warpsplitk.tactics import (WarpSplitKTactic, check_tactic, ctas_per_sm, default_tactic, grid_ctas,
                                is_legal)
from warpsplitk.planning.space import base_candidates
from warpsplitk.planning.tune import REPRESENTATIVE_MS, candidates, representative

T = WarpSplitKTactic


def small_plan():
    plan = DecodePlan(meta={"gpu": "test"})
    plan.set(4224, 7168, 1, T(32, 8, 256, 11, 1), 13.7)
    plan.set(4224, 7168, 2, T(32, 8, 256, 11, 1))
    plan.set(768, 128, 32, T(16, 32, 128, 1, 2), 1.45)
    return plan


def test_round_trip(tmp_path):
    plan = small_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.entries == plan.entries
    assert loaded.meta == plan.meta
    data = json.loads(path.read_text())
    assert data["format"] == PLAN_FORMAT and data["version"] == PLAN_VERSION


def _write(tmp_path, data):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "not a warpsplitk plan"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["shapes"][0].pop("k"), r"shapes\[0\] needs"),
    (lambda d: d["shapes"][0]["entries"].update({"33": {"tactic": "16,8,128,4,1"}}), "M=33"),
    (lambda d: d["shapes"][0]["entries"].update({"x": {"tactic": "16,8,128,4,1"}}), "integer"),
    (lambda d: d["shapes"][0]["entries"].update({"3": {"us": 1.0}}), "needs a 'tactic'"),
    (lambda d: d["shapes"][0]["entries"].update({"3": {"tactic": "16,8"}}), "five integers"),
    # stale: a tactic that no longer passes check_tactic (more stages than K tiles)
    (lambda d: d["shapes"][0]["entries"].update({"3": {"tactic": "16,8,128,2,1"}}),
     "N=768 K=128 M=3: .*exceeds"),
    # a time the plan view divides by, or prints: a positive number or null
    (lambda d: d["shapes"][0]["entries"]["32"].update(us=0), r"M=32: 'us' must be a positive "
                                                            r"number of microseconds or null, got 0$"),
    (lambda d: d["shapes"][0]["entries"]["32"].update(us=-5), "'us' must be .*got -5$"),
    (lambda d: d["shapes"][0]["entries"]["32"].update(us=[1]), r"'us' must be .*got \[1\]$"),
    (lambda d: d["shapes"][0]["entries"]["32"].update(us="fast"), "'us' must be .*got 'fast'$"),
    (lambda d: d["shapes"][0]["entries"]["32"].update(us=True), "'us' must be .*got True$"),
    # a cuBLAS entry has no tactic to check its shape against: N and K are checked alone
    (lambda d: d["shapes"].append({"n": [4096], "k": 4096, "entries": {"1": {"tactic": "cublas"}}}),
     r"N must be a positive integer, got \[4096\]$"),
    (lambda d: d["shapes"].append({"n": 4096, "k": "x", "entries": {"1": {"tactic": "cublas"}}}),
     "K must be a positive integer, got 'x'$"),
    (lambda d: d["shapes"].append({"n": -1, "k": 4096, "entries": {"1": {"tactic": "cublas"}}}),
     "N must be a positive integer, got -1$"),
    # one spelling per M, and one entry per (N, K, M) across the file
    (lambda d: d["shapes"][0]["entries"].update({" 3": {"tactic": "16,8,128,4,1"}}),
     r"M must be an integer in 1\.\.32, got ' 3'$"),
    (lambda d: d["shapes"][0]["entries"].update({"03": {"tactic": "16,8,128,4,1"}}), "got '03'$"),
    (lambda d: d["shapes"].append(dict(d["shapes"][0])), "M=32: a second entry"),
    (lambda d: d["shapes"][0]["entries"].update({"3": "16,8,128,4,1"}), "needs a 'tactic'"),
    (lambda d: d.update(version=True), "version True"),
])
def test_bad_files_name_the_entry(tmp_path, mutate, match):
    data = small_plan().to_json()
    mutate(data)
    with pytest.raises(ValueError, match=match):
        load_plan(_write(tmp_path, data))


def test_not_json(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan(_write(tmp_path, "{nope"))


def test_a_plan_file_is_a_path_of_utf8_text(tmp_path):
    binary = tmp_path / "plan.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=rf"^{binary}: not a plan file: not UTF-8 text"):
        load_plan(binary)
    # open() would take a file descriptor (True is 1: stdout) and close it
    for descriptor in (True, 1, 3):
        with pytest.raises(ValueError, match=f"the plan file must be a path, got {descriptor!r}$"):
            load_plan(descriptor)


@pytest.mark.parametrize("args,match", [
    ((4224, 7168, 0, T(32, 8, 256, 11, 1)), "M must be a positive integer, got 0$"),
    ((4224, 7168, 33, "cublas"), r"M must be in 1\.\.32, got 33$"),
    ((4224, 7168, "1", "cublas"), "M must be a positive integer, got '1'$"),
    ((0, 7168, 1, "cublas"), "N must be a positive integer, got 0$"),
    ((4224, 7168.0, 1, "cublas"), "K must be a positive integer, got 7168.0$"),
    ((4224, 7168, 1, "cublas", 0.0), "'us' must be .* got 0.0$"),
    ((4224, 7168, 1, "cublas", float("nan")), "'us' must be .* got nan$"),
])
def test_set_refuses_what_the_file_could_not_hold(args, match):
    plan = DecodePlan()
    with pytest.raises(ValueError, match=match):
        plan.set(*args)
    assert plan.entries == {}


def test_every_plan_argument_is_a_plan_none_or_auto():
    from warpsplitk.planning.plans import check_plan, prepare, resolve_plan
    plan = small_plan()
    assert check_plan(plan) is plan and check_plan(None) is None and check_plan("auto") == "auto"
    assert resolve_plan(plan, [(4224, 7168)]) is plan
    assert resolve_plan("auto", []) is None  # nothing the kernel takes: nothing to tune
    for bad in ("h200", "bogus", {}, 123, plan.to_json()):
        with pytest.raises(ValueError, match=r"plan must be a DecodePlan, None or 'auto', got "):
            check_plan(bad)
    import torch
    weight = torch.zeros(256, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto', got 'h200'$"):
        prepare(weight, "h200")
    for bad, given in ((None, "NoneType"), (torch.zeros(1024), r"shape \(1024,\)"),
                       (torch.zeros(2, 16, 128), r"shape \(2, 16, 128\)")):
        with pytest.raises(ValueError, match=rf"^weight must be a 2-D torch\.Tensor \[N, K\], "
                                             rf"got {given}$"):
            prepare(bad)
    # a CPU weight with plan="auto": refused for its device, with nothing tuned
    with pytest.raises(ValueError, match="weight must be on a CUDA device, got cpu"):
        prepare(weight, "auto")


def test_prepare_and_prepare_model_refuse_bad_ms_and_weights_by_name():
    import numpy as np
    import torch

    from warpsplitk.planning.plans import prepare, prepare_model
    weight = torch.zeros(256, 1024, dtype=torch.bfloat16)
    # as DecodeLinear and patch_model word them (check_ms)
    for call in (lambda ms: prepare(weight, None, ms=ms),
                 lambda ms: prepare_model({"w": weight}, ms=ms, progress=None)):
        with pytest.raises(ValueError, match=r"^ms must be an iterable of Ms in 1\.\.32, got 8$"):
            call(8)
        with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got 0$"):
            call([0, 8])
        with pytest.raises(ValueError, match=r"^ms must name at least one M in 1\.\.32, got \[\]$"):
            call([])
    with pytest.raises(ValueError, match=r"^bias must be None or a torch\.Tensor \[N\], got list$"):
        prepare(weight, bias=[0.0] * 256)
    with pytest.raises(ValueError, match=r"^weights must be a mapping \{name: torch\.Tensor\}, "
                                         r"got list$"):
        prepare_model([weight], progress=None)
    for bad, given in ((np.zeros((256, 1024)), "ndarray"), (torch.zeros(256), r"shape \(256,\)")):
        with pytest.raises(ValueError, match=r"^weights\['a'\] must be a 2-D torch\.Tensor "
                                             rf"\[N, K\], got {given}$"):
            prepare_model({"a": bad}, progress=None)


def test_plan_entries_of_any_integer_type_are_ints():
    import numpy as np
    plan = DecodePlan()
    plan.set(np.int64(4224), np.int64(7168), np.int32(1), T(32, 8, 256, 11, 1), 13.7)
    assert plan.entries == {(4224, 7168): {1: (T(32, 8, 256, 11, 1), 13.7)}}
    (shape, by_m), = plan.entries.items()
    assert all(type(v) is int for v in (*shape, *by_m))
    json.dumps(plan.to_json())  # NumPy integers would not serialise


def test_the_warned_shapes_are_no_constructor_argument():
    import inspect
    assert list(inspect.signature(DecodePlan).parameters) == ["meta", "entries"]
    with pytest.raises(TypeError):
        DecodePlan(_warned=set())
    assert "_warned" not in repr(DecodePlan())


def test_lookup_and_fallback_warns_once_per_shape():
    plan = small_plan()
    assert plan.lookup(4224, 7168, 1) == T(32, 8, 256, 11, 1)
    assert plan.lookup(4224, 7168, 3) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [plan.tactic_for(2048, 2048, m, sm_count=132) for m in (1, 2, 3)]
        plan.tactic_for(4224, 7168, 1)  # a hit: no warning
    assert got == [default_tactic(m, 2048, 2048, 132) for m in (1, 2, 3)]
    assert len(caught) == 1 and "N=2048, K=2048" in str(caught[0].message)
    # an empty plan is no plan: the default is what was asked for, nothing to say
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert DecodePlan().tactic_for(2048, 2048, 1, sm_count=132) == got[0]
    assert caught == []


def test_set_refuses_illegal_tactic():
    with pytest.raises(ValueError, match="N must be a positive multiple of output_tile 16, "
                                         "got N=100"):
        DecodePlan().set(100, 128, 1, T(16, 8, 128, 1, 1))


def test_builtin_plan_is_valid_and_measured():
    plan = builtin_plan("h200")
    assert plan.meta["gpu"] == "NVIDIA H200"
    assert plan.entries
    for (n, k), by_m in plan.entries.items():
        assert sorted(by_m) == list(range(1, 33)), (n, k)
        for m, (tactic, us) in by_m.items():
            check_tactic(tactic, n, k)
            if m in plan.meta["representative_ms"]:
                assert us is not None and us > 0
    table = {(s["n"], s["k"]) for s in shapes.load()["shapes"]}
    assert set(plan.entries) <= table


def test_plan_from_json_source_in_message():
    with pytest.raises(ValueError, match="^mine: "):
        plan_from_json({"format": "x"}, "mine")


# ----------------------------------------------------------------- pruning


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
                                    (1,) if t.token_tile == 8 or t.bulk_x else (2,))
    # bulk activation copies at M = 1 only, every candidate family also so;
    # the L2 prefetch is never a candidate of its own (prefetch_twins)
    bulk = [t for t in found if t.bulk_x]
    assert bool(bulk) == (m == 1)
    assert not any(t.l2_prefetch for t in found
                   if dataclasses.replace(t, early_launch=False) != late_default)
    assert [t for t in found if not t.bulk_x] == candidates(m, n, k, 132, bulk_xs=(False,))
    assert set(found) - {late_default, dataclasses.replace(default, early_launch=True)} <= {
        dataclasses.replace(t, early_launch=e) for t in base_candidates(m, n, k, 132)
        for e in (False, True)}


# ------------------------------------------------------------ plan view


def test_plan_view_without_gpu(capsys):
    from warpsplitk.cli import main
    assert main(["plan", "--no-compile", "--m", "1,32"]) == 0
    out = capsys.readouterr().out
    assert "built-in H200 plan" in out
    lines = [line for line in out.splitlines()[2:] if line.strip()]
    assert len(lines) == 2 * len(shapes.load()["shapes"])
    # the plan's own tactic shows for a tuned shape, with the time the tuner measured
    row = next(line for line in lines if " 4224  7168   1 " in line).split()
    tactic, measured = builtin_plan("h200").entries[(4224, 7168)][1]
    assert tactic.short() in row
    assert float(row[-2]) == pytest.approx(measured, abs=0.005)
    floor = 4224 * 7168 * 2 / 4.8e6
    assert int(row[-1]) == round(100 * floor / measured)


def test_plan_view_takes_shapes_as_bench_and_tune_do(tmp_path, capsys):
    """`warpsplitk plan --shapes` takes N,K pairs and .json tables, mixed,
    as `bench` and `tune` do; a table's rows keep their names."""
    from warpsplitk.cli import main
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"shapes": [{"n": 256, "k": 1024, "model": "x", "projection": "y"}]}))
    assert main(["plan", "--no-compile", "--shapes", "4224,7168", str(table), "--m", "1,8"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [tuple(r[-14:-11]) for r in rows] == [("4224", "7168", "1"), ("4224", "7168", "8"),
                                                 ("256", "1024", "1"), ("256", "1024", "8")]
    assert rows[2][:2] == ["x", "y"]
    assert main(["plan", "--no-compile", "--shapes", "4224x7168"]) == 2
    assert "a shape is 'N,K' or a .json table, got '4224x7168'" in capsys.readouterr().err


def test_plan_view_compiles_registers(tmp_path, capsys):
    from warpsplitk.cli import main
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"shapes": [{"n": 256, "k": 1024, "model": "x", "projection": "y"}]}))
    assert main(["plan", "--plan", "none", "--shapes", str(table), "--m", "8"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    tactic = default_tactic(8, 256, 1024, 132)
    assert tactic.short() in row
    regs = int(row[-5])
    assert 16 <= regs <= 255
    from warpsplitk.tactics import l2_read_factor
    assert float(row[-4]) == pytest.approx(l2_read_factor(tactic, 8), abs=0.005)
    assert row[-2:] == ["-", "-"]  # no plan: nothing measured


def test_choose_tactics_reuses_within_tolerance():
    from warpsplitk.planning.tune import choose_tactics
    a, b, c = T(16, 8, 256, 9, 1), T(32, 8, 256, 11, 1), T(32, 32, 256, 6, 2)
    times = {32: {c: 15.6, a: 18.0}, 8: {a: 14.0, b: 13.8, c: 14.05}, 1: {a: 13.9, b: 13.7}}
    picks = choose_tactics(times, tolerance=0.02)
    assert picks[32] == (c, 15.6)
    assert picks[8] == (c, 14.05)      # c is within 2% of b's 13.8: reused
    assert picks[1] == (b, 13.7)       # c not measured at M=1: the fastest
    strict = choose_tactics(times, tolerance=0.0)
    assert strict[8] == (b, 13.8)


def test_choose_tactics_takes_the_early_trigger_only_when_clearly_faster():
    from warpsplitk.planning.tune import choose_tactics
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
    from warpsplitk.planning.tune import choose_tactics
    uniform = T(32, 32, 128, 3, 1, early_launch=True, tma_x=True)
    late = dataclasses.replace(uniform, early_launch=False)
    mixed = T(64, 32, 128, 3, 1, tma_x=True, half_tiles=40)
    # 1.4% faster than the early uniform grid (7168x384 M = 32): the
    # uniform one stays, and as the early trigger beats the late uniform grid
    # clearly, it is the early one
    assert choose_tactics({32: {mixed: 2.694, uniform: 2.733, late: 2.86}})[32] == (uniform, 2.733)
    # 10% faster: the mixed grid wins
    assert choose_tactics({32: {mixed: 9.14, uniform: 10.0, late: 10.1}})[32] == (mixed, 9.14)
    assert choose_tactics({32: {mixed: 9.14}})[32] == (mixed, 9.14)


def test_choose_tactics_never_picks_outside_tolerance():
    import random

    from warpsplitk.planning.tune import choose_tactics
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
    from warpsplitk.planning.tune import KERNEL_REVISION
    with open(path, "w") as f:
        for n, k, m, tactic, us in records:
            rec = {"key": f"{n},{k},{m},{tactic}", "n": n, "k": k, "m": m, "tactic": tactic}
            if WarpSplitKTactic.parse(tactic).k_split > 1:
                rec["rev"] = KERNEL_REVISION
            rec.update({"ok": True, "us": us} if us is not None else
                       {"ok": False, "error": "relative error 0.5"})
            f.write(json.dumps(rec) + "\n")


def test_plan_from_log_makes_the_tuners_choices(tmp_path):
    from warpsplitk.planning.tune import plan_from_log
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

    from warpsplitk.planning.tune import plan_from_log
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


def test_plan_from_log_counts_confirmations_with_the_median(tmp_path):
    from warpsplitk.planning.tune import plan_from_log
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
    from warpsplitk.planning.tune import CONFIRM_ROUNDS, _cell_times, _confirm_candidates, _confirm_key
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
    assert _cell_times(cell) == {a: 5.0, b: 4.2, c: 3.0}
    assert _cell_times({a: [1.24, 1.48, 1.47], b: []}) == {a: 1.47}
    assert _confirm_key(1, 2, 8, c) == "confirm:1,2,8,32,8,256,4,1+early"
    assert _confirm_key(1, 2, 8, c, 2) == "confirm2:1,2,8,32,8,256,4,1+early"
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
    assert twins == [WarpSplitKTactic(32, 8, 256, s, 1, l2_prefetch=True) for s in (4, 6)]
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
    from warpsplitk.planning.space import BOUNDED_PREFETCH_DEPTHS, BOUNDED_PREFETCH_TOP, bounded_prefetch_twins
    n, k = 4224, 2048  # 8 K tiles of 256
    a, b = WarpSplitKTactic(32, 8, 256, 3, 1, early_launch=True), WarpSplitKTactic(32, 8, 256, 6, 1)
    times = {a: 13.0, b: 13.1, WarpSplitKTactic(32, 8, 256, 2, 1): 14.0,
             WarpSplitKTactic(32, 8, 256, 4, 1, l2_prefetch=True): 12.0}  # a prefetch: no parent
    assert BOUNDED_PREFETCH_TOP == 2 and BOUNDED_PREFETCH_DEPTHS == (1, 2, 3, 4)
    twins = bounded_prefetch_twins(times, n, k)
    # b's ring (6 of 8 tiles) leaves room for one tile past it
    assert twins == [dataclasses.replace(a, l2_prefetch=True, prefetch_tiles=p) for p in (1, 2, 3, 4)] + \
        [dataclasses.replace(b, l2_prefetch=True, prefetch_tiles=1)]
    times[twins[0]] = 12.5  # measured: not again, and not a parent
    assert bounded_prefetch_twins(times, n, k) == twins[1:]


def test_tma_twins_of_the_fastest():
    from warpsplitk.planning.space import TMA_TOP, tma_twins
    n, k = 4224, 7168
    times = {WarpSplitKTactic(16, 32, 256, s, 2): 15.0 + s / 10 for s in (2, 3, 4, 5)}
    times[WarpSplitKTactic(32, 32, 256, 4, 1, tma_x=True)] = 1.0  # boxes already: never a source
    twins = tma_twins(times, n, k)
    assert twins == [WarpSplitKTactic(16, 32, 256, s, 1, tma_x=True) for s in (2, 3, 4)]
    assert TMA_TOP == 3
    # bulk copies become boxes; a K split keeps its split; one activation warp
    small = {WarpSplitKTactic(32, 8, 256, 8, 1, bulk_x=True): 2.0,
             WarpSplitKTactic(32, 8, 256, 4, 2, 2): 2.1}
    assert tma_twins(small, 2048, 2048) == [WarpSplitKTactic(32, 8, 256, 8, 1, tma_x=True),
                                            WarpSplitKTactic(32, 8, 256, 4, 1, 2, tma_x=True)]
    # measured twins are not measured again, nor twins of twins
    times.update({t: 14.0 for t in twins[:2]})
    assert tma_twins(times, n, k) == [twins[2]]
    # illegal twins are left out: a narrow token tile takes no TMA boxes
    assert tma_twins({WarpSplitKTactic(16, 1, 256, 12, 1, bulk_x=True): 7.0}, 2112, 7168) == []


def test_mixed_twins_balance_uneven_grids_only():
    from warpsplitk.planning.space import balanced_half_tiles, mixed_twins
    assert balanced_half_tiles(3216, 32, 132) == 63      # 69 x 32 + 63 x 16
    assert balanced_half_tiles(3216, 64, 132) is None    # 100.5 64-row tiles
    assert balanced_half_tiles(2048, 32, 132) is None    # 128 tiles: no half tile fits
    # 201 CTAs of 16 rows on 132 SMs: 69 SMs with two -> one mixed grid of
    # 132, with 16-byte activation copies as the parent and with TMA boxes
    times = {WarpSplitKTactic(16, 32, 256, 4, 2): 14.6}
    twins = mixed_twins(times, 3216, 7168, 32)
    assert [(t.output_tile, t.half_tiles, t.tma_x, t.b_loader_warps) for t in twins] == [
        (32, 63, False, 2), (32, 63, True, 1)]
    assert all(is_legal(t, 3216, 7168) and grid_ctas(t, 32, 3216) == 132 for t in twins)
    # the deepest ring one CTA per SM holds (here the one over the reduction buffer)
    assert twins[0].stages == 7
    for t in twins:
        deeper = dataclasses.replace(t, stages=t.stages + 1)
        assert ctas_per_sm(t) == 1
        assert not is_legal(deeper, 3216, 7168) or ctas_per_sm(deeper) == 0
    # a TMA parent has one twin, itself with TMA boxes
    boxes = {WarpSplitKTactic(16, 32, 256, 4, 1, tma_x=True): 13.9}
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
    times = {parent: 7.4, WarpSplitKTactic(32, 8, 256, 10, 2, 2, tma_x=False): 7.5,
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
    boxes = {WarpSplitKTactic(32, 8, 256, 11, 1, tma_x=True, early_launch=True): 13.3}
    twin = narrow_twins(boxes, 4224, 7168, 4)[0]
    assert not twin.tma_x and twin.early_launch and twin.token_tile == 4
    assert not any(t.tma_x for t in narrow_twins(boxes, 4224, 7168, 4))
    # a bulk parent's twins: by 16 bytes and by bulk rows, each at both depths
    bulk = {WarpSplitKTactic(16, 8, 256, 16, 1, bulk_x=True): 7.4}
    bulk_twins = narrow_twins(bulk, n, k, 1)
    assert {t.bulk_x for t in bulk_twins} == {False, True}
    assert all(is_legal(t, n, k) and t.token_tile == 1 for t in bulk_twins)
    by_rows = [t for t in bulk_twins if t.bulk_x]
    assert len(by_rows) == 2 and {ctas_per_sm(t) for t in by_rows} == {1, 2}
    # measured twins are not proposed again
    assert narrow_twins({**times, **dict.fromkeys(twins, 7.0)}, n, k, 1) == []


def test_plan_from_log_lets_an_unmeasured_inner_m_inherit(tmp_path):
    """A log from before M = 4 was measured (or a shape whose M = 4 cell
    failed): M 2-4 take the M = 8 winner, as they did then, and the plan
    says so; a shape missing its largest M is still left out."""
    from warpsplitk.planning.tune import plan_from_log
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
    (and rings past 16 stages) unless told not to, and never the retired
    split of K in four, however fast it was."""
    from warpsplitk.planning.tune import in_default_space, plan_from_log
    wide, narrow, deep, four = ("32,8,256,4,1", "32,1,256,13,1", "16,8,256,18,1",
                                "32,8,256,4,1,4")
    assert in_default_space(WarpSplitKTactic.parse(wide))
    assert in_default_space(WarpSplitKTactic.parse(wide), narrow=False)
    assert in_default_space(WarpSplitKTactic.parse(narrow))
    assert not in_default_space(WarpSplitKTactic.parse(narrow), narrow=False)
    assert in_default_space(WarpSplitKTactic.parse(deep))
    assert not in_default_space(WarpSplitKTactic.parse(deep), narrow=False)
    assert not in_default_space(WarpSplitKTactic.parse(four))
    assert not in_default_space(WarpSplitKTactic.parse(four), narrow=False)
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
    from warpsplitk.planning.tune import plan_from_log
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
    from warpsplitk.planning.tune import (ASYNC_RING_REVISION, _read_log, is_stale, plan_from_log,
                                 stale_records)
    plain, tma, bulk = "16,8,256,4,1", "16,8,256,4,1+tma", "16,8,256,4,1+bulk"
    assert not is_stale({"tactic": plain})
    assert is_stale({"tactic": tma}) and is_stale({"tactic": bulk, "rev": 1})
    assert not is_stale({"tactic": tma, "rev": ASYNC_RING_REVISION})
    # a K split's kernel changed at revision 3 (the mbarrier hand-over)
    split = "32,8,256,4,1,2"
    assert is_stale({"tactic": split, "rev": 2}) and not is_stale({"tactic": split, "rev": 3})
    assert not is_stale({"tactic": split, "rev": 2}, revision=2)
    assert is_stale({"tactic": split + "+tma", "rev": 1}, revision=2)
    log = tmp_path / "log.jsonl"
    _log(log, [(1024, 4096, r, plain, 5.0) for r in REPRESENTATIVE_MS]
         + [(1024, 4096, r, tma, 4.0) for r in REPRESENTATIVE_MS])
    assert stale_records(str(log)) == len(REPRESENTATIVE_MS)
    assert len(_read_log(str(log))) == len(REPRESENTATIVE_MS)
    assert len(_read_log(str(log), stale=True)) == 2 * len(REPRESENTATIVE_MS)

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
    assert _read_log(str(log))[f"1024,4096,1,{tma}"]["us"] == 5.5
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
    from warpsplitk.planning.tune import dominated_stale_keys
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


def test_log_records_of_retired_builds_and_tactics_never_count(tmp_path):
    """Records of an experimental build (stamped ``variant`` by versions that
    built them) and of tactics this version no longer parses (a seventh
    comma field: the retired activation multicast) are skipped by
    ``_read_log`` and so by plans and resumes, however fast they were; a new
    record carries the kernel revision and no ``variant``."""
    from warpsplitk.planning.tune import KERNEL_REVISION, _read_log, _record, plan_from_log
    fresh = _record(key="a")
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
    logged = _read_log(str(log))
    assert sorted(logged) == sorted(f"1024,4096,{r},{split}" for r in REPRESENTATIVE_MS)
    assert logged[f"1024,4096,1,{split}"]["us"] == 5.0
    assert len(_read_log(str(log), stale=True)) == len(REPRESENTATIVE_MS)
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


def test_plan_data_built_in_python_may_key_m_by_int():
    data = small_plan().to_json()
    data["shapes"][0]["entries"] = {int(m): e for m, e in data["shapes"][0]["entries"].items()}
    assert plan_from_json(data).entries == small_plan().entries
    data["shapes"][0]["entries"][1.0] = {"tactic": "cublas"}
    with pytest.raises(ValueError, match=r"M must be an integer in 1\.\.32, got 1\.0$"):
        plan_from_json(data)
