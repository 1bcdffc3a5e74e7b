"""Decode plans: per-shape, per-M tactics chosen ahead of time by measurement.

A plan is a versioned JSON file::

    {"format": "warpsplitk-plan", "version": 1,
     "meta": {"gpu": ..., "sm_count": ..., "warpsplitk": ..., "cutlass_dsl": ...,
              "method": ..., "created": ...},
     "shapes": [{"n": N, "k": K, "entries": {"M": {"tactic": "o,t,k,s,b", "us": t}}}]}

An entry's tactic may instead be ``"cublas"`` (``CUBLAS``): for that M the
prepared weight runs ``torch.matmul`` (cuBLAS), where it measured faster.

Those are the entries of BF16 weights. A plan may also hold entries for FP8
(e4m3) weights, tuned on them (``tune(..., fp8_scales=...)``) per kind of
their FP32 scales (``contract.FP8_SCALE_KINDS``: each kind tuned on its
own): version 2, the same as version 1 plus
``"fp8": {"channel": [...], "block128": [...], ...}``, each list in the
form of ``"shapes"``. An FP8 entry is always a tactic (no cuBLAS call takes
an FP8 weight and its scales). A plan is written as version 1 while it has
no FP8 entries, so a BF16 plan's file stays what older versions read.

``load_plan`` validates every entry with ``check_tactic`` (``fp8=True`` for
the FP8 ones): a bad or stale file is an error naming the entry, never a
silent fallback. Lookups for shapes the plan lacks fall back to the defaults
(``default_choice`` for BF16: the cost model's tactic, or cuBLAS where it
predicts cuBLAS faster; for FP8 ``default_tactic(..., fp8=True,
fp8_scales=...)``) and say so once.

The plan data only: no torch, no tuning. Preparing weights with a plan is
:mod:`warpsplitk.planning.plans`.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from importlib import resources

from ..contract import FP8_SCALE_KINDS, MAX_M
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
    ``default_tactic``, or ``CUBLAS`` where ``choose.prefers_cublas`` says so
    (the cost model predicts ``torch.matmul`` faster, at M = 32 on some large
    weights; or M > 8 on a K that needs four CTAs).
    ``chained``: the call sits between kernel calls of a dependent chain
    (``bench --chain --model``), where cuBLAS must also make up the PDL
    overlap it forfeits (``choose.CHAIN_CUBLAS_US``)."""
    sm_count = resolve_sm_count(sm_count)
    tactic = default_tactic(m, n, k, sm_count)
    return CUBLAS if prefers_cublas(m, n, k, sm_count, chained=bool(chained)) else tactic


def _label(fp8_scales) -> str:
    """How messages name an entry's weights: FP8 ones with their scales."""
    return "" if fp8_scales is None else f"FP8 ({fp8_scales} scales) "


def _check_scales(fp8_scales):
    """``fp8_scales``, unless it is neither None (BF16) nor a scale kind."""
    if fp8_scales is not None and fp8_scales not in FP8_SCALE_KINDS:
        raise ValueError(f"fp8_scales must be None (BF16 weights) or one of {FP8_SCALE_KINDS}, "
                         f"got {fp8_scales!r}")
    return fp8_scales


def _check_choice(tactic, n, k, fp8_scales):
    """``ValueError`` unless ``tactic`` can be the plan's entry for an
    ``[n, k]`` weight: a tactic ``check_tactic`` takes (for an e4m3 weight
    with ``fp8_scales``), or, for a BF16 weight, ``CUBLAS``."""
    if tactic == CUBLAS:
        if fp8_scales is not None:
            raise ValueError(f"an FP8 entry must be a tactic, got {CUBLAS!r}: no cuBLAS call "
                             "takes an FP8 weight with its scales")
        return
    check_tactic(tactic, n, k, fp8=fp8_scales is not None)


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
    #: FP8 (e4m3) weights', by their scales' kind (``contract.FP8_SCALE_KINDS``):
    #: {kind: {(n, k): {m: (tactic, measured_us or None)}}}
    fp8_entries: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __repr__(self):
        # the entries run to thousands of tactics: counts, and where the plan came from
        count = sum(len(by_m) for by_m in self.entries.values())
        fp8 = [by_shape for by_shape in self.fp8_entries.values() if by_shape]
        fp8_count = sum(len(by_m) for by_shape in fp8 for by_m in by_shape.values())
        made = ", ".join(f"{key}={self.meta[key]!r}" for key in ("gpu", "source")
                         if key in self.meta)
        return (f"DecodePlan({len(self.entries)} shapes, {count} entries"
                + (f", {sum(map(len, fp8))} FP8 shapes, {fp8_count} FP8 entries" if fp8 else "")
                + (f", {made}" if made else "") + ")")

    def table(self, fp8_scales: str | None = None) -> dict:
        """The entries of BF16 weights, ``{(n, k): {m: (tactic, us)}}``, or
        with ``fp8_scales`` those of FP8 weights with scales of that kind
        (empty where it has none)."""
        if _check_scales(fp8_scales) is None:
            return self.entries
        return self.fp8_entries.get(fp8_scales, {})

    def lookup(self, n: int, k: int, m: int, *, fp8_scales: str | None = None
               ) -> WarpSplitKTactic | str | None:
        """The plan's choice for (N, K, M): a tactic, ``CUBLAS``, or None;
        with ``fp8_scales``, the tactic of its FP8 entry for those scales, or
        None."""
        hit = self.table(fp8_scales).get((n, k), {}).get(m)
        return None if hit is None else hit[0]

    def tactic_for(self, n: int, k: int, m: int, sm_count: int | None = None, *,
                   chained: bool = False, fp8_scales: str | None = None
                   ) -> WarpSplitKTactic | str:
        """The plan's choice (a tactic or ``CUBLAS``), else ``default_choice``
        (``chained`` as there); with ``fp8_scales`` the plan's FP8 entry for
        those scales, else the FP8 default for them (``default_tactic(...,
        fp8=True, fp8_scales=...)``). A missing entry is said once per shape,
        unless the plan has no entries of that kind at all (no plan for it)."""
        tactic = self.lookup(n, k, m, fp8_scales=fp8_scales)
        if tactic is not None:
            return tactic
        table = self.table(fp8_scales)
        if table and (fp8_scales, n, k) not in self._warned:
            self._warned.add((fp8_scales, n, k))
            have = f"no {_label(fp8_scales)}entry" + ("" if (n, k) not in table
                                                      else f" for M={m}")
            default = ("the cost model's choice (default_choice)" if fp8_scales is None
                       else "the FP8 default (default_tactic(..., fp8=True))")
            warnings.warn(f"decode plan has {have} for N={n}, K={k}: using {default}",
                          stacklevel=2)
        if fp8_scales is not None:
            return default_tactic(m, n, k, sm_count, fp8=True, fp8_scales=fp8_scales)
        return default_choice(m, n, k, sm_count, chained=chained)

    def set(self, n, k, m, tactic, us=None, *, fp8_scales: str | None = None):
        """Choose ``tactic`` (or ``CUBLAS``) for (N, K, M), measured at ``us``
        microseconds (or None); with ``fp8_scales``, for an FP8 weight with
        scales of that kind (a tactic)."""
        n, k, m = _check_entry(n, k, m, us, f"decode plan {_label(_check_scales(fp8_scales))}"
                                            "entry")
        _check_choice(tactic, n, k, fp8_scales)
        self._writable(fp8_scales).setdefault((n, k), {})[m] = (tactic, us)

    def _writable(self, fp8_scales) -> dict:
        """``table(fp8_scales)`` to add entries to (a kind's made on first use)."""
        return self.entries if fp8_scales is None else self.fp8_entries.setdefault(fp8_scales, {})

    def merge(self, other: DecodePlan) -> None:
        """``other``'s entries, BF16 and FP8, into this plan's (``other``'s
        winning where both have an M; checked when ``other`` took them)."""
        for kind in (None, *other.fp8_entries):
            for shape, by_m in other.table(kind).items():
                self._writable(kind).setdefault(shape, {}).update(by_m)

    def to_json(self) -> dict:
        """The plan file's data: version 1 while the plan has no FP8 entries
        (a BF16 plan's file is what older versions read), else version 2
        with the ``"fp8"`` section: each scale kind's shapes."""
        fp8 = {kind: _shapes_json(self.fp8_entries[kind]) for kind in FP8_SCALE_KINDS
               if self.fp8_entries.get(kind)}
        data = {"format": PLAN_FORMAT, "version": FP8_PLAN_VERSION if fp8 else PLAN_VERSION,
                "meta": self.meta, "shapes": _shapes_json(self.entries)}
        if fp8:
            data["fp8"] = fp8
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


def _entry_tactic(entry, n, k, where, fp8_scales):
    """An entry's tactic (or ``CUBLAS``, for a BF16 weight), legal for
    ``[n, k]`` (with ``fp8_scales``: for an e4m3 weight)."""
    try:
        tactic = CUBLAS if entry["tactic"] == CUBLAS else WarpSplitKTactic.parse(entry["tactic"])
        _check_choice(tactic, n, k, fp8_scales)
        return tactic
    except (KeyError, TypeError):
        raise ValueError(f"{where}: entry needs a 'tactic'") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _read_shapes(plan, shapes, source, fp8_scales=None):
    """Add the entries of ``shapes`` (a plan file's ``"shapes"`` list, or
    with ``fp8_scales`` its FP8 section's list of that kind) to ``plan``,
    each checked."""
    section = "shapes" if fp8_scales is None else f"fp8 {fp8_scales} shapes"
    for i, shape in enumerate(shapes):
        try:
            n, k, entries = shape["n"], shape["k"], shape["entries"]
        except (KeyError, TypeError):
            raise ValueError(f"{source}: {section}[{i}] needs 'n', 'k' and 'entries'") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{source}: {section}[{i}] 'entries' must map each M to its tactic")
        for key, entry in entries.items():
            where = f"{source}: {_label(fp8_scales)}N={n} K={k} M={key}"
            m = _entry_m(key, where)
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: entry needs a 'tactic'")
            n, k, m = _check_entry(n, k, m, entry.get("us"), where)
            if m in plan.table(fp8_scales).get((n, k), {}):
                raise ValueError(f"{where}: a second entry for this N, K and M")
            tactic = _entry_tactic(entry, n, k, where, fp8_scales)
            plan._writable(fp8_scales).setdefault((n, k), {})[m] = (tactic, entry.get("us"))


def _fp8_sections(data, version, source) -> dict:
    """``{scale kind: shapes}`` of a plan file's FP8 section (none in a
    version 1 file)."""
    if "fp8" not in data:
        return {}
    if version == PLAN_VERSION:
        raise ValueError(f"{source}: a version {PLAN_VERSION} plan holds BF16 entries only; an "
                         f"'fp8' section needs version {FP8_PLAN_VERSION}")
    section = data["fp8"]
    if not isinstance(section, dict) or not all(isinstance(v, list) for v in section.values()):
        raise ValueError(f"{source}: a plan's 'fp8' section maps each scale kind to a list of "
                         f"shapes, got {section!r:.80}")
    strays = [kind for kind in section if kind not in FP8_SCALE_KINDS]
    if strays:
        raise ValueError(f"{source}: the 'fp8' section's keys are scale kinds "
                         f"{FP8_SCALE_KINDS}, got {strays[0]!r}")
    return section


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
    fp8 = _fp8_sections(data, version, source)
    plan = DecodePlan(meta=dict(data.get("meta", {})))
    _read_shapes(plan, data.get("shapes", []), source)
    for kind, shapes in fp8.items():
        _read_shapes(plan, shapes, source, kind)
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
