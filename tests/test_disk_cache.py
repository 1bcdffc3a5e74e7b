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
    from warpsplitk.runtime.dsl import build as _build
    return _build(N, K, TACTIC, False, True, "sm_90a")


def test_key_names_every_input():
    base = dict(arch="sm_90a", n=N, k=K, tactic=TACTIC, has_bias=False, use_pdl=True)
    stem = disk_cache.key(**base)
    assert stem == disk_cache.key(**base) and len(stem) == 40
    changes = [("arch", "sm_100a"), ("n", 512), ("k", 1024),
               ("tactic", WarpSplitKTactic(16, 8, 128, 3, 1)),
               ("tactic", WarpSplitKTactic(16, 8, 128, 2, 1, 2)),
               ("has_bias", True), ("use_pdl", False), ("swiglu", True),
               ("fp8_scales", "tensor"), ("fp8_scales", "channel")]
    stems = {disk_cache.key(**{**base, field: value}) for field, value in changes}
    assert len(stems) == len(changes) and stem not in stems


def test_key_takes_the_kernel_inputs_and_the_build():
    """The key is the kernel's own inputs, the library's and the DSL's
    versions and sources, and the build (the DSL's CUDA build, its
    compile settings, the host machine): nothing else, nothing less."""
    import hashlib
    import inspect
    assert list(inspect.signature(disk_cache.key).parameters) == [
        "arch", "n", "k", "tactic", "has_bias", "use_pdl", "swiglu", "fp8_scales"]
    with pytest.raises(TypeError):
        disk_cache.key("sm_90a", N, K, TACTIC, False, True, arrivals="lane0")
    fields = {"format": disk_cache.FORMAT, **disk_cache._versions(),
              "sources": disk_cache._sources_digest(), **disk_cache.build_identity(),
              "arch": "sm_90a", "n": N, "k": K, "tactic": TACTIC.short(), "k_split": 1,
              "bias": False, "pdl": True, "swiglu": False}
    assert disk_cache.key("sm_90a", N, K, TACTIC, False, True) == hashlib.sha256(
        json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]
    # an FP8-weight kernel's key adds its scales (a BF16 key has no such field)
    assert disk_cache.key("sm_90a", N, K, TACTIC, False, True, fp8_scales="channel") == (
        hashlib.sha256(json.dumps({**fields, "fp8_scales": "channel"}, sort_keys=True)
                       .encode()).hexdigest()[:40])
    build = disk_cache.build_identity()
    assert set(build) == {"dsl_cuda", "dsl_settings", "machine"}
    assert build["dsl_cuda"].startswith(("12.", "13.")) and "-" in build["machine"]


def test_key_follows_versions_sources_and_build(monkeypatch):
    args = ("sm_90a", N, K, TACTIC, False, True)
    stem = disk_cache.key(*args)
    monkeypatch.setattr(disk_cache, "_versions", lambda: {"warpsplitk": "9", "cutlass_dsl": "4.8.1"})
    assert disk_cache.key(*args) != stem
    monkeypatch.undo()
    monkeypatch.setattr(disk_cache, "_sources_digest", lambda: "edited kernel")
    assert disk_cache.key(*args) != stem
    monkeypatch.undo()
    real = disk_cache.build_identity()
    for field, value in (("dsl_cuda", "12.9"), ("machine", "linux-aarch64"),
                         ("dsl_settings", {**real["dsl_settings"], "lineinfo": "True"})):
        monkeypatch.setattr(disk_cache, "build_identity", lambda: {**real, field: value})
        assert disk_cache.key(*args) != stem, field


def test_key_covers_every_setting_the_dsl_says_changes_code():
    """Read from the DSL's own declarations: each setting it marks as
    affecting compilation is in the key, except the target arch (a key
    field of its own, passed to every compile explicitly)."""
    from cutlass.cutlass_dsl.cutlass import CuTeDSLEnvironmentManager
    declared = {entry.key_name for entry in CuTeDSLEnvironmentManager._ENV_VAR_SPEC
                if entry.affects_compile}
    assert {"compiler_opt", "lineinfo", "debug"} <= declared
    assert set(disk_cache.build_identity()["dsl_settings"]) == declared - {"arch"}


_KEY_PROBE = (
    "from warpsplitk.runtime import disk_cache\n"
    "from warpsplitk.runtime.dsl import build as _build\n"
    "from warpsplitk.tactics import WarpSplitKTactic\n"
    f"t = WarpSplitKTactic.parse({TACTIC.short()!r})\n"
    f"stem = disk_cache.key('sm_90a', {N}, {K}, t, False, True)\n"
    f"disk_cache.store(stem, _build({N}, {K}, t, False, True, 'sm_90a'))\n"
    "print(stem)\n")


@pytest.mark.parametrize("setting", [{"CUTE_DSL_LINEINFO": "1"},
                                     {"CUTE_DSL_COMPILER_OPT": "opt-level=0"}])
def test_two_dsl_settings_compile_under_two_keys(cache, setting):
    """A kernel compiled with a DSL setting that changes its code is stored
    under another key than the plain build: a later plain run never loads it."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env = {name: value for name, value in env.items()
           if not name.startswith("CUTE_DSL_") or name == "CUTE_DSL_ARCH"}
    stems = []
    for extra in ({}, setting):
        done = subprocess.run([sys.executable, "-c", _KEY_PROBE], env={**env, **extra},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        stems.append(done.stdout.split()[-1])
    assert stems[0] != stems[1]
    assert sorted(p.stem for p in disk_cache.entries()) == sorted(stems)


def test_sources_cover_the_kernel_modules():
    package = Path(disk_cache.__file__).parents[1]
    assert all((package / name).is_file() for name in disk_cache._SOURCES)
    kernel = {f"kernel/{p.name}" for p in (package / "kernel").glob("*.py")}
    assert kernel - {"kernel/__init__.py", "kernel/emulator.py"} <= set(disk_cache._SOURCES)


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("WARPSPLITK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "warpsplitk"
    # a relative folder is resolved once, here (workers run elsewhere)
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", "rel/kernels")
    assert disk_cache.cache_dir() == Path.cwd() / "rel" / "kernels"


def test_round_trip_keeps_the_cubin(cache, compiled):
    from warpsplitk.runtime.compile import compile_for_arch
    from warpsplitk.runtime.launch import marshals_as_slots
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    assert disk_cache.load(stem) is None
    path = disk_cache.store(stem, compiled)
    assert path == cache / f"{stem}.kernel" and path.is_file()
    assert sorted(cache.iterdir()) == [path]  # no scratch folder or temporary left behind
    loaded = disk_cache.load(stem)
    assert loaded is not None and marshals_as_slots(loaded)
    cubin = compile_for_arch(N, K, TACTIC, "sm_90a").cubin
    assert cubin and cubin in path.read_bytes()
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert header["key"] == stem and header["object_bytes"] > len(cubin)
    assert len(header["sha256"]) == 64


def _loader_calls(monkeypatch):
    """Record every object the DSL's loader is handed (it still loads them)."""
    import cutlass.cute as cute
    calls = []
    real = cute.runtime.load_module
    monkeypatch.setattr(cute.runtime, "load_module",
                        lambda path, **kw: calls.append(path) or real(path, **kw))
    return calls


def test_unreadable_file_is_removed_and_reported(cache, compiled, monkeypatch):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    cache.mkdir(mode=0o700, parents=True)
    (cache / f"{stem}.kernel").write_bytes(b"\x7fELF truncated")
    calls = _loader_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="could not load"):
        assert disk_cache.load(stem) is None
    assert not (cache / f"{stem}.kernel").exists() and calls == []


@pytest.mark.parametrize("where", ["object", "header"])
def test_one_flipped_byte_is_never_loaded(cache, compiled, monkeypatch, where):
    """Integrity: a byte changed in the object (its GPU code, say) or in the
    header fails the digest; the loader never sees the file, which is
    removed, and the next compile replaces it."""
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    path = disk_cache.store(stem, compiled)
    data = bytearray(path.read_bytes())
    start = data.index(b"\n") + 1
    at = start + (len(data) - start) * 2 // 3 if where == "object" else data.index(b"4.8")
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    calls = _loader_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="could not load .*(digest|header|names another)"):
        assert disk_cache.load(stem) is None
    assert calls == [] and not path.exists()
    assert disk_cache.store(stem, compiled) == path and disk_cache.load(stem) is not None


def test_a_kernel_stored_under_another_key_is_not_loaded(cache, compiled, monkeypatch):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    other = disk_cache.key("sm_90a", N, K, TACTIC, True, True)
    disk_cache.store(stem, compiled)
    disk_cache.path_for(other).write_bytes(disk_cache.path_for(stem).read_bytes())
    calls = _loader_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="names another kernel"):
        assert disk_cache.load(other) is None
    assert calls == [] and disk_cache.load(stem) is not None


def test_a_symlinked_kernel_file_is_refused(cache, compiled, tmp_path, monkeypatch):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    real = disk_cache.store(stem, compiled)
    elsewhere = tmp_path / "planted.kernel"
    real.rename(elsewhere)
    real.symlink_to(elsewhere)
    calls = _loader_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert disk_cache.load(stem) is None
    assert calls == [] and real.is_symlink() and elsewhere.is_file()  # left alone


def test_the_folder_is_created_private_whatever_the_umask(cache, compiled):
    old = os.umask(0)
    try:
        disk_cache.store("ab" * 20, compiled)
    finally:
        os.umask(old)
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert (disk_cache.path_for("ab" * 20).stat().st_mode & 0o777) == 0o600


def _as_another_user(monkeypatch):
    # this process's user is someone else than every file's owner
    monkeypatch.setattr(os, "geteuid", lambda: os.stat("/").st_uid + 4242)


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another owner"])
def test_an_untrusted_folder_is_not_used(cache, compiled, monkeypatch, how):
    """A folder others can write (or that is not this user's) is neither
    read nor written: one warning naming it and why, kernels in memory."""
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    disk_cache.store(stem, compiled)
    calls = _loader_calls(monkeypatch)
    if how == "another owner":
        _as_another_user(monkeypatch)
        reason = "owned by uid"
    else:
        cache.chmod(0o777 if how == "world-writable" else 0o770)
        reason = "writable by"
    with pytest.warns(RuntimeWarning, match=f"not using {cache}: {reason}") as caught:
        assert disk_cache.load(stem) is None
        assert disk_cache.store("cd" * 20, compiled) is None
        assert disk_cache.writable() is not None
    assert len(caught) == 1 and calls == []
    assert not disk_cache.path_for("cd" * 20).exists()


def test_each_untrusted_folder_is_named_once(cache, monkeypatch, tmp_path):
    """A process sent to a second untrusted folder (another cache dir, one
    another user owns) is warned of that one too, once each."""
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    with pytest.warns(RuntimeWarning) as caught:
        assert disk_cache.load("ab" * 20) is None
        _as_another_user(monkeypatch)
        for folder in (theirs, cache, theirs):
            monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(folder))
            assert disk_cache.load("ab" * 20) is None
    said = [str(w.message) for w in caught]
    assert len(said) == 2, said
    assert f"not using {cache}: writable by" in said[0]
    assert f"not using {theirs}: owned by uid" in said[1]


def test_a_file_others_can_write_or_another_user_owns_is_not_loaded(cache, compiled,
                                                                     monkeypatch):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    path = disk_cache.store(stem, compiled)
    path.chmod(0o666)
    calls = _loader_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="writable by group and others"):
        assert disk_cache.load(stem) is None
    assert path.is_file() and calls == []  # not this process's to delete
    if os.geteuid() == 0:  # a file root handed to another user
        path.chmod(0o600)
        os.chown(path, 4242, 4242)
        monkeypatch.setattr(disk_cache, "_warned", set())
        with pytest.warns(RuntimeWarning, match="owned by uid 4242"):
            assert disk_cache.load(stem) is None
        assert calls == []


def test_a_module_that_fails_to_initialise_is_a_failed_load(cache, compiled, monkeypatch):
    """The loaded kernel's device set-up (its module init) failing removes
    the file and compiles again, instead of raising out of the first run."""
    import contextlib

    import torch

    from warpsplitk.runtime import compile as compile_module
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    path = disk_cache.store(stem, compiled)

    class Broken:
        def to(self, device):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")

    builds = []
    monkeypatch.setattr(disk_cache, "load", lambda s: Broken())
    monkeypatch.setattr(compile_module, "build", lambda *a, **k: builds.append(a) or compiled)
    monkeypatch.setattr(compile_module, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    compile_module._compile_cached.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="failed to initialise.*INVALID_IMAGE"):
            assert compile_module._compile_cached(0, N, K, TACTIC, False, True) is compiled
    finally:
        compile_module._compile_cached.cache_clear()
    assert len(builds) == 1 and path.is_file()  # removed, then stored again by the compile


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
    for off in ("off", "disable", "Disabled", " no "):
        monkeypatch.setenv("WARPSPLITK_DISK_CACHE", off)
        assert not disk_cache.enabled() and disk_cache.load(stem) is None
    for on in ("", "1", "on", "enable", "TRUE"):
        monkeypatch.setenv("WARPSPLITK_DISK_CACHE", on)
        assert disk_cache.enabled()
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "maybe")
    with pytest.raises(ValueError, match="WARPSPLITK_DISK_CACHE must be on or off .* got 'maybe'"):
        disk_cache.enabled()


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


def test_size_cap_parsing(monkeypatch):
    monkeypatch.delenv("WARPSPLITK_CACHE_MAX_SIZE", raising=False)
    assert disk_cache.max_bytes() == 4 << 30
    for text, expected in (("500M", 500 << 20), ("8G", 8 << 30), ("2GiB", 2 << 30),
                           ("1.5g", 3 << 29), ("2097152", 2 << 20), ("1T", 1 << 40)):
        monkeypatch.setenv("WARPSPLITK_CACHE_MAX_SIZE", text)
        assert disk_cache.max_bytes() == expected, text
    for text in ("lots", "-1G", "10K", "0", "5X"):
        monkeypatch.setenv("WARPSPLITK_CACHE_MAX_SIZE", text)
        with pytest.raises(ValueError, match="WARPSPLITK_CACHE_MAX_SIZE must be a size"):
            disk_cache.max_bytes()


def test_least_recently_used_kernels_go_past_the_cap(cache, compiled, monkeypatch):
    """Past the cap a store evicts by time of last use (a load counts as a
    use), never the kernel it just stored."""
    import time
    size = len(disk_cache._pack("ab" * 20, b"x"))  # header alone; objects are ~30 KB
    object_bytes = (1 << 20) // 4  # three fit the 1 MiB cap, a fourth spills
    monkeypatch.setenv("WARPSPLITK_CACHE_MAX_SIZE", "1M")
    monkeypatch.setattr(disk_cache, "_pack", lambda stem, obj: b"h" * size + b"\n" +
                        b"o" * object_bytes)
    now = time.time()
    for age, stem in ((400, "aa" * 20), (300, "bb" * 20), (200, "cc" * 20)):
        path = disk_cache.store(stem, compiled)
        os.utime(path, (now - age, now - age))
    disk_cache._touch(disk_cache.path_for("aa" * 20))  # the oldest, used just now
    newest = disk_cache.store("dd" * 20, compiled)
    assert sorted(p.stem for p in disk_cache.entries()) == ["aa" * 20, "cc" * 20, "dd" * 20]
    assert newest.is_file() and disk_cache.size() <= 1 << 20


def test_a_load_marks_the_kernel_used(cache, compiled):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    path = disk_cache.store(stem, compiled)
    os.utime(path, (1000, 1000))
    assert disk_cache.load(stem) is not None and path.stat().st_mtime > 1000


def test_temporaries_of_killed_processes_go_after_an_hour(cache, compiled):
    import time
    cache.mkdir(mode=0o700, parents=True)
    old, fresh = cache / ".export-old", cache / ".export-fresh"
    old.mkdir()
    (old / "partial.o").write_bytes(b"...")
    fresh.mkdir()
    stale_tmp = cache / ".tmp-abc.tmp"
    stale_tmp.write_bytes(b"...")
    hour_ago = time.time() - 3700
    for path in (old, stale_tmp):
        os.utime(path, (hour_ago, hour_ago))
    disk_cache.store("ab" * 20, compiled)
    assert not old.exists() and not stale_tmp.exists() and fresh.is_dir()


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
    real_build = compile_module.build

    def counting_build(*args, **kwargs):
        builds.append(args[:3])
        return real_build(*args, **kwargs)

    monkeypatch.setattr(compile_module, "build", counting_build)
    monkeypatch.setattr(compile_module, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(compile_module, "_initialises", lambda compiled, index, stem: True)
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
    assert "MB of 4.0 GiB (WARPSPLITK_CACHE_MAX_SIZE;" in out
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
    from warpsplitk.cli.cache import _size
    assert _size(cache / "gone.kernel") == 0
    # one another process removed first is not "could not remove"
    disk_cache.store("ef" * 20, compiled)
    monkeypatch.setattr(disk_cache, "_remove", lambda path: path.unlink() and False)
    assert main(["cache", "--clear"]) == 0
    assert "removed 0 compiled kernels" in capsys.readouterr().out


def test_prune_removes_kernels_of_other_versions_builds_or_formats(cache, compiled, monkeypatch,
                                                                   capsys):
    from warpsplitk.cli import main
    current = disk_cache.store("ab" * 20, compiled)
    assert disk_cache.stale() == []
    # a kernel left by another version of the library, and one of another DSL build
    with monkeypatch.context() as patch:
        patch.setattr(disk_cache, "_versions", lambda: {"warpsplitk": "0.0.1",
                                                        "cutlass_dsl": "4.8.1"})
        old = disk_cache.store("cd" * 20, compiled)
    with monkeypatch.context() as patch:
        real = disk_cache.build_identity()
        patch.setattr(disk_cache, "build_identity", lambda: {**real, "dsl_cuda": "12.9"})
        other_build = disk_cache.store("ee" * 20, compiled)
    # and one of the first format (an object and a note of what built it)
    legacy = cache / f"{'ef' * 20}.o"
    legacy.write_bytes(b"\x7fELF")
    (cache / f"{'ef' * 20}.build.json").write_text("{}")
    assert disk_cache.stale() == [old, other_build, legacy.with_suffix(".build.json"), legacy]
    assert main(["cache"]) == 0
    assert "4 compiled kernels" in (out := capsys.readouterr().out) and "(3 stale" in out
    assert main(["cache", "--prune"]) == 0
    assert "removed 3 stale compiled kernels" in capsys.readouterr().out
    assert disk_cache.entries() == [current]
    assert [p.name for p in cache.iterdir()] == [current.name]
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
    found = compile_module.arch_resources(N, K, TACTIC, "sm_90a")
    assert len(calls) == 1 and 16 <= found["registers"] <= 255
    assert found == {"registers": real(N, K, TACTIC, "sm_90a").registers,
                     "spill_bytes": 0, "local_bytes": 0}
    path = disk_cache.resource_path(disk_cache.key("sm_90a", N, K, TACTIC, False, True))
    assert path.is_file() and disk_cache.resource_entries() == [path]
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left
    assert compile_module.arch_resources(N, K, TACTIC, "sm_90a") == found and len(calls) == 1
    # another arch, bias or tactic is another record
    assert disk_cache.cached_resources(N, K, TACTIC, "sm_100a") is None
    assert disk_cache.cached_resources(N, K, TACTIC, has_bias=True) is None


def test_resources_hit_without_compiling_or_torch(cache):
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    disk_cache.store_resources(stem, {"registers": 77, "spill_bytes": 8, "local_bytes": 16})
    probe = (
        "import sys\n"
        "from warpsplitk.runtime import compile, disk_cache\n"
        "from warpsplitk.tactics import WarpSplitKTactic\n"
        "compile.compile_for_arch = lambda *a, **k: sys.exit('compiled instead of reading')\n"
        f"found = compile.arch_resources({N}, {K}, WarpSplitKTactic.parse({TACTIC.short()!r}))\n"
        "print(found['registers'], found['spill_bytes'], 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["77", "8", "False"]


def test_resources_switched_off(cache, monkeypatch):
    from warpsplitk.runtime import compile as compile_module
    calls = []

    class Report:
        registers, spill_bytes, local_bytes = 40, 0, 0

    monkeypatch.setattr(compile_module, "compile_for_arch",
                        lambda *a, **k: calls.append(a) or Report())
    stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "0")
    assert compile_module.arch_resources(N, K, TACTIC)["registers"] == 40
    assert compile_module.arch_resources(N, K, TACTIC)["registers"] == 40
    assert len(calls) == 2 and not cache.exists()
    assert disk_cache.store_resources(stem, {"registers": 1}) is None
    from warpsplitk.runtime.precompile import precompile_resources
    assert precompile_resources([(N, K, TACTIC, False, True)]) == {} and len(calls) == 2
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "1")
    disk_cache.store_resources(stem, {"registers": 50, "spill_bytes": 0, "local_bytes": 0})
    monkeypatch.setenv("WARPSPLITK_DISK_CACHE", "off")
    assert disk_cache.load_resources(stem) is None
    assert compile_module.arch_resources(N, K, TACTIC)["registers"] == 40


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


# ------------------------------------------------ two Unix users


_VICTIM_PROBE = """
import site, sys, warnings
for path in sys.argv[3:]:
    site.addsitedir(path)
import cutlass.cute as cute
def planted_code_ran(*args, **kwargs):
    print("PLANTED CODE RAN", flush=True)
    sys.exit(7)
cute.runtime.load_module = planted_code_ran
from warpsplitk.runtime import disk_cache
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    found = disk_cache.load(sys.argv[1])
    stored = disk_cache.store(sys.argv[2], object())
print("loaded", found is not None, "stored", stored is not None)
for w in caught:
    print("warning:", w.message)
"""


def _user(name):
    import pwd
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name],
                   capture_output=True, check=False)
    return pwd.getpwnam(name)


def _runnable_as(user, env):
    """An interpreter ``user`` can run with this package and its DSL: this
    one, else the system's of the same version with this one's site folders
    (the venv's interpreter may sit in a folder only root can enter)."""
    import site
    import shutil
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python, extra in ((sys.executable, []),
                          (shutil.which(version, path="/usr/bin:/usr/local/bin"),
                           site.getsitepackages())):
        if not python:
            continue
        try:
            done = subprocess.run([python, "-c", "import site, sys\n"
                                   "[site.addsitedir(p) for p in sys.argv[1:]]\n"
                                   "import cutlass, warpsplitk.runtime.disk_cache", *extra],
                                  user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env,
                                  capture_output=True, timeout=120, cwd="/")
        except PermissionError:  # the interpreter is in a folder the user cannot enter
            continue
        if done.returncode == 0:
            return python, extra
    return None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to create two users")
def test_a_kernel_planted_by_another_user_never_runs(compiled):
    """The cross-user plant, scripted: user A plants a valid kernel file under
    the key user B's process will ask for, in B's world-writable cache
    folder or in a folder of A's that B was pointed at. B's process refuses the folder
    and the file with a warning naming them: the loader never sees A's
    bytes, and B stores nothing there either."""
    import shutil
    import tempfile
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd")
    attacker, victim = _user("wsk-plant-a"), _user("wsk-plant-b")
    base = Path(tempfile.mkdtemp(prefix="wsk-users-", dir="/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home-b"
        home.mkdir()
        os.chown(home, victim.pw_uid, victim.pw_gid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CUTE_DSL_ARCH": "sm_90a",
               "PYTHONPATH": str(SRC)}
        runnable = _runnable_as(victim, env)
        if runnable is None:
            pytest.skip("no interpreter with this package that another user can run")
        python, sites = runnable
        stem = disk_cache.key("sm_90a", N, K, TACTIC, False, True)
        # A's folder and A's valid kernel file under B's key (made by root, then handed to A)
        shared = base / "shared-cache"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("WARPSPLITK_CACHE_DIR", str(shared))
            disk_cache.store(stem, compiled)
        planted = disk_cache._pack(stem, disk_cache.unpack(
            stem, (shared / f"{stem}.kernel").read_bytes()))
        for path in (shared, shared / f"{stem}.kernel"):
            os.chown(path, attacker.pw_uid, attacker.pw_gid)
        assert (shared / f"{stem}.kernel").read_bytes() == planted
        outcomes = {}
        # B's folder left world-writable (a careless operator), then a folder of A's
        for mode, owner in ((0o777, victim), (0o755, attacker)):
            os.chown(shared, owner.pw_uid, owner.pw_gid)
            shared.chmod(mode)
            done = subprocess.run([python, "-c", _VICTIM_PROBE, stem, "cd" * 20, *sites],
                                  user=victim.pw_uid, group=victim.pw_gid, extra_groups=[],
                                  env={**env, "WARPSPLITK_CACHE_DIR": str(shared)},
                                  capture_output=True, text=True, timeout=300, cwd="/")
            outcomes[mode] = done
            assert done.returncode == 0, done.stdout + done.stderr[-2000:]
            assert "PLANTED CODE RAN" not in done.stdout
            assert "loaded False stored False" in done.stdout
            assert f"not using {shared}:" in done.stdout
        assert "writable by group and others" in outcomes[0o777].stdout
        assert f"owned by uid {attacker.pw_uid}" in outcomes[0o755].stdout
        # B's own private folder holding a file A owns (a planted file): refused too
        own = base / "own-cache"
        own.mkdir(mode=0o700)
        shutil.copy(shared / f"{stem}.kernel", own / f"{stem}.kernel")
        os.chown(own, victim.pw_uid, victim.pw_gid)
        os.chown(own / f"{stem}.kernel", attacker.pw_uid, attacker.pw_gid)
        (own / f"{stem}.kernel").chmod(0o644)
        done = subprocess.run([python, "-c", _VICTIM_PROBE, stem, "cd" * 20, *sites],
                              user=victim.pw_uid, group=victim.pw_gid, extra_groups=[],
                              env={**env, "WARPSPLITK_CACHE_DIR": str(own)},
                              capture_output=True, text=True, timeout=300, cwd="/")
        assert done.returncode == 0 and "PLANTED CODE RAN" not in done.stdout, done.stderr[-2000:]
        assert f"not using {own / (stem + '.kernel')}: owned by uid {attacker.pw_uid}" in done.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for name in ("wsk-plant-a", "wsk-plant-b"):
            subprocess.run(["userdel", name], capture_output=True, check=False)
