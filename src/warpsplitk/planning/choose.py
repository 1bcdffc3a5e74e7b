"""The default choice: which tactic (or cuBLAS) runs a cell without a plan entry.

:func:`default_tactic` (the shipped model's :func:`choose`) ranks by
predicted time (:mod:`warpsplitk.planning.cost_model`) the tuner's
candidates of the cell with one CTA per tile along K (two for tiles of up
to 32 rows at M <= 16, where the split fits one wave and each CTA streams
8 K tiles or more), 16-byte activation copies and the late PDL trigger
(``space.base_candidates``) and the reference wave heuristic's tactic
(:func:`reference_tactic`), and keeps the reference's unless another is
predicted ``REFERENCE_MARGIN`` faster. Where that grid leaves a third of
the SMs idle on a large weight (a quarter from M = 24), its mixed grid
replaces it (:func:`balanced_grid`). The options (K split, narrow token
tiles, TMA boxes, bounded L2 prefetch) are then applied where the nearest
measured pairs say they gain (:mod:`warpsplitk.planning.measured_options`): the
linear terms for options are fitted on the few regimes where the tuner
found them winning, and ranked freely they were picked far outside those
regimes (docs/design-notes.md). The early PDL trigger is taken where the
grid's shape says it pipelines (:func:`early_trigger_pays`), and on a short
wave (:func:`short_wave`), whose measured gain ranking counts
(:func:`rank_us`). On a weight that streams at the HBM rate whatever the
tactic (:func:`hbm_bound`) the default takes a ring of
``HBM_BOUND_MIN_STAGES`` or more and neither the early trigger nor the L2
prefetch. Bulk activation rows are left to the tuner.

Where no plan entry exists, ``plans.default_choice`` runs cuBLAS for an M
whose predicted cuBLAS time is ``CUBLAS_MARGIN`` below the chosen tactic's,
on a weight of K <= ``CUBLAS_MAX_K``, and past M = 8 where K needs four
CTAs (:func:`prefers_cublas`); between
kernel calls of a dependent chain only where it also makes up the PDL
overlap it forfeits (``CHAIN_CUBLAS_US``). :func:`shortlist` is what the
quick tuner measures instead of the whole space.

Pure Python (no numpy): importable and usable where the package is.
"""

from __future__ import annotations

import dataclasses
import functools

from ..contract import FP8_SCALE_KINDS, MAX_K_SPLIT, min_k_split
from ..kernel import layout
from ..tactics import (
    CP_ASYNC,
    DEFAULT_SM_COUNT,
    MAX_STAGES,
    MMA_TOKEN_TILES,
    OUTPUT_TILES,
    TMA,
    WIDE_TILE,
    WarpSplitKTactic,
    check_m,
    check_shape,
    check_tactic,
    ctas_per_sm,
    grid_ctas,
    is_legal,
    needed_k_split,
    resolve_sm_count,
)
from . import measured_options, space
from .cost_model import CostModel, shipped_model


def default_tactic(m: int, n: int, k: int, sm_count: int | None = None, *,
                   swiglu: bool = False, fp8: bool = False,
                   fp8_scales: str = "channel") -> WarpSplitKTactic:
    """The tactic the cost model predicts fastest for M tokens on an
    ``[n, k]`` weight (:func:`choose`): the tuner's candidates and the
    reference heuristic's tactic, ranked by the model fitted to the tuner's
    measurements, then the options its nearest measured pairs say gain.
    Legal for every M in 1..32 and every shape ``contract.shape_refusal``
    accepts, with ``swiglu`` for the SwiGLU epilogue (no mixed grid), with
    ``fp8`` for e4m3 weights with ``fp8_scales`` scales (:func:`fp8_tactic`);
    ``sm_count`` None: the current GPU's. The same answer on every call.
    """
    m = check_m(m)
    sm_count = resolve_sm_count(sm_count)
    n, k = check_shape(n, k)
    if fp8:
        if fp8_scales not in FP8_SCALE_KINDS:
            raise ValueError(f"fp8_scales must be one of {FP8_SCALE_KINDS}, got {fp8_scales!r}")
        tactic = fp8_tactic(m, n, k, sm_count, fp8_scales, swiglu=swiglu)
        check_tactic(tactic, n, k, swiglu=swiglu, fp8=True)
        return tactic
    return choose_tactic(m, n, k, sm_count, swiglu=swiglu)


#: The FP8 default's rules (:func:`fp8_tactic`), from sweeps on an H100 of
#: e4m3 weights around the BF16 choice. The FP8 call is bound by its compute
#: warps' conversion of the weight, not the ring's depth (design notes), so
#: it wants several CTAs on each SM (:func:`fp8_resident`): a ring no deeper
#: than leaves room for ``FP8_MIN_RESIDENT`` CTAs per SM, or as many as the
#: grid puts on one up to ``FP8_MAX_RESIDENT``; tiles of 256 along K and at
#: most 32 rows; two CTAs along K where the grid has fewer CTAs than SMs,
#: else 16-row tiles where it has fewer than ``FP8_NARROW_GRID`` times the
#: SMs. A tune of 10 shapes of 16-340 MB at M = 1 and 8 found the fastest
#: tactics so (they streamed at 77-103% of the measured read bandwidth, the
#: BF16-derived choice with one CTA per SM at 58-91%): 2560x9728 13.3 -> 10.0
#: us, 4608x4096 9.0 -> 7.2 us; at M = 32, 3216x7168 32.6 -> 14.9 us.
FP8_MIN_RESIDENT = 2
FP8_MAX_RESIDENT = 4
FP8_NARROW_GRID = 1.5
#: Where K takes a cluster of four CTAs (``needed_k_split``), one CTA more
#: per SM and no early trigger: on an H100, 8192x29568 at M = 1 and 8 ran
#: 102.3 -> 89.6 us (a ring of 4 for 5 CTAs per SM, against 6 for 4, or
#: 101.4 at 6 per SM), and every early trigger of the sweep lost 1-11%.
#: Three CTAs keep the rules (unmeasured; 4608x36864 streams at 94% of the
#: read bandwidth at M = 1 with them).
FP8_CLUSTER_RESIDENT = FP8_MAX_RESIDENT + 1
#: Block scales take the same rules: the kernel folds each into its
#: block's conversion (``ptx.block_multiplier``), at no cost per weight.


@functools.lru_cache(maxsize=8192)
def fp8_tactic(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
               scales: str = "channel", *, swiglu: bool = False) -> WarpSplitKTactic:
    """The FP8-weight default, the BF16 choice adapted by measured rules:
    16-byte activation copies (the FP8 kernel's only kind) by two loader
    warps, no L2 prefetch or mixed grid (measured on BF16 weights), several
    CTAs per SM (:func:`fp8_resident`; the early PDL trigger only at
    M <= 16; where K takes four CTAs, ``FP8_CLUSTER_RESIDENT`` and no
    early trigger); the same for every kind of ``scales``.
    ``swiglu``: for the SwiGLU epilogue, from its BF16 choice.
    A rule whose tactic breaks ``check_tactic`` is skipped;
    where even the first breaks one, the first of :func:`ranked`'s order
    that keeps them."""
    def legal(tactic):
        return is_legal(tactic, n, k, swiglu=swiglu, fp8=True)

    base = dataclasses.replace(choose_tactic(m, n, k, sm_count, swiglu=swiglu), x_copy=CP_ASYNC,
                               early_launch=False, l2_prefetch=0, half_tiles=0)
    if not legal(base):
        base = next(t for t in (dataclasses.replace(t, x_copy=CP_ASYNC, half_tiles=0)
                                for t, _ in ranked(m, n, k, sm_count))
                    if legal(t))

    def step(tactic, **changes):
        changed = dataclasses.replace(tactic, **changes)
        return changed if legal(changed) else tactic

    cluster = needed_k_split(k) == MAX_K_SPLIT
    tactic = fp8_resident(base, m, n, sm_count, step, early=m <= 16 and not cluster,
                          most=FP8_CLUSTER_RESIDENT if cluster else FP8_MAX_RESIDENT)
    return step(tactic, b_loader_warps=2)


def fp8_resident(tactic: WarpSplitKTactic, m: int, n: int, sm_count: int, step,
                 early: bool = True, most: int = FP8_MAX_RESIDENT) -> WarpSplitKTactic:
    """The FP8 default's shape (``FP8_MIN_RESIDENT``): an
    MMA-wide token tile (narrow ones measured 1.1-1.3x slower on e4m3
    weights), at most 32 rows and tiles of 256 along K, two CTAs along K
    where the grid has fewer CTAs than SMs or else 16-row tiles where it has
    fewer than ``FP8_NARROW_GRID`` times them, with ``early`` the early PDL
    trigger where the grid has more CTAs than ``FP8_MIN_RESIDENT`` per SM,
    then the deepest ring that leaves room for the CTAs each SM should hold
    (at most ``most``).
    ``step(tactic, **changes)`` is the change where legal, else ``tactic``."""
    cover = min(t for t in MMA_TOKEN_TILES if t >= m)
    # the shape first on a short ring (a deep one would refuse wider tiles
    # or a split K), the ring last
    tactic = step(tactic, stages=2)
    tactic = step(tactic, token_tile=max(tactic.token_tile, cover))
    tactic = step(tactic, output_tile=min(tactic.output_tile, 32))
    tactic = step(tactic, k_tile=256)  # (64-row tiles take only 128)
    if grid_ctas(tactic, m, n) < sm_count:
        tactic = step(tactic, k_split=2)
    elif grid_ctas(tactic, m, n) < FP8_NARROW_GRID * sm_count:
        tactic = step(tactic, output_tile=16)
    if early and grid_ctas(tactic, m, n) > FP8_MIN_RESIDENT * sm_count:
        # CTAs that wait for a slot start sooner: 1.04-1.16x on the tune's
        # three such cells (4608x4096, 16384x3072, 30720x3840) at M <= 8
        # (at M = 32 it measured 0.95-1.02x)
        tactic = step(tactic, early_launch=True)
    wanted = -(-grid_ctas(tactic, m, n) // sm_count)
    resident = min(max(wanted, FP8_MIN_RESIDENT), most)
    if layout.split_over_rings(tactic.k_split, layout.FP8_BYTES):
        # the ring lies under the reduction buffer: up to the buffer's size
        # a deeper ring costs no CTA, so the deepest one at the most CTAs
        # the shortest ring leaves (H100, against the layout beside the
        # rings: 8192x29568 M 16/32 1.06/1.21x, 4608x36864 M 16 1.33x,
        # M <= 8 0.98-0.99x)
        resident = min(resident, ctas_per_sm(tactic, fp8=True))
    for stages in range(MAX_STAGES, 0, -1):
        deeper = step(tactic, stages=stages)
        if deeper.stages == stages and ctas_per_sm(deeper, fp8=True) >= resident:
            return deeper
    return tactic


def reference_tactic(m: int, n: int, k: int, sm_count: int | None = None) -> WarpSplitKTactic:
    """The reference wave heuristic: the baseline ``bench`` compares the
    default and the plan with (a plain wave rule on this kernel, no
    measurement behind it). Legal for every M, N and K ``default_tactic``
    takes.

    - output_tile: of the tiles that divide N, the one that minimises
      ``ceil(CTAs / SMs) * output_tile`` (the rows the busiest SM streams),
      the wider tile on ties;
    - token_tile: 8, 16 or 32, the smallest covering M, then halved (not
      below 8) while the doubled grid still fits in one wave;
    - k_tile: 256 when K holds two of them and the tile takes it, else 128;
    - k_split: 1, or what K needs (``needed_k_split``: 2 past 64 tiles
      of 256, 3-4 past 128);
    - b_loader_warps: 2 from 16 token rows or 8 K tiles on, else 1;
    - stages: the deepest ring that keeps 2 CTAs per SM when the grid
      exceeds the SMs, else the deepest legal one.
    """
    m = check_m(m)
    sm_count = resolve_sm_count(sm_count)
    n, k = check_shape(n, k)
    token_tile = min(t for t in MMA_TOKEN_TILES if t >= m)
    token_tiles = -(-m // token_tile)

    def busiest_rows(tile):
        return -(-(n // tile) * token_tiles // sm_count) * tile

    # the split only where K needs it; 48- and 64-row tiles take 128-wide K
    # tiles only (check_tactic), so not where those would need a wider split
    k_split = needed_k_split(k)
    tiles = [t for t in OUTPUT_TILES
             if n % t == 0 and (t < WIDE_TILE or min_k_split(k, 128) == k_split)]
    output_tile = min(tiles, key=lambda t: (busiest_rows(t), -t))
    row_tiles = n // output_tile
    while token_tile > layout.MMA_N and row_tiles * -(-m // (token_tile // 2)) <= sm_count:
        token_tile //= 2
    wide = output_tile >= WIDE_TILE
    k_tile = 256 if (not wide and k % 256 == 0
                     and (k // 256 >= 2 or min_k_split(k, 128) != k_split)) else 128
    cta_tiles = k // k_tile // k_split
    b_warps = 2 if token_tile >= 16 or cta_tiles >= 8 else 1
    legal = _rings(output_tile, token_tile, k_tile, b_warps, k_split, n, k)
    if not legal:  # (two activation warps are too many for a tile's copies)
        legal = _rings(output_tile, token_tile, k_tile, 1, k_split, n, k)
    if grid_ctas(legal[0], m, n) > sm_count:
        keeping_two = [t for t in legal if ctas_per_sm(t) >= 2]
        if keeping_two:
            return keeping_two[-1]
    return legal[-1]


def _rings(output_tile, token_tile, k_tile, b_warps, k_split, n, k) -> list[WarpSplitKTactic]:
    """The legal tactics of one family, shallowest ring first."""
    family = (WarpSplitKTactic(output_tile, token_tile, k_tile, s, b_warps, k_split)
              for s in range(1, min(k // k_tile // k_split, MAX_STAGES) + 1))
    return [t for t in family if is_legal(t, n, k)]


# ------------------------------------------------------------------ ranking


#: the predicted fastest candidates whose twins (``_rank``'s rules) are ranked too
TWIN_PARENTS = 3


#: K splits ranked as candidates of their own (not only as an option of the
#: fastest, ``measured_options``): of tiles of at most this many rows, at M
#: up to ``K_SPLIT_BASE_MAX_M``, where the split fits one wave
#: (``measured_options.k_split_pays``): a median 0.944 of the default's time
#: without them over the 10 cells they change (docs/design-notes.md).
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
    base = set(space.base_candidates(m, n, k, sm_count, k_splits=(1,), early_launches=(False,),
                                     bulk_xs=(False,)))
    if m <= K_SPLIT_BASE_MAX_M:
        base.update(t for t in space.base_candidates(m, n, k, sm_count, k_splits=(2,),
                                                     early_launches=(False,), bulk_xs=(False,))
                    if t.output_tile <= K_SPLIT_BASE_MAX_TILE
                    and measured_options.k_split_pays(t, m, n, k, sm_count))
    base.add(reference_tactic(m, n, k, sm_count))
    return _rank(m, n, k, sm_count, model or shipped_model(), base, ())


#: What the early trigger makes of a short-wave grid's time
#: (:func:`short_wave`): the records' early/late pairs of that class whose
#: faster one is within 5-20% of its cell's fastest tactic, a median
#: 0.883-0.890.
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


def rank_us(model: CostModel, tactic: WarpSplitKTactic, m: int, n: int, k: int,
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


# ------------------------------------------------------------------- choice


#: how much faster than the reference heuristic's tactic another must be
#: predicted to be chosen instead (shape-grouped cross-validation on the
#: records: a 1% margin cut the picks measured more than 3% slower than the
#: reference from 15 to 6 of 69)
REFERENCE_MARGIN = 0.01


#: A weight of this many bytes or more at M <= ``HBM_BOUND_MAX_M`` is
#: streamed with no overlap device (:func:`hbm_bound`): such a call is 15 us
#: or more at the HBM rate, and in a layer the next call is another
#: projection's, while the early trigger and the L2 prefetch gain in
#: independent timings only by overlapping the next call of the same weight
#: (gemma-3-12b's TP1 layer chain at M = 8 ran 2.0 us behind the reference
#: heuristic's with them). Rings shallower than ``HBM_BOUND_MIN_STAGES`` are
#: not taken there: 28 of the 37 such rings the model ranks above the
#: reference's deeper ring measured slower than it.
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
    measured pairs say gain (``measured_options.apply_options``); and its
    predicted time (the ranked time times the options' measured ratios: a
    mixed grid is counted at its parent's, which it measured no slower)."""
    model = model or shipped_model()
    order = ranked(m, n, k, sm_count, model)
    reference = reference_tactic(m, n, k, sm_count)
    reference_us = dict(order)[reference]  # ranked holds the reference's prediction
    streaming = hbm_bound(m, n, k)
    if streaming:
        order = [(t, t_us) for t, t_us in order
                 if t.stages >= HBM_BOUND_MIN_STAGES or t == reference]
    tactic, us = order[0]
    if us > reference_us * (1.0 - REFERENCE_MARGIN):
        tactic, us = reference, reference_us
    if not swiglu:  # the SwiGLU epilogue takes no mixed grid (check_tactic)
        tactic = balanced_grid(tactic, m, n, k, sm_count, model)
    # streaming: no L2 prefetch (nor, below, the early trigger)
    steps = (measured_options.STEPS_WITHOUT_PREFETCH if streaming
             else measured_options.OPTION_STEPS)
    tactic, factor = measured_options.apply_options(tactic, m, n, k, model.option_pairs,
                                                    sm_count, steps)
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
#: the mixed grid timed a median 0.87 of the tactic it replaces, none
#: slower; with more SMs busy, or on smaller weights (whose CTAs stream a few
#: K tiles each), it gains nothing. The share applies to any SM count.
BALANCE_MAX_FILL = 2 / 3
BALANCE_MIN_BYTES = 16 << 20
#: ...with TMA activation boxes from this M on: the records' mixed grids
#: with boxes over row copies, a median 0.82 at M = 24, 0.99-1.03 below
#: (where :mod:`measured_options` decides the boxes).
BALANCE_BOXES_MIN_M = 24
#: ...and from that M on, grids keeping up to this share busy: with every
#: row of x in a TMA box, a CTA's stream outlasts the wave's tail, and on an
#: H100 the mixed grid timed 0.94-1.01 (median 0.98) of the tactic it
#: replaces at M 24-32 in grids of 2/3-3/4 of the SMs; at M = 20 (row
#: copies) up to 1.23, so below ``BALANCE_BOXES_MIN_M`` the share stays 2/3.
BALANCE_WIDE_MAX_FILL = 3 / 4


def balance_max_fill(m: int) -> float:
    """The largest share of the SMs a grid may keep busy and still take its
    mixed grid at ``m`` rows (:func:`balanced_grid`)."""
    return BALANCE_WIDE_MAX_FILL if m >= BALANCE_BOXES_MIN_M else BALANCE_MAX_FILL


def balanced_grid(tactic: WarpSplitKTactic, m: int, n: int, k: int,
                  sm_count: int = DEFAULT_SM_COUNT, model: CostModel | None = None
                  ) -> WarpSplitKTactic:
    """``tactic``, or where its grid (one CTA per tile along K) keeps at most
    ``balance_max_fill(m)`` of the SMs busy on a weight of
    ``BALANCE_MIN_BYTES`` or more, the fastest-predicted of its mixed grids
    (``space.mixed_grids``: 32- or 64-row tiles, the 32-row ones with either
    K tile) with row copies, or TMA boxes from M = ``BALANCE_BOXES_MIN_M``
    on. (A tactic with TMA boxes below that M is kept: the ranked bases
    have none.)"""
    if (tactic.k_split > 1 or tactic.half_tiles
            or n * k * layout.ELEMENT_BYTES < BALANCE_MIN_BYTES
            or grid_ctas(tactic, m, n) > balance_max_fill(m) * sm_count):
        return tactic
    boxes = m >= BALANCE_BOXES_MIN_M
    grids = space.mixed_grids(tactic, n, k, m, sm_count, k_tile_widths=(128, 256))
    grids = [grid for grid in grids if (grid.x_copy == TMA) == boxes]
    if not grids:
        return tactic
    model = model or shipped_model()
    return min(grids, key=lambda grid: (model.predict_us(grid, m, n, k, sm_count), grid))


def early_trigger_pays(tactic: WarpSplitKTactic, m: int, n: int,
                       sm_count: int = DEFAULT_SM_COUNT) -> bool:
    """Whether ``tactic``'s grid takes the early PDL trigger: its ring
    fills an SM (one resident CTA) and its CTAs cover more than half the
    SMs, at most one each. The next call's CTAs then start on each SM as
    this grid's CTA there retires (the records' early/late pairs of that
    class: a median 0.979). Where the next grid fits beside the running
    one it streams alongside it instead, and a grid with some SMs holding
    two CTAs and some one leaves stragglers."""
    grid = grid_ctas(tactic, m, n)
    return ctas_per_sm(tactic) == 1 and sm_count / 2 < grid <= sm_count


@functools.lru_cache(maxsize=8192)
def _shipped_choice(m, n, k, sm_count, swiglu=False) -> tuple[WarpSplitKTactic, float]:
    return choose(m, n, k, sm_count, swiglu=swiglu)


def choose_tactic(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT, *,
                  swiglu: bool = False) -> WarpSplitKTactic:
    """The shipped model's choice (:func:`choose`), cached: ``default_tactic``
    without the argument checks."""
    return _shipped_choice(m, n, k, sm_count, bool(swiglu))[0]


# ------------------------------------------------------------------- cuBLAS


#: cuBLAS runs an M without a plan entry only where predicted this much
#: faster than the chosen tactic (as ``REFERENCE_MARGIN``: a small predicted
#: gain is within the model's error, a wrong switch costs as much)...
CUBLAS_MARGIN = 0.02
#: ...and only up to this K: above it the kernel's prediction runs high
#: (measured over predicted, the default's tactic at M = 32: a median 0.87
#: for K > 7168), and the cells predicted for cuBLAS measured the kernel
#: 3-7% faster.
CUBLAS_MAX_K = 6144
#: In a dependent chain of kernel calls (a layer's projections back to back,
#: ``bench --chain --model``), cuBLAS takes no part in PDL: the call before it
#: cannot launch it early, and it does not launch the call after it early, so
#: a cuBLAS call forfeits both overlaps. A chained call runs cuBLAS only
#: where predicted this much faster than the kernel besides ``CUBLAS_MARGIN``
#: (qwen3-4b TP2's layer at M = 32 on the H200, cuBLAS for gate_up: the chain
#: took 4.1 us more than the sum of its calls' independent times).
CHAIN_CUBLAS_US = 4.0
#: Past this M, a weight whose K needs four CTAs (``needed_k_split``: past
#: 3 x 64 tiles of the widest tile that divides K) runs cuBLAS without a
#: plan entry: 8192x29568 (Qwen2.5-72B's down at TP 1, H100) measured the
#: default 0.96x and 0.93x cuBLAS at M = 16 and 32, 1.04-1.05x at M <= 8. A
#: quick tune found nothing faster than cuBLAS at M = 32, but 1.07x at M =
#: 16 (the default's tactic misses there); M 9-15 and K in tiles of 256 are
#: not measured.
FOUR_CTA_CUBLAS_MIN_M = 8


@functools.lru_cache(maxsize=8192)
def prefers_cublas(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT, *,
                   chained: bool = False) -> bool:
    """Whether the shipped model predicts cuBLAS ``CUBLAS_MARGIN`` faster
    than its choice, on a weight of K <= ``CUBLAS_MAX_K`` (and past
    ``FOUR_CTA_CUBLAS_MIN_M`` on a K that needs four CTAs); ``chained``: a call
    between kernel calls of a dependent chain, where cuBLAS must also make up
    the PDL overlap it forfeits (``CHAIN_CUBLAS_US``)."""
    if m > FOUR_CTA_CUBLAS_MIN_M and needed_k_split(k) == MAX_K_SPLIT:
        return True
    penalty = CHAIN_CUBLAS_US if chained else 0.0
    return k <= CUBLAS_MAX_K and (shipped_model().predict_cublas_us(m, n, k) + penalty
                                  < _shipped_choice(m, n, k, sm_count, False)[1]
                                  * (1.0 - CUBLAS_MARGIN))


# ---------------------------------------------------------------- shortlist


#: Tactics the quick tuner measures per cell, by :func:`rank_us` (beside the
#: early-trigger twin of each, the bounded-prefetch twins of the predicted
#: fastest, and the default and reference tactics): replayed on the
#: exhaustive tune's log of the shape table, the quick plan's median cell is
#: 1.016 of the exhaustive one's time at 6 (13 a cell; BENCHMARKS.md).
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
