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
_SOURCES = ("kernel.py", "layout.py", "ptx.py", "tactics.py", "compile.py")

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
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "warpsplitk"


@functools.cache
def _sources_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()


@functools.cache
def _versions() -> dict:
    from importlib import metadata

    from . import __version__
    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        dsl = "unknown"
    return {"warpsplitk": __version__, "cutlass_dsl": dsl}


def key(arch: str, n: int, k: int, tactic, has_bias: bool, use_pdl: bool, arrivals: str = "",
        early_launch: bool = False, release_fence: str = "proxy",
        remote_release: str = "cluster", split_reduce: str = "mbarrier") -> str:
    """The file name stem of one compiled kernel (hex, 40 characters)."""
    fields = {
        "format": FORMAT, **_versions(), "sources": _sources_digest(), "arch": arch,
        "n": int(n), "k": int(k), "tactic": tactic.short(), "k_split": tactic.k_split,
        "bias": bool(has_bias), "pdl": bool(use_pdl), "arrivals": arrivals,
        "early_launch": bool(early_launch),
    }
    if release_fence != "proxy":  # the experimental and diagnostic builds only
        fields["release_fence"] = release_fence
    if remote_release != "cluster":
        fields["remote_release"] = remote_release
    if split_reduce != "mbarrier":
        fields["split_reduce"] = split_reduce
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
    try:
        import cutlass.cute as cute
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
    """Cached kernels built by another warpsplitk or CuTe DSL version or from
    other kernel sources (their keys can never be asked for again), or
    without a record of what built them."""
    current = _generation()
    found = []
    for path in entries():
        try:
            built = json.loads(_generation_path(path).read_text())
        except (OSError, ValueError):
            built = None
        if built != current:
            found.append(path)
    return found


def _remove(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    try:
        _generation_path(path).unlink()
    except OSError:
        pass
    return True


def prune() -> int:
    """Remove the stale kernels (``stale``); returns how many."""
    return sum(_remove(path) for path in stale())


def clear() -> int:
    """Remove every cached kernel; returns how many files were removed."""
    removed = sum(_remove(path) for path in entries())
    folder = cache_dir()
    if folder.is_dir():
        for scratch in folder.glob(".export-*"):
            shutil.rmtree(scratch, ignore_errors=True)
    return removed


__all__ = ["cache_dir", "enabled", "key", "load", "store", "entries", "stale", "prune", "clear",
           "path_for"]
