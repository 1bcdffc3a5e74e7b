"""Parallel compilation into the disk cache (warpsplitk.runtime.precompile), on a CPU."""

import importlib.util

import pytest

from warpsplitk.runtime import disk_cache, precompile
from warpsplitk.tactics import WarpSplitKTactic

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)", allow_module_level=True)

KERNELS = [
    (256, 512, WarpSplitKTactic(16, 8, 128, 2, 1), False, True),
    (256, 512, WarpSplitKTactic(32, 16, 256, 2, 2), False, True),
    (128, 1024, WarpSplitKTactic(16, 8, 256, 2, 1, 2), True, True),
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    return tmp_path


def stems(kernels):
    return {disk_cache.key("sm_90a", n, k, t, b, p) for n, k, t, b, p in kernels}


def test_fills_the_cache_under_the_in_process_keys(cache):
    from warpsplitk.runtime.compile import compile_for_arch
    failures = precompile.precompile(KERNELS + KERNELS[:1], "sm_90a", jobs=2)
    assert failures == {}
    assert {p.stem for p in disk_cache.entries()} == stems(KERNELS)
    # what a worker stored is what this process would compile
    n, k, tactic, has_bias, _ = KERNELS[2]
    cubin = compile_for_arch(n, k, tactic, "sm_90a", has_bias=has_bias).cubin
    stem = disk_cache.key("sm_90a", n, k, tactic, has_bias, True)
    assert cubin in disk_cache.path_for(stem).read_bytes()
    assert precompile.missing(KERNELS, "sm_90a") == []


def test_missing_dedups_and_skips_stored(cache):
    assert precompile.missing(KERNELS + KERNELS, "sm_90a") == KERNELS
    disk_cache.path_for(disk_cache.key("sm_90a", *KERNELS[0])).write_bytes(b"stored")
    assert precompile.missing(KERNELS, "sm_90a") == KERNELS[1:]
    # another architecture's kernels are other files
    assert precompile.missing(KERNELS, "sm_100a") == KERNELS


def test_fp8_kernels_are_items_of_their_own(cache):
    """A seventh field names an FP8 kernel's scales: another kernel, another
    file, compiled by the workers under the key the process looks up."""
    n, k, tactic, has_bias, pdl = KERNELS[0]
    fp8 = [(n, k, tactic, has_bias, pdl, False, "tensor"),
           (n, k, tactic, has_bias, pdl, False, "channel")]
    assert precompile.missing(KERNELS[:1] + fp8 + fp8, "sm_90a") == KERNELS[:1] + fp8
    assert precompile.precompile(fp8, "sm_90a", jobs=2) == {}
    assert {p.stem for p in disk_cache.entries()} == {
        disk_cache.key("sm_90a", n, k, tactic, has_bias, pdl, False, scales)
        for scales in ("tensor", "channel")}


@pytest.mark.parametrize("setting", ["one job", "cache off", "one kernel"])
def test_nothing_to_gain_does_nothing(cache, monkeypatch, setting):
    kernels, jobs = KERNELS, 4
    if setting == "one job":
        jobs = 1
    elif setting == "cache off":
        monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "0")
    else:
        kernels = KERNELS[:1]
    assert precompile.precompile(kernels, "sm_90a", jobs=jobs) == {}
    assert disk_cache.entries() == []


def test_illegal_tactic_is_the_callers_error(cache):
    bad = (256, 512, WarpSplitKTactic(16, 8, 256, 16, 1), False, True)  # 16 stages > 2 K tiles
    with pytest.raises(ValueError, match="stages=16 exceeds the 2 K tiles of K=512"):
        precompile.precompile([bad, KERNELS[0]], "sm_90a", jobs=2)


def test_jobs_setting(monkeypatch):
    monkeypatch.setenv("WARPSPLITK_COMPILE_JOBS", "3")
    assert precompile.default_jobs() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv("WARPSPLITK_COMPILE_JOBS", bad)
        with pytest.raises(ValueError, match="WARPSPLITK_COMPILE_JOBS"):
            precompile.default_jobs()
    monkeypatch.delenv("WARPSPLITK_COMPILE_JOBS")
    assert 1 <= precompile.default_jobs() <= 16


def test_register_compiles_take_the_jobs_setting_too(cache, monkeypatch):
    seen = []
    monkeypatch.setattr(precompile, "_run_workers",
                        lambda todo, arch, kind, workers, report: seen.append(workers) or {})
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 8)
    monkeypatch.setenv("WARPSPLITK_COMPILE_JOBS", "2")
    assert precompile.precompile_resources(KERNELS, "sm_90a") == {}
    monkeypatch.delenv("WARPSPLITK_COMPILE_JOBS")
    assert precompile.precompile_resources(KERNELS, "sm_90a") == {}
    assert seen == [2, 3]  # then one per core but one, at most one per kernel


def test_compile_errors_come_back_per_kernel(cache):
    # sm_80 lacks what the kernel needs (griddepcontrol, mbarrier try_wait...)
    failures = precompile.precompile(KERNELS[:2], "sm_80", jobs=2)
    assert set(failures) == set(KERNELS[:2])
    assert all(isinstance(text, str) and text for text in failures.values())
    assert disk_cache.entries() == []


def test_an_unguarded_main_script_runs_once(cache, tmp_path):
    """Workers never re-import the caller's script (multiprocessing's spawn
    would re-run an unguarded script's top level in every worker)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "user_script.py"
    script.write_text(
        "from warpsplitk.runtime import precompile\n"
        "from warpsplitk.tactics import WarpSplitKTactic as T\n"
        "print('top level ran', flush=True)\n"
        "print(precompile.precompile([(256, 512, T(16, 8, 128, 2, 1), False, True),\n"
        "                             (256, 512, T(16, 8, 128, 3, 1), False, True)],\n"
        "                            'sm_90a', jobs=2))\n")
    src = Path(precompile.__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["top level ran", "{}"]
    assert len(disk_cache.entries()) == 2


# a feeder thread must not die on the dead worker's closed pipe
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_workers_that_die_leave_the_kernels_to_the_caller(cache, monkeypatch):
    import sys
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker exits at once
    failures = precompile.precompile(KERNELS, "sm_90a", jobs=2)
    assert set(failures) == set(KERNELS)
    assert disk_cache.entries() == []


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_hangs_is_killed(cache, monkeypatch, tmp_path):
    import sys
    import time
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")  # reads nothing, answers nothing
    hang.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hang))
    monkeypatch.setenv("WARPSPLITK_COMPILE_TIMEOUT", "1.5")
    started = time.perf_counter()
    failures = precompile.precompile(KERNELS, "sm_90a", jobs=2)
    assert time.perf_counter() - started < 20
    assert set(failures) == set(KERNELS)
    assert any("timed out after 1.5 s" in text for text in failures.values())
    assert disk_cache.entries() == []


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_compile_timeout_must_be_positive_seconds(monkeypatch, value):
    monkeypatch.setenv("WARPSPLITK_COMPILE_TIMEOUT", value)
    with pytest.raises(ValueError, match="WARPSPLITK_COMPILE_TIMEOUT"):
        precompile.compile_timeout()


def test_swiglu_kernels_go_under_their_own_keys(cache):
    """A sixth field True asks for the SwiGLU epilogue: its own key, what
    this process would compile; the same kernel without it is another one."""
    from warpsplitk.runtime.compile import compile_for_arch
    n, k, tactic = 256, 512, WarpSplitKTactic(16, 8, 128, 2, 1)
    kernels = [(n, k, tactic, True, True, True), (n, k, tactic, True, True)]
    assert len(precompile.missing(kernels + kernels[:1], "sm_90a")) == 2
    assert precompile.precompile(kernels, "sm_90a", jobs=2) == {}
    stem = disk_cache.key("sm_90a", n, k, tactic, True, True, True)
    cubin = compile_for_arch(n, k, tactic, "sm_90a", has_bias=True, swiglu=True).cubin
    assert cubin in disk_cache.path_for(stem).read_bytes()
    assert precompile.missing(kernels, "sm_90a") == []
    with pytest.raises(ValueError, match="SwiGLU epilogue pairs"):
        precompile.precompile([(352, 1024, WarpSplitKTactic(32, 8, 256, 4, 1, half_tiles=2),
                                False, True, True)] + KERNELS, "sm_90a", jobs=2)


def test_workers_never_import_from_the_callers_folder(cache, tmp_path, monkeypatch):
    """A module planted in the folder the user runs from (a `queue.py`, which
    the worker imports) is not imported by the workers: they run isolated
    from the current folder, in the package's own parent."""
    import os
    from pathlib import Path
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    for name in ("queue", "json", "select", "warpsplitk_probe"):
        (planted / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{name} ')\nraise SystemExit(3)\n")
    monkeypatch.chdir(planted)
    command, folder = precompile.worker_command()
    assert folder == str(Path(precompile.__file__).resolve().parents[2])
    assert "-P" in command or os.sys.version_info < (3, 11)
    assert precompile.precompile(KERNELS[:2], "sm_90a", jobs=2) == {}
    assert not marker.exists()
    assert {p.stem for p in disk_cache.entries()} == stems(KERNELS[:2])


def test_a_relative_cache_folder_is_the_callers(tmp_path, monkeypatch):
    """Workers run in another folder: they get the folder as this process
    resolved it, so their kernels land where this process looks."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", "rel-cache")
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    assert precompile.precompile(KERNELS[:2], "sm_90a", jobs=2) == {}
    assert len(list((tmp_path / "rel-cache").glob("*.kernel"))) == 2


def test_an_interrupt_stops_and_reaps_every_worker(cache, monkeypatch):
    """A KeyboardInterrupt while workers compile kills them and waits for
    each before it propagates: no worker is left compiling."""
    import os
    import signal
    import subprocess
    started = []
    real_popen = subprocess.Popen

    class Recorded(real_popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(precompile.subprocess, "Popen", Recorded)
    many = [(256, 2048, WarpSplitKTactic(16, 8, 128, s, 1), False, True) for s in range(2, 8)]

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)  # mid-compile: a kernel takes ~1 s
    try:
        with pytest.raises(KeyboardInterrupt):
            precompile.precompile(many, "sm_90a", jobs=2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(started) == 2
    for worker in started:
        assert worker.returncode is not None  # reaped: waited for, not left running
        assert not os.path.exists(f"/proc/{worker.pid}") or \
            open(f"/proc/{worker.pid}/stat").read().split()[2] == "Z"
    assert len(disk_cache.entries()) < len(many)


def test_no_workers_where_they_could_not_store(cache, monkeypatch):
    """An untrusted (or unwritable) cache: the workers' kernels could not
    reach this process, so none start and the caller compiles in-process."""
    import subprocess
    monkeypatch.setattr(disk_cache, "_warned", set())
    cache.chmod(0o777)
    monkeypatch.setattr(precompile.subprocess, "Popen",
                        lambda *a, **k: pytest.fail("started a worker"))
    with pytest.warns(RuntimeWarning, match="writable by"):
        assert precompile.precompile(KERNELS, "sm_90a", jobs=2) == {}
    assert subprocess.Popen is not None


def test_a_worker_that_could_not_store_says_so(cache, monkeypatch):
    monkeypatch.setattr(disk_cache, "store", lambda stem, compiled: None)
    n, k, tactic, bias, pdl = KERNELS[0]
    error = precompile._compile_job({"arch": "sm_90a", "n": n, "k": k, "tactic": tactic.short(),
                                     "bias": bias, "pdl": pdl})
    assert error.startswith("could not store it in the disk cache")
