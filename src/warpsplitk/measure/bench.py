"""Benchmark: warpsplitk against torch.matmul (cuBLAS) and the HBM floor.

Both run in the same process with the method of ``timing.py``. The floor is
the weight's bytes at the datasheet's peak bandwidth (``floor_us``, the
``%floor`` column); rows also keep it at the bandwidth a plain read
(``torch.sum``) measured in the same run (``floor_measured_us``), which a
call's stream can exceed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import time
from dataclasses import asdict, dataclass

from .. import __version__, models
from ..planning.plans import CUBLAS, DecodePlan, before_down, default_choice, prepare_choices
from ..runtime import timing
from ..planning.choose import reference_tactic
from ..runtime.compile import device_arch
from ..runtime.precompile import precompile
from ..tactics import shape_refusal

DEFAULT_MS = (1, 4, 8, 16, 32)


@dataclass
class BenchRow:
    n: int
    k: int
    m: int
    tactic: str
    source: str  # "plan" or "default"
    ours_us: float
    ours_spread: float
    default_us: float | None
    cublas_us: float
    cublas_spread: float
    floor_us: float
    floor_measured_us: float
    #: the reference wave heuristic's tactic and time (tactics.reference_tactic)
    reference_tactic: str | None = None
    reference_us: float | None = None
    #: the default's tactic (plans.default_choice) where ``default_us`` is
    #: timed, so a record shows which choice that time belongs to
    default_tactic: str | None = None

    @property
    def speedup(self):
        return self.cublas_us / self.ours_us

    @property
    def weight_tbps(self):
        return self.n * self.k * 2 / (self.ours_us * 1e-6) / 1e12


def environment():
    import torch  # torch loads only when measuring
    gpu = torch.cuda.get_device_name()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "datasheet_TBps": timing.datasheet_tbps(gpu)}  # the floors' unit
    try:
        env["cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover - a bundle without metadata
        env["cutlass_dsl"] = "unknown"
    env["warpsplitk"] = __version__
    return env


def bench_shape(n, k, ms, tactic_for, *, include_default=True, seed=0, check=True,
                rounds=None):
    """Rows for one ``[n, k]`` weight; ``tactic_for(m)`` -> (tactic or
    ``CUBLAS``, source). Each configuration (ours, the default as it runs
    without a plan (``plans.default_choice``: the cost model's tactic, or
    cuBLAS where it predicts cuBLAS faster), the reference wave heuristic,
    cuBLAS) is timed in ``rounds`` graphs (``timing.ROUNDS``), alternating,
    and counts with the median one; a configuration that is another's call
    (a heuristic whose tactic is ours, a choice of cuBLAS) takes that time.
    Rows: ``(m, (tactic, source), ours, (default tactic, default_us),
    (reference tactic, reference_us), cublas)``, the default's pair ``(None,
    None)`` without ``include_default``."""
    rounds = timing.resolve_rounds(rounds)  # refused before anything is allocated
    timing.require_cuda("bench_shape")
    import torch  # torch loads only when measuring

    weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda", seed=seed)
    chosen = {m: tactic_for(m) for m in ms}
    runs = _ShapeRuns(weights, n, k, ms, {m: t for m, (t, _) in chosen.items()}, include_default)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        calls = runs.calls(m, x, out)
        check_out = _output_check(f"N={n} K={k} M={m}", x, weights[-1], out) if check else None
        timed = dict(zip(calls, timing.time_rounds(list(calls.values()), rounds, check_out)))
        rows.append((m, chosen[m], *runs.times(m, timed)))
    del runs, weights
    torch.cuda.empty_cache()
    return rows


class _ShapeRuns:
    """The configurations ``bench_shape`` times on one weight, prepared once
    per copy: ours (``tactics``), the default (``default_choice``) and the
    reference heuristic (``reference_tactic``), the latter two where they
    differ from what is timed already."""

    def __init__(self, weights, n, k, ms, tactics, include_default):
        self.weights, self.tactics, self.include_default = weights, tactics, include_default
        self.defaults = {m: default_choice(m, n, k) for m in ms}
        self.references = {m: reference_tactic(m, n, k) for m in ms}
        self.ours = [prepare_choices(w, tactics) for w in weights]
        self.default = ([prepare_choices(w, self.defaults) for w in weights]
                        if include_default and self.defaults != tactics else None)
        self.own_reference = {m for m in ms
                              if self.references[m] not in (tactics[m], self.defaults[m])}
        self.reference = ([prepare_choices(w, {m: self.references[m] for m in self.own_reference})
                           for w in weights] if include_default and self.own_reference else None)

    def calls(self, m, x, out) -> dict:
        """``{configuration: calls over the copies}`` timed at ``m``: ours
        (unless cuBLAS), the default (where it is neither ours nor cuBLAS),
        the reference heuristic's (where it is neither), cuBLAS."""
        import torch  # torch loads only when measuring
        runs = {}
        if self.tactics[m] != CUBLAS:
            runs["ours"] = [lambda p=p: p.run(x, out) for p in self.ours]
        if self.default is not None and self.defaults[m] not in (self.tactics[m], CUBLAS):
            runs["default"] = [lambda p=p: p.run(x, out) for p in self.default]
        if m in self.own_reference and self.reference is not None:
            runs["reference"] = [lambda p=p: p.run(x, out) for p in self.reference]
        runs["cublas"] = [lambda w=w: torch.matmul(x, w.t(), out=out) for w in self.weights]
        return runs

    def times(self, m, timed) -> tuple:
        """``(ours, (default tactic, default_us), (reference tactic,
        reference_us), cublas)`` at ``m`` from the timings of ``calls``: a
        configuration that is another's call (a heuristic whose tactic is
        ours, a choice of cuBLAS) takes its time."""
        cublas = timed["cublas"]
        ours = timed.get("ours", cublas)
        default_us = reference_us = None
        if self.include_default:
            default_us = (timed["default"] if "default" in timed
                          else ours if self.defaults[m] == self.tactics[m] else cublas).median_us
            if "reference" in timed:
                reference_us = timed["reference"].median_us
            else:
                reference_us = (ours.median_us if self.references[m] == self.tactics[m]
                                else default_us)
        default = self.defaults[m] if self.include_default else None
        return ours, (default, default_us), (self.references[m], reference_us), cublas


def _output_check(what, x, w, out):
    """A check that ``out`` holds ``x @ w^T`` (relative error < 1e-2, no NaN)."""
    import torch  # torch loads only when measuring

    def check():
        ref = (x.double() @ w.double().t())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not err < 1e-2 or torch.isnan(out).any():
            raise RuntimeError(f"{what}: relative error {err:.3g} (or NaN) after timing")
    return check


def run_bench(shapes, ms=DEFAULT_MS, plan=None, *, read_tbps=None, progress=print, rounds=None):
    """Benchmark every (shape, M); returns (environment, rows)."""
    import torch  # torch loads only when measuring
    rounds = timing.resolve_rounds(rounds)
    timing.require_cuda("run_bench")
    env = environment()
    env["rounds"] = rounds
    if read_tbps is None:
        read_tbps = timing.measured_read_bandwidth() / 1e12
    env["read_TBps"] = round(read_tbps, 3)
    sheet = env["datasheet_TBps"]

    def tactic_for(m, n, k):
        if plan is not None:
            t = plan.lookup(n, k, m)
            if t is not None:
                return t, "plan"
        return default_choice(m, n, k), "default"

    # every kernel of the run compiled up front, in parallel (warpsplitk.runtime.precompile)
    precompile([(n, k, t, False, True) for n, k in shapes for m in ms
                for t in (tactic_for(m, n, k)[0], default_choice(m, n, k),
                          reference_tactic(m, n, k)) if t != CUBLAS],
               device_arch(torch.cuda.current_device()), progress=progress)
    rows = []
    for n, k in shapes:
        for m, (tactic, source), ours, (default, default_us), (reference, reference_us), cublas in \
                bench_shape(n, k, ms, functools.partial(tactic_for, n=n, k=k), rounds=rounds):
            weight_bytes = n * k * 2
            row = BenchRow(n, k, m, _short(tactic), source,
                           round(ours.median_us, 3),
                           round(ours.spread, 3), None if default_us is None else round(default_us, 3),
                           round(cublas.median_us, 3), round(cublas.spread, 3),
                           round(weight_bytes / (sheet * 1e12) * 1e6, 3),
                           round(weight_bytes / (read_tbps * 1e12) * 1e6, 3),
                           reference.short(),
                           None if reference_us is None else round(reference_us, 3),
                           None if default is None else _short(default))
            rows.append(row)
            progress(format_row(row))
    return env, rows


HEADER = (f"{'N':>6} {'K':>6} {'M':>3} {'tactic':>22} {'ours us':>8} {'default':>8} "
          f"{'ref':>8} {'cuBLAS':>8} {'speedup':>7} {'TB/s':>5} {'%floor':>6}")


def _short(choice) -> str:
    """A tactic's short form, or "cublas" (``plans.CUBLAS``)."""
    return choice if isinstance(choice, str) else choice.short()


def format_row(r: BenchRow) -> str:
    def us(value):
        return f"{value:8.2f}" if value is not None else f"{'-':>8}"
    return (f"{r.n:>6} {r.k:>6} {r.m:>3} {r.tactic:>22} {r.ours_us:8.2f} {us(r.default_us)} "
            f"{us(r.reference_us)} {r.cublas_us:8.2f} {r.speedup:7.2f} {r.weight_tbps:5.2f} "
            f"{100 * r.floor_us / r.ours_us:5.0f}%")


def write_json(path, env, rows):
    with open(path, "w") as f:
        json.dump({"environment": env, "method": timing.__doc__.strip(),
                   "rows": [asdict(r) | {"speedup": round(r.speedup, 3),
                                         "weight_TBps": round(r.weight_tbps, 3)} for r in rows]},
                  f, indent=1)


#: Pairs of the shape table that chain (N of the first = K of the second).
DEFAULT_CHAINS = (((768, 7168), (7168, 768)), ((7168, 768), (1536, 7168)),
                  ((1536, 7168), (2304, 1536)), ((7168, 384), (2112, 7168)),
                  ((2048, 2048), (2048, 2048)))


@dataclass
class ChainRow:
    first: tuple
    second: tuple
    m: int
    tactics: str
    ours_us: float  # per pair: both projections, the second reading the first's output
    cublas_us: float
    floor_us: float

    @property
    def speedup(self):
        return self.cublas_us / self.ours_us


def chain_floor_us(first, second, tbps):
    """The HBM floor of one chained pair: both weights read once, in µs."""
    (n1, k1), (n2, k2) = first, second
    return 2 * (n1 * k1 + n2 * k2) / (tbps * 1e12) * 1e6


def chain_choices(plan, shapes, ms, *, gate_up=()):
    """What each call of a dependent chain runs, ``{(n, k): {m: tactic or
    CUBLAS}}``: the plan's choice, else the default of a call between kernel
    calls (``default_choice(..., chained=True)``); cuBLAS for a shape the
    kernel refuses. The shapes in ``gate_up`` (an MLP's gate/up, followed by
    down) take the early PDL trigger at M <= 8 (``plans.before_down``)."""
    chosen = {(n, k): {m: plan.tactic_for(n, k, m, chained=True) if shape_refusal(n, k) is None
                       else CUBLAS for m in ms} for n, k in shapes}
    for shape in set(gate_up) & set(chosen):
        chosen[shape] = {m: before_down(t, m) for m, t in chosen[shape].items()}
    return chosen


def layer_choices(plan, layer, ms):
    """``chain_choices`` for a layer's projections (``models.layer_chain``),
    gate/up taking the early trigger at M <= 8."""
    return chain_choices(plan, [(p["n"], p["k"]) for p in layer], ms,
                         gate_up=[(p["n"], p["k"]) for p in layer if p["projection"] == "gate_up"])


def chain_kernels(chosen):
    """The kernels ``chain_choices`` runs, as ``precompile`` takes them."""
    return {(n, k, t, False, True) for (n, k), by_m in chosen.items()
            for t in by_m.values() if t != CUBLAS}


def bench_chain(pairs=DEFAULT_CHAINS, ms=DEFAULT_MS, plan=None, *, progress=print, rounds=None):
    """Dependent chains: y = (x @ W1^T) @ W2^T, back to back over rotating weight
    pairs; with PDL the second kernel's weight stream starts before the first ends.
    Ours and cuBLAS each in ``rounds`` graphs (``timing.ROUNDS``), alternating;
    the median graph counts."""
    import torch  # torch loads only when measuring
    rounds = timing.resolve_rounds(rounds)
    timing.require_cuda("bench_chain")

    plan = plan if plan is not None else DecodePlan()
    sheet = timing.datasheet_tbps(torch.cuda.get_device_name())
    chosen = chain_choices(plan, [shape for pair in pairs for shape in pair], ms)
    precompile(sorted(chain_kernels(chosen)), device_arch(torch.cuda.current_device()), None,
               progress)
    rows = []
    for first, second in pairs:
        rows += _bench_pair(first, second, chosen, ms, rounds, sheet, progress)
        torch.cuda.empty_cache()  # the pair's weights are gone with _bench_pair's frame
    return rows


def _bench_pair(first, second, chosen, ms, rounds, sheet, progress) -> list[ChainRow]:
    """``bench_chain``'s rows of one pair, over copies of its two weights."""
    import torch  # torch loads only when measuring
    (n1, k1), (n2, k2) = first, second
    if n1 != k2:
        raise ValueError(f"a chain needs N of the first = K of the second, got "
                         f"{(n1, k1)} then {(n2, k2)}")
    copies = timing.copies_for(2 * (n1 * k1 + n2 * k2))
    w1 = timing.random_weights(n1, k1, copies, "cuda", seed=1)
    w2 = timing.random_weights(n2, k2, copies, "cuda", seed=2)
    for w in w1 + w2:
        w.mul_(w.shape[1] ** -0.5)  # keep the chained activations O(1)
    p1 = [prepare_choices(w, chosen[(n1, k1)]) for w in w1]
    p2 = [prepare_choices(w, chosen[(n2, k2)]) for w in w2]
    rows = []
    for m in ms:
        x = torch.randn(m, k1, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(m, n1, device="cuda", dtype=torch.bfloat16)
        y = torch.full((m, n2), float("nan"), device="cuda", dtype=torch.bfloat16)
        check_y = _chain_check(f"chain {(n1, k1)}->{(n2, k2)} M={m}", x, w1[-1], w2[-1], y)
        ours, cublas = timing.time_rounds(_pair_calls(x, h, y, p1, p2, w1, w2), rounds, check_y)
        row = ChainRow((n1, k1), (n2, k2), m,
                       f"{_short(p1[0].tactics[m])} -> {_short(p2[0].tactics[m])}",
                       round(2 * ours.median_us, 3), round(2 * cublas.median_us, 3),
                       round(chain_floor_us((n1, k1), (n2, k2), sheet), 3))
        rows.append(row)
        progress(f"{n1:>5}x{k1:<5} -> {n2:>5}x{k2:<5} M={m:>2} {row.tactics:>34} "
                 f"{row.ours_us:8.2f} {row.cublas_us:8.2f} {row.speedup:6.2f}x "
                 f"floor {row.floor_us:6.2f}")
    return rows


def _pair_calls(x, h, y, p1, p2, w1, w2) -> list[list]:
    """A chained pair's calls over the copies, ours then cuBLAS's: ``x -> h -> y``."""
    import torch  # torch loads only when measuring
    calls, cublas_calls = [], []
    for a, b in zip(p1, p2):
        calls += [lambda a=a: a.run(x, h), lambda b=b: b.run(h, y)]
    for a, b in zip(w1, w2):
        cublas_calls += [lambda a=a: torch.matmul(x, a.t(), out=h),
                         lambda b=b: torch.matmul(h, b.t(), out=y)]
    return [calls, cublas_calls]


def _chain_check(what, x, a, b, y):
    """A check that ``y`` holds ``(x @ a^T) @ b^T``, the middle rounded to
    BF16 as stored (relative error < 2e-2, no NaN)."""
    import torch  # torch loads only when measuring

    def check():
        ref = ((x.double() @ a.double().t()).to(torch.bfloat16).double()
               @ b.double().t())
        err = ((y.double() - ref).norm() / ref.norm()).item()
        if not err < 2e-2 or torch.isnan(y).any():
            raise RuntimeError(f"{what}: relative error {err:.3g}")
    return check


# ------------------------------------------------------------ a model's layer


@dataclass
class LayerRow:
    model: str
    tp: int
    m: int
    projections: str  # the layer's projections in order, N x K each
    tactics: str  # ours per projection ("cublas": a shape the kernel refuses, or the plan's)
    ours_us: float  # per layer: every projection, each reading the previous one's output
    reference_us: float  # the same chain with reference_tactic's tactics
    cublas_us: float
    floor_us: float

    @property
    def speedup(self):
        return self.cublas_us / self.ours_us


def layer_buffers(steps, m):
    """Element count of each of the two activation buffers a layer chain
    alternates between, and per step ``(reads, writes)``: the buffer index
    and the element count of the ``[m, k]`` input it reads and the ``[m, n]``
    output it writes. Step ``j`` reads buffer ``j % 2`` and writes the other;
    its input is the first ``m * k`` elements of what the previous step
    wrote (its output's first ``m * n`` elements, read as rows of ``k``), so
    every projection depends on its predecessor whatever the two shapes.
    ``steps``: ``[(n, k), ...]``."""
    size = m * max(max(n, k) for n, k in steps)
    return size, [((j % 2, m * k), (1 - j % 2, m * n)) for j, (n, k) in enumerate(steps)]


def layer_reference(buffers, weights, m):
    """What a layer chain leaves in its buffers, in float64 with each output
    rounded to BF16 as the kernels store it: ``buffers`` (two 1-D tensors,
    the initial contents) and ``weights`` (``[n, k]`` each, in order) ->
    (the two buffers after the chain, the last output ``[m, n]``)."""
    import torch  # torch loads only when measuring
    steps = [tuple(w.shape) for w in weights]
    _, plan = layer_buffers(steps, m)
    state = [b.double().clone() for b in buffers]
    for w, ((src, reads), (dst, writes)) in zip(weights, plan):
        n, k = w.shape
        x = state[src][:reads].view(m, k)
        y = (x @ w.double().t()).to(torch.bfloat16).double()
        state[dst][:writes] = y.reshape(-1)
    return state, state[plan[-1][1][0]][:plan[-1][1][1]].view(m, steps[-1][0])


def bench_layer(model_name, tp=1, ms=DEFAULT_MS, plan=None, *, progress=print, rounds=None):
    """One decode layer's projections (``models.layer_chain``) as a dependent
    chain, back to back in one CUDA graph over rotating copies of the layer's
    weights (>= 3x L2): ours (``layer_choices``), the reference heuristic's
    tactics, and cuBLAS for every projection. Attention and the activation
    between projections are left out; the dependency is kept through memory
    (``layer_buffers``)."""
    import torch  # torch loads only when measuring
    rounds = timing.resolve_rounds(rounds)
    plan = plan if plan is not None else DecodePlan()
    layer = models.layer_chain(model_name, tp)
    timing.require_cuda("bench_layer")
    steps = [(p["n"], p["k"]) for p in layer]
    sheet = timing.datasheet_tbps(torch.cuda.get_device_name())
    takes = {s: shape_refusal(*s) is None for s in steps}
    chosen = layer_choices(plan, layer, ms)
    kernels = chain_kernels(chosen) | {(n, k, reference_tactic(m, n, k), False, True)
                                       for n, k in steps if takes[(n, k)] for m in ms}
    precompile(sorted(kernels), device_arch(torch.cuda.current_device()), None, progress)
    layer_bytes = sum(2 * n * k for n, k in steps)
    weights = _layer_weights(steps, timing.copies_for(layer_bytes))
    chain = _LayerChain(model_name, tp, steps, weights, {
        "ours": _prepare_layer(weights, ms, takes, lambda m, n, k: chosen[(n, k)][m]),
        "reference": _prepare_layer(weights, ms, takes, reference_tactic)})
    floor_us = round(layer_bytes / (sheet * 1e12) * 1e6, 3)
    return [_layer_row(chain, m, rounds, floor_us, progress) for m in ms]


@dataclass
class _LayerChain:
    """What ``bench_layer`` times: the layer's ``steps`` (``[(n, k), ...]``),
    copies of its weights, and per copy and step the weight prepared with
    ours (``prepared["ours"]``) and the reference heuristic's tactics."""
    model: str
    tp: int
    steps: list
    weights: list
    prepared: dict


def _layer_weights(steps, copies) -> list[list]:
    """``copies`` copies of a layer's random weights, each scaled to keep the
    chained activations O(1)."""
    return [[w.mul_(w.shape[1] ** -0.5) for w in
             (timing.random_weights(n, k, 1, "cuda", seed=1000 * c + i)[0]
              for i, (n, k) in enumerate(steps))] for c in range(copies)]


def _prepare_layer(weights, ms, takes, choose) -> list[list]:
    """Per copy and step, the weight prepared with ``choose(m, n, k)``'s
    tactic at each M (cuBLAS for a shape the kernel refuses)."""
    return [[prepare_choices(w, {m: (choose(m, *w.shape) if takes[tuple(w.shape)] else CUBLAS)
                                 for m in ms})
             for w in layer_weights] for layer_weights in weights]


def _layer_row(chain, m, rounds, floor_us, progress) -> LayerRow:
    """``bench_layer``'s row at ``m``: ours and the reference checked against
    float64, then the three chains timed."""
    import torch  # torch loads only when measuring
    size, order = layer_buffers(chain.steps, m)
    buffers = [torch.randn(size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    initial = [b.clone() for b in buffers]
    views = functools.partial(_step_views, chain.steps, m, buffers, order)
    for kind in ("ours", "reference"):
        _check_layer_chain(chain, kind, m, buffers, initial, views)
    timed = timing.time_rounds([_layer_calls(chain, kind, views)
                                for kind in ("ours", "reference", "cublas")], rounds)
    per_layer = [round(t.median_us * len(chain.steps), 3) for t in timed]
    tactics = " -> ".join(_short(p.tactics[m]) for p in chain.prepared["ours"][0])
    row = LayerRow(chain.model, chain.tp, m, " -> ".join(f"{n}x{k}" for n, k in chain.steps),
                   tactics, *per_layer, floor_us)
    progress(f"{chain.model} TP{chain.tp} M={m:>2}: ours {row.ours_us:8.2f}  reference "
             f"{row.reference_us:8.2f}  cuBLAS {row.cublas_us:8.2f} us per layer  "
             f"{row.speedup:5.2f}x  floor {row.floor_us:7.2f}  [{tactics}]")
    return row


def _step_views(steps, m, buffers, order, j, i):
    """Step ``i``'s input ``[m, k]`` and output ``[m, n]`` in the two buffers
    (``layer_buffers``' ``order``), at step ``j`` of the whole chain."""
    (src, reads), (dst, writes) = order[i]
    parity = j % 2  # a layer of odd length swaps the buffers on each copy
    n, k = steps[i]
    return (buffers[src ^ parity][:reads].view(m, k),
            buffers[dst ^ parity][:writes].view(m, n))


def _layer_calls(chain, kind, views) -> list:
    """The calls of one kind ("ours", "reference", "cublas") over every copy
    of the layer, each step reading what the one before wrote."""
    import torch  # torch loads only when measuring
    out = []
    for c in range(len(chain.weights)):
        for i in range(len(chain.steps)):
            x, y = views(c * len(chain.steps), i)
            if kind == "cublas":
                out.append(lambda w=chain.weights[c][i], x=x, y=y: torch.matmul(x, w.t(), out=y))
            else:
                p = chain.prepared[kind][c][i]
                out.append(lambda p=p, x=x, y=y: p.run(x, y))
    return out


def _check_layer_chain(chain, kind, m, buffers, initial, views):
    """One layer of ``kind`` from known buffers, every output NaN-poisoned
    first, against float64 (``layer_reference``)."""
    import torch  # torch loads only when measuring
    for b, init in zip(buffers, initial):
        b.copy_(init)
    for i in range(len(chain.steps)):
        x, y = views(0, i)
        y.fill_(float("nan"))
        chain.prepared[kind][0][i].run(x, y)
    torch.cuda.synchronize()
    _, expected = layer_reference(initial, chain.weights[0], m)
    got = views(0, len(chain.steps) - 1)[1].double()
    err = ((got - expected).norm() / expected.norm()).item()
    if not err < 2e-2 or torch.isnan(got).any():
        raise RuntimeError(f"{chain.model} TP{chain.tp} layer M={m} ({kind}): relative error "
                           f"{err:.3g}")
