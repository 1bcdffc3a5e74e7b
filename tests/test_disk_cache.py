"""The on-disk cache of compiled kernels (warpsplitk.runtime.disk_cache), on a CPU.

Kernels are compiled for sm_90a without a GPU, exported, and loaded back;
the GPU test of the loaded code is in test_gpu_reliability.py.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warpsplitk.runtime import disk_cache
from warpsplitk.tactics import WarpSplitKTactic

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)", allow_module_level=True)

N, K = 256, 512
TACTIC = WarpSplitKTactic(16, 8, 128, 2, 1)
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    monkeypatch.setattr(disk_cache, "_warned", set())
    return tmp_path / "kernels"


@pytest.fixture(scope="module")
def compiled():
    from warpsplitk.runtime.compile import _build
    return _build(N, K, TACTIC, False, True, "sm_90a")


def test_key_names_every_input():
    base = dict(arch="sm_90a", n=N, k=K, tactic=TACTIC, has_bias=False, use_pdl=True)
    stem = disk_cache.key(**base)
    assert stem == disk_cache.key(**base) and len(stem) == 40
    changes = [("arch", "sm_100a"), ("n", 512), ("k", 1024),
               ("tactic", WarpSplitKTactic(16, 8, 128, 3, 1)),
               ("tactic", WarpSplitKTactic(16, 8, 128, 2, 1, 2)),
               ("has_bias", True), ("use_pdl", False), ("swiglu", True)]
    stems = {disk_cache.key(**{**base, field: value}) for field, value in changes}
    assert len(stems) == len(changes) and stem not in stems


def test_key_takes_the_kernel_inputs_only():
    """The build switches are gone from the package: the key names the
    kernel's own inputs, and stays what it was for the shipped build (the
    kernels already on disk are found again)."""
    import inspect
    assert list(inspect.signature(disk_cache.key).parameters) == [
        "arch", "n", "k", "tactic", "has_bias", "use_pdl", "swiglu"]
    with pytest.raises(TypeError):
        disk_cache.key("sm_90a", N, K, TACTIC, False, True, arrivals="lane0")
    import hashlib
    import json
    fields = {"format": disk_cache.FORMAT, **disk_cache._versions(),
              "sources": disk_cache._sources_digest(), "arch": "sm_90a", "n": N, "k": K,
              "tactic": TACTIC.short(), "k_split": 1, "bias": False, "pdl": True,
              "arrivals": "", "early_launch": False}
    assert disk_cache.key("sm_90a", N, K, TACTIC, False, True) == hashlib.sha256(
        json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]


def test_key_follows_versions_and_sources(monkeypatch):
    args = ("sm_90a", N, K, TACTIC, False, True)
    stem = disk_cache.key(*args)
    monkeypatch.setattr(disk_cache, "_versions", lambda: {"warpsplitk": "9", "cutlass_dsl": "4.8.1"})
    assert disk_cache.key(*args) != stem
    monkeypatch.undo()
    monkeypatch.setattr(disk_cache, "_sources_digest", lambda: "edited kernel")
    assert disk_cache.key(*args) != stem


def test_sources_cover_the_kernel_modules():
    package = Path(disk_cache.__file__).parents[1]
    assert all((package / name).is_file() for name in disk_cache._SOURCES)
    kernel = {f"kernel/{p.name}" for p in (package / "kernel").glob("*.py")}
    assert kernel - {"kernel/__init__.py", "kernel/emulator.py"} <= set(disk_cache._SOURCES)


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("WARPSPLITK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "warpsplitk"


def test_round_trip_keeps_the_cubin(cache, compiled):
    from warpsplitk.runtime.compile import compile_for_arch
    from warpsplitk.runtime.launch import marshals_as_slots
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    assert disk_cache.load(stem) is None
    path = disk_cache.store(stem, compiled)
    assert path == cache / f"{stem}.o" and path.is_file()
    # no scratch folder left behind; beside the kernel, what built it
    assert sorted(cache.iterdir()) == [path.with_suffix(".build.json"), path]
    loaded = disk_cache.load(stem)
    assert loaded is not None and marshals_as_slots(loaded)
    cubin = compile_for_arch(N, K, TACTIC, "sm_90a").cubin
    assert cubin and cubin in path.read_bytes()


def test_unreadable_file_is_removed_and_reported(cache, compiled):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    cache.mkdir(parents=True)
    (cache / f"{stem}.o").write_bytes(b"\x7fELF truncated")
    with pytest.warns(RuntimeWarning, match="could not load"):
        assert disk_cache.load(stem) is None
    assert not (cache / f"{stem}.o").exists()


def test_a_missing_dsl_keeps_the_stored_file(cache, compiled, monkeypatch):
    # without the DSL nothing can load the file: say so, and never remove it
    import sys
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    path = disk_cache.store(stem, compiled)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setitem(sys.modules, "cutlass.cute", None)
    with pytest.raises(ModuleNotFoundError, match="needs the CuTe DSL"):
        disk_cache.load(stem)
    assert path.is_file()


def test_switched_off(cache, compiled, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "0")
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    assert disk_cache.store(stem, compiled) is None and not cache.exists()
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "1")
    disk_cache.store(stem, compiled)
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "off")
    assert disk_cache.load(stem) is None


def test_unwritable_folder_warns_once(tmp_path, monkeypatch, compiled):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.setattr(disk_cache, "_warned", set())
    with pytest.warns(RuntimeWarning, match="kept in this process only"):
        assert disk_cache.store("ab" * 20, compiled) is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk_cache.store("cd" * 20, compiled) is None


def test_clear(cache, compiled):
    disk_cache.store("ab" * 20, compiled)
    (cache / ".export-left-over").mkdir()
    assert len(disk_cache.entries()) == 1
    assert disk_cache.clear() == 1
    assert disk_cache.entries() == [] and list(cache.iterdir()) == []


def test_compile_cached_compiles_once_across_processes(cache, compiled, monkeypatch):
    """_compile_cached stores what it builds; with the in-process cache
    emptied (a new process), it loads instead of compiling."""
    import contextlib

    import torch

    from warpsplitk.runtime import compile as compile_module
    builds = []
    real_build = compile_module._build

    def counting_build(*args, **kwargs):
        builds.append(args[:3])
        return real_build(*args, **kwargs)

    monkeypatch.setattr(compile_module, "_build", counting_build)
    monkeypatch.setattr(compile_module, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    compile_module._compile_cached.cache_clear()
    try:
        first = compile_module._compile_cached(0, N, K, TACTIC, False, True)
        assert len(builds) == 1 and len(disk_cache.entries()) == 1
        compile_module._compile_cached.cache_clear()
        second = compile_module._compile_cached(0, N, K, TACTIC, False, True)
        assert len(builds) == 1 and second is not first
        # another kernel input is another kernel
        compile_module._compile_cached.cache_clear()
        compile_module._compile_cached(0, N, K, TACTIC, True, True)
        assert len(builds) == 2 and len(disk_cache.entries()) == 2
    finally:
        compile_module._compile_cached.cache_clear()


def test_another_process_loads_without_compiling(cache, compiled):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    disk_cache.store(stem, compiled)
    probe = (
        "import sys, warpsplitk.runtime.compile as c\n"
        "from warpsplitk.runtime import disk_cache\n"
        "from warpsplitk.runtime.launch import marshals_as_slots\n"
        "c._build = lambda *a, **k: sys.exit('compiled instead of loading')\n"
        f"f = disk_cache.load({stem!r})\n"
        "print(type(f).__name__, marshals_as_slots(f))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["CudaDialectJitCompiledFunction", "True"]


def test_cache_cli(cache, compiled, capsys):
    from warpsplitk.cli import main
    disk_cache.store("ab" * 20, compiled)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and "1 compiled kernels" in out and "disk cache on" in out
    assert main(["cache", "--clear"]) == 0
    assert "removed 1 compiled kernels" in capsys.readouterr().out
    assert disk_cache.entries() == []


def test_cache_cli_counts_what_it_removed(cache, compiled, capsys, monkeypatch):
    from warpsplitk.cli import main
    disk_cache.store("ab" * 20, compiled)
    disk_cache.store("cd" * 20, compiled)
    kept = disk_cache.entries()[0]
    real = disk_cache._remove
    monkeypatch.setattr(disk_cache, "_remove", lambda path: path != kept and real(path))
    assert main(["cache", "--clear"]) == 1  # one file the file system would not let go
    out = capsys.readouterr().out
    assert f"removed 1 compiled kernels and 0 resource records from {cache}; could not remove " \
           f"1 (e.g. {kept})" in out
    assert disk_cache.entries() == [kept]
    # a file gone between the listing and its size (another process clearing)
    from warpsplitk.cli import _size
    assert _size(cache / "gone.o") == 0
    # one another process removed first is not "could not remove"
    disk_cache.store("ef" * 20, compiled)
    monkeypatch.setattr(disk_cache, "_remove", lambda path: path.unlink() and False)
    assert main(["cache", "--clear"]) == 0
    assert "removed 0 compiled kernels" in capsys.readouterr().out


def test_prune_removes_kernels_of_other_versions_or_sources(cache, compiled, monkeypatch, capsys):
    from warpsplitk.cli import main
    current = disk_cache.store("ab" * 20, compiled)
    assert (cache / f"{'ab' * 20}.build.json").is_file()
    assert disk_cache.stale() == []
    # a kernel left by another version of the library
    with monkeypatch.context() as patch:
        patch.setattr(disk_cache, "_versions", lambda: {"warpsplitk": "0.0.1",
                                                        "cutlass_dsl": "4.8.1"})
        old = disk_cache.store("cd" * 20, compiled)
    # and one without a record of what built it (written before records existed)
    bare = cache / f"{'ef' * 20}.o"
    bare.write_bytes(current.read_bytes())
    assert disk_cache.stale() == [old, bare]
    assert main(["cache"]) == 0
    assert "3 compiled kernels" in (out := capsys.readouterr().out) and "(2 stale" in out
    assert main(["cache", "--prune"]) == 0
    assert "removed 2 stale compiled kernels" in capsys.readouterr().out
    assert disk_cache.entries() == [current]
    assert sorted(p.name for p in cache.iterdir()) == [f"{'ab' * 20}.build.json", current.name]
    assert disk_cache.load("ab" * 20) is not None


# ------------------------------------------------ resource records


def test_resources_miss_compiles_and_stores(cache, monkeypatch):
    from warpsplitk.runtime import compile as compile_module
    calls = []
    real = compile_module.compile_for_arch

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_module, "compile_for_arch", counting)
    assert disk_cache.cached_resources(N, K, TACTIC) is None
    found = disk_cache.arch_resources(N, K, TACTIC, "sm_90a")
    assert len(calls) == 1 and 16 <= found["registers"] <= 255
    assert found == {"registers": real(N, K, TACTIC, "sm_90a").registers,
                     "spill_bytes": 0, "local_bytes": 0}
    path = disk_cache.resource_path(disk_cache.key("sm_90a", N, K, TACTIC, False, True))
    assert path.is_file() and disk_cache.resource_entries() == [path]
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left
    assert disk_cache.arch_resources(N, K, TACTIC, "sm_90a") == found and len(calls) == 1
    # another arch, bias or tactic is another record
    assert disk_cache.cached_resources(N, K, TACTIC, "sm_100a") is None
    assert disk_cache.cached_resources(N, K, TACTIC, has_bias=True) is None


def test_resources_hit_without_importing_the_dsl(cache):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    disk_cache.store_resources(stem, {"registers": 77, "spill_bytes": 8, "local_bytes": 16})
    probe = (
        "import sys\n"
        "from warpsplitk.runtime import disk_cache\n"
        "from warpsplitk.tactics import WarpSplitKTactic\n"
        f"found = disk_cache.arch_resources({N}, {K}, WarpSplitKTactic.parse({TACTIC.short()!r}))\n"
        "print(found['registers'], found['spill_bytes'], 'cutlass' in sys.modules, "
        "'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["77", "8", "False", "False"]


def test_resources_switched_off(cache, monkeypatch):
    from warpsplitk.runtime import compile as compile_module
    calls = []

    class Report:
        registers, spill_bytes, local_bytes = 40, 0, 0

    monkeypatch.setattr(compile_module, "compile_for_arch",
                        lambda *a, **k: calls.append(a) or Report())
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "0")
    assert disk_cache.arch_resources(N, K, TACTIC)["registers"] == 40
    assert disk_cache.arch_resources(N, K, TACTIC)["registers"] == 40
    assert len(calls) == 2 and not cache.exists()
    assert disk_cache.store_resources(stem, {"registers": 1}) is None
    from warpsplitk.runtime.precompile import precompile_resources
    assert precompile_resources([(N, K, TACTIC, False, True)]) == {} and len(calls) == 2
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "1")
    disk_cache.store_resources(stem, {"registers": 50, "spill_bytes": 0, "local_bytes": 0})
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "off")
    assert disk_cache.load_resources(stem) is None
    assert disk_cache.arch_resources(N, K, TACTIC)["registers"] == 40


def test_resources_of_another_version_or_unreadable_are_not_used(cache, monkeypatch):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    disk_cache.store_resources(stem, {"registers": 50, "spill_bytes": 0, "local_bytes": 0})
    assert disk_cache.stale() == []
    with monkeypatch.context() as patch:
        patch.setattr(disk_cache, "_versions", lambda: {"warpsplitk": "0.0.1",
                                                        "cutlass_dsl": "4.8.1"})
        old = disk_cache.store_resources("cd" * 20, {"registers": 1, "spill_bytes": 0,
                                                     "local_bytes": 0})
    assert disk_cache.load_resources("cd" * 20) is None  # written by another version
    assert disk_cache.stale() == [old]
    assert disk_cache.prune() == 1 and disk_cache.resource_entries() == [
        disk_cache.resource_path(stem)]
    # None where the compiler reported no count: kept and used as it is
    disk_cache.store_resources(stem, {"registers": None, "spill_bytes": None, "local_bytes": None})
    assert disk_cache.load_resources(stem) == {"registers": None, "spill_bytes": None,
                                               "local_bytes": None}
    # unreadable, or not counts: removed (said once), never shown
    for text in ("{truncated", '{"registers": "many", "spill_bytes": 0, "local_bytes": 0}',
                 '{"registers": -5, "spill_bytes": 0, "local_bytes": 0}',
                 '{"registers": [1], "spill_bytes": 0, "local_bytes": 0}', "[]"):
        disk_cache.store_resources(stem, {"registers": 50, "spill_bytes": 0, "local_bytes": 0})
        record = json.loads(disk_cache.resource_path(stem).read_text())
        bad = text if not text.startswith('{"') else json.dumps({**record, **json.loads(text)})
        disk_cache.resource_path(stem).write_text(bad)
        monkeypatch.setattr(disk_cache, "_warned", set())
        with pytest.warns(RuntimeWarning, match="removed the unreadable resource record"):
            assert disk_cache.load_resources(stem) is None
        assert not disk_cache.resource_path(stem).exists()


def test_precompile_resources_in_worker_processes(cache):
    """Two kernels the cache lacks, compiled by two workers into it; the
    records are those compiling in-process gives."""
    from warpsplitk.runtime.compile import compile_for_arch
    other = WarpSplitKTactic(16, 8, 128, 3, 1)
    seen = []
    from warpsplitk.runtime.precompile import precompile_resources
    failures = precompile_resources(
        [(N, K, TACTIC, False, True), (N, K, other, False, True), (N, K, TACTIC, False, True)],
        "sm_90a", jobs=2, progress=lambda done, total: seen.append((done, total)))
    assert failures == {} and seen == [(1, 2), (2, 2)]
    assert len(disk_cache.resource_entries()) == 2
    for tactic in (TACTIC, other):
        assert disk_cache.cached_resources(N, K, tactic)["registers"] == \
            compile_for_arch(N, K, tactic, "sm_90a").registers
    # nothing left to do: no worker started
    assert precompile_resources([(N, K, TACTIC, False, True)], "sm_90a", jobs=2,
                                progress=lambda *a: seen.append(a)) == {}
    assert len(seen) == 2


def test_a_cache_folder_whose_home_does_not_exist_is_named(monkeypatch, capsys):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", "~no-such-user-here/kernels")
    with pytest.raises(ValueError, match="WARPSPLITK_CACHE_DIR='~no-such-user-here/kernels': its "
                                         "'~' names no home folder here"):
        disk_cache.cache_dir()
    from warpsplitk.cli import main
    assert main(["cache"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
