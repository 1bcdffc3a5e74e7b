"""plan="auto": per-GPU plans in the cache folder, tuned once (CPU, the tuner stubbed)."""

import json
import multiprocessing

import pytest
import torch

from warpsplitk.planning import plan_cache, tune
from warpsplitk.cli import main
from warpsplitk.planning.plans import DecodePlan, builtin_plan, prepare_model
from warpsplitk.tactics import WarpSplitKTactic, default_tactic

H200 = ("NVIDIA H200", 132)
OTHER = ("NVIDIA H100 80GB HBM3", 132)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def tuner(monkeypatch):
    """A stand-in for tune.tune: the default tactic for every M, and a record of its calls."""
    calls = []

    def fake_tune(shapes, ms, **kwargs):
        calls.append((list(shapes), tuple(ms), kwargs))
        plan = DecodePlan(meta={"tuned": True})
        for n, k in shapes:
            for m in ms:
                plan.set(n, k, m, default_tactic(m, n, k, 132), 1.0)
        return plan

    monkeypatch.setattr(tune, "tune", fake_tune)
    return calls


def test_gpu_key_names_the_model_and_its_sms():
    assert plan_cache.gpu_key("NVIDIA H200", 132) == "nvidia-h200-132sm"
    assert plan_cache.gpu_key("NVIDIA H100 80GB HBM3", 114) == "nvidia-h100-80gb-hbm3-114sm"


def test_auto_tunes_once_and_the_next_process_reads_the_file(cache, tuner, capsys):
    lines = []
    plan = plan_cache.auto_plan([(4096, 4096), (4096, 4096), (2880, 2880)], (1, 8),
                                gpu=OTHER, progress=lines.append)
    # one shape tuned: the duplicate counted once, K = 2880 left to cuBLAS
    assert [c[0] for c in tuner] == [[(4096, 4096)]] and tuner[0][1] == (1, 8)
    assert tuner[0][2]["log_path"].endswith("nvidia-h100-80gb-hbm3-132sm-log.jsonl")
    assert plan.lookup(4096, 4096, 8) == default_tactic(8, 4096, 4096, 132)
    assert any("tuning 1 shape(s)" in line for line in lines)
    path = plan_cache.plan_path("nvidia-h100-80gb-hbm3-132sm")
    assert json.loads(path.read_text())["shapes"][0]["n"] == 4096
    # the next call (process) tunes nothing
    again = plan_cache.auto_plan([(4096, 4096)], (1, 8), gpu=OTHER, progress=lines.append)
    assert len(tuner) == 1 and again.lookup(4096, 4096, 1) == plan.lookup(4096, 4096, 1)
    # a new M of a known shape is tuned
    plan_cache.auto_plan([(4096, 4096)], (1, 8, 32), gpu=OTHER, progress=None)
    assert len(tuner) == 2 and tuner[1][0] == [(4096, 4096)]
    # quiet: the tuner gets a progress it can call, which prints nothing
    capsys.readouterr()
    assert tuner[1][2]["progress"]("line") is None
    assert capsys.readouterr() == ("", "")


def test_the_builtin_plan_covers_its_own_gpu(cache, tuner):
    shipped = builtin_plan("h200")
    n, k = next(iter(shipped.entries))
    plan = plan_cache.auto_plan([(n, k)], range(1, 33), gpu=H200, progress=None)
    assert tuner == [] and plan.lookup(n, k, 5) == shipped.lookup(n, k, 5)
    plan_cache.auto_plan([(n, k)], range(1, 33), gpu=OTHER, progress=None)
    assert len(tuner) == 1  # another GPU model has no built-in plan


def test_store_merges_and_keeps_other_shapes(cache):
    key = plan_cache.gpu_key(*OTHER)
    first, second = DecodePlan(), DecodePlan()
    first.set(256, 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 2.0)
    second.set(512, 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 3.0)
    second.set(256, 512, 8, WarpSplitKTactic(16, 8, 128, 2, 2), 2.5)
    plan_cache.store(key, first)
    plan_cache.store(key, second)
    merged = plan_cache.load(key)
    assert sorted(merged.entries) == [(256, 512), (512, 512)]
    assert sorted(merged.entries[(256, 512)]) == [1, 8]
    assert not list(plan_cache.plan_dir().glob("*.tmp"))


def _store_one(args):
    folder, n = args
    import os
    os.environ["WARPSPLITK_CACHE_DIR"] = folder
    plan = DecodePlan()
    plan.set(n, 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 1.0)
    plan_cache.store("gpu-1sm", plan)


def test_concurrent_writers_lose_nothing(cache):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_store_one, [(str(cache), 16 * (i + 1)) for i in range(12)])
    assert len(plan_cache.load("gpu-1sm").entries) == 12


def test_off_cache_tunes_without_keeping(cache, tuner, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "0")
    plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    assert len(tuner) == 2 and tuner[0][2]["log_path"] is None and not cache.exists()


def test_auto_refuses_inside_a_graph_capture(cache, tuner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="prepare before capturing a CUDA graph"):
        plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    assert tuner == []


def test_prepare_model_and_patch_model_take_auto_or_refuse_other_strings(cache, tuner):
    from torch import nn

    from warpsplitk.nn.linear import patch_model
    with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto'"):
        prepare_model({"w": torch.empty(16, 128)}, plan="h200")
    with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto'"):
        patch_model(nn.Sequential(nn.Linear(128, 16)), plan="fast")
    # on a CPU nothing is eligible: nothing to tune, every linear skipped
    report = patch_model(nn.Sequential(nn.Linear(128, 16)), plan="auto")
    assert tuner == [] and report.swapped == []


def test_auto_needs_a_gpu_to_name(cache, tuner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^plan='auto' is the plan measured on this machine's "
                                         "CUDA GPU, and torch sees no CUDA GPU$"):
        plan_cache.auto_plan([(4096, 4096)], (1,), progress=None)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        prepare_model({"w": torch.empty(4096, 4096, dtype=torch.bfloat16)}, plan="auto",
                      progress=None)
    assert tuner == []


def test_a_plan_the_cache_cannot_keep_still_serves(cache, tuner, tmp_path, monkeypatch):
    cache.mkdir(parents=True)
    (cache / "plans").write_text("a file where the plans folder goes")
    with pytest.warns(RuntimeWarning, match="cannot keep the tuned plan in .*plans .*serves this "
                                            "process only"):
        plan = plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    assert plan.lookup(4096, 4096, 1) is not None and tuner[0][2]["log_path"] is None
    # the folder is writable but the write fails: the same, after tuning
    (cache / "plans").unlink()
    monkeypatch.setattr(plan_cache, "store", lambda key, plan: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    with pytest.warns(RuntimeWarning, match="Permission denied"):
        plan = plan_cache.auto_plan([(2048, 2048)], (1,), gpu=OTHER, progress=None)
    assert plan.lookup(2048, 2048, 1) is not None


def test_the_tuner_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^tune measures on a CUDA GPU, and torch sees none$"):
        tune.tune([(4096, 4096)], [1])


def test_cache_command_lists_plans(cache, capsys):
    plan = DecodePlan()
    plan.set(256, 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 2.0)
    plan_cache.store(plan_cache.gpu_key(*OTHER), plan)
    assert main(["cache", "--list"]) == 0
    out = capsys.readouterr().out
    assert "plan     nvidia-h100-80gb-hbm3-132sm.json  1 shapes" in out
    assert "1 GPU plans" in out
