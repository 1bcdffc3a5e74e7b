"""Compiled kernels kept on disk, so a second process does not compile again.

``cute.compile`` never consults the CuTe DSL's own file cache (it forces
``no_cache``), so without this every process pays ~1 s of compilation per
kernel: ~50 s to prepare a whole model. The DSL can export compiled code as
an object file (host launch stub plus the embedded CUBIN) and load it back
into a process (``cute.runtime.load_module``); this module keys those files
by everything that decides the code:

* the kernel's own inputs: target arch, N, K, the tactic, bias, PDL;
* the versions of warpsplitk and of the CuTe DSL;
* a hash of the package's kernel-building sources, so an edited kernel
  never picks up an old build.

A file is written under a temporary name and renamed into place, so several
processes (tensor-parallel ranks, say) can fill the cache at once. A file
that fails to load is removed and the kernel compiled again: the cache can
make a start faster, never make it fail.

Beside the kernels, small JSON records of what compiling a kernel for an
arch without a GPU reports (registers, spills: ``arch_resources``), under
the same key, so ``warpsplitk plan`` shows compiled register counts
without compiling again (and without importing the CuTe DSL at all when
every record is there).

``WARPSPLITK_CACHE_DIR`` sets the folder (default
``$XDG_CACHE_HOME/warpsplitk``, else ``~/.cache/warpsplitk``);
``WARPSPLITK_DISK_CACHE=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

#: Bump when the key's meaning or the file format changes.
FORMAT = 1

#: The modules whose text decides the compiled code.
_SOURCES = ("kernel/warp_splitk.py", "kernel/layout.py", "kernel/ptx.py", "tactics.py",
            "runtime/compile.py")

_warned = set()
_warn_lock = threading.Lock()


def _warn_once(kind: str, message: str) -> None:
    with _warn_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(f"warpsplitk disk cache: {message}", RuntimeWarning, stacklevel=3)


def enabled() -> bool:
    return os.environ.get("WARPSPLITK_DISK_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """The folder the compiled kernels are kept in (not created here)."""
    explicit = os.environ.get("WARPSPLITK_CACHE_DIR")
    if explicit:
        try:
            return Path(explicit).expanduser()
        except RuntimeError:  # "~user/..." of a user this machine lacks
            raise ValueError(f"WARPSPLITK_CACHE_DIR={explicit!r}: its '~' names no home "
                             "folder here") from None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "warpsplitk"


@functools.cache
def _sources_digest() -> str:
    package = Path(__file__).parents[1]
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((package / name).read_bytes())
    return h.hexdigest()


@functools.cache
def _versions() -> dict:
    from importlib import metadata

    from .. import __version__
    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        dsl = "unknown"
    return {"warpsplitk": __version__, "cutlass_dsl": dsl}


def key(arch: str, n: int, k: int, tactic, has_bias: bool, use_pdl: bool,
        swiglu: bool = False) -> str:
    """The file name stem of one compiled kernel (hex, 40 characters)."""
    fields = {
        "format": FORMAT, **_versions(), "sources": _sources_digest(), "arch": arch,
        "n": int(n), "k": int(k), "tactic": tactic.short(), "k_split": tactic.k_split,
        "bias": bool(has_bias), "pdl": bool(use_pdl),
        # the shipped build's values of the build switches these once had
        "arrivals": "", "early_launch": False,
    }
    if swiglu:  # (a field only when set: the other kernels keep their keys)
        fields["swiglu"] = True
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]


def _generation() -> dict:
    # what makes a kernel file stale when it changes: this library's and
    # the DSL's versions and the kernel sources (written beside each file)
    return {**_versions(), "sources": _sources_digest()}


def _generation_path(path: Path) -> Path:
    return path.with_suffix(".build.json")


def _symbol(stem: str) -> str:
    # the exported functions' symbol prefix: a C identifier, unique per kernel
    return f"warpsplitk_{stem}"


def path_for(stem: str) -> Path:
    return cache_dir() / f"{stem}.o"


def load(stem: str):
    """The compiled kernel stored under ``stem``, or None (absent, disabled,
    or unreadable: an unreadable file is removed)."""
    if not enabled():
        return None
    path = path_for(stem)
    if not path.is_file():
        return None
    from .compile import import_dsl
    _, cute = import_dsl()  # a missing DSL is said, and the file kept: it is not the file's fault
    try:
        module = cute.runtime.load_module(str(path))
        return module[_symbol(stem)]
    except Exception as exc:  # a truncated, foreign or stale file: compile again
        _warn_once("load", f"could not load {path} ({type(exc).__name__}: {exc}); "
                           "compiling instead and replacing it")
        _remove(path)
        return None


def store(stem: str, compiled) -> Path | None:
    """Write ``compiled`` (a ``cute.compile`` result) under ``stem``; returns
    the file, or None when the cache is off or the write failed (warned
    once: the kernel still runs, only the next process compiles again)."""
    if not enabled():
        return None
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=folder) as scratch:
            compiled.export_to_c(scratch, stem, _symbol(stem))
            produced = Path(scratch) / f"{stem}.o"
            # rename within one file system: readers see all of it or nothing
            final = path_for(stem)
            os.replace(produced, final)
            generation = Path(scratch) / "generation.json"
            generation.write_text(json.dumps(_generation(), sort_keys=True))
            os.replace(generation, _generation_path(final))
        return final
    except Exception as exc:
        _warn_once("store", f"could not write to {folder} ({type(exc).__name__}: {exc}); "
                            "compiled kernels are kept in this process only")
        return None


def entries() -> list[Path]:
    folder = cache_dir()
    return sorted(folder.glob("*.o")) if folder.is_dir() else []


def stale() -> list[Path]:
    """Cached kernels and resource records built by another warpsplitk or
    CuTe DSL version or from other kernel sources (their keys can never be
    asked for again), or without a record of what built them."""
    current = _generation()
    found = []
    for path in entries():
        try:
            built = json.loads(_generation_path(path).read_text())
        except (OSError, ValueError):
            built = None
        if built != current:
            found.append(path)
    for path in resource_entries():
        try:
            record = json.loads(path.read_text())
            built = {name: record.get(name) for name in current}
        except (OSError, ValueError, AttributeError):
            built = None
        if built != current:
            found.append(path)
    return found


# ------------------------------------------------ resource records (no GPU)

#: What a resource record holds besides the generation (``_generation``).
RESOURCE_FIELDS = ("registers", "spill_bytes", "local_bytes")

_RESOURCE_SUFFIX = ".resources.json"


def resource_path(stem: str) -> Path:
    return cache_dir() / f"{stem}{_RESOURCE_SUFFIX}"


def resource_entries() -> list[Path]:
    folder = cache_dir()
    return sorted(folder.glob(f"*{_RESOURCE_SUFFIX}")) if folder.is_dir() else []


def load_resources(stem: str) -> dict | None:
    """The resource record stored under ``stem`` (``{"registers",
    "spill_bytes", "local_bytes"}``), or None (absent, disabled, unreadable
    or from another generation: an unreadable file is removed)."""
    if not enabled():
        return None
    path = resource_path(stem)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        record = None
    # a count, or None where the compiler reported none
    if not isinstance(record, dict) or any(
            name not in record or (record[name] is not None
                                   and (type(record[name]) is not int or record[name] < 0))
            for name in RESOURCE_FIELDS):
        # unreadable, or not counts (registers, bytes): never shown, compiled again
        _warn_once("resources", f"removed the unreadable resource record {path}; compiling "
                                "again")
        _remove_file(path)
        return None
    if any(record.get(name) != value for name, value in _generation().items()):
        return None  # another version's (a key collision in name only): compile again
    return {name: record[name] for name in RESOURCE_FIELDS}


def store_resources(stem: str, resources: dict, describe=None) -> Path | None:
    """Write a resource record under ``stem``, atomically (a temporary file
    renamed into place), with ``describe`` (``(n, k, tactic, arch)``, what
    ``warpsplitk cache --list`` shows) if given; None when the cache is off
    or the write failed (warned once)."""
    if not enabled():
        return None
    folder = cache_dir()
    record = {**{name: resources.get(name) for name in RESOURCE_FIELDS}, **_generation()}
    if describe is not None:
        n, k, tactic, arch = describe
        record.update(n=int(n), k=int(k), tactic=tactic.short(), arch=arch)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".resources-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, sort_keys=True)
            final = resource_path(stem)
            os.replace(scratch, final)
        except BaseException:
            _remove_file(Path(scratch))
            raise
        return final
    except Exception as exc:
        _warn_once("store", f"could not write to {folder} ({type(exc).__name__}: {exc}); "
                            "compiled kernels are kept in this process only")
        return None


def cached_resources(n: int, k: int, tactic, arch: str = "sm_90a", has_bias: bool = False,
                     use_pdl: bool = True) -> dict | None:
    """``arch_resources``' record if the cache holds it, else None (never compiles)."""
    return load_resources(key(arch, n, k, tactic, has_bias, use_pdl))


def arch_resources(n: int, k: int, tactic, arch: str = "sm_90a", has_bias: bool = False,
                   use_pdl: bool = True) -> dict:
    """Registers per thread, spilled and local bytes of the kernel for
    ``[n, k]`` with ``tactic``, compiled for ``arch`` (no GPU needed):
    ``{"registers", "spill_bytes", "local_bytes"}``. From the disk cache
    when it has the record (the CuTe DSL is then not imported), else
    compiled with ``warpsplitk.runtime.compile.compile_for_arch`` and stored."""
    stem = key(arch, n, k, tactic, has_bias, use_pdl)
    found = load_resources(stem)
    if found is not None:
        return found
    from .compile import compile_for_arch
    report = compile_for_arch(n, k, tactic, arch, has_bias=has_bias, use_pdl=use_pdl)
    found = {"registers": report.registers, "spill_bytes": report.spill_bytes,
             "local_bytes": report.local_bytes}
    store_resources(stem, found, describe=(n, k, tactic, arch))
    return found


def describe_resources(path: Path) -> str:
    """One line about a resource record: what it is of and what it says."""
    try:
        record = json.loads(Path(path).read_text())
        what = (f"{record.get('arch', '?')} N={record.get('n', '?')} K={record.get('k', '?')} "
                f"tactic={record.get('tactic', '?')}")
        return (f"{what}: {record['registers']} registers, {record['spill_bytes']} B spilled "
                f"({Path(path).name})")
    except (OSError, ValueError, KeyError, AttributeError):
        return f"{Path(path).name}: unreadable"


def _remove_file(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _remove(path: Path) -> bool:
    if path.name.endswith(_RESOURCE_SUFFIX):
        return _remove_file(path)
    if not _remove_file(path):
        return False
    try:
        _generation_path(path).unlink()
    except OSError:
        pass
    return True


def _remove_each(paths, detail):
    kernels = records = 0
    kept = []
    for path in paths:
        if not _remove(path):
            if path.exists() or path.is_symlink():  # else another process removed it
                kept.append(path)
        elif path.name.endswith(_RESOURCE_SUFFIX):
            records += 1
        else:
            kernels += 1
    return (kernels, records, kept) if detail else kernels + records


def prune(detail: bool = False):
    """Remove the stale kernels and resource records (``stale``); returns how
    many were removed (``detail``: ``(kernels, records, [paths not removed])``)."""
    return _remove_each(stale(), detail)


def clear(detail: bool = False):
    """Remove every cached kernel and resource record; returns how many were
    removed (``detail``: as :func:`prune`)."""
    removed = _remove_each(entries() + resource_entries(), detail)
    folder = cache_dir()
    if folder.is_dir():
        for scratch in folder.glob(".export-*"):
            shutil.rmtree(scratch, ignore_errors=True)
        for scratch in folder.glob(".resources-*.tmp"):
            _remove_file(scratch)
    return removed


__all__ = ["cache_dir", "enabled", "key", "load", "store", "entries", "stale", "prune", "clear",
           "path_for", "arch_resources", "cached_resources", "load_resources",
           "store_resources", "resource_entries", "resource_path", "describe_resources"]
