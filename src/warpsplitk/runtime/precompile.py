"""Compiling many kernels at once, in worker processes, into the disk cache.

Two jobs share one worker pool: ``precompile`` compiles kernels for this
process's GPU into the disk cache; ``precompile_resources`` compiles them for
a target arch on any machine and keeps their register counts
(``compile.arch_resources``, what ``warpsplitk plan`` shows).

Compiling one kernel is ~1 s of single-threaded CPU work (MLIR passes and
ptxas) and needs no GPU. Preparing a model (tens of kernels) or tuning a
table (hundreds of candidates) one kernel after another leaves the other
cores idle; here the missing kernels are handed out to worker processes
(``python -m warpsplitk.runtime.precompile``, fed one job at a time through a pipe)
that compile them into :mod:`warpsplitk.runtime.disk_cache`, after which the
calling process loads each in milliseconds. Nothing else changes: the
kernels are the ones :func:`warpsplitk.runtime.compile.compile_warp_splitk` would
build, under the same cache key.

The workers are plain subprocesses, not ``multiprocessing``: its "spawn"
start method re-imports the caller's main script in every worker, which
re-runs an unguarded script's top level (model loading included).

Without the disk cache (``WARPSPLITK_DISK_CACHE=0``) or with one worker this
does nothing and callers compile in-process.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import compile, disk_cache
from .dsl import build, require_dsl
from ..tactics import WarpSplitKTactic, check_tactic


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


#: Seconds one kernel may take in a worker before the worker is killed and
#: the kernel left to the caller's own compile (``WARPSPLITK_COMPILE_TIMEOUT``).
#: The slowest measured is ~15 s (K = 16384, 64 unrolled tiles, on a busy host).
COMPILE_TIMEOUT_S = 300.0


def compile_timeout() -> float:
    explicit = os.environ.get("WARPSPLITK_COMPILE_TIMEOUT")
    if not explicit:
        return COMPILE_TIMEOUT_S
    try:
        seconds = float(explicit)
    except ValueError:
        raise ValueError(f"WARPSPLITK_COMPILE_TIMEOUT must be a number of seconds, "
                         f"got {explicit!r}") from None
    if not seconds > 0:
        raise ValueError(f"WARPSPLITK_COMPILE_TIMEOUT must be > 0, got {explicit!r}")
    return seconds


def _compile_job(job: dict):
    """Compile one job (in a worker) into the disk cache; None or an error text."""
    tactic = WarpSplitKTactic.parse(job["tactic"])
    swiglu = bool(job.get("swiglu", False))
    fp8_scales = job.get("fp8_scales")
    stem = disk_cache.key(job["arch"], job["n"], job["k"], tactic, job["bias"], job["pdl"],
                          swiglu, fp8_scales)
    if disk_cache.path_for(stem).is_file():
        return None
    compiled = build(job["n"], job["k"], tactic, job["bias"], job["pdl"], job["arch"],
                      swiglu=swiglu, fp8_scales=fp8_scales)
    if disk_cache.store(stem, compiled) is None:
        return f"could not store it in the disk cache ({disk_cache.writable() or 'write failed'})"
    return None


def _resources_job(job: dict):
    """Compile one kernel (in a worker) for its arch and store its resource record."""
    compile.arch_resources(job["n"], job["k"], WarpSplitKTactic.parse(job["tactic"]),
                           job["arch"], job["bias"], job["pdl"], job.get("fp8_scales"))
    return None


_JOBS = {"kernel": lambda job: _compile_job(job), "resources": _resources_job}


def _worker_main() -> int:
    # Results go to the pipe the parent reads; anything the DSL prints goes
    # to stderr instead, so it cannot corrupt them.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            error = _JOBS[job.get("kind", "kernel")](job)
        except Exception as exc:  # reported to the parent, which reports the kernel
            error = f"{type(exc).__name__}: {exc}"
        results.write(json.dumps({"error": error}) + "\n")
        results.flush()
    return 0


def _options(item) -> tuple[bool, str | None]:
    """A kernel item's ``(swiglu, fp8_scales)``: its sixth and seventh fields."""
    rest = item[5:]
    return bool(rest and rest[0]), (rest[1] if len(rest) > 1 else None)


def _distinct(kernels):
    """Each kernel of ``kernels`` once, as ``(item, swiglu, fp8_scales)``:
    the item ``(n, k, tactic, has_bias, use_pdl)`` with ints and bools, and
    ``(True,)`` for the SwiGLU epilogue or ``(swiglu, fp8_scales)`` for an
    FP8-weight kernel after it."""
    seen = set()
    for n, k, tactic, has_bias, use_pdl, *rest in kernels:
        swiglu, fp8_scales = _options((None,) * 5 + tuple(rest))
        extra = ((swiglu, fp8_scales) if fp8_scales is not None
                 else (True,) if swiglu else ())
        item = (int(n), int(k), tactic, bool(has_bias), bool(use_pdl)) + extra
        if item not in seen:
            seen.add(item)
            yield item, swiglu, fp8_scales


def missing(kernels, arch: str) -> list:
    """The distinct kernels of ``kernels`` the disk cache does not hold
    (``(n, k, tactic, has_bias, use_pdl)``, a sixth field True for the
    SwiGLU epilogue, a seventh naming the scales of an FP8-weight kernel)."""
    return [item for item, swiglu, fp8_scales in _distinct(kernels)
            if not disk_cache.path_for(disk_cache.key(arch, *item[:5], swiglu,
                                                      fp8_scales)).is_file()]


def precompile(kernels, arch: str, jobs: int | None = None, progress=None) -> dict:
    """Compile the kernels the disk cache lacks, ``jobs`` at a time.

    ``kernels``: iterable of ``(n, k, tactic, has_bias, use_pdl)`` (a sixth
    field True: with the SwiGLU epilogue; a seventh: ``fp8_scales``). Returns
    ``{kernel: error text}`` for those that failed (the caller's own compile
    will raise the real error); empty when all are stored, or when there is
    nothing to gain (cache off, one job, fewer than two kernels missing).
    """
    jobs = default_jobs() if jobs is None else int(jobs)
    if not disk_cache.enabled() or jobs < 2:
        return {}
    todo = []
    for item in missing(kernels, arch):
        # an illegal tactic is the caller's error
        swiglu, fp8_scales = _options(item)
        check_tactic(item[2], item[0], item[1], swiglu=swiglu, fp8=fp8_scales is not None)
        todo.append(item)
    if len(todo) < 2:
        return {}
    require_dsl()  # once here, not as every worker's failure
    if disk_cache.writable() is not None:  # workers could not hand their kernels over
        return {}
    started = time.perf_counter()
    workers = min(jobs, len(todo))

    def report(count, total):
        if progress and (count == total or count % 20 == 0):
            progress(f"compiled {count}/{total} kernels in {workers} processes, "
                     f"{time.perf_counter() - started:.1f} s")
    return _run_workers(todo, arch, "kernel", workers, report)


def precompile_resources(kernels, arch: str = "sm_90a", jobs: int | None = None,
                         progress=None) -> dict:
    """Compile for ``arch``, ``jobs`` worker processes at a time (default:
    ``default_jobs()``), the kernels of ``kernels`` (``(n, k, tactic, has_bias,
    use_pdl)``, a seventh field naming the scales of an FP8-weight kernel as
    ``missing``'s) whose resource records the disk cache lacks, storing their
    records (``compile.arch_resources``). ``progress(done, total)`` after
    each. Returns ``{kernel: error}`` of those that failed (left to the
    caller's own ``arch_resources``, which raises). Nothing is done with the
    cache off; with one job the kernels are compiled in this process."""
    if not disk_cache.enabled():
        return {}
    todo = [item for item, _, fp8_scales in _distinct(kernels)
            if not disk_cache.resource_path(disk_cache.key(
                arch, *item[:5], fp8_scales=fp8_scales)).is_file()]
    if not todo:
        return {}
    require_dsl()
    jobs = max(1, default_jobs() if jobs is None else int(jobs))
    if disk_cache.writable() is not None:
        jobs = 1  # a worker's record could not reach this process: compile here
    workers = min(jobs, len(todo))
    if workers > 1:
        return _run_workers(todo, arch, "resources", workers,
                            progress or (lambda count, total: None))
    failures = {}
    for count, item in enumerate(todo, 1):
        try:
            compile.arch_resources(*item[:3], arch, *item[3:5], _options(item)[1])
        except Exception as exc:  # the caller's own arch_resources raises it again
            failures[item] = f"{type(exc).__name__}: {exc}"
        if progress:
            progress(count, len(todo))
    return failures


def worker_command() -> tuple[list[str], str]:
    """The command line of a compile worker and the folder it runs in.

    A worker imports only from the package's own parent folder and the
    interpreter's paths: it runs in that folder, with the safe-path flag
    (``-P``, Python 3.11+: no current folder on ``sys.path``), so a
    ``queue.py`` in the folder the user happened to start from is never
    imported by a process compiling their kernels."""
    package_parent = str(Path(__file__).resolve().parents[2])
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *flags, "-m", "warpsplitk.runtime.precompile"], package_parent


def _worker_env(arch: str) -> dict:
    package_parent = worker_command()[1]
    env = dict(os.environ, CUTE_DSL_ARCH=arch)  # the DSL exports code only with a target set
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    # the folder as this process resolved it (a relative one would move with the cwd)
    env["WARPSPLITK_CACHE_DIR"] = str(disk_cache.cache_dir())
    return env


def _run_workers(todo, arch, kind, workers, report) -> dict:
    """Hand the ``(n, k, tactic, has_bias, use_pdl)`` items of ``todo`` to
    ``workers`` worker processes, one ``kind`` job at a time
    (``_JOBS``); ``report(done, total)`` after each. Returns ``{item: error}``
    of those that failed. An exception in this process (KeyboardInterrupt
    included) kills and reaps every worker before it propagates."""
    return _WorkerPool(todo, arch, kind, report).run(workers)


class _WorkerPool:
    """Feeding threads, one per worker process, taking items from one queue."""

    def __init__(self, todo, arch, kind, report):
        self.total, self.arch, self.kind, self.report = len(todo), arch, kind, report
        self.timeout = compile_timeout()
        self.pending = queue.Queue()
        for item in todo:
            self.pending.put(item)
        self.failures, self.done = {}, 0
        self.lock = threading.Lock()
        self.command, self.folder = worker_command()
        self.env = _worker_env(arch)
        self.running = []  # every worker started, so a stop can reap them all
        self.stopping = threading.Event()

    def run(self, workers) -> dict:
        with tempfile.TemporaryFile("w+") as log:
            threads = [threading.Thread(target=self._feed, args=(log,), daemon=True)
                       for _ in range(workers)]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            except BaseException:
                _stop(self.running, threads, self.stopping, self.lock)
                raise
        while not self.pending.empty():  # every worker died: nothing more is compiled here
            self.failures[self.pending.get_nowait()] = "no worker left"
        return self.failures

    def _start(self, log):
        with self.lock:
            if self.stopping.is_set():
                return None
            worker = subprocess.Popen(self.command, env=self.env, cwd=self.folder,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log, text=True)
            self.running.append(worker)
            return worker

    def _feed(self, log):
        worker = self._start(log)
        if worker is None:
            return
        with worker:
            while not self.stopping.is_set():
                try:
                    item = self.pending.get_nowait()
                except queue.Empty:
                    break
                error = self._compile(worker, item)
                with self.lock:
                    if error:
                        self.failures[item] = error
                    self.done += 1
                    count = self.done
                self.report(count, self.total)
                if error and (error == "the worker died" or error.startswith("timed out")):
                    break
            try:
                worker.stdin.close()
            except OSError:  # a dead worker's pipe: its job is already counted as failed
                pass

    def _compile(self, worker, item) -> str | None:
        """Send one job; its error, or None."""
        n, k, tactic, has_bias, use_pdl = item[:5]
        swiglu, fp8_scales = _options(item)
        job = {"kind": self.kind, "arch": self.arch, "n": n, "k": k, "tactic": tactic.short(),
               "bias": has_bias, "pdl": use_pdl, **({"swiglu": True} if swiglu else {}),
               **({"fp8_scales": fp8_scales} if fp8_scales is not None else {})}
        try:
            worker.stdin.write(json.dumps(job) + "\n")
            worker.stdin.flush()
            # a worker that hangs is killed: its kernel (and those it would
            # have taken) are left to the other workers and the caller
            if not select.select([worker.stdout], [], [], self.timeout)[0]:
                worker.kill()
                return f"timed out after {self.timeout:g} s"
            reply = worker.stdout.readline()
            return json.loads(reply)["error"] if reply else "the worker died"
        except (OSError, ValueError, KeyError) as exc:
            return f"the worker failed: {exc}"


def _stop(running, threads, stopping, lock) -> None:
    """Kill every worker, wait for each to exit, and let the feeding threads
    finish (their pipes are closed by the kills)."""
    with lock:
        stopping.set()
        workers = list(running)
    for worker in workers:
        try:
            worker.kill()
        except OSError:
            pass
    for worker in workers:
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:  # not seen: a killed process exits at once
            pass
    for t in threads:
        t.join(timeout=10)


__all__ = ["precompile", "precompile_resources", "missing", "default_jobs", "worker_command"]


if __name__ == "__main__":
    sys.exit(_worker_main())
