"""The cost model: a tactic's time on a weight, predicted from the tuner's measurements.

The kernel streams its weight from HBM once per call; what it costs on top
is set by how the grid lands on the SMs. The model writes a call's time as
a weighted sum of terms that each measure one such effect
(``FEATURES``, in the order of ``features``):

* ``fixed``: 1 (launch, the PDL wait, the epilogue);
* ``hbm_us``: the weight's bytes at ``BYTES_PER_US`` (the measured read
  bandwidth of the H200): the floor every tactic shares;
* ``busiest_sm_us``: the bytes (weight and activation rows) the busiest SM
  reads, at its fair share of that bandwidth: a grid of 201 CTAs on 132 SMs
  makes 69 SMs read twice what the others do;
* ``latency_us``: the busiest SM's bytes over the bytes (weight and
  activation rows) its rings hold in flight (stages x tile x resident
  CTAs), times one memory round trip (``LATENCY_US``): by Little's law,
  what a shallow ring caps it at;
* ``bound_us``: the largest of the three, the time the slowest side sets;
* ``l2_reads_us``: the bytes the grid reads through L2 (each token tile
  re-reads the weight tile; every CTA reads its activation rows);
* ``k_tile_steps``: K tiles a CTA computes, per wave; ``k_tile_slots``: K
  tiles one SM slot computes in turn (the unrolled loop's barrier round
  trips);
* ``waves``: grid CTAs over what the GPU holds at once, rounded up;
* ``idle_sm_hbm_us``: ``hbm_us`` when the grid leaves SMs idle;
* one flag per option (``early``, ``prefetch_all``, ``prefetch_bounded``,
  ``tma``, ``bulk``, ``k_split``, ``half_tiles``, ``narrow``,
  ``two_activation_warps``, ``k_tile_256``); ``prefetch_depth`` (K tiles
  of a bounded prefetch) and ``prefetch_latency_us`` (``latency_us`` with
  the prefetch, which hides some of it); ``tma_steps``, ``bulk_steps``,
  ``k_split_steps`` and ``narrow_steps`` (``k_tile_slots`` with the
  option: a cost per stage);
* ``activation_copies`` (16-byte copies per activation thread per stage,
  times the K tiles: issued after the dependency wait), ``token_tiles``,
  ``log_stages``;
* ``weight_rereads_us``: ``hbm_us`` for each token tile past the first.
  Every token tile streams the whole weight; the copies after the first
  hit L2 only when the CTAs sharing a weight tile run in step, and the
  weight is loaded evict-first (M = 32 in two 16-token tiles measured
  1.2-1.9x one 32-token tile on 2-50 MB weights).

One effect is a factor instead: a grid whose second wave is nearly empty
(:func:`sparse_tail_factor`).

The coefficients are package data (``data/cost-model-<gpu>.json``), fitted
by ``scripts/fit_cost_model.py`` to the calibration records in
``bench/results`` (never the benchmarks of the default) by least squares on the relative error (each cell's
measurements weighted alike), with a small ridge. The shapes of the
held-out models (``HELD_OUT_MODELS``, a fifth of the model table's shapes)
are never in the fit: they are what the model is judged on.

cuBLAS's time is a second linear model of the shape alone
(``CUBLAS_FEATURES``), fitted to the cuBLAS timings of the same records:
where no plan entry exists, ``plans.default_choice`` runs cuBLAS for an M
whose predicted cuBLAS time is ``CUBLAS_MARGIN`` below the chosen tactic's,
on a weight of K <= ``CUBLAS_MAX_K`` (:func:`prefers_cublas`); between
kernel calls of a dependent chain only where it also makes up the PDL
overlap it forfeits (``CHAIN_CUBLAS_US``).

:func:`choose_tactic` (what ``default_tactic`` returns, :func:`choose`)
ranks by predicted time the tuner's candidates of the cell with one CTA per
tile along K (two for tiles of up to 32 rows at M <= 16, where the split
fits one wave and each CTA streams 8 K tiles or more), 16-byte activation
copies and the late PDL trigger (``space.base_candidates``) and the
reference wave heuristic's tactic, and keeps the reference's unless another
is predicted ``REFERENCE_MARGIN`` faster. Where that grid leaves a third of
the SMs idle on a large weight, its mixed grid replaces it
(:func:`balanced_grid`). The options (K split, narrow token tiles, TMA
boxes, bounded L2 prefetch) are then applied where the nearest measured
pairs say they gain (:mod:`warpsplitk.planning.neighbours`): the linear terms for
options are fitted on the few regimes where the tuner found them winning,
and ranked freely they were picked far outside those regimes
(docs/design-notes.md). The early PDL trigger is taken where the grid's
shape says it pipelines (:func:`early_trigger_pays`), and on a short wave
(:func:`short_wave`), whose measured gain ranking counts (:func:`rank_us`).
On a weight that streams at the HBM rate whatever the tactic
(:func:`hbm_bound`) the default takes a ring of ``HBM_BOUND_MIN_STAGES``
or more and neither the early trigger nor the L2 prefetch.
Bulk activation rows are left to the tuner.

Pure Python (no numpy): importable and usable where the package is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from importlib import resources

from ..jsonfile import loads
from ..kernel import layout
from . import neighbours
from ..tactics import (
    DEFAULT_SM_COUNT,
    WarpSplitKTactic,
    ctas_per_sm,
    grid_ctas,
)

#: The H200's measured HBM read bandwidth, in bytes per microsecond: the
#: unit of the bandwidth terms (the fit scales them).
BYTES_PER_US = 4.4e6

FEATURES = (
    "fixed", "hbm_us", "busiest_sm_us", "latency_us", "bound_us", "l2_reads_us",
    "k_tile_steps", "k_tile_slots", "waves", "idle_sm_hbm_us",
    "early", "prefetch_all", "prefetch_bounded", "prefetch_depth", "prefetch_latency_us",
    "tma", "tma_steps", "bulk", "bulk_steps", "k_split", "k_split_steps",
    "half_tiles", "narrow", "narrow_steps", "two_activation_warps", "activation_copies",
    "k_tile_256", "token_tiles", "log_stages", "weight_rereads_us",
)

CUBLAS_FEATURES = ("fixed", "hbm_us", "m_hbm_us", "activation_us", "flops_us", "small_n")

#: Models whose shapes (every TP degree) never enter the fit: the held-out set.
HELD_OUT_MODELS = ("gemma-2-27b", "gemma-3-12b", "llama-3.2-3b", "qwen3-4b")

#: One memory round trip as the rings see it, in microseconds (the unit of
#: the latency term; the fit scales it).
LATENCY_US = 1.0

#: The cost model shipped for these GPUs (their name as torch reports it,
#: lower case, contains the key).
MODEL_FILES = {"h200": "cost-model-h200.json"}
DEFAULT_MODEL = "h200"
MODEL_FORMAT = "warpsplitk-cost-model"


def features(tactic: WarpSplitKTactic, m: int, n: int, k: int,
             sm_count: int = DEFAULT_SM_COUNT) -> tuple[float, ...]:
    """The terms of ``FEATURES`` for ``tactic`` on an ``[n, k]`` weight at
    M = ``m`` (the tactic is assumed legal)."""
    t = tactic
    weight_bytes = n * k * layout.ELEMENT_BYTES
    full, half = layout.row_tiles(n, t.output_tile, t.half_tiles)
    row_ctas = full + half
    token_tiles = -(-m // t.token_tile)
    grid = row_ctas * token_tiles * t.k_split
    resident = max(1, ctas_per_sm(t))
    busiest = -(-grid // sm_count)
    waves = -(-grid // (sm_count * resident))
    k_cta = k // t.k_split
    rows = n / row_ctas
    tokens = min(m, t.token_tile)
    busiest_bytes = busiest * (rows + tokens) * k_cta * layout.ELEMENT_BYTES
    in_flight = (min(busiest, resident) * t.stages * (rows + tokens) * t.k_tile
                 * layout.ELEMENT_BYTES)
    k_tiles = k_cta / t.k_tile
    hbm = weight_bytes / BYTES_PER_US
    busiest_sm = busiest_bytes / (BYTES_PER_US / sm_count)
    l2_reads = (token_tiles * weight_bytes
                + m * k * layout.ELEMENT_BYTES * row_ctas) / BYTES_PER_US
    narrow = t.token_tile < layout.MMA_N
    copies = 0.0 if (t.tma_x or t.bulk_x) else (
        t.token_tile * t.k_tile / layout.CHUNK / (layout.WARP * t.b_loader_warps))
    prefetch_all = t.l2_prefetch and not t.prefetch_tiles
    steps = k_tiles * busiest / min(busiest, resident)  # K tiles an SM slot computes in turn
    # Little's law: an SM whose rings hold in_flight bytes gets in_flight per
    # memory round trip (LATENCY_US), however much bandwidth is left
    latency = busiest_bytes / in_flight * LATENCY_US
    return (
        1.0, hbm, busiest_sm, latency, max(hbm, busiest_sm, latency), l2_reads,
        k_tiles * waves, steps, float(waves), hbm if grid < sm_count else 0.0,
        float(t.early_launch), float(prefetch_all), float(t.prefetch_tiles > 0),
        float(t.prefetch_tiles), latency * t.l2_prefetch,
        float(t.tma_x), steps * t.tma_x, float(t.bulk_x), steps * t.bulk_x,
        float(t.k_split > 1), steps * (t.k_split > 1), float(t.half_tiles > 0), float(narrow),
        steps * narrow, float(t.b_loader_warps == 2), copies * k_tiles,
        float(t.k_tile == 256), float(token_tiles), math.log(t.stages),
        (token_tiles - 1) * hbm,
    )


#: A grid of one CTA per SM that spills past the SMs by under
#: ``SPARSE_TAIL_FILL`` of them, at M >= ``SPARSE_TAIL_MIN_M``, measures
#: ``SPARSE_TAIL_FACTOR`` times the linear terms' prediction: the few CTAs of
#: the second wave stream their tiles with the GPU's bandwidth mostly idle,
#: while ``busiest_sm_us`` counts them as if the whole wave streamed (the
#: calibration records' 5 such timings: a median 1.12 of the linear
#: prediction; the same spill with more CTAs per SM: 1.04). It multiplies
#: the linear prediction, a correction of the fit's residual there. Below
#: M = 16 the records show no such gap (the tile's math is short beside its
#: stream).
SPARSE_TAIL_FACTOR = 1.12
SPARSE_TAIL_FILL = 0.25
SPARSE_TAIL_MIN_M = 16


def sparse_tail_factor(tactic: WarpSplitKTactic, m: int, n: int,
                       sm_count: int = DEFAULT_SM_COUNT) -> float:
    """``SPARSE_TAIL_FACTOR`` where ``tactic``'s grid on M = ``m`` rows of
    an N = ``n`` weight ends in a sparse second wave, else 1."""
    if m < SPARSE_TAIL_MIN_M or ctas_per_sm(tactic) > 1:
        return 1.0
    tail = grid_ctas(tactic, m, n) - sm_count
    return SPARSE_TAIL_FACTOR if 0 < tail < SPARSE_TAIL_FILL * sm_count else 1.0


def cublas_features(m: int, n: int, k: int) -> tuple[float, ...]:
    """The terms of ``CUBLAS_FEATURES`` for ``torch.matmul`` of ``[m, k]``
    by an ``[n, k]`` weight: a fixed cost, the weight's stream (also scaled
    by M, cuBLAS's tiles re-reading it), the activations, the math at the
    mma rate of one SM per 8 x 16 output block, and 1 for N below 1024."""
    hbm = n * k * layout.ELEMENT_BYTES / BYTES_PER_US
    return (1.0, hbm, hbm * m / 32, m * k * layout.ELEMENT_BYTES / BYTES_PER_US,
            2.0 * m * n * k / 1e9, float(n < 1024))


@dataclass(frozen=True)
class CostModel:
    """Fitted coefficients of ``FEATURES`` and ``CUBLAS_FEATURES``, and the
    measured option pairs (``neighbours.pairs``) the options are read off."""

    coefficients: tuple[float, ...]
    cublas_coefficients: tuple[float, ...]
    option_pairs: dict = field(default_factory=dict, compare=False, hash=False)
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def predict_us(self, tactic: WarpSplitKTactic, m: int, n: int, k: int,
                   sm_count: int = DEFAULT_SM_COUNT) -> float:
        """Predicted time of one call of ``tactic`` (independent calls, PDL on)."""
        return (_dot(self.coefficients, features(tactic, m, n, k, sm_count))
                * sparse_tail_factor(tactic, m, n, sm_count))

    def predict_cublas_us(self, m: int, n: int, k: int) -> float:
        """Predicted time of one ``torch.matmul`` (cuBLAS) call."""
        return _dot(self.cublas_coefficients, cublas_features(m, n, k))

    def to_json(self) -> dict:
        return {"format": MODEL_FORMAT, "version": 2, "meta": self.meta,
                "features": dict(zip(FEATURES, self.coefficients)),
                "cublas_features": dict(zip(CUBLAS_FEATURES, self.cublas_coefficients)),
                "option_pairs": self.option_pairs}

    @classmethod
    def from_json(cls, data, source="cost model") -> "CostModel":
        if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
            raise ValueError(f"{source}: not a warpsplitk cost model (format must be "
                             f"{MODEL_FORMAT!r})")
        try:
            coefficients = tuple(float(data["features"][name]) for name in FEATURES)
            cublas = tuple(float(data["cublas_features"][name]) for name in CUBLAS_FEATURES)
            width = len(neighbours.describe(WarpSplitKTactic(32, 8, 256, 2, 1), 8, 1024, 1024)) + 1
            option_pairs = {name: [[float(x) for x in row] for row in rows]
                            for name, rows in data["option_pairs"].items()}
            if any(name not in neighbours.TWINS or any(len(row) != width for row in rows)
                   for name, rows in option_pairs.items()):
                raise ValueError("option_pairs: unknown option or row length")
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: needs a number for every feature and option pair of "
                             f"this version ({error!r})") from None
        return cls(coefficients, cublas, option_pairs, dict(data.get("meta", {})))


def _dot(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


@functools.cache
def shipped_model(name: str = DEFAULT_MODEL) -> CostModel:
    """The cost model shipped in the package for GPU ``name``."""
    if name not in MODEL_FILES:
        raise ValueError(f"no cost model {name!r}: shipped are {sorted(MODEL_FILES)}")
    file = resources.files("warpsplitk").joinpath("data", MODEL_FILES[name])
    text = file.read_text(encoding="utf-8")
    where = f"cost model {name!r}"
    return CostModel.from_json(loads(text, where), where)


# ------------------------------------------------------------------ choice


#: the predicted fastest candidates whose twins (``_rank``'s rules) are ranked too
TWIN_PARENTS = 3


#: K splits ranked as candidates of their own (not only as a twin of the
#: fastest, ``neighbours``): of tiles of at most this many rows, at M up to
#: ``K_SPLIT_BASE_MAX_M``, where the split fits one wave
#: (``neighbours.k_split_pays``). A/B on the H200 against the default without
#: them: 10 cells changed, a median 0.944 of its time (768 x 7168 M = 16:
#: 0.78); with 48- and 64-row tiles or at M = 32 too, a median 1.112 over
#: 66 cells (docs/design-notes.md).
K_SPLIT_BASE_MAX_TILE = 32
K_SPLIT_BASE_MAX_M = 16


def ranked(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
           model: CostModel | None = None) -> list[tuple[WarpSplitKTactic, float]]:
    """The cell's tactics without options, fastest first by
    :func:`rank_us`: ``[(tactic, us)]``. The tuner's candidates with one CTA per
    tile along K, 16-byte activation copies and the late trigger
    (``space.base_candidates``), those with two CTAs per tile along K where
    ``K_SPLIT_BASE_MAX_TILE`` and ``K_SPLIT_BASE_MAX_M`` allow, and the
    reference heuristic's tactic."""
    from . import space
    from ..tactics import reference_tactic
    base = set(space.base_candidates(m, n, k, sm_count, k_splits=(1,), early_launches=(False,),
                                     bulk_xs=(False,)))
    if m <= K_SPLIT_BASE_MAX_M:
        base.update(t for t in space.base_candidates(m, n, k, sm_count, k_splits=(2,),
                                                     early_launches=(False,), bulk_xs=(False,))
                    if t.output_tile <= K_SPLIT_BASE_MAX_TILE
                    and neighbours.k_split_pays(t, m, n, k, sm_count))
    base.add(reference_tactic(m, n, k, sm_count))
    return _rank(m, n, k, sm_count, model or shipped_model(), base, ())


#: What the early trigger makes of a short-wave grid's time
#: (:func:`short_wave`): the records' early/late pairs of the class whose
#: faster one is within 5-20% of its cell's fastest tactic, a median
#: 0.883-0.890 (29-49 pairs; all 111, with slow tactics no ranking picks,
#: 0.957); 7168 x 384 in 32-row tiles with it, 0.86-0.88 of 64-row tiles
#: without.
SHORT_WAVE_EARLY_GAIN = 0.89


def short_wave(tactic: WarpSplitKTactic, m: int, n: int, k: int,
               sm_count: int = DEFAULT_SM_COUNT) -> bool:
    """Whether ``tactic``'s grid is a short wave: tiles of 32 rows or more,
    more CTAs than SMs but one wave of resident CTAs, each streaming 2 to 7
    K tiles. Such a call is short beside its launch; with the early trigger
    the next call's CTAs take each SM slot as this call's retire."""
    grid = grid_ctas(tactic, m, n)
    tiles = k // tactic.k_split // tactic.k_tile
    return (tactic.output_tile >= 32 and 2 <= tiles < 8
            and sm_count < grid <= sm_count * max(1, ctas_per_sm(tactic)))


def rank_us(model: "CostModel", tactic: WarpSplitKTactic, m: int, n: int, k: int,
            sm_count: int = DEFAULT_SM_COUNT) -> float:
    """The time ranking uses: the predicted time, times
    ``SHORT_WAVE_EARLY_GAIN`` for a short wave (which :func:`choose` gives
    the early trigger)."""
    us = model.predict_us(tactic, m, n, k, sm_count)
    return us * SHORT_WAVE_EARLY_GAIN if short_wave(tactic, m, n, k, sm_count) else us


def _rank(m, n, k, sm_count, model, base, twin_rules) -> list[tuple[WarpSplitKTactic, float]]:
    """``base`` and what each of ``twin_rules`` (``{tactic: us}`` -> twins)
    makes of its ``TWIN_PARENTS`` fastest, by :func:`rank_us`; ties
    broken by the tactic's own order (the same answer in every process)."""
    predicted = {t: rank_us(model, t, m, n, k, sm_count) for t in base}
    parents = dict(sorted(predicted.items(), key=lambda item: (item[1], item[0]))[:TWIN_PARENTS])
    for rule in twin_rules:
        for twin in rule(parents):
            if twin not in predicted:
                predicted[twin] = rank_us(model, twin, m, n, k, sm_count)
    return sorted(predicted.items(), key=lambda item: (item[1], item[0]))


#: how much faster than the reference heuristic's tactic another must be
#: predicted to be chosen instead (shape-grouped cross-validation on the
#: records: a 1% margin cut the picks measured more than 3% slower than the
#: reference from 15 to 6 of 69, and lowered the picks' mean time)
REFERENCE_MARGIN = 0.01


#: A weight of this many bytes or more at M <= ``HBM_BOUND_MAX_M`` is
#: streamed with no overlap device (:func:`hbm_bound`): such a call is 15 us
#: or more at the HBM rate, and in a layer the next call is another
#: projection's. The early trigger and the L2 prefetch gain in independent
#: timings only by overlapping the next call of the same weight (held-out
#: 3840 x 15360 at M <= 8: 0.95-0.97 of the reference's time). In
#: gemma-3-12b's TP1 layer chain on the H200, gate_up and down with them
#: (and 2-stage rings) ran 0.9 us (M = 1) and 2.0 us (M = 8) behind the
#: reference heuristic's chain; without, 0.4 us ahead (M = 1) and
#: 0.1-0.7 us behind over three runs (M = 8). Rings shallower than
#: ``HBM_BOUND_MIN_STAGES`` are not taken there: of the calibration
#: records' 2- and 3-stage rings on such cells that the model ranks above
#: the reference heuristic's deeper ring, 28 of 37 measured slower than it
#: (a median 1.017; 28672 x 4096 at M = 1: 1.039).
HBM_BOUND_MIN_BYTES = 64 << 20
HBM_BOUND_MAX_M = 8
HBM_BOUND_MIN_STAGES = 4


def hbm_bound(m: int, n: int, k: int) -> bool:
    """Whether the default streams ``[n, k]`` at M = ``m`` without the early
    trigger or the L2 prefetch, in a ring of ``HBM_BOUND_MIN_STAGES`` or
    more: a weight of ``HBM_BOUND_MIN_BYTES`` or more at M <=
    ``HBM_BOUND_MAX_M``."""
    return m <= HBM_BOUND_MAX_M and n * k * layout.ELEMENT_BYTES >= HBM_BOUND_MIN_BYTES


def choose(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
           model: CostModel | None = None, *, swiglu: bool = False
           ) -> tuple[WarpSplitKTactic, float]:
    """The fastest-predicted tactic of :func:`ranked` (the reference
    heuristic's unless another is predicted ``REFERENCE_MARGIN`` faster),
    as its mixed grid where :func:`balanced_grid` says so (not with
    ``swiglu``, for the SwiGLU epilogue), with the options its nearest
    measured pairs say gain (``neighbours.apply_options``); and its predicted
    time (the ranked time times the options' measured ratios: a mixed grid
    is counted at its parent's, which it measured no slower)."""
    from ..tactics import reference_tactic
    model = model or shipped_model()
    order = ranked(m, n, k, sm_count, model)
    reference = reference_tactic(m, n, k, sm_count)
    reference_us = dict(order)[reference]  # ranked holds the reference's prediction
    streaming = hbm_bound(m, n, k)
    if streaming:
        order = [(t, t_us) for t, t_us in order if t.stages >= HBM_BOUND_MIN_STAGES or t == reference]
    tactic, us = order[0]
    if us > reference_us * (1.0 - REFERENCE_MARGIN):
        tactic, us = reference, reference_us
    if not swiglu:  # the SwiGLU epilogue takes no mixed grid (check_tactic)
        tactic = balanced_grid(tactic, m, n, k, sm_count, model)
    # streaming: no L2 prefetch (nor, below, the early trigger)
    steps = neighbours.STEPS_WITHOUT_PREFETCH if streaming else neighbours.OPTION_STEPS
    tactic, factor = neighbours.apply_options(tactic, m, n, k, model.option_pairs, sm_count, steps)
    if streaming:
        return tactic, us * factor
    if early_trigger_pays(tactic, m, n, sm_count) or short_wave(tactic, m, n, k, sm_count):
        # (a short wave's gain is counted in ranking; the other's is not: it
        # depends on the next kernel's grid)
        tactic = dataclasses.replace(tactic, early_launch=True)
    return tactic, us * factor


#: A grid that keeps at most this share of the SMs busy, on a weight of
#: ``BALANCE_MIN_BYTES`` or more, takes its mixed grid instead
#: (:func:`balanced_grid`): tiles and their halves, one CTA per SM, so every
#: SM streams its share. In the calibration records' 20 cells of that class
#: the mixed grid timed a median 0.87 of the tactic it replaces (0.79-0.97,
#: none slower; 5120 x 7168 at M = 8: 80 CTAs, 0.81), the two compared in
#: the same form (mostly the late trigger without the L2 prefetch: what the
#: tuner timed of both). With more SMs busy it gains nothing (3584-row
#: weights, 112 CTAs: 0.97-1.15), nor on weights of 7 MB (2304 x 1536, 72
#: CTAs: 1.16-1.20), whose CTAs stream a few K tiles each. Measured on the
#: H200's 132 SMs; the share applies to any SM count.
BALANCE_MAX_FILL = 2 / 3
BALANCE_MIN_BYTES = 16 << 20
#: ...with TMA activation boxes from this M on: the records' mixed grids
#: with boxes over row copies, a median 0.82 at M = 24 and 0.94 at M = 32,
#: 0.99-1.03 below (where :mod:`neighbours` decides the boxes).
BALANCE_BOXES_MIN_M = 24


def balanced_grid(tactic: WarpSplitKTactic, m: int, n: int, k: int,
                  sm_count: int = DEFAULT_SM_COUNT, model: CostModel | None = None
                  ) -> WarpSplitKTactic:
    """``tactic``, or where its grid (one CTA per tile along K) keeps at most
    ``BALANCE_MAX_FILL`` of the SMs busy on a weight of
    ``BALANCE_MIN_BYTES`` or more, the fastest-predicted of its mixed grids
    (``space.mixed_grids``: 32- or 64-row tiles, the 32-row ones with either
    K tile) with row copies, or TMA boxes from M = ``BALANCE_BOXES_MIN_M``
    on. (A tactic with TMA boxes below that M is kept: the ranked bases
    have none.)"""
    from . import space
    if (tactic.k_split > 1 or tactic.half_tiles
            or n * k * layout.ELEMENT_BYTES < BALANCE_MIN_BYTES
            or grid_ctas(tactic, m, n) > BALANCE_MAX_FILL * sm_count):
        return tactic
    boxes = m >= BALANCE_BOXES_MIN_M
    grids = space.mixed_grids(tactic, n, k, m, sm_count, k_tile_widths=(128, 256))
    grids = [grid for grid in grids if grid.tma_x == boxes]
    if not grids:
        return tactic
    model = model or shipped_model()
    return min(grids, key=lambda grid: (model.predict_us(grid, m, n, k, sm_count), grid))


def early_trigger_pays(tactic: WarpSplitKTactic, m: int, n: int,
                       sm_count: int = DEFAULT_SM_COUNT) -> bool:
    """Whether ``tactic``'s grid takes the early PDL trigger: its ring
    fills an SM (one resident CTA) and its CTAs cover more than half the
    SMs, at most one each. The next call's CTAs then start on each SM as
    this grid's CTA there retires (pairs within 8% of their cell's fastest
    in the calibration records: early over late a median 0.979, 5% of 237
    pairs more than 3% slower). Where the next grid fits beside the running
    one it streams alongside it instead (median 1.003, 42% of 351 pairs
    more than 3% slower), and a grid with some SMs holding two CTAs and
    some one leaves stragglers (20% of 86)."""
    grid = grid_ctas(tactic, m, n)
    return ctas_per_sm(tactic) == 1 and sm_count / 2 < grid <= sm_count


@functools.lru_cache(maxsize=8192)
def _shipped_choice(m, n, k, sm_count, swiglu=False) -> tuple[WarpSplitKTactic, float]:
    return choose(m, n, k, sm_count, swiglu=swiglu)


def choose_tactic(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT, *,
                  swiglu: bool = False) -> WarpSplitKTactic:
    """The shipped model's choice (:func:`choose`): ``default_tactic``."""
    return _shipped_choice(m, n, k, sm_count, bool(swiglu))[0]


#: cuBLAS runs an M without a plan entry only where predicted this much
#: faster than the chosen tactic (as ``REFERENCE_MARGIN``: a small predicted
#: gain is within the model's error, a wrong switch costs as much)...
CUBLAS_MARGIN = 0.02
#: ...and only up to this K. Of the calibration cells where cuBLAS is
#: predicted that much faster than the default's measured tactic (all at
#: M = 32), the two with K <= 6144 (131104 x 5376, 9472 x 3584) measured
#: cuBLAS 3-8% faster, the three with K of 10752-14336 the kernel, by 3-7%
#: (a held-out 4608 x 9216: 8%): there the kernel's prediction runs high
#: (measured over predicted, the default's tactic at M = 32: a median 0.87
#: for K > 7168, 1.02 for K <= 4096).
CUBLAS_MAX_K = 6144
#: In a dependent chain of kernel calls (a layer's projections back to back,
#: ``bench --chain --model``), cuBLAS takes no part in PDL: the call before it
#: cannot launch it early, and it does not launch the call after it early, so
#: a cuBLAS call forfeits both overlaps. A chained call runs cuBLAS only
#: where predicted this much faster than the kernel besides ``CUBLAS_MARGIN``.
#: Measured on qwen3-4b TP2's layer at M = 32, whose gate_up (9728 x 2560)
#: the model gives cuBLAS: on the H200 that chain took 4.1 us more than
#: the sum of its calls' independent times (the reference heuristic's chain,
#: every call a kernel, within 0.1 us of its sum); on an H100, where cuBLAS
#: and the reference's kernel time alike on that weight in independent calls,
#: running the kernel there took 5.0 us off the chain.
CHAIN_CUBLAS_US = 4.0


@functools.lru_cache(maxsize=8192)
def prefers_cublas(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT, *,
                   chained: bool = False) -> bool:
    """Whether the shipped model predicts cuBLAS ``CUBLAS_MARGIN`` faster
    than its choice, on a weight of K <= ``CUBLAS_MAX_K``; ``chained``: a call
    between kernel calls of a dependent chain, where cuBLAS must also make up
    the PDL overlap it forfeits (``CHAIN_CUBLAS_US``)."""
    penalty = CHAIN_CUBLAS_US if chained else 0.0
    return k <= CUBLAS_MAX_K and (shipped_model().predict_cublas_us(m, n, k) + penalty
                                  < _shipped_choice(m, n, k, sm_count, False)[1]
                                  * (1.0 - CUBLAS_MARGIN))


#: Tactics the quick tuner measures per cell, by :func:`rank_us` (beside the
#: early-trigger twin of each, the bounded-prefetch twins of the predicted
#: fastest, and the default and reference tactics). Replayed on the
#: exhaustive tune's log of the shape table, the quick plan's median cell is
#: 1.031 of the exhaustive one's time at 3 (8 tactics a cell), 1.016 at 6
#: (13 a cell); timed side by side on the GPU: BENCHMARKS.md.
SHORTLIST = 6


def shortlist(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT, size: int = SHORTLIST,
              model: CostModel | None = None) -> list[WarpSplitKTactic]:
    """What the quick tuner measures in one cell: of the whole tuner space
    (``space.base_candidates`` with K splits and bulk rows, late trigger,
    and the TMA, narrow, L2-prefetch and mixed-grid twins of the predicted
    three fastest), the ``size`` fastest predicted and the early-trigger twin
    of each; the bounded-prefetch twins of the fastest
    (effects the model knows least, so measured rather than ranked); and
    ``default_tactic``'s and the reference heuristic's tactics, so that both
    compete in every cell (``tune.choose_tactics`` then prefers a tactic
    without the early trigger or a mixed grid, or one another M chose, when
    within 2%)."""
    from . import space
    from ..tactics import reference_tactic
    base = set(space.base_candidates(m, n, k, sm_count, early_launches=(False,)))
    reference = reference_tactic(m, n, k, sm_count)
    base.add(reference)
    order = [t for t, _ in _rank(m, n, k, sm_count, model or shipped_model(), base, (
        lambda parents: space.tma_twins(parents, n, k),
        lambda parents: space.narrow_twins(parents, n, k, m, sm_count),
        lambda parents: space.prefetch_twins(parents, n, k),
        lambda parents: space.mixed_twins(parents, n, k, m, sm_count)))]
    chosen = order[:size]
    chosen += [dataclasses.replace(t, early_launch=True) for t in chosen]
    chosen += space.bounded_prefetch_twins({order[0]: 0.0}, n, k, top=1, depths=(2, 4))
    chosen += [choose_tactic(m, n, k, sm_count), reference]
    return list(dict.fromkeys(chosen))


# --------------------------------------------------------------------- fit


def solve_least_squares(rows, targets, weights, ridge=0.0) -> list[float]:
    """``argmin_c sum_i w_i^2 (rows_i . c - t_i)^2 + ridge |c|^2`` by the
    normal equations and Gaussian elimination with partial pivoting."""
    size = len(rows[0])
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    for row, target, weight in zip(rows, targets, weights):
        w2 = weight * weight
        for i, a in enumerate(row):
            if a:
                wa = w2 * a
                rhs[i] += wa * target
                gram_i = gram[i]
                for j in range(size):
                    gram_i[j] += wa * row[j]
    for i in range(size):
        gram[i][i] += ridge
    # augmented elimination
    matrix = [gram[i] + [rhs[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-300:
            raise ValueError(f"least squares: feature {col} has no data (singular system)")
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        lead = matrix[col][col]
        for r in range(col + 1, size):
            factor = matrix[r][col] / lead
            if factor:
                row_r, row_c = matrix[r], matrix[col]
                for j in range(col, size + 1):
                    row_r[j] -= factor * row_c[j]
    solution = [0.0] * size
    for i in reversed(range(size)):
        total = matrix[i][size] - sum(matrix[i][j] * solution[j] for j in range(i + 1, size))
        solution[i] = total / matrix[i][i]
    return solution


#: Ridge of the fits, in units of the normalised (relative) system.
RIDGE = 1e-3


def fit(cells, cublas, sm_count: int = DEFAULT_SM_COUNT, meta=None) -> CostModel:
    """A model fitted to ``cells`` (``{(n, k, m): {tactic: us}}``) and
    ``cublas`` (``{(n, k, m): us}``): least squares on the relative error,
    each cell's measurements sharing one cell's weight."""
    rows, targets, weights = [], [], []
    for (n, k, m), timings in sorted(cells.items()):
        share = 1.0 / math.sqrt(len(timings))
        for tactic, us in sorted(timings.items()):
            rows.append(features(tactic, m, n, k, sm_count))
            targets.append(us)
            weights.append(share / us)
    if not rows:
        raise ValueError("cost model fit: no tactic timings")
    coefficients = solve_least_squares(rows, targets, weights, RIDGE)
    cells_c = sorted(cublas.items())
    if not cells_c:
        raise ValueError("cost model fit: no cuBLAS timings")
    cublas_coefficients = solve_least_squares(
        [cublas_features(m, n, k) for (n, k, m), _ in cells_c], [us for _, us in cells_c],
        [1.0 / us for _, us in cells_c], RIDGE)
    return CostModel(tuple(_round(c) for c in coefficients),
                     tuple(_round(c) for c in cublas_coefficients),
                     neighbours.pairs(cells, sm_count), dict(meta or {}))


def _round(value: float) -> float:
    return float(f"{value:.6g}")
