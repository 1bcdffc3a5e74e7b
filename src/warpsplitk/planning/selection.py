"""The rules that turn measurements into a plan, shared by the tuner and
``plan_from_log`` (the plan a tuning log gives, without a GPU).

A tactic timed in several graphs counts with their median (``cell_times``).
Among tactics within ``TOLERANCE`` of a cell's fastest, one already chosen
for another M of the shape is preferred: fewer kernels per shape, a shorter
cold start (``choose_tactics``). An early PDL trigger and a mixed grid must
win by more than ``TOLERANCE``, a tie going to the late trigger and the
uniform grid: such small wins did not hold outside the tuner (a mixed grid
1% faster in the tuner was 6% slower in the benchmark, 7168x384 at M = 32;
the early trigger: docs/design-notes.md). cuBLAS takes an M only where it
beats the chosen tactic by more than ``TOLERANCE``, a tie staying with the
kernel (``prefer_cublas``).
"""

from __future__ import annotations

import os
import statistics

from ..kernel import layout
from ..tactics import DEFAULT_MAX_STAGES, K_SPLITS, WarpSplitKTactic, is_legal
from .decode_plan import CUBLAS, DecodePlan
from .tune_log import ASYNC_RING_REVISION, KERNEL_REVISION, count_lines, read_log

#: Times within this fraction of the fastest count as equal (the spread of a
#: median over 7 replays is 1-3%).
TOLERANCE = 0.02

#: The Ms the tuner measures; every other M takes the winner of the next one
#: up. 4 serves 2..4, the Ms a 4-row narrow token tile covers.
REPRESENTATIVE_MS = (1, 4, 8, 16, 24, 32)


def representative(m: int, reps=REPRESENTATIVE_MS) -> int:
    """The measured M (of ``reps``) whose winner serves ``m``."""
    return min(r for r in reps if r >= m)


def cell_times(samples):
    """``{tactic: [us, ...]}`` -> ``{tactic: median us}``: a tactic timed in
    several graphs (a first pass and its confirmations) counts with the
    median of them, so one graph in a lucky state does not pick it (small
    kernels' graphs can be bimodal)."""
    return {t: round(statistics.median(v), 3) for t, v in samples.items() if v}


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


def in_default_space(tactic: WarpSplitKTactic, narrow=True) -> bool:
    """Whether ``tactic`` is in the space ``tune`` measures: with
    ``narrow=False`` no narrow token tile and no ring past
    ``DEFAULT_MAX_STAGES`` (only the narrow twins reach deeper). A log holds
    whatever any tune measured; a plan is made from what the tune asked
    for."""
    if not narrow and (tactic.token_tile < layout.MMA_N or tactic.stages > DEFAULT_MAX_STAGES):
        return False
    return tactic.k_split in K_SPLITS


def build_plan(best, shapes, ms, meta, reps=REPRESENTATIVE_MS, shape_reps=None, *,
               fp8_scales=None) -> DecodePlan:
    """The plan of ``best`` (``{(n, k, rep): (tactic, us)}``) for ``shapes``
    x ``ms``: each M takes its representative's choice (``shape_reps``: a
    shape's own representatives, where it has fewer), with a time only where
    it was measured; with ``fp8_scales``, as the plan's FP8 entries for
    those scales."""
    plan = DecodePlan(meta=meta)
    for n, k in shapes:
        for m in ms:
            rep = representative(m, (shape_reps or {}).get((n, k), reps))
            hit = best.get((n, k, rep))
            if hit is not None:
                plan.set(n, k, m, hit[0], hit[1] if rep == m else None, fp8_scales=fp8_scales)
    return plan


def _log_samples(logged, narrow, fp8_scales=None) -> dict:
    """``{(n, k): {m: {tactic: [us, ...]}}}`` of a log's correct kernel
    timings of BF16 weights (``fp8_scales``: of e4m3 weights with scales of
    that kind): each first timing of a tactic in the space
    (``in_default_space``) that this version accepts, then its
    confirmations beside it (one without a first timing counts for
    nothing)."""
    samples = {}
    mine = {key: rec for key, rec in logged.items() if rec.get("fp8") == fp8_scales}
    for rec in mine.values():
        if rec.get("ok") and not rec.get("confirm") and rec["tactic"] != CUBLAS:
            tactic = WarpSplitKTactic.parse(rec["tactic"])
            if not in_default_space(tactic, narrow):
                continue
            if not is_legal(tactic, rec["n"], rec["k"], fp8=fp8_scales is not None):
                continue  # measured by an earlier version that allowed it (narrow + bulk_x)
            cell = samples.setdefault((rec["n"], rec["k"]), {}).setdefault(rec["m"], {})
            cell[tactic] = [rec["us"]]
    for rec in mine.values():
        if rec.get("confirm") and rec.get("ok"):
            tactic = WarpSplitKTactic.parse(rec["tactic"])
            cell = samples.get((rec["n"], rec["k"]), {}).get(rec["m"], {})
            if tactic in cell:
                cell[tactic].append(rec["us"])
    return samples


def _choose_shapes(measured, reps, tolerance):
    """``choose_tactics`` for each shape of ``measured`` (``{(n, k): {m:
    {tactic: us}}}``) measured at every representative but perhaps some
    below its largest measured one: ``(best, partial, inherited,
    shape_reps)``, as ``plan_from_log`` describes."""
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
    return best, partial, inherited, shape_reps


def plan_from_log(log_path, ms=range(1, 33), meta=None, tolerance=TOLERANCE,
                  reps=REPRESENTATIVE_MS, narrow=True, records=None, stale=False,
                  revision=None, fp8_scales=None):
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
    ``narrow_tiles``), and only those this version accepts (a log can hold
    some it now refuses). With ``records``, only the log's first ``records``
    lines count (the log as it stood when the plan was made; the plan's meta
    says how many). With ``stale``, records of kernels changed since count
    too (a plan made before the first change is rebuilt that way; its meta
    says ``async_ring_revision`` 1); with ``revision``, the records valid at
    that kernel revision (a plan made then; its meta says
    ``kernel_revision``). With ``fp8_scales``: the plan's FP8 entries, of
    the log's timings of e4m3 weights with scales of that kind.
    """
    revision = KERNEL_REVISION if revision is None else revision
    logged = read_log(log_path, records, stale, revision)
    cublas_us = {(rec["n"], rec["k"], rec["m"]): rec["us"] for rec in logged.values()
                 if rec["tactic"] == CUBLAS and rec.get("ok") and fp8_scales is None}
    measured = {key: {m: cell_times(cell) for m, cell in by_m.items()}
                for key, by_m in _log_samples(logged, narrow, fp8_scales).items()}
    reps = sorted({representative(m, reps) for m in ms})
    best, partial, inherited, shape_reps = _choose_shapes(measured, reps, tolerance)
    best = prefer_cublas(best, cublas_us, tolerance)
    shapes = sorted({(n, k) for n, k, _ in best})
    meta = dict(meta or {}, source=f"log {os.path.basename(log_path)}", representative_ms=reps,
                log_records=records if records is not None else count_lines(log_path),
                async_ring_revision=1 if stale else min(revision, ASYNC_RING_REVISION),
                kernel_revision=1 if stale else revision, narrow_tiles=bool(narrow),
                **({"fp8_scales": fp8_scales} if fp8_scales else {}))
    if inherited:
        meta["inherited_ms"] = inherited
    return build_plan(best, shapes, ms, meta, reps, shape_reps, fp8_scales=fp8_scales), partial
