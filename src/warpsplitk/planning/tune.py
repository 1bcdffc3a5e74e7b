"""The tuner: measure a pruned set of tactics per (shape, M) and write a plan.

Two depths. The quick tune (the default) measures in each cell only the
cost model's shortlist (``choose.shortlist``): the few tactics it ranks
as able to win, the early-trigger twins it cannot rank well, and the
default's and the reference heuristic's tactics, all compiled in parallel
before the first measurement. The exhaustive tune (``shortlist=0``,
``warpsplitk tune --exhaustive``) measures the whole search space of
:mod:`warpsplitk.planning.space`: the pruned candidates of each cell, then the
measured neighbours of its fastest. Its logs are what the cost model is
fitted to (``scripts/fit_cost_model.py``).

Each candidate is compiled, checked against an fp64 reference, and timed exactly
as the benchmark times (``timing.time_calls`` over weight copies >= 3x L2).
Candidates that fail to compile, are wrong or time under the HBM floor are
dropped and reported. The ``confirm`` (``CONFIRM``) fastest of each cell, and
its default tactic, are then timed in ``CONFIRM_ROUNDS`` more graphs,
alternating, and count with the median of their timings, as the benchmark
counts its graphs: one replay set can flatter a tactic (768x128 at M = 8:
1.26 us in one run, 1.37 in the next). With ``cublas`` each cell also times
``torch.matmul`` on the same weight copies. The plan is chosen from these
timings by the rules of :mod:`.selection`; every measurement is appended to
the tuning log (:mod:`.tune_log`) as it is made, and with ``resume`` a rerun
skips what the log already holds.

With ``fp8_scales`` (``warpsplitk tune --dtype fp8``) the tune is of e4m3
weights with FP32 scales of that kind, timed as the benchmark times them
(``timing.random_fp8``), into the plan's FP8 entries. Quick or exhaustive,
each cell first measures the pruned FP8 space (``candidates(...,
fp8_scales=...)``: a few dozen tactics, the FP8 default for those scales
among them): the cost model behind the quick shortlist is fitted to BF16
timings, and an FP8 call is bound by other work (``choose.fp8_tactic``). The
exhaustive tune then adds the twins the FP8 kernel takes (with block scales
no mixed grid: ``runtime.compile`` refuses one). No cuBLAS timing: no cuBLAS
call takes an FP8 weight with its scales.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..contract import FP8_SCALE_KINDS, fp8_scale_factors
from ..kernel import layout
from ..version import __version__
from ..runtime import timing
from ..runtime.compile import compile_warp_splitk, device_arch
from ..runtime.dsl import gmem_pointer
from ..runtime.precompile import precompile
from ..runtime.prepared import stream_handle
from ..tactics import (
    DEFAULT_MAX_STAGES,
    DEFAULT_SM_COUNT,
    OPTIONAL_K_SPLITS,
    WarpSplitKTactic,
    is_legal,
)
from . import choose
from .choose import SHORTLIST, default_tactic
from .decode_plan import CUBLAS, DecodePlan
from .selection import (
    REPRESENTATIVE_MS,
    TOLERANCE,
    build_plan,
    cell_times,
    choose_tactics,
    prefer_cublas,
    representative,
)
from .space import (
    base_candidates,
    bounded_prefetch_twins,
    mixed_twins,
    narrow_twins,
    prefetch_twins,
    tma_twins,
)
from .tune_log import (
    ASYNC_RING_REVISION,
    KERNEL_REVISION,
    append_record,
    confirm_key,
    dominated_keys,
    log_key,
    new_record,
    stale_split,
)


def candidates(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
               k_splits=(1, 2), early_launches=(False, True), bulk_xs=(False, True),
               max_stages=DEFAULT_MAX_STAGES, fp8_scales=None) -> list[WarpSplitKTactic]:
    """What the tuner times first in a cell: ``space.base_candidates`` and the
    default tactic, each with every trigger of ``early_launches``; with
    ``fp8_scales``, of an e4m3 weight with those scales (the FP8 space and
    the FP8 default for them)."""
    found = set(base_candidates(m, n, k, sm_count, k_splits, early_launches, bulk_xs,
                                max_stages, fp8=fp8_scales is not None))
    found.add(cell_default(m, n, k, sm_count, fp8_scales))
    return sorted({dataclasses.replace(t, early_launch=e) for t in found for e in early_launches})


def cell_default(m, n, k, sm_count=DEFAULT_SM_COUNT, fp8_scales=None) -> WarpSplitKTactic:
    """A cell's default tactic: ``default_tactic``'s, for an e4m3 weight with
    ``fp8_scales`` scales the FP8 default for them."""
    fp8 = {} if fp8_scales is None else {"fp8": True, "fp8_scales": fp8_scales}
    return default_tactic(m, n, k, sm_count, **fp8)


#: How many of each cell's fastest candidates are timed again by default.
CONFIRM = 3

#: Graphs each confirmed candidate is timed in after its first: with the
#: first, ``timing.ROUNDS`` graphs, ranked by their median, as the benchmark
#: ranks (older log records hold one confirmation: the median of two
#: timings is their mean).
CONFIRM_ROUNDS = timing.ROUNDS - 1


def _confirm_candidates(samples, confirm, default=None):
    """The ``confirm`` fastest tactics of one cell by their first timing, and
    the cell's ``default`` heuristic tactic if it was measured: the plan
    must not lose to the default, and a single timing of it can be off by
    more than the margins between the fastest (3072x128 M=1: 1.47 us in the
    tuner, 1.24 us in every benchmark)."""
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


def tuning_order(shapes) -> list[tuple[int, int]]:
    """The distinct ``(n, k)`` of ``shapes`` in the order ``tune`` measures
    them: largest weight first (ties as given), so that a time budget leaves
    out the shapes whose calls cost least."""
    distinct = list(dict.fromkeys((n, k) for n, k in shapes))
    return sorted(distinct, key=lambda shape: -shape[0] * shape[1])


def plan_meta(gpu, sm_count, torch_version, **extra) -> dict:
    """A tuned plan's provenance (``DecodePlan.meta``)."""
    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover
        dsl = "unknown"
    return {"gpu": gpu, "sm_count": sm_count, "warpsplitk": __version__, "cutlass_dsl": dsl,
            "torch": torch_version,
            "method": "warpsplitk tune: " + " ".join(timing.__doc__.split()),
            "representative_ms": list(REPRESENTATIVE_MS),
            "async_ring_revision": ASYNC_RING_REVISION,
            "kernel_revision": KERNEL_REVISION,
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **extra}


@dataclass(frozen=True)
class TuneOptions:
    """What ``tune`` measures and how it chooses (its keyword arguments)."""
    check: bool = True
    tolerance: float = TOLERANCE
    k_splits: tuple = OPTIONAL_K_SPLITS
    early_launches: tuple = (False, True)
    confirm: int = CONFIRM
    bulk_xs: tuple = (False, True)
    l2_prefetch: bool = True
    tma: bool = True
    mixed: bool = True
    narrow: bool = True
    bounded_prefetch: bool = True
    cublas: bool = True
    shortlist: int = SHORTLIST
    #: None: BF16 weights; a scale kind: e4m3 weights with FP32 scales of it
    fp8_scales: str | None = None


@dataclass
class _Cell:
    """One (shape, M) cell being measured: the shape's weight copies (the
    last one's results are checked), x, out and the fp64 reference, the
    addresses the kernel takes (an FP8 weight's scales too, ``scale_ptrs``),
    and ``samples``: ``{tactic: [us, ...]}``."""
    n: int
    k: int
    m: int
    weights: list
    weight_ptrs: list
    x: object
    out: object
    ref: object
    x_ptr: object
    out_ptr: object
    scale_ptrs: list | None = None
    samples: dict = field(default_factory=dict)

    @property
    def bias_ptr(self):
        return self.weight_ptrs[-1]  # never read: these kernels have no bias

    def launch(self, code, copy, stream):
        """``code`` on weight copy ``copy`` (-1: the checked one), x and out."""
        weight = self.weight_ptrs[copy]
        if self.scale_ptrs is None:
            code(weight, self.x_ptr, self.bias_ptr, self.out_ptr, self.m, stream)
        else:
            code(weight, self.x_ptr, self.bias_ptr, self.scale_ptrs[copy], self.out_ptr, self.m,
                 stream)


class Tuner:
    """One tune on the current GPU: the work of each cell, the log it
    resumes from and appends to, and the choices made so far. ``run``
    measures shape by shape; every record reaches the log through
    ``_append``."""

    def __init__(self, shapes, ms, options: TuneOptions, *, sm_count=None, progress=print):
        import torch  # GPU work only: importing this module stays torch-free
        from cuda.bindings import driver  # comes with the CuTe DSL: likewise kept out

        self.shapes, self.ms, self.options, self.progress = shapes, ms, options, progress
        self.fp8_scales = options.fp8_scales
        #: what compile_warp_splitk takes of the weight's dtype
        self.kernel_options = {} if self.fp8_scales is None else {"fp8_scales": self.fp8_scales}
        self.device = torch.cuda.current_device()
        self.cuda_device = torch.device("cuda", self.device)
        self.gpu = torch.cuda.get_device_name(self.device)  # its HBM bounds a believable time
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.sm_count = sm_count
        self.torch_version = torch.__version__
        self._cu_stream = driver.CUstream
        self.reps = sorted({representative(m) for m in ms})
        self.work = self._work()
        self.rules = self._twin_rules()
        self.done = {}  # {key: record} of the log, when resuming
        self.log = self.log_path = None
        self.cublas_us = {}  # {(n, k, rep): us of torch.matmul}
        self.best = {}  # {(n, k, rep): (tactic or CUBLAS, us)}

    def _work(self) -> dict:
        """``{(n, k, rep): [tactic, ...]}``: what each cell measures first."""
        o = self.options
        # FP8: the pruned space, quick or not (the shortlist's model is of BF16 timings)
        if o.shortlist and self.fp8_scales is None:
            return {(n, k, r): choose.shortlist(r, n, k, self.sm_count, o.shortlist)
                    for n, k in self.shapes for r in self.reps}
        return {(n, k, r): candidates(r, n, k, self.sm_count, o.k_splits, o.early_launches,
                                      o.bulk_xs, fp8_scales=self.fp8_scales)
                for n, k in self.shapes for r in self.reps}

    def _twin_rules(self) -> list:
        """The exhaustive tune's measured neighbours, in order: each rule maps
        a cell's ``{tactic: us}`` to the twins to time next."""
        o, sm_count, fp8 = self.options, self.sm_count, self.fp8_scales is not None
        if o.shortlist:
            return []
        rules = [rule for on, rule in (
            (o.l2_prefetch, lambda times, n, k, r: prefetch_twins(times, n, k, fp8=fp8)),
            (o.tma, lambda times, n, k, r: tma_twins(times, n, k)),
            # after the TMA twins: a TMA parent's narrow twin copies by 16 bytes
            (o.narrow, lambda times, n, k, r: narrow_twins(times, n, k, r, sm_count, fp8=fp8)),
            # last: a cell's fastest, TMA twins included, are the mixed grids' parents
            # (none with block scales: each row block takes its own scales, and a
            # half tile's rows would need theirs; runtime.compile refuses one)
            (o.mixed and self.fp8_scales != "block128",
             lambda times, n, k, r: mixed_twins(times, n, k, r, sm_count)),
            # after every other rule: any of them may have found the parents
            (o.bounded_prefetch,
             lambda times, n, k, r: bounded_prefetch_twins(times, n, k, fp8=fp8)))
            if on]
        if not fp8:
            return rules
        # the twins the FP8 kernel takes (check_tactic's rules: no TMA boxes)
        return [lambda times, n, k, r, rule=rule: [t for t in rule(times, n, k, r)
                                                   if is_legal(t, n, k, fp8=True)]
                for rule in rules]

    def _default(self, r, n, k) -> WarpSplitKTactic:
        """The cell's default tactic (the FP8 default for an FP8 tune)."""
        return cell_default(r, n, k, self.sm_count, self.fp8_scales)

    def _key(self, n, k, r, tactic, round_=0) -> str:
        """A timing's log key (``round_``: a confirmation's), of this tune's dtype."""
        if round_:
            return confirm_key(n, k, r, tactic, round_, self.fp8_scales)
        return log_key(n, k, r, tactic, self.fp8_scales)

    def _record(self, **fields) -> dict:
        """A new log record of this tune's dtype (an FP8 one names its scales)."""
        return new_record(**fields, **({} if self.fp8_scales is None
                                       else {"fp8": self.fp8_scales}))

    def run(self, log_path=None, *, resume=True, jobs=None, time_budget_s=None) -> DecodePlan:
        """Measure the shapes in order, resuming from the log at ``log_path``
        (unless not ``resume``) and appending to it, until ``time_budget_s``
        is spent (compiling included): the plan of what was measured."""
        if resume:
            self._resume(log_path)
        self.progress(f"{sum(len(v) for v in self.work.values())} candidates to measure, "
                      f"{len({(n, k, t) for (n, k, _), ts in self.work.items() for t in ts})} "
                      "distinct kernels")
        started = time.perf_counter()
        # compile failures are not recorded here: the in-process compile
        # raises the same error and logs it with the candidate
        extra = () if self.fp8_scales is None else (False, self.fp8_scales)
        precompile([(n, k, t, False, True, *extra) for n, k, t in sorted(self._to_build())],
                   device_arch(self.device), jobs, self.progress)
        with self._log_open(log_path):
            for index, (n, k) in enumerate(self.shapes):
                if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                    self.progress(f"time budget of {time_budget_s:.0f} s spent: "
                                  f"{len(self.shapes) - index} shapes left untuned: "
                                  f"{self.shapes[index:]}")
                    break
                self._tune_shape(n, k)
        meta = plan_meta(self.gpu, self.sm_count, self.torch_version,
                         narrow_tiles=bool(self.options.narrow),
                         **({} if self.fp8_scales is None else {"fp8_scales": self.fp8_scales}))
        return build_plan(self.best, self.shapes, self.ms, meta, fp8_scales=self.fp8_scales)

    def _resume(self, log_path):
        """Take the log's valid records as measured. Stale ones (kernels
        changed since) are measured again if still candidates, unless already
        slower than their cell's best valid one (``dominated_keys``)."""
        self.done, stale = stale_split(log_path)
        if not stale:
            return
        dominated = dominated_keys(self.done, stale)
        for key in dominated:
            self.done[key] = {"key": key, "ok": False, "dominated": True}
        self.progress(f"{len(stale)} logged timings of kernels changed since (async activation "
                      "rings before the release fence, K splits before the mbarrier hand-over): "
                      f"{len(dominated)} were already slower than their cell's best valid one "
                      "and only slower since, and are skipped; the rest are measured again if "
                      "still candidates")

    def _logged_times(self, n, k, r) -> dict:
        """``{tactic: [us]}``: the log's correct first timings of a cell's work."""
        return {t: [self.done[self._key(n, k, r, t)]["us"]] for t in self.work[(n, k, r)]
                if self.done.get(self._key(n, k, r, t), {}).get("ok")}

    def _to_build(self) -> set:
        """``{(n, k, tactic)}`` to compile before the first measurement: each
        cell's work, the twins of its logged fastest and its confirmations,
        where the log lacks them."""
        to_build = set()
        for (n, k, r), ts in self.work.items():
            logged = self._logged_times(n, k, r)
            to_build |= {(n, k, t) for t in ts if self._key(n, k, r, t) not in self.done}
            # a cell not measured yet: its twins are likely those of the next
            # measured M up (the same tactics ranked alike), compiled now in
            # parallel rather than one by one when the cell gets there
            proxy = logged
            for q in (q for q in self.reps if q > r):
                if proxy:
                    break
                proxy = self._logged_times(n, k, q)
            for rule in self.rules:
                twins = rule({t: v[0] for t, v in proxy.items()}, n, k, r)
                to_build |= {(n, k, t) for t in twins if self._key(n, k, r, t) not in self.done}
                for t in twins:
                    rec = self.done.get(self._key(n, k, r, t), {})
                    if rec.get("ok"):
                        logged[t] = [rec["us"]]
            default = self._default(r, n, k)
            to_build |= {(n, k, t) for j, t in _confirmations(logged, self.options.confirm, default)
                         if self._key(n, k, r, t, j) not in self.done}
        return to_build

    @contextmanager
    def _log_open(self, log_path):
        """The log open for ``_append`` (read and append: ``append_record``
        looks at its tail first), starting with this run's provenance:
        ``tune --from-log`` names this GPU in the plan it rebuilds."""
        self.log = open(log_path, "ab+") if log_path else None
        self.log_path = log_path
        try:
            self._append({"meta": plan_meta(self.gpu, self.sm_count, self.torch_version)})
            yield
        finally:
            if self.log is not None:
                self.log.close()
            self.log = None

    def _append(self, record):
        """The one way a record reaches the log (none without one)."""
        if self.log is not None:
            append_record(self.log, record, self.log_path)

    def _logged(self, key, measure, *args) -> dict:
        """The record of ``key``: the log's, else ``measure(*args)``'s, appended."""
        rec = self.done.get(key)
        if rec is None:
            rec = measure(*args)
            self._append(rec)
        return rec

    def _tune_shape(self, n, k):
        """Measure every representative M of ``[n, k]`` on fresh weight
        copies and choose the shape's entries."""
        import torch  # GPU work only: importing this module stays torch-free

        weights, scales = self._weights(n, k)
        measured = {r: self._tune_cell(self._cell(n, k, r, weights, scales)) for r in self.reps}
        picks = {(n, k, r): pick
                 for r, pick in choose_tactics(measured, self.options.tolerance).items()}
        self.best.update(prefer_cublas(picks, self.cublas_us, self.options.tolerance))
        del weights, scales
        torch.cuda.empty_cache()

    def _weights(self, n, k) -> tuple:
        """``(weights, scales)``: the shape's random weight copies, together
        at least ``timing.L2_MULTIPLE`` L2s, and for an FP8 tune their
        scales (else None), made as the benchmark makes them."""
        if self.fp8_scales is None:
            return timing.random_weights(n, k, timing.copies_for(n * k * layout.ELEMENT_BYTES),
                                         "cuda", seed=n * 7 + k), None
        return timing.random_fp8(n, k, timing.copies_for(n * k * layout.FP8_BYTES),
                                 seed=n * 7 + k, scales=self.fp8_scales)

    def _cell(self, n, k, m, weights, scales) -> _Cell:
        import torch  # GPU work only: importing this module stays torch-free

        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        x_ptr, out_ptr = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())
        checked = weights[-1].double()
        if scales is not None:  # the product the FP8 kernel computes
            checked = checked * fp8_scale_factors(scales[-1], n, k).double()
        return _Cell(n, k, m, weights, [gmem_pointer(w.data_ptr()) for w in weights], x, out,
                     x.double() @ checked.t(), x_ptr, out_ptr,
                     None if scales is None else [gmem_pointer(s.data_ptr()) for s in scales])

    def _tune_cell(self, cell: _Cell) -> dict:
        """Measure one cell (its work, each rule's twins, the confirmations,
        cuBLAS) and report it: ``{tactic: median us}``."""
        n, k, r = cell.n, cell.k, cell.m
        for tactic in self.work[(n, k, r)]:
            self._measure(cell, tactic)
        for rule in self.rules:
            for tactic in rule({t: v[0] for t, v in cell.samples.items()}, n, k, r):
                self._measure(cell, tactic)
        default = self._default(r, n, k)
        for j, tactic in _confirmations(cell.samples, self.options.confirm, default):
            self._confirm(cell, tactic, j)
        if self.options.cublas:
            self._time_cublas(cell)
        times = cell_times(cell.samples)
        fastest = min(times, key=times.get) if times else None
        self.progress(f"{'FP8 ' if self.fp8_scales else ''}N={n:>6} K={k:>6} M={r:>2}: "
                      f"{len(self.work[(n, k, r)])} candidates, "
                      f"fastest {fastest.short() if fastest else '-'} "
                      f"{times[fastest] if fastest else float('nan'):.2f} us"
                      + (f", cuBLAS {self.cublas_us[(n, k, r)]:.2f} us"
                         if (n, k, r) in self.cublas_us else ""))
        return times

    def _stream(self):
        # looked up at each call, as run() does: timing captures on its own stream
        return self._cu_stream(stream_handle(self.cuda_device))

    def _time_code(self, cell: _Cell, code):
        """``code`` timed as the benchmark times, over the cell's weight copies."""
        return timing.time_calls([lambda copy=copy: cell.launch(code, copy, self._stream())
                                  for copy in range(len(cell.weight_ptrs))])

    def _timed(self, t, cell: _Cell) -> dict:
        """A kernel timing's record fields; under the time any HBM read of
        the weight needs, an error: the measurement is broken."""
        element = layout.ELEMENT_BYTES if self.fp8_scales is None else layout.FP8_BYTES
        floor = timing.physical_floor_us(cell.n * cell.k * element, self.gpu)
        if t.median_us < floor:
            return {"ok": False, "error": f"{t.median_us:.3f} us is under the {floor:.3f} us "
                                          "any HBM read of the weight needs: the measurement "
                                          "is broken"}
        return {"ok": True, "us": round(t.median_us, 3), "spread": round(t.spread, 3)}

    def _measure(self, cell: _Cell, tactic):
        """``tactic``'s first timing in ``cell``; a failure is reported (unless
        a skipped stale timing) and leaves the tactic out."""
        key = self._key(cell.n, cell.k, cell.m, tactic)
        rec = self._logged(key, self._first_timing, cell, key, tactic)
        if not rec.get("ok"):
            if not rec.get("dominated"):
                self.progress(f"dropped {key}: {rec.get('error')}")
            return
        cell.samples[tactic] = [rec["us"]]

    def _first_timing(self, cell: _Cell, key, tactic) -> dict:
        """Compile ``tactic``, check it against the fp64 reference, time it."""
        import torch  # GPU work only: importing this module stays torch-free

        rec = self._record(key=key, n=cell.n, k=cell.k, m=cell.m, tactic=tactic.short())
        try:
            code = compile_warp_splitk(self.device, cell.n, cell.k, tactic, **self.kernel_options)
        except Exception as error:
            rec.update(ok=False, error=f"compile: {error}")
            return rec
        cell.out.fill_(float("nan"))
        cell.launch(code, -1, self._stream())
        torch.cuda.synchronize()
        err = ((cell.out.double() - cell.ref).norm() / cell.ref.norm()).item()
        if self.options.check and not err < 1e-2:
            rec.update(ok=False, error=f"relative error {err:.3g}")
            return rec
        rec.update(self._timed(self._time_code(cell, code), cell))
        if rec["ok"]:
            rec["rel_err"] = err
        return rec

    def _confirm(self, cell: _Cell, tactic, round_):
        """``tactic``'s ``round_``-th confirmation in ``cell``: one more graph's
        timing beside its first."""
        key = self._key(cell.n, cell.k, cell.m, tactic, round_)
        rec = self._logged(key, self._confirmation, cell, key, tactic)
        if rec.get("ok"):
            cell.samples[tactic].append(rec["us"])

    def _confirmation(self, cell: _Cell, key, tactic) -> dict:
        t = self._time_code(cell, compile_warp_splitk(self.device, cell.n, cell.k, tactic,
                                                      **self.kernel_options))
        return self._record(key=key, n=cell.n, k=cell.k, m=cell.m, tactic=tactic.short(),
                            confirm=True, **self._timed(t, cell))

    def _time_cublas(self, cell: _Cell):
        """torch.matmul (cuBLAS) on the cell's weight copies and x."""
        key = log_key(cell.n, cell.k, cell.m, CUBLAS)
        rec = self._logged(key, self._cublas_timing, cell, key)
        if rec.get("ok"):
            self.cublas_us[(cell.n, cell.k, cell.m)] = rec["us"]

    def _cublas_timing(self, cell: _Cell, key) -> dict:
        # in as many graphs as a confirmed candidate, the median counting
        import torch  # GPU work only: importing this module stays torch-free

        t = timing.time_rounds([[lambda w=w: torch.matmul(cell.x, w.t(), out=cell.out)
                                 for w in cell.weights]], CONFIRM_ROUNDS + 1)[0]
        return new_record(key=key, n=cell.n, k=cell.k, m=cell.m, tactic=CUBLAS, ok=True,
                          us=round(t.median_us, 3), spread=round(t.spread, 3))


def tune(shapes, ms, *, log_path=None, resume=True, progress=print, sm_count=None,
         check=True, time_budget_s=None, tolerance=TOLERANCE, k_splits=OPTIONAL_K_SPLITS,
         early_launches=(False, True), jobs=None,
         confirm=None, bulk_xs=(False, True), l2_prefetch=True, tma=True,
         mixed=True, narrow=True, bounded_prefetch=True, cublas=True,
         shortlist=SHORTLIST, fp8_scales=None) -> DecodePlan:
    """Measure and return a plan for ``shapes`` x ``ms`` on the current GPU.

    With ``shortlist`` (the default, ``choose.SHORTLIST``), each cell
    measures only what the cost model ranks as able to win
    (``choose.shortlist``), all of it known, and so compiled, before the
    first measurement: the quick tune. With ``shortlist=0`` it measures the
    whole space (``candidates``, then the measured neighbours of each cell's
    fastest: with ``l2_prefetch``, ``tma``, ``narrow``, ``mixed`` and
    ``bounded_prefetch``, the twins of :mod:`.space`): the exhaustive tune.

    Shapes are measured largest weight first (``tuning_order``). With
    ``time_budget_s``, shapes not reached in time are left out of the
    plan (lookups fall back to ``default_choice``) and reported; a rerun
    with the same log resumes where this one stopped. The candidates are
    compiled first, ``jobs`` worker processes at a time (default: one per
    core but one), so measuring only loads them. Each cell's ``confirm``
    (default ``CONFIRM``) fastest tactics are timed in ``CONFIRM_ROUNDS``
    more graphs and count with the median of their timings.

    With ``fp8_scales`` (one of ``contract.FP8_SCALE_KINDS``) the weights
    are e4m3 with FP32 scales of that kind and the plan's entries are its
    FP8 entries for them (the module docstring); cuBLAS is not timed."""
    if fp8_scales is not None and fp8_scales not in FP8_SCALE_KINDS:
        raise ValueError(f"fp8_scales must be None (BF16 weights) or one of {FP8_SCALE_KINDS}, "
                         f"got {fp8_scales!r}")
    timing.require_cuda("tune")
    options = TuneOptions(
        check=check, tolerance=tolerance, k_splits=k_splits, early_launches=early_launches,
        confirm=CONFIRM if confirm is None else confirm, bulk_xs=bulk_xs,
        l2_prefetch=l2_prefetch, tma=tma, mixed=mixed, narrow=narrow,
        bounded_prefetch=bounded_prefetch, cublas=cublas and fp8_scales is None,
        shortlist=shortlist, fp8_scales=fp8_scales)
    tuner = Tuner(tuning_order(shapes), ms, options, sm_count=sm_count, progress=progress)
    return tuner.run(log_path, resume=resume, jobs=jobs, time_budget_s=time_budget_s)
