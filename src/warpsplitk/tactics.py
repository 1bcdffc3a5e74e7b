"""Tactics: the compile-time shape of one warp split-K kernel, and its rules.

Pure Python: importable and checkable on a machine with neither a GPU nor
the CuTe DSL.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

from .contract import (K_TILE_WIDTHS, MAX_K_SPLIT, MAX_K_TILES, MAX_M, MAX_N, OPTIONAL_K_SPLIT,
                       as_integer, min_k_split, n_bound_refusal, shape_refusal)
from .kernel import layout

OUTPUT_TILES = (16, 32, 48, 64)
#: output tiles from this size on need k_tile 128 (see check_tactic)
WIDE_TILE = 48
#: Token tiles of whole mma blocks (8 columns each): the tuner's base
#: candidates, which the default (cost model) ranks.
MMA_TOKEN_TILES = (8, 16, 32)
#: Token tiles narrower than one mma block, for M <= 4: the stage holds only
#: these rows (``layout.stage_row``), and the shared memory an 8-row stage
#: would spend on rows past M goes to ring depth. Measured as twins of a
#: cell's fastest 8-row tactics (``space.narrow_twins``).
NARROW_TOKEN_TILES = (1, 2, 4)
TOKEN_TILES = NARROW_TOKEN_TILES + MMA_TOKEN_TILES
K_TILES = K_TILE_WIDTHS
#: Ring depth at most. 16 bounds every 8-row stage the shared memory holds
#: but one (16-row tiles x 256 K: 18 stages); narrow token tiles make
#: stages small enough for up to 26 (16 rows x 256 K, one token row).
MAX_STAGES = 32
#: ...and the tuner's base candidates' at most (``space.base_candidates``),
#: the space the default ranks: deeper rings come only with narrow token
#: tiles, whose smaller stages leave room for them.
DEFAULT_MAX_STAGES = 16
B_LOADER_WARPS = (1, 2)
#: CTAs of a cluster that share one output tile's K (each streams 1/k_split
#: of K; the others' partial sums meet the first's in its shared memory):
#: for weights whose N leaves SMs idle, and for K past ``MAX_K_TILES`` tiles.
K_SPLITS = tuple(range(1, MAX_K_SPLIT + 1))
#: The splits a tuner or the default may choose; wider ones only where K
#: needs them (``check_tactic``, ``needed_k_split``).
OPTIONAL_K_SPLITS = tuple(range(1, OPTIONAL_K_SPLIT + 1))
#: Where the kernel lets the next PDL kernel launch: False after its last
#: activation tile is issued, True before its griddepcontrol.wait (see
#: WarpSplitKTactic.early_launch).
EARLY_LAUNCHES = (False, True)
#: ``short()`` suffix of a tactic with the early PDL trigger.
EARLY_SUFFIX = "+early"
#: ``WarpSplitKTactic.l2_prefetch``: no L2 prefetch...
PREFETCH_OFF = 0
#: ...the rest of the CTA's K share past the ring...
PREFETCH_ALL = -1
#: ...or that many K tiles past the ring (a bounded prefetch): about what
#: keeps HBM busy across the gap between two calls (~1 us x 4.4 TB/s over
#: 64-132 CTAs: 33-70 KB per CTA, 2-8 tiles of 8-16 KB), few enough that L2
#: keeps them.
PREFETCH_TILES = (1, 2, 3, 4, 6, 8)
L2_PREFETCHES = (PREFETCH_OFF, PREFETCH_ALL) + PREFETCH_TILES
#: ``short()`` suffix of a tactic with the L2 prefetch; followed by the
#: tile count of a bounded one (``+prefetch4``).
PREFETCH_SUFFIX = "+prefetch"
#: ``WarpSplitKTactic.x_copy``: how activation stages arrive. 16-byte
#: ``cp.async`` copies by every activation-loader thread...
CP_ASYNC = "cp.async"
#: ...one bulk copy per token row and stage...
BULK = "bulk"
#: ...or TMA boxes.
TMA = "tma"
X_COPIES = (CP_ASYNC, BULK, TMA)
#: ``short()`` suffix of each activation copy but the default.
X_COPY_SUFFIXES = {BULK: "+bulk", TMA: "+tma"}
#: ``short()`` suffix of a mixed grid, followed by its count of half tiles.
HALF_SUFFIX = "+half"
#: Output tiles that may be mixed with tiles of half their rows (a half
#: tile must still be a whole number of 16-row mma blocks).
HALF_TILE_SOURCES = (32, 64)
#: Dynamic shared memory a block may opt into on sm_90 and sm_100.
SMEM_PER_BLOCK = layout.SMEM_PER_BLOCK
#: Shared memory of one SM, and what the driver reserves per resident block.
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
BLOCKS_PER_SM = 32
DEFAULT_SM_COUNT = 132


@functools.total_ordering
@dataclass(frozen=True)
class WarpSplitKTactic:
    """Compile-time parameters of one warp split-K kernel.

    output_tile: weight rows (output columns) per CTA, 16, 32, 48 or 64 (the
        wider tiles cut the activation re-reads per weight byte, for many
        tokens; 48 divides N where 32 and 64 do not, e.g. 3216 = 48 * 67).
    token_tile: token rows per CTA, 1, 2, 4, 8, 16 or 32; ``ceil(M /
        token_tile)`` CTAs share each weight tile. Below 8 (narrow tiles,
        for M <= 4) the activation stage holds only the tile's rows and the
        mma's other columns read duplicates that are never stored
        (``layout.stage_row``): smaller stages, a deeper ring for the same
        shared memory. Not with TMA boxes (a box has at least 8 rows).
    k_tile: K elements per pipeline stage, 128 or 256.
    stages: depth of the shared-memory rings, 1..32 (the tuner's base
        candidates at most 16).
    b_loader_warps: warps that load activations, 1 or 2.
    k_split: CTAs of a cluster splitting K, 1 or 2 (doubles the grid for
        shapes whose N leaves SMs idle; the default takes it where the
        nearest measured cells gained from it,
        ``warpsplitk.planning.measured_options``); 3 or 4 only where K needs
        them (past 2 x ``MAX_K_TILES`` tiles).
    early_launch: where the kernel triggers the next PDL kernel's launch.
        False: once its last activation tile is issued (late in the CTA's
        life when the ring is shallower than K). True: before its
        griddepcontrol.wait, so the next kernel's CTAs become resident and
        prefetch their weight while this grid still streams. Either way
        every read of x and write of out waits for the previous grid to
        complete, so the choice is speed only, and the tuner makes it per
        cell (docs/design-notes.md).
    l2_prefetch: what the weight loaders, once the ring's first fill is
        issued, ask L2 for (``cp.async.bulk.prefetch.L2``, one instruction
        per weight row): ``PREFETCH_OFF`` (0) nothing; ``PREFETCH_ALL``
        (-1) the rest of the CTA's K share; P in ``PREFETCH_TILES`` only P
        K tiles past the ring (fewer than remain). The weight does not
        depend on the previous kernel, so under PDL that stream can run
        while this CTA still waits for the previous grid, instead of only
        as fast as the ring drains after it. Legal only when the ring does
        not already hold the CTA's whole K share. A hint: it changes no
        result. On large weights the whole share queues ahead of the refills
        the running grid needs; a few tiles per CTA are what the gap
        between two calls can stream, and L2 keeps them.
    x_copy: how activation rows reach the ring (``X_COPIES``).
        ``CP_ASYNC`` ("cp.async", the default): every activation-loader
        thread issues 16-byte ``cp.async`` copies, rows past M zero-filled
        (``token_tile * k_tile / 8`` copies per stage, M or not). ``BULK``
        ("bulk"): one lane per token row inside M issues one
        ``cp.async.bulk`` of the row's stage slice, completing on the
        stage's barrier by byte count, into row-padded stages; rows past M
        are never written (their outputs are never stored); the copies
        follow the dependency wait, so their issue cost is on every call's
        critical path. ``TMA`` ("tma"): one lane issues ``k_tile / 64``
        copies of a ``[token_tile, 64]`` box of x per stage
        (``cp.async.bulk.tensor``, through a tensor map built per call from
        x's address and M), into 128-byte-swizzled stages; rows past M
        arrive as zeros: the same few instructions per stage at any M,
        where bulk copies need one per token row. Bulk and TMA copies take
        one activation warp.
    half_tiles: a mixed grid: the last ``half_tiles`` CTAs
        along N own ``output_tile / 2`` weight rows, the others
        ``output_tile``, so that N can spread evenly over the SMs where no
        single tile size does (3216 rows: 69 CTAs of 32 and 63 of 16, one
        per SM, instead of 201 CTAs of 16 on 132 SMs). Both tile paths are
        traced into one kernel, chosen by block index; shared memory is the
        larger tile's. output_tile 32 or 64; not with k_split. Depends on N,
        so it is never in ``all_tactics``.

    Tactics sort by output_tile, token_tile, k_tile, stages, b_loader_warps,
    k_split and early_launch, then without an L2 prefetch before with one,
    16-byte before TMA before bulk copies, by half_tiles, and last by the
    prefetch's bound (the whole share before bounded ones). Rankings break
    ties of predicted time by this order: it is part of what the default
    returns.
    """

    output_tile: int = 16
    token_tile: int = 8
    k_tile: int = 128
    stages: int = 4
    b_loader_warps: int = 1
    k_split: int = 1
    early_launch: bool = False
    l2_prefetch: int = PREFETCH_OFF
    x_copy: str = CP_ASYNC
    half_tiles: int = 0

    def _order(self) -> tuple:
        """The sort key (the class docstring's order)."""
        return (self.output_tile, self.token_tile, self.k_tile, self.stages,
                self.b_loader_warps, self.k_split, self.early_launch,
                self.l2_prefetch != PREFETCH_OFF, self.x_copy == BULK, self.x_copy == TMA,
                self.half_tiles, 0 if self.l2_prefetch == PREFETCH_ALL else self.l2_prefetch)

    def __lt__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._order() < other._order()

    @property
    def async_activation_ring(self) -> bool:
        """Activation stages written by the async proxy (TMA boxes or bulk
        copies): their release needs a cross-proxy fence (kernel/warp_splitk.py)."""
        return self.x_copy != CP_ASYNC

    @property
    def activation_layout(self) -> str:
        """The activation stage layout (``layout.B_LAYOUTS``): "tma" for TMA
        boxes, "padded" for bulk-copied rows, "swizzle" for 16-byte copies."""
        if self.x_copy == TMA:
            return "tma"
        return "padded" if self.x_copy == BULK else "swizzle"

    @property
    def threads(self) -> int:
        warps = layout.COMPUTE_WARPS + layout.A_LOADER_WARPS + self.b_loader_warps
        return warps * layout.WARP

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: both rings, reduction buffer, mbarriers."""
        return self.smem_plan.total

    @property
    def smem_plan(self) -> layout.SmemPlan:
        return layout.smem_plan(self.output_tile, self.token_tile, self.k_tile, self.stages,
                                self.k_split, self.activation_layout)

    def smem_plan_for(self, fp8: bool = False) -> layout.SmemPlan:
        """``smem_plan``, or with ``fp8`` the FP8-weight kernel's: weight
        stages of one byte per element, "pairs" activation stages."""
        if not fp8:
            return self.smem_plan
        return layout.smem_plan(self.output_tile, self.token_tile, self.k_tile, self.stages,
                                self.k_split, layout.FP8_ACTIVATION_LAYOUT, layout.FP8_BYTES)

    def one_loop_split(self, k: int, fp8: bool = False) -> bool:
        """``layout.one_loop_split`` of this tactic on ``k`` columns: every
        rank of its uneven K split runs one loop of the longest share."""
        return layout.one_loop_split(k // self.k_tile, self.k_split, self.l2_prefetch,
                                     self.x_copy == CP_ASYNC, fp8)

    @property
    def reduction_aliased(self) -> bool:
        """The ring is too deep for the reduction buffer beside it: the buffer
        lies over the rings (``layout.smem_plan``)."""
        return self.smem_plan.reduction_aliased

    def short(self) -> str:
        """``o,t,k,s,b`` as the CLI takes it (``o,t,k,s,b,c`` when k_split c > 1),
        then ``+early`` with the early PDL trigger, ``+prefetch`` with the L2
        prefetch of the whole K share (``+prefetchP`` bounded to P tiles),
        ``+bulk`` with bulk activation copies or ``+tma`` with TMA ones, and
        ``+halfH`` with H half tiles."""
        text = (f"{self.output_tile},{self.token_tile},{self.k_tile},"
                f"{self.stages},{self.b_loader_warps}")
        if self.k_split > 1:
            text = f"{text},{self.k_split}"
        if self.early_launch:
            text += EARLY_SUFFIX
        if self.l2_prefetch == PREFETCH_ALL:
            text += PREFETCH_SUFFIX
        elif self.l2_prefetch:
            text += f"{PREFETCH_SUFFIX}{self.l2_prefetch}"
        text += X_COPY_SUFFIXES.get(self.x_copy, "")
        return f"{text}{HALF_SUFFIX}{self.half_tiles}" if self.half_tiles else text

    @classmethod
    def parse(cls, text: str) -> "WarpSplitKTactic":
        """Inverse of :meth:`short`."""
        body = text.strip() if isinstance(text, str) else ""
        options = {}
        head, marker, count = body.rpartition(HALF_SUFFIX)
        if marker and count.isascii() and count.isdigit():
            body, options["half_tiles"] = head, int(count)
        # short()'s order, reversed
        for x_copy, suffix in X_COPY_SUFFIXES.items():
            if body.endswith(suffix):
                body, options["x_copy"] = body[:-len(suffix)], x_copy
                break
        head, marker, count = body.rpartition(PREFETCH_SUFFIX)
        if marker and count.isascii() and count.isdigit() and count[0] != "0":
            body, options["l2_prefetch"] = head, int(count)
        elif body.endswith(PREFETCH_SUFFIX):
            body, options["l2_prefetch"] = body[:-len(PREFETCH_SUFFIX)], PREFETCH_ALL
        if body.endswith(EARLY_SUFFIX):
            body, options["early_launch"] = body[:-len(EARLY_SUFFIX)], True
        try:
            fields = [int(v) for v in body.split(",")]
        except ValueError:
            fields = []
        if len(fields) not in (5, 6):
            raise ValueError(
                "a tactic is five integers 'output_tile,token_tile,k_tile,stages,"
                "b_loader_warps', then optionally k_split, then "
                f"optionally '{EARLY_SUFFIX}', '{PREFETCH_SUFFIX}', then "
                f"'{X_COPY_SUFFIXES[BULK]}' or '{X_COPY_SUFFIXES[TMA]}' in that order "
                f"('{PREFETCH_SUFFIX}P' for a bounded prefetch), "
                f"then optionally '{HALF_SUFFIX}H', "
                f"got {text!r}")
        return cls(*fields, **options)


def _member(value, allowed) -> bool:
    """``value`` is one of ``allowed`` and of its type: ``16.0`` or ``True``
    would pass ``in`` (``16.0 == 16``, ``True == 1``) and reach the compiler."""
    return type(value) is type(allowed[0]) and value in allowed


def _field_error(name, value, allowed):
    return ValueError(f"warp split-K tactic: {name} must be one of {allowed}, got {value!r}")


#: The values each field of a tactic takes, by type and value (``_member``),
#: in the order they are checked (stages, a range, between the two).
_TILE_VALUES = (("output_tile", OUTPUT_TILES), ("token_tile", TOKEN_TILES), ("k_tile", K_TILES))
_OPTION_VALUES = (("b_loader_warps", B_LOADER_WARPS), ("k_split", K_SPLITS),
                  ("early_launch", EARLY_LAUNCHES), ("l2_prefetch", L2_PREFETCHES),
                  ("x_copy", X_COPIES))


def _check_members(tactic, table) -> None:
    for name, allowed in table:
        value = getattr(tactic, name)
        if not _member(value, allowed):
            raise _field_error(name, value, allowed)


def not_a_tactic(value) -> ValueError:
    """The error for a value that is no ``WarpSplitKTactic``; a short form
    string is pointed at ``WarpSplitKTactic.parse``."""
    hint = (f" (WarpSplitKTactic.parse({value!r}) reads a short form)"
            if isinstance(value, str) else "")
    return ValueError(f"expected a WarpSplitKTactic, got {type(value).__name__}{hint}")


def _check_values(tactic) -> None:
    """``ValueError`` unless each field of ``tactic`` holds a value the kernel
    takes (``check_tactic`` adds the rules of their combinations and the weight's)."""
    if not isinstance(tactic, WarpSplitKTactic):
        raise not_a_tactic(tactic)
    _check_members(tactic, _TILE_VALUES)
    if type(tactic.stages) is not int or not 1 <= tactic.stages <= MAX_STAGES:
        raise ValueError(f"warp split-K tactic: stages must be in 1..{MAX_STAGES}, "
                         f"got {tactic.stages!r}")
    _check_members(tactic, _OPTION_VALUES)
    if type(tactic.half_tiles) is not int or tactic.half_tiles < 0:
        raise ValueError(f"warp split-K tactic: half_tiles must be a count >= 0, got "
                         f"{tactic.half_tiles!r}")


# The rules of check_tactic, in the order it applies them: each takes
# (tactic, n, k, swiglu), n and k as given (made ints where integral), and
# raises ValueError naming what it refuses.


def _one_lane_copies(t, n, k, swiglu):
    if t.x_copy != CP_ASYNC and t.b_loader_warps != 1:
        # one lane issues a stage's boxes; one lane per token row its bulk copies
        raise ValueError(f"warp split-K tactic: x_copy {t.x_copy!r} takes b_loader_warps 1, "
                         f"got {t.b_loader_warps}")


def _no_narrow_boxes(t, n, k, swiglu):
    if t.token_tile < layout.MMA_N and t.x_copy == TMA:
        # a TMA stage's boxes must start on 1024-byte boundaries (the
        # 128-byte swizzle), and a box of fewer than 8 rows is not one
        raise ValueError(f"warp split-K tactic: a narrow token_tile {t.token_tile} "
                         f"(< {layout.MMA_N}) does not take x_copy {TMA!r}")


def _even_thread_copies(t, n, k, swiglu):
    chunks = t.token_tile * t.k_tile // layout.CHUNK
    b_threads = t.b_loader_warps * layout.WARP
    if t.x_copy == CP_ASYNC and chunks % b_threads:
        # the 16-byte loader gives every activation thread the same number of
        # copies per stage
        raise ValueError(f"warp split-K tactic: a stage of token_tile {t.token_tile} x "
                         f"k_tile {t.k_tile} is {chunks} 16-byte copies, not a multiple "
                         f"of the {b_threads} threads of b_loader_warps {t.b_loader_warps}")


def _wide_tiles_take_k_tile_128(t, n, k, swiglu):
    if t.output_tile >= WIDE_TILE and t.k_tile != 128:
        # ptxas-driven: 48 or 64 rows x 256 K are 24-32 copies per weight-loader
        # thread per stage; ptxas 13.4 hoists their addresses into 150-255
        # registers and spills (measured on sm_90a). Wide tiles take k_tile 128.
        raise ValueError(f"warp split-K tactic: output_tile {t.output_tile} needs k_tile "
                         f"128 (got k_tile {t.k_tile}: the compiled kernel spills or "
                         "holds 150+ registers)")


def _rows_fill_n(t, n, k, swiglu):
    """N is whole tiles (of a mixed grid: half tiles and whole ones), below ``MAX_N``."""
    if t.half_tiles:
        if t.output_tile not in HALF_TILE_SOURCES:
            raise ValueError(f"warp split-K tactic: half_tiles needs output_tile in "
                             f"{HALF_TILE_SOURCES} (half tiles of whole 16-row blocks), got "
                             f"{t.output_tile}")
        if t.k_split > 1:
            raise ValueError(f"warp split-K tactic: half_tiles is for k_split 1, got "
                             f"{t.k_split}")
        half_rows = t.half_tiles * (t.output_tile // 2)
        if type(n) is not int or n <= half_rows or (n - half_rows) % t.output_tile:
            raise ValueError(f"warp split-K: with {t.half_tiles} half tiles of "
                             f"{t.output_tile // 2} rows, N must be {half_rows} plus a "
                             f"positive multiple of output_tile {t.output_tile}, got N={n!r}")
    elif type(n) is not int or n <= 0 or n % t.output_tile:
        raise ValueError(f"warp split-K: N must be a positive multiple of output_tile "
                         f"{t.output_tile}, got N={n!r}")
    _check_below_max_n(n)


def _k_fills_tiles(t, n, k, swiglu):
    """K is whole K tiles, split evenly (unevenly only past ``MAX_K_TILES``
    tiles), at most ``MAX_K_TILES`` per CTA."""
    if type(k) is not int or k <= 0 or k % t.k_tile:
        raise ValueError(f"warp split-K: K must be a positive multiple of k_tile "
                         f"{t.k_tile}, got K={k!r}")
    k_tiles = k // t.k_tile
    if k_tiles % t.k_split and k_tiles <= MAX_K_TILES:
        # (a mixed grid has k_split 1: no uneven split meets one)
        raise ValueError(f"warp split-K: k_split {t.k_split} must divide the {k_tiles} "
                         f"K tiles of K={k} (k_tile {t.k_tile}); an uneven split only past "
                         f"{MAX_K_TILES} tiles")
    # wider splits only where K needs them, whatever the tile (the tuner's
    # space and check_tactic agree); needed_k_split refuses a K none takes
    if t.k_split > OPTIONAL_K_SPLIT and needed_k_split(k) != t.k_split:
        raise ValueError(f"warp split-K: k_split {t.k_split} only where K needs that many "
                         f"CTAs (at most {MAX_K_TILES} tiles each, in the widest tile that "
                         f"divides K); K={k} needs {needed_k_split(k)}")
    if -(-k_tiles // t.k_split) > MAX_K_TILES:
        per_cta = "" if t.k_split == 1 else f" per CTA, k_split {t.k_split}"
        raise ValueError(f"warp split-K: K={k} is {-(-k_tiles // t.k_split)} tiles of {t.k_tile}"
                         f"{per_cta}; the unrolled compute loop takes at most {MAX_K_TILES} "
                         f"(K <= {MAX_K_TILES * t.k_tile * t.k_split}"
                         f"{_wider_split_hint(k, t)})")


def _wider_split_hint(k, t):
    """The split that takes K in ``t``'s tiles, for a refusal's message."""
    split = min_k_split(k, t.k_tile)
    return f"; a k_split of {split} takes it" if split and split > t.k_split else ""


def _cta_tiles(t, k):
    """The K tiles a CTA streams (the fewest, where the split is uneven), and
    how a message says "per CTA"."""
    per_cta = "" if t.k_split == 1 else f" per CTA (k_split {t.k_split})"
    return k // t.k_tile // t.k_split, per_cta


def _ring_within_k(t, n, k, swiglu):
    cta_tiles, per_cta = _cta_tiles(t, k)
    if t.stages > cta_tiles:
        raise ValueError(f"warp split-K: stages={t.stages} exceeds the {cta_tiles} "
                         f"K tiles{per_cta} of K={k} (k_tile {t.k_tile})")


def _prefetch_past_ring(t, n, k, swiglu):
    """The L2 prefetch asks for K tiles the ring does not hold; a bounded one
    for fewer than all of them."""
    cta_tiles, per_cta = _cta_tiles(t, k)
    if t.l2_prefetch and t.stages >= cta_tiles:
        raise ValueError(f"warp split-K: l2_prefetch needs more K tiles{per_cta} than ring "
                         f"stages; the {t.stages}-stage ring already holds all {cta_tiles} "
                         f"of K={k} (k_tile {t.k_tile}), leaving nothing to prefetch")
    if t.l2_prefetch > 0 and t.stages + t.l2_prefetch >= cta_tiles:
        raise ValueError(f"warp split-K: l2_prefetch {t.l2_prefetch} tiles past a "
                         f"{t.stages}-stage ring reaches the end of the {cta_tiles} K "
                         f"tiles{per_cta} of K={k}: that is the whole-remainder prefetch, "
                         f"l2_prefetch PREFETCH_ALL ({PREFETCH_ALL})")


def _ring_of_two(t, n, k, swiglu):
    cta_tiles, per_cta = _cta_tiles(t, k)
    if t.stages == 1 and cta_tiles > 1:
        raise ValueError(f"warp split-K: a one-stage ring serialises load and compute; "
                         f"K={k} spans {cta_tiles} tiles{per_cta}, use stages >= 2")


def _fits_shared_memory(t, fp8):
    # an FP8 weight's stages are half the bytes: deeper rings fit
    smem = t.smem_plan_for(fp8).total
    if smem > SMEM_PER_BLOCK:
        raise ValueError(f"warp split-K: tactic {t.short()} needs {smem} B of shared "
                         f"memory, over the {SMEM_PER_BLOCK} B a block may use")


def _swiglu_takes_one_tile_size(t, n, k, swiglu):
    if swiglu and t.half_tiles:
        raise ValueError(f"warp split-K: the SwiGLU epilogue pairs the gate and up halves of "
                         f"every CTA's {t.output_tile} rows; a mixed grid (half_tiles "
                         f"{t.half_tiles}) has CTAs of other sizes")


_RULES = (_one_lane_copies, _no_narrow_boxes, _even_thread_copies, _wide_tiles_take_k_tile_128,
          _rows_fill_n, _k_fills_tiles, _ring_within_k, _prefetch_past_ring, _ring_of_two)


#: the narrowest tile of an FP8 weight with the SwiGLU epilogue: 16 gate rows and 16 up rows
FP8_SWIGLU_MIN_TILE = 2 * layout.MMA_M


def _fp8_rules(t, swiglu):
    """What the FP8-weight kernel takes beyond the BF16 one's rules."""
    if t.x_copy != CP_ASYNC:
        # its activation stage is laid out for its 8-byte B loads
        # (layout.swizzle_pairs), which bulk rows and TMA boxes are not
        raise ValueError(f"warp split-K tactic: FP8 weights take x_copy {CP_ASYNC!r}, "
                         f"got {t.x_copy!r}")
    if swiglu and t.output_tile < FP8_SWIGLU_MIN_TILE:
        # a block scale is one per 16-row MMA block: its rows must all be
        # gate or all up rows, so each half of the tile has 16 or more
        raise ValueError(f"warp split-K tactic: FP8 weights with the SwiGLU epilogue take "
                         f"output_tile {FP8_SWIGLU_MIN_TILE} or more, got {t.output_tile}")


def check_tactic(tactic: WarpSplitKTactic, n: int, k: int, *, swiglu: bool = False,
                 fp8: bool = False) -> None:
    """Raise ``ValueError`` naming the first rule ``tactic`` breaks for an
    ``[n, k]`` weight (with ``swiglu``: a ``[gate; up]`` weight run with the
    SwiGLU epilogue, ``n / 2`` outputs; with ``fp8``: e4m3 weights). N and
    K may be any integral type."""
    _check_values(tactic)
    n, k = as_integer(n, n), as_integer(k, k)
    for rule in _RULES:
        rule(tactic, n, k, swiglu)
    _fits_shared_memory(tactic, fp8)
    _swiglu_takes_one_tile_size(tactic, n, k, swiglu)
    if fp8:
        _fp8_rules(tactic, swiglu)


def is_legal(tactic: WarpSplitKTactic, n: int, k: int, *, swiglu: bool = False,
             fp8: bool = False) -> bool:
    try:
        check_tactic(tactic, n, k, swiglu=swiglu, fp8=fp8)
    except ValueError:
        return False
    return True


def all_tactics(k_splits=(1,), early_launches=(False,), l2_prefetches=(PREFETCH_OFF,),
                x_copies=(CP_ASYNC,)):
    """Every tactic of the kernel's space, legal for some shape or not (with
    ``k_splits=K_SPLITS``, the cluster split of K too; with
    ``early_launches=EARLY_LAUNCHES``, both PDL trigger points; with
    ``l2_prefetches=L2_PREFETCHES``, the L2 prefetch of the whole K share and
    its bounded forms too; with ``x_copies=X_COPIES``, bulk and TMA
    activation copies too). Narrow token tiles come with 16-byte copies only."""
    for o, t, kt, s, b, c, e, f, x in itertools.product(
            OUTPUT_TILES, TOKEN_TILES, K_TILES, range(1, MAX_STAGES + 1), B_LOADER_WARPS,
            k_splits, early_launches, l2_prefetches, x_copies):
        if x != CP_ASYNC and b > 1:
            continue  # never legal (check_tactic)
        if t < layout.MMA_N and (x != CP_ASYNC or (t * kt // layout.CHUNK) % (b * layout.WARP)):
            continue  # a narrow token tile: 16-byte copies, as many per thread
        yield WarpSplitKTactic(o, t, kt, s, b, c, e, f, x)


def legal_tactics(m: int, n: int, k: int, k_splits=(1,), early_launches=(False,),
                  l2_prefetches=(PREFETCH_OFF,), x_copies=(CP_ASYNC,)) -> list[WarpSplitKTactic]:
    """The tuning space for one shape: legal tactics whose token tile is no
    larger than the mma-wide tile needed to cover ``m`` in one tile (a bigger
    tile only loads zeros); narrow tiles included. A K that needs a split
    (``needed_k_split``) gets it whatever ``k_splits`` says. ``ValueError``
    for an M, N or K ``default_tactic`` refuses."""
    m = check_m(m)
    n, k = check_shape(n, k)
    need = min(t for t in MMA_TOKEN_TILES if t >= m)
    k_splits = tuple(sorted(set(k_splits) | {needed_k_split(k)}))
    return [t for t in all_tactics(k_splits, early_launches, l2_prefetches, x_copies)
            if t.token_tile <= need and is_legal(t, n, k)]


def needed_k_split(k: int) -> int:
    """The fewest CTAs along K any tactic for K needs: 1 up to ``MAX_K_TILES``
    tiles of 256, then as many as keep each CTA's share within them (up to
    ``MAX_K_SPLIT``); ``ValueError`` (``shape_refusal``'s reason) for a K no
    tactic takes."""
    splits = [s for s in (min_k_split(k, width) for width in K_TILES) if s]
    if not splits:
        raise ValueError(f"warp split-K: {shape_refusal(layout.MMA_M, k)}")
    return min(splits)


def check_m(m) -> int:
    """``m`` as an int; ``ValueError`` unless it is an integer in 1..32."""
    value = as_integer(m)
    if value is None or not 1 <= value <= MAX_M:
        raise ValueError(f"warp split-K: M must be in 1..{MAX_M}, "
                         f"got {m if value is None else value!r}")
    return value


def check_ms(ms) -> tuple[int, ...]:
    """``ms``, an iterable of token counts, as a sorted tuple of ints without
    repeats; ``ValueError`` unless each is an integer in 1..32."""
    try:
        items = list(ms)
    except TypeError:
        raise ValueError(f"ms must be an iterable of Ms in 1..{MAX_M}, got {ms!r}") from None
    return tuple(sorted({check_m(m) for m in items}))


# ------------------------------------------------------- occupancy model


#: Registers per thread ptxas 13.4 allots each tactic family for sm_90a (the
#: CTA's maximum over its warp roles), measured with ``compile_for_arch``: the
#: most over K = 4 tiles and K = 7168, since the pressure of the unrolled loop
#: varies with the K-tile count. Kernel ABI with
#: pointer arguments (2026-12-02). Keyed (output_tile, token_tile, k_tile,
#: b_loader_warps). Feeds the residency model only.
MEASURED_REGISTERS = {
    (16, 8, 128, 1): 34, (16, 8, 128, 2): 34, (16, 8, 256, 1): 52, (16, 8, 256, 2): 40,
    (16, 16, 128, 1): 40, (16, 16, 128, 2): 34, (16, 16, 256, 1): 80, (16, 16, 256, 2): 48,
    (16, 32, 128, 1): 88, (16, 32, 128, 2): 58, (16, 32, 256, 1): 196, (16, 32, 256, 2): 80,
    (32, 8, 128, 1): 40, (32, 8, 128, 2): 40, (32, 8, 256, 1): 72, (32, 8, 256, 2): 64,
    (32, 16, 128, 1): 54, (32, 16, 128, 2): 48, (32, 16, 256, 1): 92, (32, 16, 256, 2): 64,
    (32, 32, 128, 1): 80, (32, 32, 128, 2): 72, (32, 32, 256, 1): 196, (32, 32, 256, 2): 94,
    (64, 8, 128, 1): 72, (64, 8, 128, 2): 64, (64, 16, 128, 1): 72, (64, 16, 128, 2): 76,
    (64, 32, 128, 1): 158, (64, 32, 128, 2): 130, (48, 8, 128, 1): 56, (48, 8, 128, 2): 61,
    (48, 16, 128, 1): 64, (48, 16, 128, 2): 61, (48, 32, 128, 1): 108, (48, 32, 128, 2): 92,
}


#: The same with TMA activation boxes (``x_copy`` TMA, one activation warp that
#: holds no copy addresses), keyed (output_tile, token_tile, k_tile): the
#: one-warp 16-byte loader's address registers are what set 196 for 16- and
#: 32-row tiles of 32 tokens x 256 above; with boxes the compute warps do.
MEASURED_REGISTERS_TMA = {
    (16, 8, 128): 32, (16, 8, 256): 40, (16, 16, 128): 32, (16, 16, 256): 40,
    (16, 32, 128): 46, (16, 32, 256): 55, (32, 8, 128): 40, (32, 8, 256): 72,
    (32, 16, 128): 52, (32, 16, 256): 72, (32, 32, 128): 69, (32, 32, 256): 78,
    (48, 8, 128): 56, (48, 16, 128): 56, (48, 32, 128): 84, (64, 8, 128): 72,
    (64, 16, 128): 72, (64, 32, 128): 102,
}


def register_estimate(tactic: WarpSplitKTactic) -> int:
    # a narrow token tile runs the 8-row tile's mma code with fewer copies
    token_tile = max(tactic.token_tile, layout.MMA_N)
    if tactic.x_copy == TMA:
        measured = MEASURED_REGISTERS_TMA.get(
            (tactic.output_tile, token_tile, tactic.k_tile), 128)
    else:
        key = (tactic.output_tile, token_tile, tactic.k_tile, tactic.b_loader_warps)
        measured = MEASURED_REGISTERS.get(key, 128)
    # registers are allocated in units of 8 per thread
    return -(-measured // 8) * 8


def ctas_per_sm(tactic: WarpSplitKTactic, fp8: bool = False) -> int:
    """CTAs of this tactic one SM holds at once (shared memory, threads,
    registers; with ``fp8``, the FP8-weight kernel's shared memory,
    ``smem_plan_for``); ``ValueError`` for what is no tactic of the kernel's
    space."""
    if not isinstance(tactic, WarpSplitKTactic):  # before the cache: a list is unhashable
        raise not_a_tactic(tactic)
    return _ctas_per_sm(tactic, bool(fp8))


@functools.lru_cache(maxsize=65536)  # a pure function of the (frozen) tactic
def _ctas_per_sm(tactic, fp8):
    _check_values(tactic)  # once per distinct tactic: the cache keeps hot loops cheap
    by_smem = SMEM_PER_SM // (tactic.smem_plan_for(fp8).total + SMEM_RESERVED_PER_BLOCK)
    by_threads = THREADS_PER_SM // tactic.threads
    # (the BF16 kernel's registers for both: none measured of the FP8 kernel)
    by_regs = REGISTERS_PER_SM // (register_estimate(tactic) * tactic.threads)
    return max(0, min(by_smem, by_threads, by_regs, BLOCKS_PER_SM))


def grid_ctas(tactic: WarpSplitKTactic, m: int, n: int) -> int:
    full, half = layout.row_tiles(n, tactic.output_tile, tactic.half_tiles)
    return (full + half) * -(-m // tactic.token_tile) * tactic.k_split


def waves(tactic: WarpSplitKTactic, m: int, n: int, sm_count: int = DEFAULT_SM_COUNT,
          fp8: bool = False) -> float:
    """Grid CTAs over the CTAs the whole GPU holds at once (``fp8``: the
    FP8-weight kernel's)."""
    return grid_ctas(tactic, m, n) / (sm_count * max(1, ctas_per_sm(tactic, fp8)))


def sm_balance(tactic: WarpSplitKTactic, m: int, n: int,
               sm_count: int = DEFAULT_SM_COUNT, fp8: bool = False) -> float:
    """Bytes the busiest SM reads through L2 over the mean per SM (1.0: all
    equal), with CTAs dealt to SMs in launch order, one wave: a CTA reads its
    weight rows and its token rows inside M, each K long (its K share with
    k_split). 3216x7168 at M = 32, 201 CTAs of 16 rows: 69 SMs read two
    CTAs' (2 x (16 + 32) rows), 1.31; the mixed grid of 69 x 32 and 63 x 16
    rows, one CTA per SM: 1.13. Idle SMs count in the mean (82 CTAs of 32
    rows: 1.61), so a grid smaller than the GPU shows as unbalanced too.
    ``fp8``: weight rows of one byte per element, x rows of two."""
    weight_row = 0.5 if fp8 else 1.0  # a weight row's bytes per x row's
    full, half = layout.row_tiles(n, tactic.output_tile, tactic.half_tiles)
    load = [0.0] * sm_count
    cta = 0
    for _ in range(tactic.k_split):
        for token_tile in range(-(-m // tactic.token_tile)):
            tokens = min(tactic.token_tile, m - token_tile * tactic.token_tile)
            for tile_n in range(full + half):
                rows, _ = layout.cta_rows(tile_n, tactic.output_tile, full)
                load[cta % sm_count] += (rows * weight_row + tokens) / tactic.k_split
                cta += 1
    return max(load) / (sum(load) / sm_count)


def l2_read_factor(tactic: WarpSplitKTactic, m: int, fp8: bool = False) -> float:
    """Bytes the grid reads through L2 per byte of weight streamed from HBM.

    Each of the ``ceil(M / token_tile)`` CTAs of an output tile reads the
    whole weight tile, and every CTA reads its tokens' rows of x (rows past M
    are zero-filled, not read): ``ceil(M / token_tile) + M / output_tile``.
    At 1 the weight stream is all there is; at M = 32 with 16-row tiles x
    alone is twice the weight, and L2, not HBM, sets the time. ``fp8``: a
    weight of one byte per element, so x counts twice.
    """
    m = check_m(m)
    return -(-m // tactic.token_tile) + (2 if fp8 else 1) * m / tactic.output_tile


def _device_sm_count():
    try:
        import torch  # here, not at the top: `import warpsplitk` stays torch-free
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # pragma: no cover - torch missing or broken
        pass
    return DEFAULT_SM_COUNT


def resolve_sm_count(sm_count):
    """``sm_count``, checked; None: the current GPU's (``DEFAULT_SM_COUNT`` without one)."""
    if sm_count is None:
        return _device_sm_count()
    if type(sm_count) is not int or sm_count < 1:
        raise ValueError(f"sm_count must be a positive integer (the GPU's SMs), got {sm_count!r}")
    return sm_count


def _check_below_max_n(n):
    if n >= MAX_N:
        raise ValueError(f"warp split-K: {n_bound_refusal(n)}")


def check_shape(n, k) -> tuple[int, int]:
    """``(n, k)`` as ints; ``ValueError`` with ``shape_refusal``'s reason."""
    reason = shape_refusal(n, k)
    if reason is not None:
        raise ValueError(f"warp split-K: {reason}")
    return operator.index(n), operator.index(k)
