"""The default's options, applied where the nearest measured pairs gained.

The cost model (:mod:`warpsplitk.planning.cost_model`) ranks the tactics of a cell
by terms that follow the hardware: bytes per SM, waves, ring depth. The
kernel's options (K split across two CTAs, narrow token tiles at M <= 4,
TMA activation boxes, a bounded L2 prefetch) move a call's time by a few
percent either way, depending on the regime in ways a linear term does not
capture: ranked by the linear model, the TMA twin of a near-best tactic was
taken almost always and was no faster in median (docs/design-notes.md).

So an option is applied as the measurements say: for each step of
``OPTION_STEPS``, the tactic's twin with the option (``TWINS``: ``space``'s
twin rules) is taken when its
``NEIGHBOURS`` nearest measured (tactic, twin) pairs, all within ``RADIUS``
of the tactic's own descriptor (:func:`describe`), have a median time ratio
below ``1 - MARGIN``. Where fewer pairs lie that close, the option stays
off: it has not been measured in that regime.

The pairs are every (tactic, twin) measured in one cell of the fit's
records (:func:`pairs`), shipped in the cost model's file, whose meta holds
the shape-grouped cross-validation of this rule per option
(``scripts/fit_cost_model.py``). The early PDL trigger is not among the
options: its pairs predict it poorly (its gain depends on the next kernel),
so the tuner measures it.
"""

from __future__ import annotations

import math
import statistics

from ..kernel import layout
from ..tactics import (
    BULK,
    DEFAULT_SM_COUNT,
    TMA,
    WarpSplitKTactic,
    ctas_per_sm,
    grid_ctas,
    is_legal,
)
from . import space

#: pairs whose median decides (odd, so the median is one measured ratio)
NEIGHBOURS = 9
#: the farthest a pair may lie from the tactic (in descriptor units:
#: 1 is a factor of 2 in one of N, K, M, the tiles, the ring or the grid's
#: occupancy) for its ratio to count
RADIUS = 2.5
#: the least gain an option must show before it is applied
MARGIN = 0.02


#: the fewest K tiles each CTA of a K split streams: on shorter streams the
#: cluster hand-over outweighs the halved stream (the fit's cross-validated
#: pairs: from 8 tiles on, 1 of 14 accepted splits more than 3% slower; with
#: fewer too, 17 of 64)
K_SPLIT_MIN_TILES = 8


def k_split_pays(t: WarpSplitKTactic, m: int, n: int, k: int,
                 sm_count: int = DEFAULT_SM_COUNT, resident: int | None = None) -> bool:
    """Whether ``t``, a tactic with two CTAs per tile along K, is in the
    regime where the measured pairs gain from the split: each CTA streams at
    least ``K_SPLIT_MIN_TILES`` K tiles and the grid fits in one wave of
    resident CTAs (it fills SM slots the unsplit grid leaves idle; past one
    wave the split adds a partial wave: measured pairs a median ratio of
    0.82 where it fits, 1.07 where it does not). ``resident``: CTAs per SM
    to count, ``t``'s own by default; the option (``_k_split``) counts its
    parent's, whose ring may be deeper."""
    per_sm = ctas_per_sm(t) if resident is None else resident
    return (k // t.k_split // t.k_tile >= K_SPLIT_MIN_TILES
            and grid_ctas(t, m, n) <= sm_count * max(1, per_sm))


def _k_split(t, m, n, k, sm_count=DEFAULT_SM_COUNT):
    split = space.k_split_twin(t, k)
    if split is None:
        return None
    return split if k_split_pays(split, m, n, k, sm_count, resident=ctas_per_sm(t)) else None


def _narrow(t, m, n, k, sm_count=DEFAULT_SM_COUNT):
    if t.x_copy == BULK or t.k_split > 1 or t.half_tiles:
        return None
    return space.narrow_twin(t, m, n, k, ctas_per_sm(t))


def _tma(t, m, n, k, sm_count=DEFAULT_SM_COUNT):
    return space.tma_twin(t)


def _prefetch(tiles: int):
    def twin(t, m, n, k, sm_count=DEFAULT_SM_COUNT):
        return space.prefetch_twin(t, tiles)
    return twin


#: name -> ``(tactic, m, n, k[, sm_count])`` -> the tactic's twin with that
#: option (``space``'s twin rules; a K split only where it pays), None where
#: it has it or cannot take it; legality is checked apart
TWINS = {
    "k_split": _k_split,
    "narrow": _narrow,
    "tma": _tma,
    "prefetch2": _prefetch(2),
    "prefetch3": _prefetch(3),
    "prefetch4": _prefetch(4),
}

#: The options in the order they are decided; a step of several names takes
#: the one whose pairs show the largest gain. K split first: it changes the
#: grid, which the later options' pairs are described by; it competes with
#: narrow token tiles, which it excludes (at M = 1 a narrow tile gains where
#: a split of a short K loses). A TMA box has 8 rows or more: no box on a
#: narrow tile.
OPTION_STEPS = (("k_split", "narrow"), ("tma",), ("prefetch2", "prefetch3", "prefetch4"))
#: The steps of a call that streams with no overlap device (``choose.hbm_bound``).
STEPS_WITHOUT_PREFETCH = tuple(step for step in OPTION_STEPS
                               if not any(name.startswith("prefetch") for name in step))


def describe(t: WarpSplitKTactic, m: int, n: int, k: int,
             sm_count: int = DEFAULT_SM_COUNT) -> tuple[float, ...]:
    """Where ``t`` on an ``[n, k]`` weight at M = ``m`` sits, in units of a
    factor of 2: N, K, M, the token and output tiles, the K tile, the ring,
    the grid's occupancy of the GPU's CTA slots, the weight's bytes; and the
    activation path (TMA boxes, loader warps)."""
    occupancy = grid_ctas(t, m, n) / (sm_count * max(1, ctas_per_sm(t)))
    return (math.log2(n), math.log2(k), math.log2(m), math.log2(t.token_tile),
            math.log2(t.output_tile), t.k_tile / 128, math.log2(t.stages),
            math.log2(occupancy), math.log2(n * k * layout.ELEMENT_BYTES),
            float(t.x_copy == TMA), float(t.b_loader_warps))


def pairs(cells, sm_count: int = DEFAULT_SM_COUNT) -> dict[str, list[list[float]]]:
    """``{(n, k, m): {tactic: us}}`` -> ``{option: [[*describe(tactic),
    log(twin us / tactic us)], ...]}`` for every tactic whose twin with the
    option was measured in the same cell (rounded to 4 decimals: package
    data)."""
    found = {name: [] for name in TWINS}
    for (n, k, m), timings in sorted(cells.items()):
        for tactic, us in sorted(timings.items()):
            for name, twin_of in TWINS.items():
                twin = twin_of(tactic, m, n, k, sm_count)
                if twin is not None and twin in timings:
                    row = [*describe(tactic, m, n, k, sm_count), math.log(timings[twin] / us)]
                    found[name].append([round(x, 4) for x in row])
    return found


def estimate(rows, descriptor) -> float | None:
    """The median log time ratio of the ``NEIGHBOURS`` rows (``pairs``'
    rows of one option) nearest ``descriptor``; None unless that many lie
    within ``RADIUS``."""
    limit = RADIUS * RADIUS
    reach = limit * (1 + 1e-9)  # the running sum's rounding, for the filter only
    near = []
    for row in rows:
        partial = 0.0
        for a, b in zip(row, descriptor):  # most rows are out of reach early
            partial += (a - b) * (a - b)
            if partial > reach:
                break
        else:
            d2 = math.fsum((a - b) ** 2 for a, b in zip(row, descriptor))
            if d2 <= limit:
                near.append((d2, row[-1]))
    if len(near) < NEIGHBOURS:
        return None
    near.sort()
    return statistics.median(ratio for _, ratio in near[:NEIGHBOURS])


def apply_options(tactic: WarpSplitKTactic, m: int, n: int, k: int, option_pairs,
                  sm_count: int = DEFAULT_SM_COUNT, steps=OPTION_STEPS
                  ) -> tuple[WarpSplitKTactic, float]:
    """``tactic`` with every option its nearest measured pairs say gains
    more than ``MARGIN`` (``steps`` in order, each decided on the tactic the
    steps before it made), and the product of the accepted time ratios."""
    factor = 1.0
    threshold = math.log(1.0 - MARGIN)
    for step in steps:
        best = None
        for name in step:
            twin = TWINS[name](tactic, m, n, k, sm_count)
            if twin is None or not is_legal(twin, n, k) or not option_pairs.get(name):
                continue
            gain = estimate(option_pairs[name], describe(tactic, m, n, k, sm_count))
            if gain is not None and gain < threshold and (best is None or gain < best[0]):
                best = (gain, twin)
        if best is not None:
            factor *= math.exp(best[0])
            tactic = best[1]
    return tactic, factor
