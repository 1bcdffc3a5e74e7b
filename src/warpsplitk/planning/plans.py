"""Decode plans: per-shape, per-M tactics chosen ahead of time by measurement.

A plan is a versioned JSON file::

    {"format": "warpsplitk-plan", "version": 1,
     "meta": {"gpu": ..., "sm_count": ..., "warpsplitk": ..., "cutlass_dsl": ...,
              "method": ..., "created": ...},
     "shapes": [{"n": N, "k": K, "entries": {"M": {"tactic": "o,t,k,s,b", "us": t}}}]}

An entry's tactic may instead be ``"cublas"`` (``CUBLAS``): for that M the
prepared weight runs ``torch.matmul`` (cuBLAS), where it measured faster.
``load_plan`` validates every other entry with ``check_tactic``: a bad or
stale file is an error naming the entry, never a silent fallback. Lookups for
shapes the plan lacks fall back to the cost model (``default_choice``: its
tactic, or cuBLAS where it predicts cuBLAS faster) and say so once.
``prepare`` compiles everything a weight needs before any graph capture.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources

from ..jsonfile import loads, read_json
from ..tactics import MAX_M, WarpSplitKTactic, as_integer, check_ms, check_tactic, resolve_sm_count
from .choose import default_tactic, prefers_cublas

PLAN_FORMAT = "warpsplitk-plan"
PLAN_VERSION = 1
#: A plan entry that runs ``torch.matmul`` (cuBLAS) for its M instead of the kernel.
CUBLAS = "cublas"


def is_time(us) -> bool:
    """A measured time: a positive finite number (of microseconds)."""
    return type(us) in (int, float) and math.isfinite(us) and us > 0


def _check_entry(n, k, m, us, where):
    """A plan entry's (N, K, M), as ints, and measured time: positive integers
    (any integral type), M in 1..32, ``us`` None or a positive finite number
    of microseconds."""
    sizes = []
    for name, value in (("N", n), ("K", k), ("M", m)):
        size = as_integer(value)
        if size is None or size < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        sizes.append(size)
    n, k, m = sizes
    if m > MAX_M:
        raise ValueError(f"{where}: M must be in 1..{MAX_M}, got {m}")
    if us is not None and not is_time(us):
        raise ValueError(f"{where}: 'us' must be a positive number of microseconds or null, "
                         f"got {us!r}")
    return n, k, m


def check_plan(plan):
    """``plan``, unless it is not what every function taking a plan accepts:
    a ``DecodePlan``, None (the default (cost model)) or ``"auto"``."""
    if plan is None or isinstance(plan, DecodePlan) or (isinstance(plan, str) and plan == "auto"):
        return plan
    raise ValueError(f"plan must be a DecodePlan, None or 'auto', got {plan!r}")


def resolve_plan(plan, shapes, ms=range(1, MAX_M + 1), *, progress=print, jobs=None):
    """The ``DecodePlan`` (or None) ``plan`` stands for: ``"auto"`` is this
    GPU's plan (``plan_cache.auto_plan``), tuned first for the ``shapes``
    (``[(n, k)]``) it lacks; no shapes, nothing to tune: None."""
    if check_plan(plan) != "auto":
        return plan
    if not shapes:
        return None
    from .plan_cache import auto_plan
    return auto_plan(shapes, ms, progress=progress, jobs=jobs)


def default_choice(m: int, n: int, k: int, sm_count: int | None = None, *,
                   chained: bool = False) -> WarpSplitKTactic | str:
    """What runs M tokens on an ``[n, k]`` weight without a plan entry:
    ``default_tactic``, or ``CUBLAS`` where the cost model predicts
    ``torch.matmul`` faster than that tactic (M = 32 on some large weights).
    ``chained``: the call sits between kernel calls of a dependent chain
    (``bench --chain --model``), where cuBLAS must also make up the PDL
    overlap it forfeits (``cost_model.CHAIN_CUBLAS_US``)."""
    sm_count = resolve_sm_count(sm_count)
    tactic = default_tactic(m, n, k, sm_count)
    return CUBLAS if prefers_cublas(m, n, k, sm_count, chained=bool(chained)) else tactic


@dataclass
class DecodePlan:
    meta: dict = field(default_factory=dict)
    #: {(n, k): {m: (tactic, measured_us or None)}}
    entries: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set, init=False, repr=False, compare=False)

    def lookup(self, n: int, k: int, m: int) -> WarpSplitKTactic | str | None:
        """The plan's choice for (N, K, M): a tactic, ``CUBLAS``, or None."""
        hit = self.entries.get((n, k), {}).get(m)
        return None if hit is None else hit[0]

    def tactic_for(self, n: int, k: int, m: int, sm_count: int | None = None, *,
                   chained: bool = False) -> WarpSplitKTactic | str:
        """The plan's choice (a tactic or ``CUBLAS``), else ``default_choice``
        (``chained`` as there; said once per shape, unless the plan is empty:
        no plan at all)."""
        tactic = self.lookup(n, k, m)
        if tactic is not None:
            return tactic
        if self.entries and (n, k) not in self._warned:
            self._warned.add((n, k))
            have = "no entry" if (n, k) not in self.entries else f"no entry for M={m}"
            warnings.warn(f"decode plan has {have} for N={n}, K={k}: using the cost model's "
                          "choice (default_choice)", stacklevel=2)
        return default_choice(m, n, k, sm_count, chained=chained)

    def set(self, n, k, m, tactic, us=None):
        """Choose ``tactic`` (or ``CUBLAS``) for (N, K, M), measured at ``us``
        microseconds (or None)."""
        n, k, m = _check_entry(n, k, m, us, "decode plan entry")
        if tactic != CUBLAS:
            check_tactic(tactic, n, k)
        self.entries.setdefault((n, k), {})[m] = (tactic, us)

    def to_json(self) -> dict:
        shapes = []
        for (n, k), by_m in sorted(self.entries.items()):
            shapes.append({"n": n, "k": k, "entries": {
                str(m): {"tactic": t if t == CUBLAS else t.short(), "us": us}
                for m, (t, us) in sorted(by_m.items())}})
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "meta": self.meta, "shapes": shapes}

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


def plan_from_json(data, source="plan") -> DecodePlan:
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ValueError(f"{source}: not a warpsplitk plan (format must be {PLAN_FORMAT!r})")
    if type(data.get("version")) is not int or data["version"] != PLAN_VERSION:
        raise ValueError(f"{source}: plan version {data.get('version')!r}, this warpsplitk reads "
                         f"version {PLAN_VERSION}")
    if not isinstance(data.get("meta", {}), dict) or not isinstance(data.get("shapes", []), list):
        raise ValueError(f"{source}: a plan's 'meta' is an object and its 'shapes' a list")
    plan = DecodePlan(meta=dict(data.get("meta", {})))
    for i, shape in enumerate(data.get("shapes", [])):
        try:
            n, k, entries = shape["n"], shape["k"], shape["entries"]
        except (KeyError, TypeError):
            raise ValueError(f"{source}: shapes[{i}] needs 'n', 'k' and 'entries'") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{source}: shapes[{i}] 'entries' must map each M to its tactic")
        for key, entry in entries.items():
            where = f"{source}: N={n} K={k} M={key}"
            # one spelling per M: " 1" and "1" would both be M = 1 (JSON's
            # keys are text; data built in Python may key by int)
            if type(key) is int:
                m = key
            elif isinstance(key, str) and key.isascii() and key.isdigit() \
                    and str(int(key)) == key:
                m = int(key)
            else:
                raise ValueError(f"{where}: M must be an integer in 1..{MAX_M}, got {key!r}")
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: entry needs a 'tactic'")
            n, k, m = _check_entry(n, k, m, entry.get("us"), where)
            if m in plan.entries.get((n, k), {}):
                raise ValueError(f"{where}: a second entry for this N, K and M")
            try:
                if entry["tactic"] == CUBLAS:
                    tactic = CUBLAS
                else:
                    tactic = WarpSplitKTactic.parse(entry["tactic"])
                    check_tactic(tactic, n, k)
            except (KeyError, TypeError):
                raise ValueError(f"{where}: entry needs a 'tactic'") from None
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            plan.entries.setdefault((n, k), {})[m] = (tactic, entry.get("us"))
    return plan


def load_plan(path) -> DecodePlan:
    """Read and validate a plan file; every problem (no such file, not
    JSON, not a plan, a bad entry) is a ``ValueError`` naming the file."""
    return plan_from_json(read_json(path, "plan file"), str(path))


def builtin_plans() -> list[str]:
    """The names of the plans shipped with the package (``builtin_plan``)."""
    folder = resources.files("warpsplitk").joinpath("data")
    return sorted(entry.name[len("plan-"):-len(".json")] for entry in folder.iterdir()
                  if entry.name.startswith("plan-") and entry.name.endswith(".json"))


def builtin_plan(name: str = "h200") -> DecodePlan:
    """A plan shipped with the package (measured on that GPU); ``ValueError``
    naming the shipped ones for any other name."""
    available = builtin_plans()
    if name not in available:
        raise ValueError(f"no built-in plan {name!r}: the built-in plans are "
                         f"{', '.join(map(repr, available))}")
    file = resources.files("warpsplitk").joinpath(f"data/plan-{name}.json")
    text = file.read_text(encoding="utf-8")
    where = f"built-in plan {name!r}"
    return plan_from_json(loads(text, where), where)


def _check_prepare_ms(ms) -> tuple[int, ...]:
    """``check_ms``, and at least one M: a prepared weight runs some M."""
    checked = check_ms(ms)
    if not checked:
        raise ValueError(f"ms must name at least one M in 1..{MAX_M}, got {ms!r}")
    return checked


def prepare(weight, plan: DecodePlan | str | None = None, ms=range(1, MAX_M + 1), bias=None, *,
            swiglu: bool = False):
    """``weight`` prepared with the plan's choice for each M in ``ms`` (the
    default (cost model) where the plan has none; ``plan="auto"``: this GPU's
    plan, tuned first where it lacks the shape), all compiled now: a
    ``PreparedWarpSplitK``, or, where the plan or the cost model runs some Ms
    on cuBLAS, a ``PreparedDecode`` with the same interface. With ``swiglu``
    (``weight`` is ``[gate; up]``): a ``PreparedWarpSplitK`` with the SwiGLU
    epilogue, every M on the kernel (:func:`swiglu_tactic`)."""
    from ..runtime.prepared import _matrix_shape
    n, k = _matrix_shape("weight", weight, "[N, K]")
    ms = _check_prepare_ms(ms)
    import torch
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise ValueError(f"bias must be None or a torch.Tensor [N], got {type(bias).__name__}")
    # a weight the kernel cannot take is refused by PreparedWarpSplitK, before any tuning
    from ..contract import weight_refusal
    plan = resolve_plan(plan, [(n, k)] if weight_refusal(weight, bias) is None else [], ms)
    plan = plan if plan is not None else DecodePlan()
    if swiglu:
        from ..runtime.prepared import PreparedWarpSplitK
        return PreparedWarpSplitK(weight, {m: swiglu_tactic(plan, m, n, k) for m in ms},
                                  bias=bias, swiglu=True)
    return prepare_choices(weight, {m: plan.tactic_for(n, k, m) for m in ms}, bias)


#: ``before_down`` applies up to this M. Layers chained (``bench --chain
#: --model``): at M = 1 and 8 every gate/up it changed gained, 1.1-2.6 us
#: per layer against the same chain without it (H100, same process) and
#: 1.3-2.2 us on the H200's layers record; at M = 32 gemma-2-27b TP4's,
#: two CTAs per SM with down's grid fitting beside them, lost 5.6 us (H200).
BEFORE_DOWN_MAX_M = 8


def swiglu_tactic(plan: DecodePlan | None, m: int, n: int, k: int,
                  sm_count: int | None = None) -> WarpSplitKTactic:
    """The tactic M tokens run on a ``[gate; up]`` weight with the SwiGLU
    epilogue: the plan's, where it has one the epilogue takes (not cuBLAS,
    not a mixed grid), else ``default_tactic``'s for the epilogue; as the
    call before down (:func:`before_down`: the early PDL trigger at M <= 8)."""
    from ..tactics import is_legal
    choice = plan.lookup(n, k, m) if plan is not None else None
    if choice is None or choice == CUBLAS or not is_legal(choice, n, k, swiglu=True):
        choice = default_tactic(m, n, k, sm_count, swiglu=True)
    return before_down(choice, m)


def before_down(choice, m: int):
    """``choice`` for M tokens of an MLP's gate/up call, whose output the
    down projection's kernel reads next: with the early PDL trigger at
    M <= ``BEFORE_DOWN_MAX_M`` (cuBLAS as it is). Down's CTAs then become
    resident as gate/up's last CTAs leave their SMs and fill their rings
    from HBM during gate/up's tail; with the late trigger they launch only
    when gate/up's last CTAs are nearly done. The cost model and the tuner
    choose for independent calls, whose next call is the same shape, and
    leave the trigger off on large weights (``cost_model.hbm_bound``)."""
    from dataclasses import replace
    if choice == CUBLAS or m > BEFORE_DOWN_MAX_M:
        return choice
    return replace(choice, early_launch=True)


def prepare_choices(weight, choices, bias=None):
    """``weight`` prepared for ``{M: tactic or CUBLAS}``: a ``PreparedWarpSplitK``
    when every M runs the kernel, else a ``PreparedDecode``."""
    from ..runtime.prepared import PreparedDecode, PreparedWarpSplitK
    cublas_ms = [m for m, t in choices.items() if t == CUBLAS]
    if not cublas_ms:
        return PreparedWarpSplitK(weight, choices, bias=bias)
    tactics = {m: t for m, t in choices.items() if t != CUBLAS}
    return PreparedDecode(weight, tactics, cublas_ms, bias=bias)


def precompile_for(weights, plan: DecodePlan | None = None, ms=range(1, MAX_M + 1),
                   jobs=None, progress=print, has_bias=False, swiglu=False):
    """Compile, in parallel worker processes, every kernel that preparing
    ``weights`` (an iterable of CUDA tensors) with ``plan`` (and ``swiglu``,
    as :func:`prepare`) will need, into the disk cache; preparing then loads
    them. Returns the failures (the later in-process compile reports their
    errors)."""
    import torch

    from ..runtime.compile import device_arch
    from ..runtime.precompile import precompile
    weights = list(weights)
    plan = resolve_plan(plan, [tuple(w.shape) for w in weights if isinstance(w, torch.Tensor)
                               and w.is_cuda and w.dim() == 2], ms, progress=progress,
                        jobs=jobs)
    plan = plan if plan is not None else DecodePlan()
    by_arch = {}
    for weight in weights:
        # what PreparedWarpSplitK would refuse is left to it (and its errors)
        if (not isinstance(weight, torch.Tensor) or weight.device.type != "cuda"
                or weight.dtype != torch.bfloat16 or weight.dim() != 2):
            continue
        n, k = weight.shape
        index = weight.device.index
        try:
            arch = device_arch(torch.cuda.current_device() if index is None else index)
            if swiglu:
                kernels = [(n, k, swiglu_tactic(plan, m, n, k), has_bias, True, True)
                           for m in ms]
            else:
                kernels = [(n, k, t, has_bias, True)
                           for t in (plan.tactic_for(n, k, m) for m in ms) if t != CUBLAS]
        except ValueError:
            continue
        by_arch.setdefault(arch, []).extend(kernels)
    failures = {}
    for arch, kernels in by_arch.items():
        failures.update(precompile(kernels, arch, jobs, progress))
    return failures


def prepare_model(weights, plan: DecodePlan | None = None, ms=range(1, MAX_M + 1), progress=print,
                  jobs=None):
    """Prepare every weight of ``{name: weight}`` before graph capture; reports
    progress and the total compile time. Returns ``{name: prepared}`` (each a
    ``PreparedWarpSplitK`` or ``PreparedDecode``, as :func:`prepare`).

    The kernels are first compiled ``jobs`` at a time in worker processes
    (default: ``precompile.default_jobs()``) into the
    disk cache, from which each weight's preparation then loads them.

    ``plan="auto"``: the plan for this GPU (``warpsplitk.planning.plan_cache``), tuning
    first the weights' shapes it lacks and keeping them for the next process."""
    start = time.perf_counter()
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping {{name: torch.Tensor}}, got "
                         f"{type(weights).__name__}")
    from ..runtime.prepared import _matrix_shape
    for name, weight in weights.items():
        _matrix_shape(f"weights[{name!r}]", weight, "[N, K]")
    ms = _check_prepare_ms(ms)
    plan = resolve_plan(plan, [tuple(w.shape) for w in weights.values()], ms,
                        progress=progress, jobs=jobs)
    precompile_for(weights.values(), plan, ms, jobs, progress)
    prepared = {}
    for i, (name, weight) in enumerate(weights.items(), 1):
        t0 = time.perf_counter()
        prepared[name] = prepare(weight, plan, ms)
        if progress:
            progress(f"[{i}/{len(weights)}] {name} {tuple(weight.shape)} "
                     f"{time.perf_counter() - t0:.1f} s")
    if progress:
        progress(f"prepared {len(weights)} weights in {time.perf_counter() - start:.1f} s")
    return prepared
