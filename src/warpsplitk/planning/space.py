"""The tactic search space of one (shape, M) cell: what the tuner measures
and what the default (:mod:`warpsplitk.planning.choose`) ranks; and the
twin rules (a tactic with one option more: ``*_twin``), stated here once
for the tuner's measured neighbours (``*_twins``) and the default's options
(:mod:`warpsplitk.planning.measured_options`).

Pruning, before anything is measured (``base_candidates``):

* M buckets: a tactic's time depends on M through the token tiles only, and
  rows past M cost the same shared-memory work as real ones, so M is
  measured at ``tune.REPRESENTATIVE_MS`` (1, 4, 8, 16, 24, 32); every M
  between two of them takes the next one's winner (2..4 the M=4 winner,
  9..16 the M=16 winner, and so on);
* token_tile: the smallest tile covering M, or half of it (two token tiles
  that each re-read the weight tile from L2) when that is still >= 8;
* b_loader_warps: 2 for 16- and 32-token tiles; for 8-token tiles 1, and 2
  as well when M > 1: the activation copies are issued after the
  dependency wait, on every call's critical path once the weight is
  prefetched, so two warps issuing them may pay where one suffices
  before the prefetch;
* stages, per (output_tile, token_tile, k_tile): the grid needs
  ``r = ceil(CTAs / SMs)`` resident CTAs per SM for one wave; the deepest
  rings that fit r, r + 1 and 2r per SM (room beside a running grid lets
  the next kernel's CTAs start under PDL; when no ring fits r, the one with
  the most CTAs per SM). At one CTA per SM that can be a ring too deep for
  the reduction buffer beside it, which then lies over the rings
  (``layout.smem_plan``): at M >= 16 a stage or two more in flight;
* every output tile, also 48 and 64 rows with 8-token tiles: they
  amortise activation re-reads at 16 tokens and more, and on the
  H200 the fewest, longest CTAs measured fastest even with most SMs idle
  (1152x1536 at M=1: 36 CTAs 1.99 us, 72 CTAs 2.21 us);
* k_tile 128 only where 256 cannot give two tiles (and for 48/64-row tiles,
  which take 128);
* with ``k_splits=(1, 2)`` (the default) the cluster split of K too, only
  where ``N / output_tile`` token-tile CTAs leave SMs idle, pruned like the
  rest; a K past ``MAX_K_TILES`` tiles of 256 takes the split it needs
  (``tactics.needed_k_split``) whatever ``k_splits`` says;
* with ``early_launches=(False, True)`` (the default) every candidate also with the early PDL trigger
  (``WarpSplitKTactic.early_launch``), which can be 16% faster or slower
  depending on the tactic's residency, so it is measured rather than modelled;
* with ``bulk_xs=(False, True)`` (the default), at M = 1 every candidate also with its activation row copied by
  one bulk copy per stage (``x_copy`` bulk, one activation warp): 0.90-0.97x
  on most of the table at M = 1, but already 1.01-1.21x at M = 2 and
  1.03-1.46x at M = 8, where several small bulk copies per stage cost
  more than 16-byte copies;
* measured neighbours: with ``l2_prefetch`` (the default), once a cell's candidates are timed,
  its ``PREFETCH_TOP`` fastest are timed again with the L2 prefetch of the
  weight past the ring (``WarpSplitKTactic.l2_prefetch``), for weights up to
  ``PREFETCH_MAX_BYTES``: it was 0.90-0.97x on some 11-14 MB weights, but
  1.05-1.26x on 22-61 MB ones and 1.19x on 2048x2048 at M = 32, too mixed to model and too often a loss to double the space for;
* measured neighbours: with ``mixed`` (the default), each cell's
  ``MIXED_TOP`` fastest whose grid loads some SMs with more CTAs than
  others (3216x7168 at M = 32: 201 CTAs on 132 SMs, 69 of them with two)
  or leaves SMs idle (2624x6144: 82 CTAs of 32 rows) are timed again as a
  mixed grid of 32- or 64-row tiles and their halves, one CTA per SM
  (``WarpSplitKTactic.half_tiles``), with and without TMA boxes
  (2624x6144 M = 32 10.0 -> 9.13 µs, 3216x7168 M = 16 12.8 -> 11.3 µs);
* measured neighbours: with ``bounded_prefetch`` (the default), last, each
  cell's
  ``BOUNDED_PREFETCH_TOP`` fastest are timed again with the L2 prefetch
  bounded to 1-4 K tiles past the ring (``l2_prefetch`` 1-4), on
  weights of every size. Between two calls
  HBM idles while the running grid drains and completes and the next one
  waits for it (~1 µs on 22-30 MB weights, which stream at 84-92% of the
  read bandwidth against 96% for 61 MB); a few tiles per CTA asked of L2
  before the wait fill that gap, where the whole remainder (the unbounded
  prefetch) queued ahead of the running grid's refills;
* measured neighbours: with ``tma`` (the default), each cell's ``TMA_TOP``
  fastest are timed again with their activations as TMA boxes
  (``WarpSplitKTactic.x_copy`` tma, one activation warp): 0.92-1.14x of the best
  without them, a win at M >= 4 on most mid and large weights, so measured
  where the cell's own fastest are rather than across the whole space;
* measured neighbours: with ``narrow`` (the default), at M <= 4 each cell's
  ``NARROW_TOP`` fastest 8-token tactics are timed again with a 1- or
  4-row token tile at the ring depths its smaller stages allow
  (``narrow_twins``: it wins 11 of the 80 benchmarked cells);
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ..kernel import layout
from ..tactics import (
    BULK,
    CP_ASYNC,
    DEFAULT_MAX_STAGES,
    DEFAULT_SM_COUNT,
    K_TILES,
    MAX_STAGES,
    MMA_TOKEN_TILES,
    NARROW_TOKEN_TILES,
    OUTPUT_TILES,
    PREFETCH_ALL,
    PREFETCH_OFF,
    TMA,
    WIDE_TILE,
    WarpSplitKTactic,
    ctas_per_sm,
    grid_ctas,
    is_legal,
    needed_k_split,
    sm_balance,
)


#: the L2 prefetch's measured-neighbour rule (module docstring)
PREFETCH_TOP = 3
PREFETCH_MAX_BYTES = 16 * 2**20


def _activation_warps(token_tile, m, bulk=False):
    """The b_loader_warps worth measuring (see the module docstring)."""
    if bulk:
        return (1,)  # one lane per token row issues the bulk copies
    if token_tile == 8:
        return (1, 2) if m > 1 else (1,)
    return (2,)


def base_candidates(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
                    k_splits=(1, 2), early_launches=(False, True), bulk_xs=(False, True),
                    max_stages=DEFAULT_MAX_STAGES, fp8: bool = False) -> list[WarpSplitKTactic]:
    """The pruned candidates of one (shape, M) cell (the module docstring's
    rules), each with every trigger of ``early_launches``; with ``fp8``, of
    an e4m3 weight: tactics ``check_tactic(..., fp8=True)`` takes, their
    rings sized by the FP8 kernel's shared memory (``ctas_per_sm``)."""
    cover = min(t for t in MMA_TOKEN_TILES if t >= m)
    token_tiles = {cover} | ({cover // 2} if cover // 2 >= 8 else set())
    found = set()
    forced_split = needed_k_split(k)
    for token_tile, output_tile, k_tile, k_split, b_warps, bulk in \
            itertools.product(sorted(token_tiles), OUTPUT_TILES, K_TILES, k_splits,
                              (1, 2), bulk_xs):
        optional_split = k_split > forced_split
        k_split = max(k_split, forced_split)
        if bulk and m > 1:
            continue  # one bulk copy per stage pays; eight do not (module docstring)
        if b_warps not in _activation_warps(token_tile, m, bulk):
            continue
        x_copy = BULK if bulk else CP_ASYNC
        family = [WarpSplitKTactic(output_tile, token_tile, k_tile, s, b_warps, k_split,
                                   x_copy=x_copy)
                  for s in range(1, max_stages + 1)]
        family = [t for t in family if is_legal(t, n, k, fp8=fp8)]
        if not family:
            continue
        if optional_split and grid_ctas(family[0], m, n) // k_split >= sm_count:
            continue  # the grid already covers the SMs: no reason to split K
        if k_tile == 128 and output_tile < WIDE_TILE and k % 256 == 0 and k // 256 >= 2:
            continue  # 256-wide tiles reach the same depth with half the barriers
        wanted = math.ceil(grid_ctas(family[0], m, n) / sm_count)
        fits_any = False
        for r in sorted({wanted, wanted + 1, 2 * wanted}):
            fitting = [t for t in family if ctas_per_sm(t, fp8) >= r]
            if fitting:
                found.add(fitting[-1])
                fits_any = True
        if not fits_any:  # several waves whatever the ring: most resident, deepest
            found.add(max(family, key=lambda t: (ctas_per_sm(t, fp8), t.stages)))
    # the early trigger's twin of each
    return sorted({dataclasses.replace(t, early_launch=e) for t in found for e in early_launches})


def prefetch_twins(times, n, k, top=PREFETCH_TOP, fp8=False) -> list[WarpSplitKTactic]:
    """``{tactic: us}`` of one cell -> its ``top`` fastest tactics with the L2
    prefetch, where legal (the ring does not hold all of K; ``fp8``: for an
    e4m3 weight) and the weight is at most ``PREFETCH_MAX_BYTES`` (BF16 bytes,
    as measured); none already in ``times``."""
    if n * k * 2 > PREFETCH_MAX_BYTES:
        return []
    fastest = sorted((t for t in times if not t.l2_prefetch), key=times.get)[:top]
    twins = [prefetch_twin(t) for t in fastest]
    return [t for t in twins if t not in times and is_legal(t, n, k, fp8=fp8)]


#: the bounded L2 prefetch's measured-neighbour rule (module docstring):
#: the depths measured (2 or 4 tiles won 87 of 89 parents on the 22-61 MB
#: weights, 8 two, and 8 was slower than none on most)
BOUNDED_PREFETCH_TOP = 2
BOUNDED_PREFETCH_DEPTHS = (1, 2, 3, 4)


def prefetch_twin(tactic: WarpSplitKTactic, depth: int = PREFETCH_ALL
                  ) -> WarpSplitKTactic | None:
    """``tactic`` with the L2 prefetch of its whole K share past the ring, or
    of ``depth`` K tiles of it; None where it has a prefetch."""
    if tactic.l2_prefetch != PREFETCH_OFF:
        return None
    return dataclasses.replace(tactic, l2_prefetch=depth)


def bounded_prefetch_twins(times, n, k, top=BOUNDED_PREFETCH_TOP,
                           depths=BOUNDED_PREFETCH_DEPTHS, fp8=False) -> list[WarpSplitKTactic]:
    """``{tactic: us}`` of one cell -> its ``top`` fastest tactics without
    an L2 prefetch, each with the prefetch
    bounded to each of ``depths`` K tiles past the ring that leaves some of
    the CTA's K share unprefetched; any weight size. None already in
    ``times``, all legal (``fp8``: for an e4m3 weight)."""
    parents = sorted((t for t in times if not t.l2_prefetch), key=times.get)[:top]
    twins = [prefetch_twin(t, p) for t in parents for p in depths]
    return [t for t in dict.fromkeys(twins) if t not in times and is_legal(t, n, k, fp8=fp8)]


#: the TMA twins' measured-neighbour rule (module docstring)
TMA_TOP = 3


def with_tma_boxes(tactic: WarpSplitKTactic, **changes) -> WarpSplitKTactic:
    """``tactic`` with its activations as TMA boxes: one activation warp
    (``check_tactic``'s rule for TMA copies), plus ``changes``."""
    return dataclasses.replace(tactic, x_copy=TMA, b_loader_warps=1, **changes)


def tma_twin(tactic: WarpSplitKTactic) -> WarpSplitKTactic | None:
    """``tactic`` with TMA boxes (:func:`with_tma_boxes`); None where it has
    them or its token tile is narrow (a box has 8 rows or more)."""
    if tactic.x_copy == TMA or tactic.token_tile < layout.MMA_N:
        return None
    return with_tma_boxes(tactic)


def tma_twins(times, n, k, top=TMA_TOP) -> list[WarpSplitKTactic]:
    """``{tactic: us}`` of one cell -> its ``top`` fastest tactics with their
    activations as TMA boxes (one activation warp); none already in
    ``times``, all legal."""
    plain = sorted((t for t in times if t.x_copy != TMA), key=times.get)
    found = [tma_twin(t) for t in plain[:top]]
    unique = list(dict.fromkeys(t for t in found if t is not None))
    return [t for t in unique if t not in times and is_legal(t, n, k)]


def k_split_twin(tactic: WarpSplitKTactic, k: int) -> WarpSplitKTactic | None:
    """``tactic`` with two CTAs per tile along K, its ring no deeper than
    the K tiles each then holds (768x7168 at M = 8: 18 stages against 14
    tiles per CTA); None where it splits K or is a mixed grid."""
    if tactic.k_split != 1 or tactic.half_tiles:
        return None
    return dataclasses.replace(tactic, k_split=2,
                               stages=min(tactic.stages, k // 2 // tactic.k_tile))


#: the mixed grids' measured-neighbour rule (module docstring)
MIXED_TOP = 3
#: ...for weights at least this large: below, a CTA streams a few K tiles and
#: the call is launch and latency, not the busiest SM's bytes (the tuner's
#: 1.23 µs mixed pick on 1536x128 at M = 16 benchmarked 1.50)
MIXED_MIN_BYTES = 4 << 20


def balanced_half_tiles(n, output_tile, ctas):
    """Half tiles that make a mixed grid of exactly ``ctas`` CTAs along N
    (``full * output_tile + half * output_tile / 2 == n``, ``full + half ==
    ctas``); None where no such grid has at least one of each."""
    if (2 * n) % output_tile:
        return None
    full = 2 * n // output_tile - ctas
    half = ctas - full
    return half if full >= 1 and half >= 1 else None


def mixed_grids(tactic, n, k, m, sm_count=DEFAULT_SM_COUNT,
                k_tile_widths=None) -> list[WarpSplitKTactic]:
    """Where ``tactic``'s grid leaves SMs unevenly loaded (more CTAs than
    SMs but not a whole number of waves, or fewer CTAs than SMs), its mixed
    grids: 32- or 64-row tiles and their halves with one CTA per SM per
    token tile (``half_tiles``), at the deepest ring one CTA per SM holds,
    where that lowers the busiest SM's L2 bytes against the mean by 5% or
    more (``sm_balance``); each with ``tactic``'s activation path and with
    TMA boxes. 64-row tiles take 128-wide K tiles; 32-row tiles
    ``tactic``'s, or each of ``k_tile_widths``. All legal."""
    token_tiles = -(-m // tactic.token_tile)
    if grid_ctas(tactic, m, n) % sm_count == 0 or sm_count % token_tiles:
        return []
    per_row = sm_count // token_tiles
    found = []
    for output_tile in (32, 64):
        half = balanced_half_tiles(n, output_tile, per_row)
        if half is None:
            continue
        # 64-row tiles take 128-wide K tiles (``check_tactic``)
        widths = (128,) if output_tile >= WIDE_TILE else (k_tile_widths or (tactic.k_tile,))
        for k_tile in widths:
            grid = dataclasses.replace(tactic, output_tile=output_tile, k_tile=k_tile,
                                       half_tiles=half)
            for variant in dict.fromkeys((grid, with_tma_boxes(grid))):
                family = [dataclasses.replace(variant, stages=s)
                          for s in range(1, DEFAULT_MAX_STAGES + 1)]
                family = [f for f in family if is_legal(f, n, k) and ctas_per_sm(f) >= 1]
                # only where the busiest SM reads measurably less (at M = 1 the
                # 32-row CTAs carry as much weight as two 16-row ones did)
                if family and sm_balance(family[-1], m, n, sm_count) < 0.95 * sm_balance(
                        tactic, m, n, sm_count):
                    found.append(family[-1])
    return list(dict.fromkeys(found))


def mixed_twins(times, n, k, m, sm_count=DEFAULT_SM_COUNT, top=MIXED_TOP) -> list[WarpSplitKTactic]:
    """``{tactic: us}`` of one cell -> the mixed grids (:func:`mixed_grids`)
    of its ``top`` fastest without a K split, for weights of
    ``MIXED_MIN_BYTES`` or more; the TMA boxes matter (2624x6144 at M = 32
    mixed, 9.13 µs with the boxes, 11.9 without). None already in
    ``times``."""
    if n * k * 2 < MIXED_MIN_BYTES:
        return []
    plain = sorted((t for t in times if t.k_split == 1 and not t.half_tiles), key=times.get)
    found = [grid for t in plain[:top] for grid in mixed_grids(t, n, k, m, sm_count)]
    return [t for t in dict.fromkeys(found) if t not in times]


#: the narrow token tiles' measured-neighbour rule (module docstring)
NARROW_TOP = 3


def narrow_twin(parent: WarpSplitKTactic, m: int, n: int, k: int, resident: int,
                bulk: bool = False, fp8: bool = False) -> WarpSplitKTactic | None:
    """``parent`` (8 token rows) with the narrowest token tile that covers
    M <= 4, activations by 16-byte copies (or bulk rows), at the deepest
    legal ring that keeps ``resident`` CTAs per SM (``fp8``: of the e4m3
    weight's kernel); None where there is none."""
    if m > NARROW_TOKEN_TILES[-1] or parent.token_tile != 8:
        return None
    token_tile = min(t for t in NARROW_TOKEN_TILES if t >= m)
    twin = dataclasses.replace(parent, token_tile=token_tile,
                               x_copy=BULK if bulk else CP_ASYNC)
    copies = token_tile * twin.k_tile // layout.CHUNK
    if not bulk and copies % (twin.b_loader_warps * layout.WARP):
        twin = dataclasses.replace(twin, b_loader_warps=1)  # too few copies for two warps
    family = [dataclasses.replace(twin, stages=s) for s in range(1, MAX_STAGES + 1)]
    fitting = [t for t in family
               if is_legal(t, n, k, fp8=fp8) and ctas_per_sm(t, fp8) >= resident]
    return fitting[-1] if fitting else None


def narrow_twins(times, n, k, m, sm_count=DEFAULT_SM_COUNT,
                 top=NARROW_TOP, fp8=False) -> list[WarpSplitKTactic]:
    """``{tactic: us}`` of one cell with M <= 4 -> its ``top`` fastest
    8-token tactics with the narrowest token tile that still covers M
    (``NARROW_TOKEN_TILES``: the stage holds M's rows only), activations by
    16-byte copies (a narrow tile takes no TMA boxes) and, for a parent
    with bulk rows, also by bulk rows,
    each at two ring depths: the deepest that keeps the
    parent's CTAs per SM (the shared memory the 8-row stage spent on rows
    past M, as depth) and the deepest that fits one CTA more per SM (room
    for the next kernel's CTAs to start under PDL while this grid streams).
    None already in ``times``, all legal (``fp8``: for an e4m3 weight)."""
    if m > NARROW_TOKEN_TILES[-1]:
        return []
    parents = sorted((t for t in times if t.token_tile == 8), key=times.get)[:top]
    found = []
    for parent in parents:
        resident = ctas_per_sm(parent, fp8)
        # a narrow tile takes no TMA boxes: a TMA parent's twin copies by 16 bytes
        for bulk in dict.fromkeys((False, parent.x_copy == BULK)):
            for r in (resident, resident + 1):
                twin = narrow_twin(parent, m, n, k, r, bulk, fp8)
                if twin is not None:
                    found.append(twin)
    unique = list(dict.fromkeys(found))
    return [t for t in unique if t not in times]
