"""Decode plans (planning/decode_plan.py, through planning/plans.py): file round
trip, validation, lookup and fallback, prepare's refusals, the plan view."""

import dataclasses
import json
import warnings
from importlib import resources

import pytest

from warpsplitk import shapes
from warpsplitk.planning.plans import (
    FP8_PLAN_VERSION,
    PLAN_FORMAT,
    PLAN_VERSION,
    DecodePlan,
    builtin_plan,
    load_plan,
    plan_from_json,
)
from warpsplitk.planning.choose import default_tactic
from warpsplitk.tactics import WarpSplitKTactic, check_tactic


T = WarpSplitKTactic


def small_plan():
    plan = DecodePlan(meta={"gpu": "test"})
    plan.set(4224, 7168, 1, T(32, 8, 256, 11, 1), 13.7)
    plan.set(4224, 7168, 2, T(32, 8, 256, 11, 1))
    plan.set(768, 128, 32, T(16, 32, 128, 1, 2), 1.45)
    return plan


def saved_and_loaded(plan, tmp_path):
    """``plan`` saved to a file and loaded back, and the file's JSON."""
    path = tmp_path / "plan.json"
    plan.save(path)
    return load_plan(path), json.loads(path.read_text())


def test_round_trip(tmp_path):
    plan = small_plan()
    loaded, data = saved_and_loaded(plan, tmp_path)
    assert loaded.entries == plan.entries
    assert loaded.meta == plan.meta
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
    assert list(inspect.signature(DecodePlan).parameters) == ["meta", "entries", "fp8_entries"]
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


def test_plan_view_without_gpu(capsys):
    from warpsplitk.cli import main
    assert main(["plan", "--no-compile", "--m", "1,32"]) == 0
    out = capsys.readouterr().out
    assert "built-in H200 plan" in out
    lines = [line for line in out.splitlines()[3:] if line.strip() and not line.startswith("#")]
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
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]
            if not line.startswith("#")]
    assert [tuple(r[-15:-12]) for r in rows] == [("4224", "7168", "1"), ("4224", "7168", "8"),
                                                 ("256", "1024", "1"), ("256", "1024", "8")]
    assert rows[2][:2] == ["x", "y"]
    assert main(["plan", "--no-compile", "--shapes", "4224x7168"]) == 2
    assert "a shape is 'N,K' or a .json table, got '4224x7168'" in capsys.readouterr().err


def test_plan_view_compiles_registers(tmp_path, capsys):
    from warpsplitk.cli import main
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"shapes": [{"n": 256, "k": 1024, "model": "x", "projection": "y"}]}))
    assert main(["plan", "--plan", "none", "--shapes", str(table), "--m", "8"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line[0] != "#"][-1].split()
    tactic = default_tactic(8, 256, 1024, 132)
    assert tactic.short() in row
    regs, local = int(row[-6]), int(row[-5])  # and the local frame, compiled
    assert 16 <= regs <= 255 and local >= 0
    from warpsplitk.tactics import l2_read_factor
    assert float(row[-4]) == pytest.approx(l2_read_factor(tactic, 8), abs=0.005)
    assert row[-2:] == ["-", "-"]  # no plan: nothing measured


def test_plan_data_built_in_python_may_key_m_by_int():
    data = small_plan().to_json()
    data["shapes"][0]["entries"] = {int(m): e for m, e in data["shapes"][0]["entries"].items()}
    assert plan_from_json(data).entries == small_plan().entries
    data["shapes"][0]["entries"][1.0] = {"tactic": "cublas"}
    with pytest.raises(ValueError, match=r"M must be an integer in 1\.\.32, got 1\.0$"):
        plan_from_json(data)


def test_a_plan_prints_in_one_short_line():
    plan = builtin_plan("h200")
    text = repr(plan)
    assert text.startswith("DecodePlan(") and len(text) < 200 and "NVIDIA H200" in text
    assert repr(DecodePlan()) == "DecodePlan(0 shapes, 0 entries)"


def test_prepare_refuses_a_cpu_weight_before_reading_the_plan():
    """The device error comes first: no plan-entry warning for a weight
    that cannot run anyway."""
    import warnings
    torch = pytest.importorskip("torch")
    from warpsplitk.planning.plans import prepare
    weight = torch.randn(256, 1024, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan warning would fail here
        with pytest.raises(ValueError, match="^weight must be on a CUDA device, got cpu$"):
            prepare(weight, DecodePlan(entries={(512, 512): {}}), ms=[1])


# ------------------------------------------------------------- FP8 entries

def fp8_plan():
    """``small_plan`` with FP8 entries for channel and block scales: tactics
    other than the FP8 default."""
    plan = small_plan()
    for m in (1, 8):
        default = default_tactic(m, 4224, 7168, 132, fp8=True, fp8_scales="block128")
        plan.set(4224, 7168, m, dataclasses.replace(default, early_launch=True), 9.5,
                 fp8_scales="block128")
    plan.set(768, 128, 32, T(16, 32, 128, 1, 2), None, fp8_scales="channel")
    return plan


def test_fp8_entries_round_trip_as_version_2(tmp_path):
    plan = fp8_plan()
    loaded, data = saved_and_loaded(plan, tmp_path)
    assert loaded == plan and loaded.fp8_entries == plan.fp8_entries
    assert loaded.entries == small_plan().entries  # the BF16 entries as they were
    assert data["version"] == FP8_PLAN_VERSION == 2
    assert data["shapes"] == small_plan().to_json()["shapes"]
    assert {kind: [(s["n"], s["k"], sorted(s["entries"])) for s in shapes]
            for kind, shapes in data["fp8"].items()} == {
        "channel": [(768, 128, ["32"])], "block128": [(4224, 7168, ["1", "8"])]}
    assert "2 FP8 shapes, 3 FP8 entries" in repr(loaded) and "FP8" not in repr(small_plan())


def test_a_plan_without_fp8_entries_stays_version_1(tmp_path):
    data = small_plan().to_json()
    assert data["version"] == PLAN_VERSION == 1 and "fp8" not in data
    # the shipped plan: read and written back byte for byte
    shipped = resources.files("warpsplitk").joinpath("data/plan-h200.json")
    builtin_plan("h200").save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == shipped.read_bytes()
    # a version 2 file without FP8 entries reads too (and writes as version 1)
    data["version"] = 2
    assert plan_from_json(data) == small_plan()
    data["fp8"] = {"tensor": []}
    assert plan_from_json(data).to_json()["version"] == 1


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(version=3), r"^plan: plan version 3, this warpsplitk reads versions 1 "
                                    r"\(BF16 entries\) and 2 \(BF16 and FP8 entries\)$"),
    (lambda d: d.update(version=1), r"a version 1 plan holds BF16 entries only; an 'fp8' "
                                    r"section needs version 2$"),
    (lambda d: d.update(fp8=[]), r"a plan's 'fp8' section maps each scale kind to a list of "
                                 r"shapes, got \[\]"),
    (lambda d: d["fp8"].update(channel={}), r"maps each scale kind to a list of shapes"),
    (lambda d: d["fp8"].update(block=[]), r"the 'fp8' section's keys are scale kinds \('tensor', "
                                          r"'channel', 'block128'\), got 'block'$"),
    (lambda d: d["fp8"]["channel"][0].pop("k"), r"fp8 channel shapes\[0\] needs 'n', 'k' and "
                                                r"'entries'"),
    # checked as FP8 entries: the FP8 kernel's rules, and no cuBLAS
    (lambda d: d["fp8"]["channel"][0]["entries"].update({"8": {"tactic": "16,8,128,1,1+tma"}}),
     r"FP8 \(channel scales\) N=768 K=128 M=8: warp split-K tactic: FP8 weights take x_copy "
     r"'cp\.async', got 'tma'"),
    (lambda d: d["fp8"]["channel"][0]["entries"].update({"8": {"tactic": "cublas"}}),
     r"\(channel scales\) N=768 K=128 M=8: an FP8 entry must be a tactic, got 'cublas'"),
    (lambda d: d["fp8"]["channel"][0]["entries"]["32"].update(us=-1), "FP8 .* 'us' must be"),
    (lambda d: d["fp8"]["channel"].append(dict(d["fp8"]["channel"][0])),
     r"\(channel scales\) N=768 K=128 M=32: a second entry"),
])
def test_bad_fp8_sections_name_the_entry(mutate, match):
    data = fp8_plan().to_json()
    mutate(data)
    with pytest.raises(ValueError, match=match):
        plan_from_json(data)


def test_fp8_entries_are_apart_from_the_bf16_ones_and_by_scale_kind():
    plan = fp8_plan()
    assert plan.lookup(768, 128, 32) == T(16, 32, 128, 1, 2)  # both hold it: each its own
    assert plan.lookup(768, 128, 32, fp8_scales="channel") == T(16, 32, 128, 1, 2)
    assert plan.lookup(768, 128, 32, fp8_scales="tensor") is None
    assert plan.lookup(4224, 7168, 8) is None
    assert plan.lookup(4224, 7168, 8, fp8_scales="block128").early_launch
    assert plan.lookup(4224, 7168, 8, fp8_scales="channel") is None
    with pytest.raises(ValueError, match="an FP8 entry must be a tactic, got 'cublas'"):
        plan.set(768, 128, 1, "cublas", fp8_scales="tensor")
    with pytest.raises(ValueError, match="FP8 weights take x_copy 'cp.async', got 'bulk'"):
        plan.set(768, 128, 1, T(16, 1, 128, 1, 1, x_copy="bulk"), fp8_scales="tensor")
    plan.set(768, 128, 1, T(16, 1, 128, 1, 1, x_copy="bulk"))  # a BF16 entry takes it
    with pytest.raises(ValueError, match=r"decode plan FP8 \(tensor scales\) entry: M must be in "
                                         r"1\.\.32, got 33"):
        plan.set(768, 128, 33, T(16, 32, 128, 1, 2), fp8_scales="tensor")
    for call in (lambda: plan.set(768, 128, 1, T(16, 32, 128, 1, 2), fp8_scales="row"),
                 lambda: plan.lookup(768, 128, 1, fp8_scales=True)):
        with pytest.raises(ValueError, match=r"fp8_scales must be None \(BF16 weights\) or one "
                                             r"of \('tensor', 'channel', 'block128'\), got "):
            call()
    assert "tensor" not in plan.fp8_entries  # nothing refused was kept


def test_fp8_lookups_fall_back_to_the_fp8_default_said_once():
    plan = fp8_plan()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = plan.tactic_for(4224, 7168, 1, 132, fp8_scales="block128")
        got = [plan.tactic_for(2048, 2048, m, 132, fp8_scales="block128") for m in (1, 32)]
        plan.tactic_for(4224, 7168, 2, 132, fp8_scales="block128")
    assert hit == plan.lookup(4224, 7168, 1, fp8_scales="block128")
    assert got == [default_tactic(m, 2048, 2048, 132, fp8=True, fp8_scales="block128")
                   for m in (1, 32)]
    assert [str(w.message) for w in caught] == [
        "decode plan has no FP8 (block128 scales) entry for N=2048, K=2048: using the FP8 "
        "default (default_tactic(..., fp8=True))",
        "decode plan has no FP8 (block128 scales) entry for M=2 for N=4224, K=7168: using the "
        "FP8 default (default_tactic(..., fp8=True))"]
    # no entries for these scales: no plan for them; the default, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.tactic_for(4224, 7168, 1, 132, fp8_scales="tensor") == default_tactic(
            1, 4224, 7168, 132, fp8=True, fp8_scales="tensor")


def test_merge_takes_the_other_plans_entries_of_every_kind():
    plan = small_plan()
    plan.merge(fp8_plan())
    assert plan == fp8_plan()
    other = DecodePlan()
    other.set(768, 128, 32, T(16, 32, 128, 1, 1), fp8_scales="channel")
    plan.merge(other)
    assert plan.lookup(768, 128, 32, fp8_scales="channel") == T(16, 32, 128, 1, 1)
    assert plan.lookup(768, 128, 32) == T(16, 32, 128, 1, 2)


def test_plan_view_says_where_a_plan_with_fp8_entries_shows_them(tmp_path, capsys):
    from warpsplitk.cli import main
    path = tmp_path / "plan.json"
    fp8_plan().save(path)
    argv = ["plan", "--no-compile", "--shapes", "4224,7168", "--m", "1", "--plan"]
    assert main(argv + [str(path)]) == 0
    out = capsys.readouterr().out
    assert "BF16 weights: the plan's FP8 entries (2 shapes) show with --dtype fp8" in out
    row = next(line for line in out.splitlines() if " 4224  7168   1 " in line)
    assert small_plan().lookup(4224, 7168, 1).short() in row.split()
    small_plan().save(path)
    assert main(argv + [str(path)]) == 0
    assert "FP8" not in capsys.readouterr().out
