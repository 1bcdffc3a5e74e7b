"""Decode plans: per-shape, per-M tactics chosen ahead of time by measurement.

A plan is a versioned JSON file::

    {"format": "warpsplitk-plan", "version": 1,
     "meta": {"gpu": ..., "sm_count": ..., "warpsplitk": ..., "cutlass_dsl": ...,
              "method": ..., "created": ...},
     "shapes": [{"n": N, "k": K, "entries": {"M": {"tactic": "o,t,k,s,b", "us": t}}}]}

An entry's tactic may instead be ``"cublas"`` (``CUBLAS``): for that M the
prepared weight runs ``torch.matmul`` (cuBLAS), where it measured faster.

Those are the entries of BF16 weights. A plan may also hold entries for FP8
(e4m3) weights, tuned on them (``tune(..., fp8_scales=...)``): version 2, the
same as version 1 plus ``"fp8": {"shapes": [...]}`` in the form of
``"shapes"``. An FP8 entry is always a tactic (no cuBLAS call takes an FP8
weight and its scales) and serves weights of every scale kind. A plan is
written as version 1 while it has no FP8 entries, so a BF16 plan's file stays
what older versions read.

``load_plan`` validates every entry with ``check_tactic`` (``fp8=True`` for
the FP8 ones): a bad or stale file is an error naming the entry, never a
silent fallback. Lookups for shapes the plan lacks fall back to the defaults
(``default_choice`` for BF16: the cost model's tactic, or cuBLAS where it
predicts cuBLAS faster; ``default_tactic(..., fp8=True)`` for FP8) and say so
once.

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
#: The version of a plan with BF16 entries only.
PLAN_VERSION = 1
#: The version of a plan with FP8 entries too (its ``"fp8"`` section).
FP8_PLAN_VERSION = 2
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


def _label(fp8) -> str:
    """How messages name an entry's weights: FP8 ones by name, BF16 as always."""
    return "FP8 " if fp8 else ""


def _check_choice(tactic, n, k, fp8):
    """``ValueError`` unless ``tactic`` can be the plan's entry for an
    ``[n, k]`` weight: a tactic ``check_tactic`` takes (with ``fp8`` for an
    e4m3 weight), or, for a BF16 weight, ``CUBLAS``."""
    if tactic == CUBLAS:
        if fp8:
            raise ValueError(f"an FP8 entry must be a tactic, got {CUBLAS!r}: no cuBLAS call "
                             "takes an FP8 weight with its scales")
        return
    check_tactic(tactic, n, k, fp8=fp8)


def _shapes_json(table) -> list:
    """A plan file's ``"shapes"`` list of ``{(n, k): {m: (tactic, us)}}``."""
    return [{"n": n, "k": k, "entries": {
        str(m): {"tactic": t if t == CUBLAS else t.short(), "us": us}
        for m, (t, us) in sorted(by_m.items())}}
        for (n, k), by_m in sorted(table.items())]


@dataclass
class DecodePlan:
    meta: dict = field(default_factory=dict)
    #: BF16 weights': {(n, k): {m: (tactic or CUBLAS, measured_us or None)}}
    entries: dict = field(default_factory=dict)
    #: FP8 (e4m3) weights': {(n, k): {m: (tactic, measured_us or None)}}
    fp8_entries: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __repr__(self):
        # the entries run to thousands of tactics: counts, and where the plan came from
        counts = [f"{len(table)} {_label(fp8)}shapes, "
                  f"{sum(len(by_m) for by_m in table.values())} {_label(fp8)}entries"
                  for fp8, table in ((False, self.entries), (True, self.fp8_entries))
                  if table or not fp8]
        made = ", ".join(f"{key}={self.meta[key]!r}" for key in ("gpu", "source")
                         if key in self.meta)
        return f"DecodePlan({', '.join(counts)}" + (f", {made}" if made else "") + ")"

    def table(self, fp8: bool = False) -> dict:
        """The entries of BF16 weights, or with ``fp8`` those of FP8 weights."""
        return self.fp8_entries if fp8 else self.entries

    def lookup(self, n: int, k: int, m: int, *, fp8: bool = False
               ) -> WarpSplitKTactic | str | None:
        """The plan's choice for (N, K, M): a tactic, ``CUBLAS``, or None;
        with ``fp8``, its FP8 entry's tactic, or None."""
        hit = self.table(fp8).get((n, k), {}).get(m)
        return None if hit is None else hit[0]

    def tactic_for(self, n: int, k: int, m: int, sm_count: int | None = None, *,
                   chained: bool = False, fp8: bool = False) -> WarpSplitKTactic | str:
        """The plan's choice (a tactic or ``CUBLAS``), else ``default_choice``
        (``chained`` as there); with ``fp8`` the plan's FP8 entry, else the
        FP8 default (``default_tactic(..., fp8=True)``). A missing entry is
        said once per shape, unless the plan has no entries of the weight's
        dtype at all (no plan for it)."""
        tactic = self.lookup(n, k, m, fp8=fp8)
        if tactic is not None:
            return tactic
        table = self.table(fp8)
        if table and (fp8, n, k) not in self._warned:
            self._warned.add((fp8, n, k))
            have = f"no {_label(fp8)}entry" + ("" if (n, k) not in table else f" for M={m}")
            default = ("the FP8 default (default_tactic(..., fp8=True))" if fp8
                       else "the cost model's choice (default_choice)")
            warnings.warn(f"decode plan has {have} for N={n}, K={k}: using {default}",
                          stacklevel=2)
        if fp8:
            return default_tactic(m, n, k, sm_count, fp8=True)
        return default_choice(m, n, k, sm_count, chained=chained)

    def set(self, n, k, m, tactic, us=None, *, fp8: bool = False):
        """Choose ``tactic`` (or ``CUBLAS``) for (N, K, M), measured at ``us``
        microseconds (or None); with ``fp8``, for an FP8 weight (a tactic)."""
        n, k, m = _check_entry(n, k, m, us, f"decode plan {_label(fp8)}entry")
        _check_choice(tactic, n, k, fp8)
        self.table(fp8).setdefault((n, k), {})[m] = (tactic, us)

    def to_json(self) -> dict:
        """The plan file's data: version 1 while the plan has no FP8 entries
        (a BF16 plan's file is what older versions read), else version 2
        with the ``"fp8"`` section."""
        data = {"format": PLAN_FORMAT,
                "version": FP8_PLAN_VERSION if self.fp8_entries else PLAN_VERSION,
                "meta": self.meta, "shapes": _shapes_json(self.entries)}
        if self.fp8_entries:
            data["fp8"] = {"shapes": _shapes_json(self.fp8_entries)}
        return data

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


def _entry_tactic(entry, n, k, where, fp8):
    """An entry's tactic (or ``CUBLAS``, for a BF16 weight), legal for
    ``[n, k]`` (with ``fp8``: for an e4m3 weight)."""
    try:
        tactic = CUBLAS if entry["tactic"] == CUBLAS else WarpSplitKTactic.parse(entry["tactic"])
        _check_choice(tactic, n, k, fp8)
        return tactic
    except (KeyError, TypeError):
        raise ValueError(f"{where}: entry needs a 'tactic'") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _read_shapes(plan, shapes, source, fp8):
    """Add the entries of ``shapes`` (a plan file's ``"shapes"`` list, or
    with ``fp8`` its FP8 section's) to ``plan``, each checked."""
    table, section = plan.table(fp8), "fp8 shapes" if fp8 else "shapes"
    for i, shape in enumerate(shapes):
        try:
            n, k, entries = shape["n"], shape["k"], shape["entries"]
        except (KeyError, TypeError):
            raise ValueError(f"{source}: {section}[{i}] needs 'n', 'k' and 'entries'") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{source}: {section}[{i}] 'entries' must map each M to its tactic")
        for key, entry in entries.items():
            where = f"{source}: {_label(fp8)}N={n} K={k} M={key}"
            m = _entry_m(key, where)
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: entry needs a 'tactic'")
            n, k, m = _check_entry(n, k, m, entry.get("us"), where)
            if m in table.get((n, k), {}):
                raise ValueError(f"{where}: a second entry for this N, K and M")
            table.setdefault((n, k), {})[m] = (_entry_tactic(entry, n, k, where, fp8),
                                               entry.get("us"))


def _fp8_shapes(data, version, source) -> list:
    """The shapes of a plan file's FP8 section (``[]`` where it has none)."""
    if "fp8" not in data:
        return []
    if version == PLAN_VERSION:
        raise ValueError(f"{source}: a version {PLAN_VERSION} plan holds BF16 entries only; an "
                         f"'fp8' section needs version {FP8_PLAN_VERSION}")
    section = data["fp8"]
    if not isinstance(section, dict) or not isinstance(section.get("shapes", []), list):
        raise ValueError(f"{source}: a plan's 'fp8' section is an object whose 'shapes' is a "
                         f"list, got {section!r:.80}")
    return section.get("shapes", [])


def plan_from_json(data, source="plan") -> DecodePlan:
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ValueError(f"{source}: not a warpsplitk plan (format must be {PLAN_FORMAT!r})")
    version = data.get("version")
    if type(version) is not int or version not in (PLAN_VERSION, FP8_PLAN_VERSION):
        raise ValueError(f"{source}: plan version {version!r}, this warpsplitk reads versions "
                         f"{PLAN_VERSION} (BF16 entries) and {FP8_PLAN_VERSION} (BF16 and FP8 "
                         "entries)")
    if not isinstance(data.get("meta", {}), dict) or not isinstance(data.get("shapes", []), list):
        raise ValueError(f"{source}: a plan's 'meta' is an object and its 'shapes' a list")
    fp8_shapes = _fp8_shapes(data, version, source)
    plan = DecodePlan(meta=dict(data.get("meta", {})))
    _read_shapes(plan, data.get("shapes", []), source, fp8=False)
    _read_shapes(plan, fp8_shapes, source, fp8=True)
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
