"""The tuner: measure a pruned set of tactics per (shape, M) and write a plan.

Two depths. The quick tune (the default) measures in each cell only the
cost model's shortlist (``cost_model.shortlist``): the few tactics it ranks
as able to win, the early-trigger twins it cannot rank well, and the
default's and the reference heuristic's tactics, all compiled in parallel
before the first measurement. The exhaustive tune (``shortlist=0``,
``warpsplitk tune --exhaustive``) measures the whole search space of
:mod:`warpsplitk.planning.space`: the pruned candidates of each cell, then the
measured neighbours of its fastest. Its logs are what the cost model is
fitted to (``scripts/fit_cost_model.py``).

Each candidate is compiled, checked against an fp64 reference, and timed exactly
as the benchmark times (``timing.time_calls`` over weight copies >= 3x L2).
Candidates that fail to compile or are wrong are dropped and reported.
With ``confirm`` (default ``CONFIRM`` = 3) the N fastest of each cell,
and its default tactic, are then timed in ``CONFIRM_ROUNDS`` (2)
more graphs, alternating, and count with the median of their timings, as
the benchmark counts its three graphs: a single replay
set can flatter a tactic (the early trigger's replays are bimodal on small
kernels: 768x128 at M = 8 measured 1.26 us in one run, 1.37 in the next).
Among tactics within ``TOLERANCE`` of the fastest, one already chosen for
another M of the shape is preferred (``choose_tactics``): fewer distinct
kernels per shape, a shorter cold start, at no measurable cost. The early
PDL trigger must win by more than ``TOLERANCE``: it is measured on
independent calls, and some grids were much slower with it
(docs/design-notes.md), so a tie goes to the late trigger. So must a mixed
grid: one 1% faster in the tuner was 6% slower in the benchmark's process
(7168x384 at M = 32), so a tie goes to the uniform grid.
With ``cublas`` (the default) each cell also times ``torch.matmul``
(cuBLAS) on the same weight copies, and the plan says ``"cublas"`` for an
M where it beats the chosen tactic by more than ``TOLERANCE``
(``prefer_cublas``; ``plans.prepare`` then runs cuBLAS for it).
Every measurement is appended to a JSON-lines log; with ``resume`` a rerun
skips what the log already holds. Each record is one write, synced before
the next measurement, so a crash or a full disk costs at most the record
being written: a last line left unfinished is ignored by the readers
(``read_log_records``) and cut off before the next append.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
import warnings

from .. import jsonfile
from ..kernel import layout
from ..runtime import timing
from .choose import SHORTLIST, default_tactic
from .plans import CUBLAS, DecodePlan, is_time
from .space import (
    base_candidates,
    bounded_prefetch_twins,
    mixed_twins,
    narrow_twins,
    prefetch_twins,
    tma_twins,
)
from ..tactics import (
    DEFAULT_MAX_STAGES,
    DEFAULT_SM_COUNT,
    K_SPLITS,
    MAX_M,
    WarpSplitKTactic,
    is_legal,
)

def candidates(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
               k_splits=(1, 2), early_launches=(False, True), bulk_xs=(False, True),
               max_stages=DEFAULT_MAX_STAGES) -> list[WarpSplitKTactic]:
    """What the tuner times first in a cell: ``space.base_candidates`` and the
    default tactic, each with every trigger of ``early_launches``."""
    found = set(base_candidates(m, n, k, sm_count, k_splits, early_launches, bulk_xs,
                                max_stages))
    found.add(default_tactic(m, n, k, sm_count))
    return sorted({dataclasses.replace(t, early_launch=e) for t in found for e in early_launches})


#: The Ms the tuner measures; every other M takes the winner of the next one
#: up. 4 serves 2..4, the Ms a 4-row narrow token tile covers.
REPRESENTATIVE_MS = (1, 4, 8, 16, 24, 32)


def representative(m: int, reps=REPRESENTATIVE_MS) -> int:
    """The measured M (of ``reps``) whose winner serves ``m``."""
    return min(r for r in reps if r >= m)


def _log_key(n, k, m, tactic):
    """A measurement's log key; ``tactic`` may be ``CUBLAS`` (torch.matmul)."""
    return f"{n},{k},{m},{tactic if tactic == CUBLAS else tactic.short()}"


#: Log key prefix of a confirmation measurement (a second, later timing of
#: one of a cell's fastest candidates, in a freshly captured graph).
CONFIRM_PREFIX = "confirm:"

#: How many of each cell's fastest candidates are timed a second time by
#: default.
CONFIRM = 3


#: Graphs each confirmed candidate is timed in after its first: with the
#: first, ``timing.ROUNDS`` graphs, ranked by their median, as the benchmark
#: ranks (older log records hold one confirmation: the median of two
#: timings is their mean).
CONFIRM_ROUNDS = timing.ROUNDS - 1


def _confirm_key(n, k, m, tactic, round_=1):
    """Log key of a candidate's ``round_``-th confirmation (1: ``confirm:``;
    later ones ``confirm2:``, ...)."""
    prefix = CONFIRM_PREFIX if round_ == 1 else f"confirm{round_}:"
    return prefix + _log_key(n, k, m, tactic)


def _cell_times(samples):
    """``{tactic: [us, ...]}`` -> ``{tactic: median us}``: a tactic timed in
    several graphs (a first pass and its confirmations) counts with the
    median of them, so one graph in a lucky state does not pick it (small
    kernels' graphs can be bimodal)."""
    return {t: round(statistics.median(v), 3) for t, v in samples.items() if v}


def _confirm_candidates(samples, confirm, default=None):
    """The ``confirm`` fastest tactics of one cell by their first timing, and
    the cell's ``default`` heuristic tactic if it was measured: the plan
    must not lose to the default, and a single timing of it can be off by
    more than the margins between the fastest (3072x128 M=1, late trigger:
    1.47 us in the tuner, 1.24 us in every benchmark), so it
    is confirmed beside them and the median of its graphs decides."""
    first = {t: v[0] for t, v in samples.items() if v}
    chosen = sorted(first, key=first.get)[:confirm]
    if confirm and default in first and default not in chosen:
        chosen.append(default)
    return chosen


def _confirmations(samples, confirm, default=None, rounds=None):
    """``[(round, tactic), ...]``: the confirmation timings of one cell in
    the order the tuner makes them, round by round over the candidates of
    ``_confirm_candidates`` (alternating, as the benchmark alternates its
    configurations); ``rounds`` defaults to ``CONFIRM_ROUNDS``."""
    rounds = CONFIRM_ROUNDS if rounds is None else rounds
    chosen = _confirm_candidates(samples, confirm, default)
    return [(j, t) for j in range(1, rounds + 1) for t in chosen]


def _count_lines(path):
    """How many lines of the log count (``read_log_records``): an
    unfinished last line does not, and is cut off before the next append."""
    return len(_log_lines(path, warn=False))


#: Kernel revisions. A log record carries the revision its kernel had
#: (``rev``; none: 1). Each change below made the timings of some tactics
#: stale: the tuner measures them again on resume, and plans leave them out
#: unless asked (``stale=True``), or made at an earlier ``revision``.
#: 2: the cross-proxy fence before each stage release of an async
#: activation ring (TMA boxes or bulk copies), up to ~10% slower.
ASYNC_RING_REVISION = 2
#: 3: a K split's partial sums handed over by st.async into an mbarrier of
#: the first CTA instead of a cluster barrier every CTA waits on; faster.
SPLIT_MBARRIER_REVISION = 3
KERNEL_REVISION = SPLIT_MBARRIER_REVISION


def is_stale(rec, revision=KERNEL_REVISION) -> bool:
    """Whether a log record times a kernel that changed between its
    revision and ``revision`` (never a cuBLAS timing)."""
    if rec["tactic"] == CUBLAS:
        return False
    tactic = WarpSplitKTactic.parse(rec["tactic"])
    rev = rec.get("rev", 1)
    return ((tactic.async_activation_ring and rev < ASYNC_RING_REVISION <= revision)
            or (tactic.k_split > 1 and rev < SPLIT_MBARRIER_REVISION <= revision))


def _record(**fields):
    """A new log record, stamped with the revision its kernel has."""
    return {**fields, "rev": KERNEL_REVISION}


def _current(rec) -> bool:
    """Whether a log record times a kernel this version builds: not one of
    a retired experimental build (``variant``) nor a tactic this version no
    longer parses (a retired field)."""
    if rec.get("variant"):
        return False
    if rec.get("tactic") == CUBLAS:
        return True
    try:
        WarpSplitKTactic.parse(rec["tactic"])
    except ValueError:
        return False
    return True


def check_log_record(rec, where="tuning log record"):
    """``ValueError`` naming ``where`` unless ``rec`` (a log line's object)
    is a provenance line (``{"meta": ...}``) or a measurement plans can use:
    a ``key`` and a ``tactic`` string, ``n`` and ``k`` positive integers,
    ``m`` in 1..32, ``rev`` (if any) a positive integer, and, when ``ok``,
    ``us`` a positive finite number of microseconds."""
    if not isinstance(rec, dict) or ("key" not in rec and "meta" not in rec):
        raise ValueError(f"{where}: not a tuning record (a JSON object with a 'key')")
    if "key" not in rec:
        if not isinstance(rec["meta"], dict):
            raise ValueError(f"{where}: a provenance line's 'meta' must be an object, got "
                             f"{rec['meta']!r}")
        return
    for name in ("key", "tactic"):
        if not isinstance(rec.get(name), str):
            raise ValueError(f"{where}: {name!r} must be a string, got {rec.get(name)!r}")
    for name in ("n", "k", "m") + (("rev",) if "rev" in rec else ()):
        value = rec.get(name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{where}: {name!r} must be a positive integer, got {value!r}")
    if rec["m"] > MAX_M:
        raise ValueError(f"{where}: 'm' must be in 1..{MAX_M}, got {rec['m']}")
    us = rec.get("us")
    if rec.get("ok") and not is_time(us):
        raise ValueError(f"{where}: 'us' must be a positive number of microseconds, got {us!r}")


#: A log line ends with a newline (this writer's) or a carriage return (a
#: file edited elsewhere: the readers split lines as text mode does).
_LINE_ENDS = (b"\n", b"\r")


def _unfinished(raw: bytes, where: str) -> bool:
    """Whether ``raw``, a log's last line, is a write cut short (a full disk,
    a process killed mid-record): no line end, and not JSON. One without a
    line end that parses is a whole record."""
    if raw.endswith(_LINE_ENDS):
        return False
    try:
        jsonfile.loads(raw.decode("utf-8"), where)
    except ValueError:  # UnicodeDecodeError too: a character cut in two
        return True
    return False


def _log_lines(path, records=None, warn=True) -> list[tuple[int, bytes]]:
    """``[(line number, line)]`` of the log (its first ``records`` lines
    only, when given), less an unfinished last line (``_unfinished``), with a
    warning: the records before it stand, and a resume or ``plan="auto"``
    must not stop at the one record a crash cut short."""
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    if records is not None:
        lines = lines[:records]
    numbered = list(enumerate(lines, 1))
    if numbered and _unfinished(lines[-1], f"{path} line {len(lines)}"):
        numbered.pop()
        if warn:
            warnings.warn(f"{path} line {len(lines)}: ignoring the unfinished last line (no "
                          "newline, not JSON: a write cut short); the next tune appending to "
                          "the log removes it", RuntimeWarning, stacklevel=2)
    return numbered


def read_log_records(path, records=None) -> list[tuple[int, dict]]:
    """``[(line number, record)]`` of the tuning log ``path`` (its first
    ``records`` lines only, when given): each non-blank line one strict JSON
    object (``jsonfile.loads``: a key named twice is an error) that
    ``check_log_record`` accepts. An unfinished last line is left out with a
    warning (``_log_lines``); any other broken line is a ``ValueError``
    naming the file and the line. Reading the file may raise ``OSError``."""
    found = []
    for number, raw in _log_lines(path, records):
        where = f"{path} line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start}); "
                             "a tuning log holds one JSON record a line") from None
        if not text.strip():
            continue
        try:
            record = jsonfile.loads(text, where)
        except ValueError as error:
            raise ValueError(f"{error}; a tuning log holds one JSON record a line") from None
        check_log_record(record, where)
        found.append((number, record))
    return found


def _read_log(path, records=None, stale=False, revision=KERNEL_REVISION):
    """``{key: record}`` of a tuning log (its first ``records`` lines only,
    when given: the log as it stood when a plan was made from it), the last
    record of each key winning; records stale at ``revision`` (``is_stale``)
    are left out unless ``stale``, and so are records of kernels this
    version does not build (``_current``)."""
    done = {}
    if path and os.path.exists(path):
        for _, rec in read_log_records(path, records):
            if "key" not in rec:
                continue  # a provenance line ({"meta": ...})
            if not _current(rec):
                continue
            if stale or not is_stale(rec, revision):
                done[rec["key"]] = rec
    return done


def _end_at_line(fd: int, path) -> None:
    """Make the log open as ``fd`` (read and append, its lock held) end at a
    line's end: a tail without a newline that parses is a whole record and
    gets its newline; one that does not is a write cut short, and is cut
    off with a warning naming it. A record appended after a half line would
    be glued to it, and the log broken at that line for good."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) in _LINE_ENDS:
        return
    data = os.pread(fd, size, 0)
    cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    number = len(data[:cut].splitlines()) + 1
    tail = data[cut:]
    if not _unfinished(tail, f"{path} line {number}"):
        os.write(fd, b"\n")
        return
    os.ftruncate(fd, cut)
    warnings.warn(f"{path} line {number}: removed the unfinished last line before appending "
                  f"({len(tail)} bytes, no newline, not JSON: a write cut short): "
                  f"{tail[:80]!r}{'...' if len(tail) > 80 else ''}", RuntimeWarning,
                  stacklevel=3)


def _append(log, record, path) -> None:
    """Append ``record`` to the log open as ``log`` (``open(path, "ab+")``):
    under the log's lock (tunes in several processes share a GPU's log),
    after ``_end_at_line``, in one write, then synced: a crash or power loss
    keeps every record measured before it (each cost a compile and a
    timing), and can leave at most this one unfinished."""
    import fcntl
    fd = log.fileno()
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        _end_at_line(fd, path)
        log.write((json.dumps(record) + "\n").encode())
        log.flush()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.fsync(fd)


def _stale_split(path):
    """``(valid, stale)``: the log's ``{key: record}``, split by ``is_stale``
    (a key measured again since holds its newer, valid record)."""
    everything = _read_log(path, stale=True)
    valid = {key: rec for key, rec in everything.items() if not is_stale(rec)}
    return valid, {key: rec for key, rec in everything.items() if key not in valid}


def stale_records(path) -> int:
    """How many keys of the log have only stale timings (to measure again)."""
    return len(_stale_split(path)[1])


def _dominated(valid, stale) -> set:
    best = {}
    for rec in valid.values():
        if rec.get("ok") and not rec.get("confirm"):
            cell = (rec["n"], rec["k"], rec["m"])
            best[cell] = min(best.get(cell, float("inf")), rec["us"])
    # only the release fence is known to slow kernels down: a stale K split
    # (faster since revision 3) is measured again whatever its old time
    return {key for key, rec in stale.items()
            if rec.get("ok") and not rec.get("confirm") and rec["tactic"] != CUBLAS
            and WarpSplitKTactic.parse(rec["tactic"]).k_split == 1
            and rec["us"] >= best.get((rec["n"], rec["k"], rec["m"]), float("inf"))}


def dominated_stale_keys(path) -> set:
    """Keys of stale timings not worth measuring again: the release fence
    only adds work to a kernel, so a timing it made stale that was already
    slower than the best valid one of its cell can only get slower (a K
    split, faster since, is always measured again; confirmations and
    failures are not judged: their cell's candidates decide)."""
    return _dominated(*_stale_split(path))


#: Times within this fraction of the fastest count as equal (the spread of a
#: median over 7 replays is 1-3%): a tactic already chosen for another M of
#: the shape is reused, so a shape compiles fewer kernels.
TOLERANCE = 0.02


def prefer_cublas(best, cublas_us, tolerance=TOLERANCE) -> dict:
    """``best`` (``{(n, k, m): (tactic, us)}``) with ``CUBLAS`` where
    torch.matmul measured faster than the chosen tactic by more than
    ``tolerance`` (``cublas_us``: ``{(n, k, m): us}``); a tie stays with the
    kernel (PDL overlap in a chain, which the independent timing misses)."""
    chosen = dict(best)
    for cell, (tactic, us) in best.items():
        theirs = cublas_us.get(cell)
        if theirs is not None and us is not None and theirs * (1 + tolerance) < us:
            chosen[cell] = (CUBLAS, theirs)
    return chosen


def choose_tactics(times_by_m, tolerance=TOLERANCE):
    """``{m: {tactic: us}}`` -> ``{m: (tactic, us)}``: per M the fastest
    tactic, except that one already chosen for a larger M of the same shape
    wins when it is within ``tolerance`` of the fastest, and that an early
    PDL trigger, or a mixed grid, counts only when it beats every tactic
    without one by more than ``tolerance``."""
    chosen, picks = [], {}
    for m in sorted(times_by_m, reverse=True):
        times = dict(times_by_m[m])
        if not times:
            continue
        # mixed grids first: they must beat the early uniform grids too, and
        # an early trigger then competes only with what is left
        for needs_margin in (lambda t: t.half_tiles, lambda t: t.early_launch):
            without = [us for t, us in times.items() if not needs_margin(t)]
            if without:
                bar = min(without) / (1 + tolerance)
                times = {t: us for t, us in times.items() if not needs_margin(t) or us < bar}
        fastest = min(times.values())
        reuse = [t for t in chosen if t in times and times[t] <= fastest * (1 + tolerance)]
        tactic = min(reuse, key=times.get) if reuse else min(times, key=times.get)
        if tactic not in chosen:
            chosen.append(tactic)
        picks[m] = (tactic, times[tactic])
    return picks


def tuning_order(shapes) -> list[tuple[int, int]]:
    """The distinct ``(n, k)`` of ``shapes`` in the order ``tune`` measures
    them: largest weight first (ties as given), so that a time budget leaves
    out the shapes whose calls cost least."""
    distinct = list(dict.fromkeys((n, k) for n, k in shapes))
    return sorted(distinct, key=lambda shape: -shape[0] * shape[1])


def tune(shapes, ms, *, log_path=None, resume=True, progress=print, sm_count=None,
         check=True, time_budget_s=None, tolerance=TOLERANCE, k_splits=K_SPLITS,
         early_launches=(False, True), jobs=None,
         confirm=None, bulk_xs=(False, True), l2_prefetch=True, tma=True,
         mixed=True, narrow=True, bounded_prefetch=True, cublas=True,
         shortlist=SHORTLIST) -> DecodePlan:
    """Measure and return a plan for ``shapes`` x ``ms`` on the current GPU.

    With ``shortlist`` (the default, ``cost_model.SHORTLIST``), each cell
    measures only what the cost model ranks as able to win
    (``cost_model.shortlist``), all of it known, and so compiled, before the
    first measurement: the quick tune. With ``shortlist=0`` it measures the
    whole space (``candidates``, then the measured neighbours of each cell's
    fastest): the exhaustive tune.

    Shapes are measured largest weight first (``tuning_order``). With
    ``time_budget_s``, shapes not reached in time are left out of the
    plan (lookups fall back to ``plans.default_choice``) and reported; a rerun
    with the same log resumes where this one stopped. The candidates are
    compiled first, ``jobs`` worker processes at a time (default: one per
    core but one), so measuring only loads them. Then, with ``l2_prefetch``,
    each cell's fastest candidates are timed with the L2 prefetch
    (``prefetch_twins``), with ``tma`` with TMA activation boxes
    (``tma_twins``), and each cell's ``confirm`` fastest tactics are
    timed in ``CONFIRM_ROUNDS`` more graphs, alternating, and count with
    the median of their timings (``_cell_times``)."""
    import torch

    timing.require_cuda("tune")
    from cuda.bindings import driver

    if confirm is None:
        confirm = CONFIRM
    shapes = tuning_order(shapes)

    from ..runtime.compile import compile_warp_splitk
    from ..runtime.dsl import gmem_pointer
    from ..runtime.prepared import _stream_handle

    def stream():
        return driver.CUstream(_stream_handle(cuda_device))

    device = torch.cuda.current_device()
    gpu = torch.cuda.get_device_name(device)  # its HBM bounds a believable time
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    reps = sorted({representative(m) for m in ms})
    if shortlist:
        from .choose import shortlist as ranked_shortlist
        work = {(n, k, r): ranked_shortlist(r, n, k, sm_count, shortlist)
                for n, k in shapes for r in reps}
    else:
        work = {(n, k, r): candidates(r, n, k, sm_count, k_splits, early_launches, bulk_xs)
                for n, k in shapes for r in reps}
    done, stale = _stale_split(log_path) if resume else ({}, {})
    if stale:
        # timings of kernels changed since (ASYNC_RING_REVISION): measured
        # again where they could still win, skipped where they cannot
        dominated = _dominated(done, stale)
        for key in dominated:
            done[key] = {"key": key, "ok": False, "dominated": True}
        progress(f"{len(stale)} logged timings of kernels changed since (async activation "
                 "rings before the release fence, K splits before the mbarrier hand-over): "
                 f"{len(dominated)} were already slower than their cell's best valid one and "
                 "only slower since, and are skipped; the rest are measured again if still "
                 "candidates")
    progress(f"{sum(len(v) for v in work.values())} candidates to measure, "
             f"{len({(n, k, t) for (n, k, _), ts in work.items() for t in ts})} distinct kernels")
    started = time.perf_counter()
    # compile failures are not recorded here: the in-process compile below
    # raises the same error and logs it with the candidate
    from ..runtime.compile import device_arch
    from ..runtime.precompile import precompile
    # what will be timed: candidates not in the log, and the fastest logged
    # ones of each cell whose confirmation is not in the log either
    # measured neighbours, in order: each rule maps a cell's {tactic: us}
    # to the twins to time next
    rules = [rule for on, rule in (
        (l2_prefetch, lambda times, n, k, r: prefetch_twins(times, n, k)),
        (tma, lambda times, n, k, r: tma_twins(times, n, k)),
        # after the TMA twins: a TMA parent's narrow twin copies by 16 bytes
        (narrow, lambda times, n, k, r: narrow_twins(times, n, k, r, sm_count)),
        # last: a cell's fastest, TMA twins included, are the mixed grids' parents
        (mixed, lambda times, n, k, r: mixed_twins(times, n, k, r, sm_count)),
        # after every other rule: any of them may have found the parents
        (bounded_prefetch, lambda times, n, k, r: bounded_prefetch_twins(times, n, k)))
        if on and not shortlist]
    def logged_times(n, k, r):
        return {t: [done[_log_key(n, k, r, t)]["us"]] for t in work[(n, k, r)]
                if done.get(_log_key(n, k, r, t), {}).get("ok")}

    to_build = set()
    for (n, k, r), ts in work.items():
        logged = logged_times(n, k, r)
        to_build |= {(n, k, t) for t in ts if _log_key(n, k, r, t) not in done}
        # a cell not measured yet: its twins are likely those of the next
        # measured M up (the same tactics ranked alike), compiled now in
        # parallel rather than one by one when the cell gets there
        proxy = logged
        for q in (q for q in reps if q > r):
            if proxy:
                break
            proxy = logged_times(n, k, q)
        for rule in rules:
            # the twins of the logged fastest (any a proxy missed compile
            # when their cell gets there)
            twins = rule({t: v[0] for t, v in proxy.items()}, n, k, r)
            to_build |= {(n, k, t) for t in twins if _log_key(n, k, r, t) not in done}
            for t in twins:
                rec = done.get(_log_key(n, k, r, t), {})
                if rec.get("ok"):
                    logged[t] = [rec["us"]]
        to_build |= {(n, k, t) for j, t in _confirmations(
                         logged, confirm, default_tactic(r, n, k, sm_count))
                     if _confirm_key(n, k, r, t, j) not in done}
    precompile([(n, k, t, False, True) for n, k, t in sorted(to_build)], device_arch(device),
               jobs, progress)
    # read and append: _append looks at the log's tail before each record
    log = open(log_path, "ab+") if log_path else None
    if log:
        # the run's provenance: `tune --from-log` names this GPU in the plan it rebuilds
        _append(log, {"meta": plan_meta(gpu, sm_count, torch.__version__)}, log_path)
    cuda_device = torch.device("cuda", device)
    samples = {}  # {(n, k): {rep: {tactic: [us, ...]}}}
    measured = {}  # {(n, k): {rep: {tactic: median us}}}
    cublas_us = {}  # {(n, k, rep): us of torch.matmul}
    best = {}
    try:
        for index, (n, k) in enumerate(shapes):
            if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                progress(f"time budget of {time_budget_s:.0f} s spent: {len(shapes) - index} "
                         f"shapes left untuned: {shapes[index:]}")
                break
            copies = timing.copies_for(n * k * 2)
            weights = timing.random_weights(n, k, copies, "cuda", seed=n * 7 + k)
            weight_ptrs = [gmem_pointer(w.data_ptr()) for w in weights]
            bias_ptr = weight_ptrs[-1]  # never read: these kernels have no bias
            for r in reps:
                x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(r, n, device="cuda", dtype=torch.bfloat16)
                x_ptr, out_ptr = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())
                ref = x.double() @ weights[-1].double().t()

                def time_code(code, ptrs=weight_ptrs, x_ptr=x_ptr, out_ptr=out_ptr, r=r):
                    # the stream is looked up at each call, as run() does:
                    # timing captures on its own stream
                    return timing.time_calls([
                        lambda wp=wp, c=code: c(wp, x_ptr, bias_ptr, out_ptr, r, stream())
                        for wp in ptrs])

                cell = samples.setdefault((n, k), {}).setdefault(r, {})

                def measure(tactic, n=n, k=k, r=r, x_ptr=x_ptr, out_ptr=out_ptr, ref=ref,
                            out=out, cell=cell, time_code=time_code,
                            checked_weight=weight_ptrs[-1], bias_ptr=bias_ptr):
                    key = _log_key(n, k, r, tactic)
                    rec = done.get(key)
                    if rec is None:
                        rec = _record(key=key, n=n, k=k, m=r, tactic=tactic.short())
                        try:
                            code = compile_warp_splitk(device, n, k, tactic)
                        except Exception as error:
                            rec.update(ok=False, error=f"compile: {error}")
                        else:
                            out.fill_(float("nan"))
                            code(checked_weight, x_ptr, bias_ptr, out_ptr, r, stream())
                            torch.cuda.synchronize()
                            err = ((out.double() - ref).norm() / ref.norm()).item()
                            if check and not err < 1e-2:
                                rec.update(ok=False, error=f"relative error {err:.3g}")
                            else:
                                t = time_code(code)
                                floor = timing.physical_floor_us(n * k * 2, gpu)
                                if t.median_us < floor:
                                    rec.update(ok=False, error=f"{t.median_us:.3f} us is under the "
                                               f"{floor:.3f} us any HBM read of the weight needs: "
                                               "the measurement is broken")
                                else:
                                    rec.update(ok=True, us=round(t.median_us, 3),
                                               spread=round(t.spread, 3), rel_err=err)
                        if log:
                            _append(log, rec, log_path)
                    if not rec.get("ok"):
                        if not rec.get("dominated"):
                            progress(f"dropped {key}: {rec.get('error')}")
                        return
                    cell[tactic] = [rec["us"]]

                for tactic in work[(n, k, r)]:
                    measure(tactic)
                for rule in rules:
                    for tactic in rule({t: v[0] for t, v in cell.items()}, n, k, r):
                        measure(tactic)
                for j, tactic in _confirmations(cell, confirm, default_tactic(r, n, k, sm_count)):
                    key = _confirm_key(n, k, r, tactic, j)
                    rec = done.get(key)
                    if rec is None:
                        t = time_code(compile_warp_splitk(device, n, k, tactic))
                        rec = _record(key=key, n=n, k=k, m=r, tactic=tactic.short(),
                                      confirm=True, ok=True, us=round(t.median_us, 3),
                                      spread=round(t.spread, 3))
                        if t.median_us < timing.physical_floor_us(n * k * 2, gpu):
                            rec.update(ok=False, error="under the HBM floor: measurement broken")
                        if log:
                            _append(log, rec, log_path)
                    if rec.get("ok"):
                        cell[tactic].append(rec["us"])
                if cublas:
                    # torch.matmul (cuBLAS) on the same copies and x, in as
                    # many graphs as a confirmed candidate, the median counting
                    key = _log_key(n, k, r, CUBLAS)
                    rec = done.get(key)
                    if rec is None:
                        t = timing.time_rounds([[
                            lambda w=w, x=x, out=out: torch.matmul(x, w.t(), out=out)
                            for w in weights]], CONFIRM_ROUNDS + 1)[0]
                        rec = _record(key=key, n=n, k=k, m=r, tactic=CUBLAS, ok=True,
                                      us=round(t.median_us, 3), spread=round(t.spread, 3))
                        if log:
                            _append(log, rec, log_path)
                    if rec.get("ok"):
                        cublas_us[(n, k, r)] = rec["us"]
                times = measured.setdefault((n, k), {})[r] = _cell_times(cell)
                fastest = min(times, key=times.get) if times else None
                progress(f"N={n:>6} K={k:>6} M={r:>2}: {len(work[(n, k, r)])} candidates, fastest "
                         f"{fastest.short() if fastest else '-'} "
                         f"{times[fastest] if fastest else float('nan'):.2f} us"
                         + (f", cuBLAS {cublas_us[(n, k, r)]:.2f} us"
                            if (n, k, r) in cublas_us else ""))
            picks = {(n, k, r): pick for r, pick in
                     choose_tactics(measured.get((n, k), {}), tolerance).items()}
            best.update(prefer_cublas(picks, cublas_us, tolerance))
            del weights, weight_ptrs
            torch.cuda.empty_cache()
    finally:
        if log:
            log.close()
    meta = plan_meta(gpu, sm_count, torch.__version__, narrow_tiles=bool(narrow))
    return _plan(best, shapes, ms, meta)


def plan_meta(gpu, sm_count, torch_version, **extra) -> dict:
    """A tuned plan's provenance (``DecodePlan.meta``)."""
    try:
        import importlib.metadata as md
        dsl = md.version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover
        dsl = "unknown"
    from .. import __version__
    return {"gpu": gpu, "sm_count": sm_count, "warpsplitk": __version__, "cutlass_dsl": dsl,
            "torch": torch_version,
            "method": "warpsplitk tune: " + " ".join(timing.__doc__.split()),
            "representative_ms": list(REPRESENTATIVE_MS),
            "async_ring_revision": ASYNC_RING_REVISION,
            "kernel_revision": KERNEL_REVISION,
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **extra}


def _plan(best, shapes, ms, meta, reps=REPRESENTATIVE_MS, shape_reps=None) -> DecodePlan:
    plan = DecodePlan(meta=meta)
    for n, k in shapes:
        for m in ms:
            rep = representative(m, (shape_reps or {}).get((n, k), reps))
            hit = best.get((n, k, rep))
            if hit is not None:
                plan.set(n, k, m, hit[0], hit[1] if rep == m else None)
    return plan


def in_default_space(tactic: WarpSplitKTactic, narrow=True) -> bool:
    """Whether ``tactic`` is in the space ``tune`` measures: with
    ``narrow=False`` no narrow token tile and no ring past
    ``DEFAULT_MAX_STAGES`` (only the narrow twins reach deeper). A log holds
    whatever any tune measured; a plan is made from what the tune asked
    for."""
    if not narrow and (tactic.token_tile < layout.MMA_N or tactic.stages > DEFAULT_MAX_STAGES):
        return False
    return tactic.k_split in K_SPLITS


def plan_from_log(log_path, ms=range(1, 33), meta=None, tolerance=TOLERANCE,
                  reps=REPRESENTATIVE_MS, narrow=True, records=None, stale=False,
                  revision=None):
    """The plan ``tune`` makes from the measurements in its log, without a GPU.

    A shape is planned when the log has a correct measurement for every
    representative M (``reps``: a plan tuned before 4 was one of them is
    rebuilt with its own, ``meta["representative_ms"]``), or for every one
    but some below its largest measured M: those Ms then take the winner of
    the next measured M up, as they did before they were representatives
    (a log older than M = 4's measurement), and the plan's meta lists them
    (``inherited_ms``). Shapes measured in part (the tuner measures each
    shape's Ms in ascending order: a run stopped mid-shape lacks the largest)
    are left out and returned with the plan: ``(plan, {(n, k): missing reps})``.
    Only tactics of the space the flags name count (``in_default_space``:
    narrow token tiles unless ``narrow=False``; the plan's meta says
    ``narrow_tiles``), and only
    those this version accepts (a log can hold some it now refuses). With
    ``records``, only the log's first ``records`` lines count (the log as
    it stood when the plan was made; the plan's meta says how many). With
    ``stale``, records of kernels changed since count too (a plan made
    before the first change is rebuilt that way; its meta says
    ``async_ring_revision`` 1); with ``revision``, the records valid at that
    kernel revision (a plan made then; its meta says ``kernel_revision``).
    """
    samples = {}  # {(n, k): {rep: {tactic: [us, ...]}}}
    revision = KERNEL_REVISION if revision is None else revision
    logged = _read_log(log_path, records, stale, revision)
    cublas_us = {(rec["n"], rec["k"], rec["m"]): rec["us"] for rec in logged.values()
                 if rec["tactic"] == CUBLAS and rec.get("ok")}
    for rec in logged.values():
        if rec.get("ok") and not rec.get("confirm") and rec["tactic"] != CUBLAS:
            tactic = WarpSplitKTactic.parse(rec["tactic"])
            if not in_default_space(tactic, narrow):
                continue
            if not is_legal(tactic, rec["n"], rec["k"]):
                continue  # measured by an earlier version that allowed it (narrow + bulk_x)
            samples.setdefault((rec["n"], rec["k"]), {}).setdefault(rec["m"], {})[tactic] = [rec["us"]]
    for rec in logged.values():  # a confirmation counts only beside its first timing
        if rec.get("confirm") and rec.get("ok"):
            tactic = WarpSplitKTactic.parse(rec["tactic"])
            cell = samples.get((rec["n"], rec["k"]), {}).get(rec["m"], {})
            if tactic in cell:
                cell[tactic].append(rec["us"])
    measured = {key: {m: _cell_times(cell) for m, cell in by_m.items()}
                for key, by_m in samples.items()}
    reps = sorted({representative(m, reps) for m in ms})
    best, partial, inherited, shape_reps = {}, {}, {}, {}
    for (n, k), by_rep in sorted(measured.items()):
        have = [r for r in reps if by_rep.get(r)]
        missing = [r for r in reps if not by_rep.get(r)]
        if not have or max(missing, default=0) > max(have):
            partial[(n, k)] = missing
            continue
        if missing:
            inherited[f"{n},{k}"] = missing
            shape_reps[(n, k)] = have
        for r, pick in choose_tactics({r: by_rep[r] for r in have}, tolerance).items():
            best[(n, k, r)] = pick
    best = prefer_cublas(best, cublas_us, tolerance)
    shapes = sorted({(n, k) for n, k, _ in best})
    meta = dict(meta or {}, source=f"log {os.path.basename(log_path)}", representative_ms=reps,
                log_records=records if records is not None else _count_lines(log_path),
                async_ring_revision=1 if stale else min(revision, ASYNC_RING_REVISION),
                kernel_revision=1 if stale else revision, narrow_tiles=bool(narrow))
    if inherited:
        meta["inherited_ms"] = inherited
    return _plan(best, shapes, ms, meta, reps, shape_reps), partial
