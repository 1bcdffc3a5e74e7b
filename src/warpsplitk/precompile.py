"""Compiling many kernels at once, in worker processes, into the disk cache.

Compiling one kernel is ~1 s of single-threaded CPU work (MLIR passes and
ptxas) and needs no GPU. Preparing a model (tens of kernels) or tuning a
table (hundreds of candidates) one kernel after another leaves the other
cores idle; here each missing kernel is compiled by a pool of spawned
processes and written to :mod:`warpsplitk.disk_cache`, after which the
calling process loads each in milliseconds. Nothing else changes: the
kernels are the ones :func:`warpsplitk.compile.compile_warp_splitk` would
build, under the same cache key.

Without the disk cache (``WARPSPLITK_DISK_CACHE=0``) or with one worker this
does nothing and callers compile in-process as before.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from . import disk_cache
from .tactics import WarpSplitKTactic, check_tactic

#: A kernel to compile: (n, k, tactic, has_bias, use_pdl).
Kernel = tuple


def default_jobs() -> int:
    """Worker processes: ``WARPSPLITK_COMPILE_JOBS``, else one per core but one, at most 16."""
    explicit = os.environ.get("WARPSPLITK_COMPILE_JOBS")
    if explicit:
        try:
            jobs = int(explicit)
        except ValueError:
            raise ValueError(f"WARPSPLITK_COMPILE_JOBS must be an integer, got {explicit!r}") from None
        if jobs < 1:
            raise ValueError(f"WARPSPLITK_COMPILE_JOBS must be >= 1, got {jobs}")
        return jobs
    return max(1, min(16, (os.cpu_count() or 1) - 1))


def _worker_init(arch: str) -> None:
    # Before the worker imports the DSL: the target is then the process's
    # arch, which the DSL needs to export code when the worker sees no GPU.
    os.environ["CUTE_DSL_ARCH"] = arch


def _compile_one(arch: str, n: int, k: int, tactic_text: str, has_bias: bool, use_pdl: bool,
                 arrivals: str):
    # runs in a worker: compile for arch (no GPU needed) and store
    from .compile import _build
    tactic = WarpSplitKTactic.parse(tactic_text)
    stem = disk_cache.key(arch, n, k, tactic, has_bias, use_pdl, arrivals)
    if disk_cache.path_for(stem).is_file():
        return None
    compiled = _build(n, k, tactic, has_bias, use_pdl, arch, arrivals=arrivals)
    if disk_cache.store(stem, compiled) is None:
        return "could not write the disk cache"
    return None


def missing(kernels, arch: str, arrivals: str = "") -> list:
    """The distinct kernels of ``kernels`` the disk cache does not hold."""
    seen, todo = set(), []
    for n, k, tactic, has_bias, use_pdl in kernels:
        item = (int(n), int(k), tactic, bool(has_bias), bool(use_pdl))
        if item in seen:
            continue
        seen.add(item)
        stem = disk_cache.key(arch, n, k, tactic, has_bias, use_pdl, arrivals)
        if not disk_cache.path_for(stem).is_file():
            todo.append(item)
    return todo


def precompile(kernels, arch: str, jobs: int | None = None, progress=None) -> dict:
    """Compile the kernels the disk cache lacks, ``jobs`` at a time.

    ``kernels``: iterable of ``(n, k, tactic, has_bias, use_pdl)``. Returns
    ``{kernel: error text}`` for those that failed (the caller's own compile
    will raise the real error); empty when all are stored, or when there is
    nothing to gain (cache off, one job, fewer than two kernels missing).
    """
    from .compile import _arrivals_from_env
    jobs = default_jobs() if jobs is None else int(jobs)
    if not disk_cache.enabled() or jobs < 2:
        return {}
    arrivals = _arrivals_from_env()
    todo = []
    for item in missing(kernels, arch, arrivals):
        check_tactic(item[2], item[0], item[1])  # an illegal tactic is the caller's error
        todo.append(item)
    if len(todo) < 2:
        return {}
    started = time.perf_counter()
    failures = {}
    # spawn, not fork: the parent may hold a CUDA context and DSL state
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context,
                             initializer=_worker_init, initargs=(arch,)) as pool:
        futures = {pool.submit(_compile_one, arch, n, k, tactic.short(), has_bias, use_pdl,
                               arrivals): (n, k, tactic, has_bias, use_pdl)
                   for n, k, tactic, has_bias, use_pdl in todo}
        for done, future in enumerate(as_completed(futures), 1):
            kernel = futures[future]
            try:
                error = future.result()
            except Exception as exc:  # the compile's own error, reported by the caller
                error = f"{type(exc).__name__}: {exc}"
            if error:
                failures[kernel] = error
            if progress and (done == len(todo) or done % 20 == 0):
                progress(f"compiled {done}/{len(todo)} kernels in {min(jobs, len(todo))} "
                         f"processes, {time.perf_counter() - started:.1f} s")
    return failures


__all__ = ["precompile", "missing", "default_jobs"]
