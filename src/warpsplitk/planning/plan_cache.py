"""Plans measured on this machine's GPU, kept beside the compiled kernels.

``plan="auto"`` (``prepare_model``, ``patch_model``) resolves to the plan for
the current GPU: the built-in plan where one was measured on this GPU model,
then this GPU's cached plan file, and every shape neither covers is tuned
first (``warpsplitk.planning.tune.tune``, with progress) and merged into the file, so
the next process starts with nothing to tune. FP8 weights' shapes are tuned
as FP8 (on e4m3 weights, with scales of the weight's kind) into the plan's
FP8 entries of that kind. Tuning happens at preparation,
never inside a CUDA-graph capture (refused with a ``ValueError``).

The file is ``plans/<gpu>.json`` in the disk cache's folder
(``WARPSPLITK_CACHE_DIR``), keyed by the GPU's name and SM count; the
tuner's log sits beside it (``<gpu>-log.jsonl``), so an interrupted tune
resumes. Writers merge under a file lock and replace the file atomically:
several processes may tune different shapes at once.

A plan decides which kernels run, so the folder and its files follow
:mod:`warpsplitk.runtime.private_files`: a folder or file another user could
have written (or a link planted in place of one) is not used, with one
warning, and a plan tuned meanwhile serves its process only. A plan file
this version cannot read is never overwritten: the next store moves it
aside (``<gpu>.json.unreadable-<UTC time>``) before writing its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from .. import jsonfile
from ..contract import BUILTIN_PLAN_GPUS, MAX_M, shape_refusal
from ..runtime import disk_cache, private_files
from . import tune
from .decode_plan import DecodePlan, builtin_plan, plan_from_json


def builtin_plan_for(name: str, sm_count: int) -> str | None:
    """The built-in plan measured on this GPU model (``builtin_plan``'s
    name), or None: a plan is this GPU's only where it was measured on it."""
    return next((plan for plan, gpu in BUILTIN_PLAN_GPUS.items() if gpu == (name, sm_count)), None)


def gpu_key(name: str, sm_count: int) -> str:
    """``nvidia-h200-132sm``: a GPU model's plan-file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "gpu"
    return f"{slug}-{int(sm_count)}sm"


def plan_dir() -> Path:
    return disk_cache.cache_dir() / "plans"


def plan_path(key: str) -> Path:
    return plan_dir() / f"{key}.json"


def log_path(key: str) -> Path:
    return plan_dir() / f"{key}-log.jsonl"


def read_file(path: Path) -> DecodePlan:
    """The plan file ``path``, opened without following a link and only if
    this user alone could have written it (``UntrustedPath`` otherwise,
    ``FileNotFoundError`` when absent); a file that is not a plan this
    version reads is a ``ValueError`` naming it."""
    data = private_files.read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a plan file: not UTF-8 text ({error.reason} at byte "
                         f"{error.start})") from None
    return plan_from_json(jsonfile.loads(text, str(path)), str(path))


def _load(key: str) -> DecodePlan:
    """``load`` without its warnings for the folder or file: an untrusted or
    unreadable folder or file is an ``OSError`` (``UntrustedPath`` for
    one another user could have written)."""
    if not disk_cache.enabled():
        return DecodePlan()
    try:
        private_files.check_dir(plan_dir())  # read-only: a missing folder is not made here
        return read_file(plan_path(key))
    except FileNotFoundError:
        return DecodePlan()
    except ValueError as error:
        warnings.warn(f"warpsplitk: ignoring the cached plan {error}; the next tuned plan "
                      "stored moves it aside", RuntimeWarning, stacklevel=3)
        return DecodePlan()


def load(key: str) -> DecodePlan:
    """This GPU's cached plan (empty when there is none or the cache is off;
    an unreadable file, or a folder or file another user could have
    written, is reported and ignored)."""
    try:
        return _load(key)
    except OSError as error:
        _not_used(error)
        return DecodePlan()


@contextmanager
def _locked(key: str):
    """An exclusive lock on this GPU's plan file, across processes (in a
    folder ``private_files.private_dir`` made or checked)."""
    # no truncation and no link followed: a link planted in place of the
    # lock file must not make this process empty (or create) the file it
    # points at
    fd = private_files.open_file(plan_dir() / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _aside_path(path: Path) -> Path:
    """A free name beside ``path`` for an unreadable copy of it, stamped
    with the UTC time it was moved aside."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.unreadable-{stamp}")
    number = 1
    while aside.exists():  # two moved aside within one second: keep both
        number += 1
        aside = path.with_name(f"{path.name}.unreadable-{stamp}-{number}")
    return aside


def _move_aside(path: Path, error: ValueError) -> Path:
    """Rename the unreadable plan file ``path`` out of the way (under the
    lock): what a newer version, or a person, wrote there is kept, never
    overwritten by the plan of a few shapes."""
    aside = _aside_path(path)
    os.replace(path, aside)
    warnings.warn(f"warpsplitk: {error}; moved aside to {aside} (its bytes unchanged) and a "
                  f"new plan written to {path}", RuntimeWarning, stacklevel=3)
    return aside


#: Temporary names in the plans folder: this version's (``write_atomic``)
#: and earlier versions'; one a killed process left is removed after an hour.
_SCRATCH = [".tmp-*.tmp", "*.json.tmp"]


def store(key: str, plan: DecodePlan) -> Path | None:
    """Merge ``plan``'s entries (BF16 and FP8) into this GPU's plan file (``plan`` wins where
    both have an M), atomically and under the lock; None with the cache off.
    A folder or file another user could have written is an ``UntrustedPath``
    (an ``OSError``); an unreadable plan file is moved aside first."""
    if not disk_cache.enabled():
        return None
    folder = private_files.private_dir(plan_dir())
    with _locked(key):
        path = plan_path(key)
        try:
            merged = read_file(path)
        except FileNotFoundError:
            merged = DecodePlan()
        except ValueError as error:
            _move_aside(path, error)
            merged = DecodePlan()
        merged.meta.update(plan.meta)
        merged.merge(plan)
        private_files.write_atomic(path, json.dumps(merged.to_json(), indent=1).encode())
    private_files.remove_stale_scratch(folder, _SCRATCH)
    return path


def _not_kept(error):
    warnings.warn(f"warpsplitk: cannot keep the tuned plan in {plan_dir()} ({error}); it "
                  "serves this process only", RuntimeWarning, stacklevel=3)


def _not_used(error):
    # an UntrustedPath reads "<path>: <reason>"; other OSErrors name their path too
    warnings.warn(f"warpsplitk: not using the plan cache ({error}); a plan tuned now serves "
                  "this process only", RuntimeWarning, stacklevel=3)


def entries() -> list[Path]:
    """Every cached plan file (``warpsplitk cache`` lists them)."""
    folder = plan_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def _lacking(plan: DecodePlan, shapes, ms, fp8_scales=None) -> list:
    """The distinct ``(n, k)`` of ``shapes`` the kernel takes whose entries
    in ``plan`` (its FP8 ones for ``fp8_scales``) lack some M of ``ms``."""
    table = plan.table(fp8_scales)
    return list(dict.fromkeys(
        (int(n), int(k)) for n, k in shapes if shape_refusal(n, k) is None
        and not all(m in table.get((n, k), {}) for m in ms)))


def _current_gpu(torch) -> tuple:
    """``(name, sm_count)`` of the current CUDA device."""
    if not torch.cuda.is_available():
        raise ValueError("plan='auto' is the plan measured on this machine's CUDA GPU, "
                         "and torch sees no CUDA GPU")
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return properties.name, properties.multi_processor_count


def auto_plan(shapes, ms=range(1, MAX_M + 1), *, gpu=None, progress=print,
              jobs=None, fp8_shapes=None) -> DecodePlan:
    """The plan for ``shapes`` (``[(n, k)]`` of BF16 weights) x ``ms`` on the
    current GPU (``gpu``: ``(name, sm_count)``, else the current CUDA
    device's): the built-in plan of this GPU model and the cached plan file,
    after tuning and storing every shape they do not cover for every M.
    ``fp8_shapes`` (``[(n, k, scale kind)]`` of FP8 weights) likewise, by
    the plans' FP8 entries, tuned on e4m3 weights with scales of that kind.
    Shapes the kernel does not take are left out (they run on cuBLAS)."""
    import torch  # only plan="auto" needs it: importing plan_cache stays torch-free

    ms = tuple(ms)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError("plan='auto' tunes the shapes its plan lacks before preparing; "
                         "prepare before capturing a CUDA graph, not during it")
    gpu = _current_gpu(torch) if gpu is None else gpu
    key = gpu_key(*gpu)
    plan = DecodePlan(meta={"gpu": gpu[0], "sm_count": gpu[1], "source": "auto"})
    builtin = builtin_plan_for(*gpu)
    if builtin is not None:
        plan.merge(builtin_plan(builtin))
    keep = disk_cache.enabled()
    try:
        plan.merge(_load(key))
    except OSError as error:  # the folder or file cannot be trusted: one warning
        _not_used(error)
        keep = False
    todo = _lacking(plan, shapes, ms)
    kinds = dict.fromkeys(kind for *_, kind in fp8_shapes or ())
    fp8_todo = {kind: _lacking(plan, [(n, k) for n, k, of in fp8_shapes if of == kind], ms, kind)
                for kind in kinds}
    fp8_todo = {kind: lacking for kind, lacking in fp8_todo.items() if lacking}
    if todo or fp8_todo:
        plan.merge(_tune(key, gpu[0], todo, fp8_todo, ms, keep, progress, jobs))
    return plan


def _tune(key, gpu_name, todo, fp8_todo, ms, keep, progress, jobs) -> DecodePlan:
    """The plan of ``todo`` (BF16 shapes) and ``fp8_todo`` (``{scale kind:
    shapes}``) tuned on this GPU, its log beside the plan file and the
    plan stored in it where ``keep`` (and the folder can be trusted)."""
    if progress:
        fp8 = (f" and {sum(map(len, fp8_todo.values()))} FP8 shape(s)" if fp8_todo else "")
        progress(f"warpsplitk: tuning {len(todo)} shape(s){fp8} this {gpu_name} has no plan for"
                 + (f"; kept in {plan_path(key)}" if keep else ""))
    log = str(log_path(key)) if keep else None
    if log:
        try:
            # the tuner appends its log here: a folder only this user writes
            private_files.private_dir(plan_dir())
        except OSError as error:
            _not_kept(error)
            log = None
    # progress=None: a quiet tune (the tuner itself always reports)
    quiet = progress or (lambda line: None)
    runs = [(todo, {})] if todo else []
    runs += [(shapes, {"fp8_scales": kind}) for kind, shapes in fp8_todo.items()]
    tuned = DecodePlan()
    for shapes, dtype in runs:
        plan = tune.tune(shapes, ms, log_path=log, resume=True, jobs=jobs, progress=quiet,
                         **dtype)
        tuned.meta.update(plan.meta)
        tuned.merge(plan)
    if log:
        try:
            store(key, tuned)
        except OSError as error:  # the tune still serves this process
            _not_kept(error)
    return tuned


__all__ = ["auto_plan", "gpu_key", "plan_path", "log_path", "load", "read_file", "store", "entries"]
