"""plan="auto": per-GPU plans in the cache folder, tuned once (CPU, the tuner stubbed)."""

import json
import multiprocessing

import pytest
import torch

from warpsplitk.planning import plan_cache, tune
from warpsplitk.cli import main
from warpsplitk.planning.plans import DecodePlan, builtin_plan, prepare_model
from warpsplitk.planning.choose import default_tactic
from warpsplitk.tactics import WarpSplitKTactic

H200 = ("NVIDIA H200", 132)
OTHER = ("NVIDIA H100 80GB HBM3", 132)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def tuner(monkeypatch):
    """A stand-in for tune.tune: the default tactic for every M (with
    ``fp8_scales``: the FP8 default, as FP8 entries), and a record of its calls."""
    calls = []

    def fake_tune(shapes, ms, **kwargs):
        calls.append((list(shapes), tuple(ms), kwargs))
        kind = kwargs.get("fp8_scales")
        fp8 = {} if kind is None else {"fp8": True, "fp8_scales": kind}
        plan = DecodePlan(meta={"tuned": True})
        for n, k in shapes:
            for m in ms:
                plan.set(n, k, m, default_tactic(m, n, k, 132, **fp8), 1.0, fp8_scales=kind)
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


def test_auto_tunes_fp8_shapes_as_fp8_once(cache, tuner, capsys):
    """FP8 weights' shapes are tuned per scale kind into FP8 entries of that
    kind, kept in the file beside the BF16 ones; BF16 entries, or another
    kind's, cover no FP8 weight."""
    lines = []
    plan = plan_cache.auto_plan([(4096, 4096)], (1, 8), gpu=OTHER, progress=lines.append,
                                fp8_shapes=[(4096, 4096, "channel"), (2048, 4096, "block128"),
                                            (1024, 4096, "channel"), (2880, 2880, "tensor")])
    assert [(c[0], c[2].get("fp8_scales")) for c in tuner] == [
        ([(4096, 4096)], None), ([(4096, 4096), (1024, 4096)], "channel"),
        ([(2048, 4096)], "block128")]  # K = 2880: not the kernel's, not tuned
    assert all(c[2]["log_path"].endswith("-132sm-log.jsonl") for c in tuner)
    assert any("tuning 1 shape(s) and 3 FP8 shape(s)" in line for line in lines)
    assert plan.lookup(2048, 4096, 8, fp8_scales="block128") == default_tactic(
        8, 2048, 4096, 132, fp8=True, fp8_scales="block128")
    assert plan.lookup(2048, 4096, 8) is None
    assert plan.lookup(2048, 4096, 8, fp8_scales="channel") is None
    data = json.loads(plan_cache.plan_path(plan_cache.gpu_key(*OTHER)).read_text())
    assert data["version"] == 2 and {kind: len(shapes) for kind, shapes in data["fp8"].items()} \
        == {"channel": 2, "block128": 1}
    # the next process tunes nothing; another kind of a tuned shape is tuned for it
    again = plan_cache.auto_plan([(4096, 4096)], (1, 8), gpu=OTHER, progress=None,
                                 fp8_shapes=[(2048, 4096, "block128")])
    assert len(tuner) == 3 and again.fp8_entries == plan.fp8_entries
    plan_cache.auto_plan([], (1, 8), gpu=OTHER, progress=None,
                         fp8_shapes=[(2048, 4096, "channel")])
    assert tuner[-1][0] == [(2048, 4096)] and tuner[-1][2]["fp8_scales"] == "channel"
    # a BF16 shape with FP8 entries only is tuned as BF16
    plan_cache.auto_plan([(2048, 4096)], (1, 8), gpu=OTHER, progress=None)
    assert tuner[-1][0] == [(2048, 4096)] and "fp8_scales" not in tuner[-1][2]
    # the built-in plan (BF16 only) covers no FP8 shape of its GPU
    shipped = next(iter(builtin_plan("h200").entries))
    plan_cache.auto_plan([], (1,), gpu=H200, progress=None, fp8_shapes=[(*shipped, "tensor")])
    assert tuner[-1][0] == [shipped] and tuner[-1][2]["fp8_scales"] == "tensor"


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

    from warpsplitk.nn.patch import patch_model
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
    with pytest.warns(RuntimeWarning, match="not using the plan cache .*plans: not a folder.*"
                                            "serves this process only"):
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


# ------------------------------------------------ trust: what another user could have written


def _one_plan(n=256):
    plan = DecodePlan()
    plan.set(n, 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 2.0)
    return plan


def _only_warning(record, *words):
    """The one warning of ``record`` (``warnings.catch_warnings(record=True)``),
    a RuntimeWarning naming ``words``."""
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert record[0].category is RuntimeWarning
    for word in words:
        assert str(word) in message, (word, message)
    return message


def test_the_plans_folder_is_private_whatever_the_umask(cache):
    import os
    import stat
    old = os.umask(0)
    try:
        path = plan_cache.store(plan_cache.gpu_key(*OTHER), _one_plan())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(plan_cache.plan_dir()).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700  # made here: made private too
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lock = plan_cache.plan_dir() / f"{plan_cache.gpu_key(*OTHER)}.lock"
    assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600


def _untrusted_folder(how, monkeypatch):
    """Make the (existing) plans folder one this process must not trust;
    the reason the warning gives."""
    import os
    folder = plan_cache.plan_dir()
    if how == "world-writable":
        os.chmod(folder, 0o777)
        return "writable by group and others (mode 0777"
    if how == "chown":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(folder, 12345, -1)
        return "owned by uid 12345, not by this user"
    # as any user: this process is someone else than the folder's owner
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    return f"owned by uid {me}, not by this user (uid {me + 1})"


@pytest.mark.parametrize("how", ["world-writable", "chown", "another-euid"])
def test_a_folder_another_user_could_write_is_not_used(cache, tuner, monkeypatch, how):
    import warnings
    key = plan_cache.gpu_key(*OTHER)
    kept = DecodePlan()
    kept.set(4096, 4096, 1, default_tactic(1, 4096, 4096, 132), 1.0)
    path = plan_cache.store(key, kept)
    before = path.read_bytes()
    reason = _untrusted_folder(how, monkeypatch)
    # plan='auto': one warning naming the folder and why; the cached plan is
    # not read (the shape is tuned), the tuned plan not written, no log
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    _only_warning(record, "not using the plan cache", plan_cache.plan_dir(), reason,
                  "serves this process only")
    assert len(tuner) == 1 and tuner[0][2]["log_path"] is None
    assert plan.lookup(4096, 4096, 1) is not None
    assert path.read_bytes() == before
    # the module's own calls: load warns and is empty, store refuses
    with pytest.warns(RuntimeWarning, match="not using the plan cache"):
        assert plan_cache.load(key).entries == {}
    from warpsplitk.runtime.private_files import UntrustedPath
    import re
    with pytest.raises(UntrustedPath, match=re.escape(reason)):
        plan_cache.store(key, _one_plan())
    assert path.read_bytes() == before


def test_a_lock_file_linked_to_another_file_leaves_it_alone(cache, tuner, tmp_path):
    import warnings
    key = plan_cache.gpu_key(*OTHER)
    plan_cache.store(key, _one_plan())
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file")
    lock = plan_cache.plan_dir() / f"{key}.lock"
    lock.unlink()
    lock.symlink_to(victim)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    _only_warning(record, "cannot keep the tuned plan", lock, "symbolic link")
    assert victim.read_text() == "another user's file"
    assert plan.lookup(4096, 4096, 1) is not None
    assert (4096, 4096) not in plan_cache.load(key).entries  # not stored
    # a link to a file yet to be: never created through it
    victim.unlink()
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        plan_cache.auto_plan([(2048, 2048)], (1,), gpu=OTHER, progress=None)
    assert not victim.exists()


def test_a_linked_plan_file_is_not_read_nor_written_through(cache, tuner, tmp_path):
    import warnings
    key = plan_cache.gpu_key(*OTHER)
    planted = tmp_path / "planted.json"
    rigged = DecodePlan()
    rigged.set(4096, 4096, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 0.1)
    rigged.save(planted)
    before = planted.read_bytes()
    plan_cache.plan_dir().mkdir(mode=0o700, parents=True)
    plan_cache.plan_path(key).symlink_to(planted)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = plan_cache.auto_plan([(4096, 4096)], (1,), gpu=OTHER, progress=None)
    _only_warning(record, "not using the plan cache", plan_cache.plan_path(key), "symbolic link")
    assert len(tuner) == 1  # the planted plan was not taken
    assert plan.lookup(4096, 4096, 1) == default_tactic(1, 4096, 4096, 132)
    assert planted.read_bytes() == before
    assert plan_cache.plan_path(key).is_symlink()


def _unknown_version_plan():
    plan = DecodePlan()
    for i in range(50):
        plan.set(16 * (i + 1), 512, 1, WarpSplitKTactic(16, 8, 128, 2, 1), 2.0)
    data = plan.to_json()
    data["version"] = 999  # a later warpsplitk's
    return json.dumps(data).encode()


@pytest.mark.parametrize("contents", [_unknown_version_plan(), b'{"format": "warpsplitk-pl',
                                      b"\xff\xfe not text"],
                         ids=["unknown-version", "not-json", "not-utf8"])
def test_an_unreadable_plan_is_moved_aside_never_overwritten(cache, contents):
    import warnings
    key = plan_cache.gpu_key(*OTHER)
    path = plan_cache.plan_path(key)
    plan_cache.plan_dir().mkdir(mode=0o700, parents=True)
    path.write_bytes(contents)
    # reading only: ignored, with the promise of what the next store does
    with pytest.warns(RuntimeWarning, match="ignoring the cached plan .*moves it aside"):
        assert plan_cache.load(key).entries == {}
    assert path.read_bytes() == contents
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan_cache.store(key, _one_plan())
    aside = [p for p in plan_cache.plan_dir().iterdir() if ".unreadable-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == contents
    assert aside[0].name.startswith(f"{key}.json.unreadable-") and aside[0].name.endswith("Z")
    _only_warning(record, path, aside[0])
    assert sorted(plan_cache.load(key).entries) == [(256, 512)]
    assert plan_cache.entries() == [path]  # the copy is not a plan to list


def test_stale_temporaries_are_removed_on_store(cache):
    import os
    import time
    folder = plan_cache.plan_dir()
    folder.mkdir(mode=0o700, parents=True)
    names = ["old.json.tmp", ".tmp-old.tmp", "fresh.json.tmp", ".tmp-fresh.tmp", "other.txt"]
    for name in names:
        (folder / name).write_text("left by a killed process")
    two_hours_ago = time.time() - 7200
    for name in ("old.json.tmp", ".tmp-old.tmp", "other.txt"):
        os.utime(folder / name, (two_hours_ago, two_hours_ago))
    plan_cache.store(plan_cache.gpu_key(*OTHER), _one_plan())
    assert sorted(p.name for p in folder.iterdir() if p.suffix in (".tmp", ".txt")) == \
        [".tmp-fresh.tmp", "fresh.json.tmp", "other.txt"]
