"""Plans measured on this machine's GPU, kept beside the compiled kernels.

``plan="auto"`` (``prepare_model``, ``patch_model``) resolves to the plan for
the current GPU: the built-in plan where one was measured on this GPU model,
then this GPU's cached plan file, and every shape neither covers is tuned
first (``warpsplitk.planning.tune.tune``, with progress) and merged into the file, so
the next process starts with nothing to tune. Tuning happens at preparation,
never inside a CUDA-graph capture (refused with a ``ValueError``).

The file is ``plans/<gpu>.json`` in the disk cache's folder
(``WARPSPLITK_CACHE_DIR``), keyed by the GPU's name and SM count; the
tuner's log sits beside it (``<gpu>-log.jsonl``), so an interrupted tune
resumes. Writers merge under a file lock and replace the file atomically:
several processes may tune different shapes at once.
"""

from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..runtime import disk_cache
from .plans import DecodePlan, builtin_plan, load_plan
from ..tactics import MAX_M

#: the built-in plans and the GPU (name, SM count) each was measured on
_BUILTIN_GPUS = {"h200": ("NVIDIA H200", 132)}


def builtin_plan_for(name: str, sm_count: int) -> str | None:
    """The built-in plan measured on this GPU model (``builtin_plan``'s
    name), or None: a plan is this GPU's only where it was measured on it."""
    return next((plan for plan, gpu in _BUILTIN_GPUS.items() if gpu == (name, sm_count)), None)


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


def load(key: str) -> DecodePlan:
    """This GPU's cached plan (empty when there is none or the cache is off;
    an unreadable file is reported and ignored)."""
    path = plan_path(key)
    if not disk_cache.enabled() or not path.is_file():
        return DecodePlan()
    try:
        return load_plan(path)
    except ValueError as error:
        import warnings
        warnings.warn(f"warpsplitk: ignoring the cached plan {error}", stacklevel=2)
        return DecodePlan()


@contextmanager
def _locked(key: str):
    """An exclusive lock on this GPU's plan file, across processes."""
    import fcntl
    plan_dir().mkdir(parents=True, exist_ok=True)
    with open(plan_dir() / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(key: str, plan: DecodePlan) -> Path | None:
    """Merge ``plan``'s entries into this GPU's plan file (``plan`` wins where
    both have an M), atomically and under the lock; None with the cache off."""
    if not disk_cache.enabled():
        return None
    with _locked(key):
        merged = load(key)
        merged.meta.update(plan.meta)
        for shape, by_m in plan.entries.items():
            merged.entries.setdefault(shape, {}).update(by_m)
        path = plan_path(key)
        handle, scratch = tempfile.mkstemp(dir=plan_dir(), suffix=".json.tmp")
        os.close(handle)
        try:
            merged.save(scratch)
            os.replace(scratch, path)
        except BaseException:
            Path(scratch).unlink(missing_ok=True)
            raise
    return path


def _not_kept(error):
    import warnings
    warnings.warn(f"warpsplitk: cannot keep the tuned plan in {plan_dir()} ({error}); it "
                  "serves this process only", RuntimeWarning, stacklevel=3)


def entries() -> list[Path]:
    """Every cached plan file (``warpsplitk cache`` lists them)."""
    folder = plan_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def _covered(plan: DecodePlan, n: int, k: int, ms) -> bool:
    have = plan.entries.get((n, k), {})
    return all(m in have for m in ms)


def auto_plan(shapes, ms=range(1, MAX_M + 1), *, gpu=None, progress=print,
              jobs=None) -> DecodePlan:
    """The plan for ``shapes`` (``[(n, k)]``) x ``ms`` on the current GPU
    (``gpu``: ``(name, sm_count)``, else the current CUDA device's): the
    built-in plan of this GPU model and the cached plan file, after tuning
    and storing every shape they do not cover for every M. Shapes the kernel
    does not take are left out (they run on cuBLAS)."""
    import torch

    from ..tactics import shape_refusal
    ms = tuple(ms)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError("plan='auto' tunes the shapes its plan lacks before preparing; "
                         "prepare before capturing a CUDA graph, not during it")
    if gpu is None:
        if not torch.cuda.is_available():
            raise ValueError("plan='auto' is the plan measured on this machine's CUDA GPU, "
                             "and torch sees no CUDA GPU")
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = (properties.name, properties.multi_processor_count)
    key = gpu_key(*gpu)
    plan = DecodePlan(meta={"gpu": gpu[0], "sm_count": gpu[1], "source": "auto"})
    builtin = builtin_plan_for(*gpu)
    if builtin is not None:
        plan.entries.update(builtin_plan(builtin).entries)
    for shape, by_m in load(key).entries.items():
        plan.entries.setdefault(shape, {}).update(by_m)
    todo = list(dict.fromkeys((int(n), int(k)) for n, k in shapes
                              if shape_refusal(n, k) is None
                              and not _covered(plan, n, k, ms)))
    if todo:
        from .tune import tune
        if progress:
            progress(f"warpsplitk: tuning {len(todo)} shape(s) this {gpu[0]} has no plan for; "
                     f"kept in {plan_path(key)}")
        log = str(log_path(key)) if disk_cache.enabled() else None
        if log:
            try:
                plan_dir().mkdir(parents=True, exist_ok=True)
            except OSError as error:
                _not_kept(error)
                log = None
        # progress=None: a quiet tune (the tuner itself always reports)
        tuned = tune(todo, ms, log_path=log, resume=True, jobs=jobs,
                     progress=progress or (lambda line: None))
        if log:
            try:
                store(key, tuned)
            except OSError as error:  # the tune still serves this process
                _not_kept(error)
        for shape, by_m in tuned.entries.items():
            plan.entries.setdefault(shape, {}).update(by_m)
    return plan


__all__ = ["auto_plan", "gpu_key", "plan_path", "log_path", "load", "store", "entries"]
