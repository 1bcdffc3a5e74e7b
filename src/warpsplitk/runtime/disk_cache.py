"""Compiled kernels kept on disk, so a second process does not compile again.

``cute.compile`` never consults the CuTe DSL's own file cache (it forces
``no_cache``), so without this every process pays ~1 s of compilation per
kernel: ~50 s to prepare a whole model. The DSL can export compiled code as
an object file (host launch stub plus the embedded CUBIN) and load it back
into a process (``cute.runtime.load_module``, which links the object's host
code into the process). Loading a file is running its code, so this cache
trusts nothing it cannot show this user wrote for this exact build:

* **Where.** The folder (``cache_dir``) is created ``0700`` and used only
  while it and each file in it belong to this user and no one else can
  write them; files are opened without following links
  (:mod:`warpsplitk.runtime.private_files`). Anything else is one warning
  naming the path and the reason, and kernels stay in the process.
* **What.** The key (``key``) covers everything that decides the code: the
  kernel's own inputs (target arch, N, K, the tactic, bias, PDL, SwiGLU),
  the versions of warpsplitk and of the CuTe DSL, a hash of the package's
  kernel-building sources, the DSL's CUDA build, every DSL setting the DSL
  itself declares to affect compilation (compiler options, line info, ...)
  and the host machine type.
* **Whole.** A stored kernel is one file: a header line (format, key,
  build, object size, SHA-256 of the header's fields and the object bytes)
  then the object. ``load`` reads it once, checks the header names the
  asked-for key and the digest matches, and hands exactly the bytes it
  checked to the loader (through an anonymous in-memory file). A mismatch
  is a warning, a deletion and a compile, never a load.

A file is written under a temporary name and renamed into place, so several
processes (tensor-parallel ranks, say) can fill the cache at once. The
cache holds at most ``max_bytes`` (``WARPSPLITK_CACHE_MAX_SIZE``, default 4
GiB): a store evicts the least recently used kernels past it, and removes
temporary files and export folders a killed process left over an hour ago.

Beside the kernels, small JSON records of what compiling a kernel for an
arch without a GPU reports (registers, spills: ``compile.arch_resources``), under
the same key, so ``warpsplitk plan`` shows compiled register counts
without compiling again.

``WARPSPLITK_CACHE_DIR`` sets the folder (default
``$XDG_CACHE_HOME/warpsplitk``, else ``~/.cache/warpsplitk``);
``WARPSPLITK_DISK_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from ..jsonfile import loads
from ..version import __version__
from . import private_files
from .dsl import import_dsl
from .private_files import UntrustedPath

#: Bump when the key's meaning or the file format changes.
FORMAT = 2

#: The modules whose text decides the compiled code.
_SOURCES = ("kernel/warp_splitk.py", "kernel/layout.py", "kernel/ptx.py", "tactics.py",
            "runtime/compile.py")

#: A stored kernel: ``<key>.kernel`` (header line, then the object bytes).
KERNEL_SUFFIX = ".kernel"
#: Files of the first format (an object and a ``.build.json`` beside it): never
#: loaded, listed as stale so ``warpsplitk cache --prune`` removes them.
_LEGACY_SUFFIXES = (".o", ".build.json")
#: Temporaries a killed process can leave behind (``remove_stale_scratch``).
_SCRATCH = (".export-*", ".tmp-*.tmp", ".resources-*.tmp")
#: The longest header line read (a header is ~600 bytes).
_MAX_HEADER = 1 << 16

_warned = set()
_warn_lock = threading.Lock()


def _warn_once(kind: str, message: str) -> None:
    with _warn_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(f"warpsplitk disk cache: {message}", RuntimeWarning, stacklevel=3)


def _untrusted(error: UntrustedPath) -> None:
    # once per cache folder: a process pointed at a second untrusted folder
    # (another WARPSPLITK_CACHE_DIR, another user's) hears of that one too
    _warn_once(f"untrusted {cache_dir()}",
               f"not using {error.path}: {error.reason}; compiled kernels are "
               "kept in this process only (docs/reliability.md, Security model)")


_SWITCH = {"1": True, "on": True, "true": True, "yes": True, "enable": True, "enabled": True,
           "0": False, "off": False, "false": False, "no": False, "disable": False,
           "disabled": False}


def enabled() -> bool:
    """Whether the disk cache is on (``WARPSPLITK_DISK_CACHE``: on unless set
    to 0/off/false/no/disable; any other value is a ``ValueError``)."""
    value = os.environ.get("WARPSPLITK_DISK_CACHE", "").strip().lower()
    if not value:
        return True
    if value not in _SWITCH:
        raise ValueError(f"WARPSPLITK_DISK_CACHE must be on or off (1/on/true/yes/enable or "
                         f"0/off/false/no/disable), got {os.environ['WARPSPLITK_DISK_CACHE']!r}")
    return _SWITCH[value]


def cache_dir() -> Path:
    """The folder the compiled kernels are kept in (absolute; not created here)."""
    explicit = os.environ.get("WARPSPLITK_CACHE_DIR")
    if explicit:
        try:
            return Path(explicit).expanduser().absolute()
        except RuntimeError:  # "~user/..." of a user this machine lacks
            raise ValueError(f"WARPSPLITK_CACHE_DIR={explicit!r}: its '~' names no home "
                             "folder here") from None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(base) / "warpsplitk").absolute()


#: The default of ``max_bytes``: ~100,000 kernels of ~30 KB, thousands of models.
DEFAULT_MAX_BYTES = 4 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def max_bytes() -> int:
    """The cache's size cap: ``WARPSPLITK_CACHE_MAX_SIZE`` (bytes, or with a
    K, M, G or T suffix, powers of 1024: ``500M``, ``8G``), else 4 GiB."""
    text = os.environ.get("WARPSPLITK_CACHE_MAX_SIZE", "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text.lower())
    if not found or float(found[1]) * _UNITS[found[2]] < 1 << 20:
        raise ValueError(f"WARPSPLITK_CACHE_MAX_SIZE must be a size of at least 1M (bytes, or "
                         f"with a K/M/G/T suffix: 500M, 8G), got {text!r}")
    return int(float(found[1]) * _UNITS[found[2]])


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

    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        dsl = "unknown"
    return {"warpsplitk": __version__, "cutlass_dsl": dsl}


def _dsl_settings() -> dict:
    """The DSL's settings that change compiled code, as the DSL itself
    declares them (``affects_compile``), read as this process's DSL reads
    them (once per process). The target arch is left out: the key names it,
    and the compile passes it explicitly."""
    try:
        from cutlass.cutlass_dsl.cutlass import CuTeDSLEnvironmentManager
        manager = CuTeDSLEnvironmentManager("CUTE_DSL")
        return {entry.key_name: repr(getattr(manager, entry.attribute))
                for entry in manager._ENV_VAR_SPEC
                if entry.affects_compile and entry.key_name != "arch"}
    except (ImportError, AttributeError):  # a DSL that declares them otherwise:
        # every one of its variables then (over-keying only costs a compile)
        return {name: value for name, value in sorted(os.environ.items())
                if name.startswith("CUTE_DSL_") and name != "CUTE_DSL_ARCH"}


@functools.cache
def build_identity() -> dict:
    """What besides the kernel's inputs decides the code this process
    compiles: the DSL's CUDA build and compile settings and the host
    machine (imports the CuTe DSL; computed once per process)."""
    import_dsl()
    from cutlass.base_dsl.version_info import CUDA_VERSION
    return {"dsl_cuda": f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}",
            "dsl_settings": _dsl_settings(),
            "machine": f"{sys.platform}-{platform.machine()}"}


def key(arch: str, n: int, k: int, tactic, has_bias: bool, use_pdl: bool,
        swiglu: bool = False, fp8_scales: str | None = None) -> str:
    """The file name stem of one compiled kernel (hex, 40 characters);
    ``fp8_scales``: the FP8-weight kernel with those scales."""
    fields = {
        "format": FORMAT, **_versions(), "sources": _sources_digest(), **build_identity(),
        "arch": arch, "n": int(n), "k": int(k), "tactic": tactic.short(),
        "k_split": tactic.k_split, "bias": bool(has_bias), "pdl": bool(use_pdl),
        "swiglu": bool(swiglu),
    }
    if fp8_scales is not None:  # (absent for BF16: those keys stay as they were)
        fields["fp8_scales"] = str(fp8_scales)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]


def _generation() -> dict:
    # what makes a kernel file stale when it changes: this library's and
    # the DSL's versions, the kernel sources and the build (in each header)
    return {**_versions(), "sources": _sources_digest(), **build_identity()}


def _symbol(stem: str) -> str:
    # the exported functions' symbol prefix: a C identifier, unique per kernel
    return f"warpsplitk_{stem}"


def path_for(stem: str) -> Path:
    return cache_dir() / f"{stem}{KERNEL_SUFFIX}"


# ------------------------------------------------ the kernel file


def _digest(header: dict, obj: bytes) -> str:
    # the header's fields (all but the digest itself), then the object
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"},
                                  sort_keys=True).encode())
    h.update(b"\0")
    h.update(obj)
    return h.hexdigest()


def _pack(stem: str, obj: bytes) -> bytes:
    header = {"format": FORMAT, "key": stem, "build": _generation(), "object_bytes": len(obj)}
    header["sha256"] = _digest(header, obj)
    return json.dumps(header, sort_keys=True).encode() + b"\n" + obj


def _header(data: bytes, where) -> dict:
    """The header of a stored kernel's bytes (``ValueError`` if there is none)."""
    end = data.find(b"\n", 0, _MAX_HEADER)
    if end < 0:
        raise ValueError(f"{where}: no header line")
    header = loads(data[:end].decode("utf-8", "replace"), str(where))
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the header is not an object")
    return header


def unpack(stem: str, data: bytes, where="kernel file") -> bytes:
    """The object bytes of a stored kernel ``data`` if its header names
    ``stem`` in this format and its digest matches; else ``ValueError``."""
    header = _header(data, where)
    obj = data[data.index(b"\n") + 1:]
    if header.get("format") != FORMAT or header.get("key") != stem:
        raise ValueError(f"{where}: the header names another kernel or format")
    if header.get("object_bytes") != len(obj):
        raise ValueError(f"{where}: {len(obj)} object bytes, the header says "
                         f"{header.get('object_bytes')!r} (a partial or altered file)")
    if header.get("sha256") != _digest(header, obj):
        raise ValueError(f"{where}: the digest does not match its contents (an altered file)")
    return obj


def _load_object(obj: bytes, scratch_dir: Path):
    """The DSL module of object bytes ``obj``, loaded from an anonymous
    in-memory file (never from a path another process could swap)."""
    _, cute = import_dsl()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("warpsplitk-kernel", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, obj)
            return cute.runtime.load_module(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    # no anonymous files: a private copy in the (already checked) cache folder
    fd, copy = tempfile.mkstemp(prefix=".tmp-", suffix=".tmp", dir=scratch_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(obj)
        return cute.runtime.load_module(copy)
    finally:
        os.unlink(copy)


def load(stem: str):
    """The compiled kernel stored under ``stem``, or None: absent, cache off,
    untrusted (warned; the file is left alone), or failing its checks or the
    loader (warned; the file is removed, the caller compiles again)."""
    if not enabled():
        return None
    path = path_for(stem)
    try:
        private_files.check_dir(path.parent)
        data = private_files.read_bytes(path)
    except FileNotFoundError:
        return None
    except UntrustedPath as error:
        _untrusted(error)
        return None
    except OSError as error:
        _warn_once("read", f"could not read {path} ({error}); compiling instead")
        return None
    import_dsl()  # a missing DSL is said, and the file kept: it is not the file's fault
    try:
        module = _load_object(unpack(stem, data, path), path.parent)
        compiled = module[_symbol(stem)]
    except Exception as exc:  # altered, partial, foreign or stale: compile again
        discard(stem, f"could not load {path} ({type(exc).__name__}: {exc})")
        return None
    _touch(path)
    return compiled


def discard(stem: str, why: str) -> None:
    """Remove the kernel stored under ``stem`` (it failed a check, or the
    loaded module failed to initialise), warning once with ``why``."""
    _warn_once("load", f"{why}; compiling instead and replacing it")
    _remove_file(path_for(stem))


def _touch(path: Path) -> None:
    # the time of last use, which eviction goes by (access times are often off)
    try:
        os.utime(path)
    except OSError:
        pass


def store(stem: str, compiled) -> Path | None:
    """Write ``compiled`` (a ``cute.compile`` result) under ``stem``; returns
    the file, or None when the cache is off, untrusted or the write failed
    (warned once: the kernel still runs, only the next process compiles
    again). Evicts the least recently used kernels past ``max_bytes`` and
    removes temporaries older than an hour."""
    if not enabled():
        return None
    folder = cache_dir()
    try:
        private_files.private_dir(folder)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=folder) as scratch:
            compiled.export_to_c(scratch, stem, _symbol(stem))
            obj = (Path(scratch) / f"{stem}.o").read_bytes()
        final = private_files.write_atomic(path_for(stem), _pack(stem, obj))
    except UntrustedPath as error:
        _untrusted(error)
        return None
    except Exception as exc:
        _warn_once("store", f"could not write to {folder} ({type(exc).__name__}: {exc}); "
                            "compiled kernels are kept in this process only")
        return None
    housekeeping(keep=final)
    return final


def writable() -> str | None:
    """Why this process cannot store kernels (off, untrusted, not writable),
    or None: asked before handing compiles to workers that would store."""
    if not enabled():
        return "the disk cache is off (WARPSPLITK_DISK_CACHE)"
    folder = cache_dir()
    try:
        private_files.private_dir(folder)
    except UntrustedPath as error:
        _untrusted(error)
        return f"{error.path}: {error.reason}"
    except OSError as error:
        return f"{folder}: {error.strerror or error}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder}: not writable"
    return None


def housekeeping(keep: Path | None = None) -> tuple[int, int]:
    """Remove temporaries older than an hour, then the least recently used
    kernels and records while the cache is over ``max_bytes`` (never
    ``keep``). Returns ``(scratch removed, files evicted)``."""
    folder = cache_dir()
    scratch = private_files.remove_stale_scratch(folder, _SCRATCH)
    limit = max_bytes()
    files = []
    for path in entries() + resource_entries() + legacy_entries():
        try:
            st = os.lstat(path)
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    evicted = 0
    for _, size, path in sorted(files):
        if total <= limit:
            break
        if path != keep and _remove(path):
            total -= size
            evicted += 1
    return scratch, evicted


def size() -> int:
    """Bytes held by the cache's kernels and records."""
    total = 0
    for path in entries() + resource_entries() + legacy_entries():
        try:
            total += os.lstat(path).st_size
        except OSError:
            pass
    return total


def entries() -> list[Path]:
    folder = cache_dir()
    return sorted(folder.glob(f"*{KERNEL_SUFFIX}")) if folder.is_dir() else []


def legacy_entries() -> list[Path]:
    """Kernel files of an earlier format (never loaded; stale)."""
    folder = cache_dir()
    if not folder.is_dir():
        return []
    return sorted(p for suffix in _LEGACY_SUFFIXES for p in folder.glob(f"*{suffix}"))


def _stored_generation(path: Path):
    # a kernel's header, read up to its first line (never the whole object)
    try:
        with os.fdopen(private_files.open_file(path), "rb") as f:
            return _header(f.read(_MAX_HEADER), path).get("build")
    except (OSError, ValueError):
        return None


def stale() -> list[Path]:
    """Cached kernels and resource records built by another warpsplitk or
    CuTe DSL version or build, from other kernel sources, unreadable, or of
    an earlier file format (their keys can never be asked for again)."""
    current = _generation()
    found = [path for path in entries() if _stored_generation(path) != current]
    for path in resource_entries():
        try:
            record = loads(private_files.read_bytes(path).decode("utf-8"), str(path))
            built = {name: record.get(name) for name in current}
        except (OSError, ValueError, AttributeError):
            built = None
        if built != current:
            found.append(path)
    return found + legacy_entries()


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
    "spill_bytes", "local_bytes"}``), or None (absent, disabled, untrusted,
    unreadable or from another generation: an unreadable file is removed)."""
    if not enabled():
        return None
    path = resource_path(stem)
    try:
        private_files.check_dir(path.parent)
        text = private_files.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except UntrustedPath as error:
        _untrusted(error)
        return None
    except (OSError, UnicodeDecodeError):
        text = None
    try:
        record = loads(text, str(path)) if text is not None else None
    except ValueError:
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
    ``warpsplitk cache --list`` shows) if given; None when the cache is off,
    untrusted or the write failed (warned once)."""
    if not enabled():
        return None
    folder = cache_dir()
    record = {**{name: resources.get(name) for name in RESOURCE_FIELDS}, **_generation()}
    if describe is not None:
        n, k, tactic, arch = describe
        record.update(n=int(n), k=int(k), tactic=tactic.short(), arch=arch)
    try:
        private_files.private_dir(folder)
        return private_files.write_atomic(resource_path(stem),
                                          json.dumps(record, sort_keys=True).encode(),
                                          prefix=".resources-")
    except UntrustedPath as error:
        _untrusted(error)
        return None
    except Exception as exc:
        _warn_once("store", f"could not write to {folder} ({type(exc).__name__}: {exc}); "
                            "compiled kernels are kept in this process only")
        return None


def cached_resources(n: int, k: int, tactic, arch: str = "sm_90a", has_bias: bool = False,
                     use_pdl: bool = True) -> dict | None:
    """``arch_resources``' record if the cache holds it, else None (never compiles)."""
    return load_resources(key(arch, n, k, tactic, has_bias, use_pdl))


def describe_resources(path: Path) -> str:
    """One line about a resource record: what it is of and what it says."""
    try:
        record = loads(private_files.read_bytes(path).decode("utf-8"), str(path))
        what = (f"{record.get('arch', '?')} N={record.get('n', '?')} K={record.get('k', '?')} "
                f"tactic={record.get('tactic', '?')}")
        return (f"{what}: {record['registers']} registers, {record['spill_bytes']} B spilled "
                f"({Path(path).name})")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return f"{Path(path).name}: unreadable"


def _remove_file(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _remove(path: Path) -> bool:
    return _remove_file(path)


def _remove_each(paths, detail):
    kernels = records = 0
    kept = []
    for path in paths:
        if not _remove(path):
            if path.exists() or path.is_symlink():  # else another process removed it
                kept.append(path)
        elif path.name.endswith(_RESOURCE_SUFFIX):
            records += 1
        elif not path.name.endswith(".build.json"):  # an old kernel's note, not a kernel
            kernels += 1
    return (kernels, records, kept) if detail else kernels + records


def prune(detail: bool = False):
    """Remove the stale kernels and resource records (``stale``); returns how
    many were removed (``detail``: ``(kernels, records, [paths not removed])``)."""
    return _remove_each(stale(), detail)


def clear(detail: bool = False):
    """Remove every cached kernel and resource record; returns how many were
    removed (``detail``: as :func:`prune`)."""
    removed = _remove_each(entries() + resource_entries() + legacy_entries(), detail)
    folder = cache_dir()
    if folder.is_dir():
        private_files.remove_stale_scratch(folder, _SCRATCH, older_than_s=0)
    return removed


__all__ = ["cache_dir", "enabled", "key", "load", "store", "discard", "entries", "stale",
           "prune", "clear", "path_for", "max_bytes", "size", "housekeeping", "writable",
           "build_identity", "unpack", "cached_resources", "load_resources",
           "store_resources", "resource_entries", "resource_path", "describe_resources"]
