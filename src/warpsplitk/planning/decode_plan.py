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

The plan data only: no torch, no tuning. Preparing weights with a plan is
:mod:`warpsplitk.planning.plans`.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from importlib import resources

from ..contract import MAX_M
from ..jsonfile import loads, read_json
from ..tactics import WarpSplitKTactic, as_integer, check_tactic, resolve_sm_count
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


def default_choice(m: int, n: int, k: int, sm_count: int | None = None, *,
                   chained: bool = False) -> WarpSplitKTactic | str:
    """What runs M tokens on an ``[n, k]`` weight without a plan entry:
    ``default_tactic``, or ``CUBLAS`` where the cost model predicts
    ``torch.matmul`` faster than that tactic (M = 32 on some large weights).
    ``chained``: the call sits between kernel calls of a dependent chain
    (``bench --chain --model``), where cuBLAS must also make up the PDL
    overlap it forfeits (``choose.CHAIN_CUBLAS_US``)."""
    sm_count = resolve_sm_count(sm_count)
    tactic = default_tactic(m, n, k, sm_count)
    return CUBLAS if prefers_cublas(m, n, k, sm_count, chained=bool(chained)) else tactic


@dataclass
class DecodePlan:
    meta: dict = field(default_factory=dict)
    #: {(n, k): {m: (tactic, measured_us or None)}}
    entries: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __repr__(self):
        # the entries run to thousands of tactics: counts, and where the plan came from
        count = sum(len(by_m) for by_m in self.entries.values())
        made = ", ".join(f"{key}={self.meta[key]!r}" for key in ("gpu", "source")
                         if key in self.meta)
        return (f"DecodePlan({len(self.entries)} shapes, {count} entries"
                + (f", {made}" if made else "") + ")")

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


def _entry_m(key, where) -> int:
    """An entry's M from its key: one spelling per M, as " 1" and "1" would
    both be M = 1 (JSON's keys are text; data built in Python may key by int)."""
    if type(key) is int:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key:
        return int(key)
    raise ValueError(f"{where}: M must be an integer in 1..{MAX_M}, got {key!r}")


def _entry_tactic(entry, n, k, where):
    """An entry's tactic (or ``CUBLAS``), legal for ``[n, k]``."""
    try:
        if entry["tactic"] == CUBLAS:
            return CUBLAS
        tactic = WarpSplitKTactic.parse(entry["tactic"])
        check_tactic(tactic, n, k)
        return tactic
    except (KeyError, TypeError):
        raise ValueError(f"{where}: entry needs a 'tactic'") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


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
            m = _entry_m(key, where)
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: entry needs a 'tactic'")
            n, k, m = _check_entry(n, k, m, entry.get("us"), where)
            if m in plan.entries.get((n, k), {}):
                raise ValueError(f"{where}: a second entry for this N, K and M")
            tactic = _entry_tactic(entry, n, k, where)
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
