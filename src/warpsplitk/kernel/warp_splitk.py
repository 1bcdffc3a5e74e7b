"""The warp split-K BF16 GEMM for decode, in the CuTe DSL.

``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` for M <= 32.

One CTA owns ``output_tile`` weight rows and ``token_tile`` token rows and
walks its K through two shared-memory rings of ``stages`` slots, one for the
weight (operand A of ``mma.sync.m16n8k16``) and one for the activations
(operand B). Its warps have fixed roles:

* warps 0-3, compute (:meth:`WarpSplitKKernel.compute`): each owns one
  quarter of every stage's K slice, so all four consume every stage at once
  and accumulate partial sums of the whole output tile (warp split-K). At
  the end the partials meet in a padded shared buffer, the 128 compute
  threads add them in warp order (bitwise reproducible) and store BF16.
* warps 4-5, weight loader (:meth:`WarpSplitKKernel.weight_loader`): 16-byte
  ``cp.async.cg`` copies carrying an L2 evict_first policy. The weight is read
  once; the activations are read by every CTA of a row of tiles, so the
  weight must not push them out of L2.
* warps 6(-7), activation loader: 16-byte ``cp.async`` copies with rows past
  M zero-filled (:meth:`~WarpSplitKKernel.activation_loader`); with
  ``x_copy`` bulk one bulk copy per token row inside M into row-padded stages
  (:meth:`~WarpSplitKKernel.activation_bulk`); with ``x_copy`` tma ``k_tile / 64``
  TMA boxes per stage through a tensor map of x built on the host at every
  call (:meth:`~WarpSplitKKernel.activation_tma`).

Each stage has three mbarriers: ``full_a`` / ``full_b`` complete when a
stage's copies land (``cp.async.mbarrier.arrive.noinc`` by every loader
thread, or the bulk/TMA bytes) and ``empty`` when every compute lane is done
with it.

PDL: the weight does not depend on the previous kernel in the stream, so the
weight loaders issue their first tile before the barriers even exist. Only
the activation loaders ``griddepcontrol.wait``; they let the next kernel
launch (``launch_dependents``) once their last tile is issued, or before
their wait with ``early_launch``. The compute warps write ``out`` after
consuming activation tiles, hence after the previous grid has completed: the
overlap is safe for chained projections. (A weight rewritten by the kernel
right before is not ordered; decode weights are constants.)

``k_split`` c: a cluster of c CTAs shares each output tile, each streaming
its share of K (uneven shares: for FP8 weights with row copies of x and
no L2 prefetch one loop of the longest share, a shorter rank's last tile
zero-filled; otherwise a traced view per rank). The others store
their partial sums into the first one's shared memory with ``st.async``,
whose bytes complete an mbarrier there; only the first CTA waits, adds all
4c warps' partials and stores.

``half_tiles``: a mixed grid whose last CTAs along N run the same roles for
half as many weight rows (:meth:`~WarpSplitKKernel.body` traces both).

``l2_prefetch``: once the weight ring's first fill is issued, each weight
loader thread asks L2 for the rest of one tile row's K share (or, bounded,
``l2_prefetch`` K tiles of it) with one ``cp.async.bulk.prefetch.L2``, so
that stream does not wait for the ring to drain.

The compute loop is unrolled over the static K-tile count, so every ring
slot, parity and stage offset is a constant and every ``ldmatrix`` address is
a per-lane register plus an immediate. All address math is ``layout.py``'s,
which the NumPy emulator (``emulator.py``) runs too.
"""

from __future__ import annotations

import copy
import dataclasses

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda_driver
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from . import layout, ptx
from ..tactics import BULK, TMA, WarpSplitKTactic

_BYTES = layout.ELEMENT_BYTES


class WarpSplitKKernel:
    """One compiled kernel per (N, K, tactic, bias?, SwiGLU?, PDL?); M is dynamic.

    With ``swiglu`` the weight is ``[gate; up]`` (N = 2 I rows) and the
    kernel writes ``silu(x @ gate^T) * (x @ up^T)``, ``[M, I]``: each CTA
    streams the gate rows of its outputs and the matching up rows
    (``layout.weight_row``), so both sums of an output meet in its own
    reduction buffer and the activation costs no extra pass over memory."""

    #: e4m3 weights (``WarpSplitKFp8Kernel``): byte stages, converted in registers
    fp8 = False

    def __init__(self, tactic: WarpSplitKTactic, n: int, k: int, *, has_bias: bool = False,
                 use_pdl: bool = True, swiglu: bool = False):
        t = tactic
        self.tactic = t
        self.n, self.k = n, k
        self.has_bias = has_bias
        self.use_pdl = use_pdl
        self.swiglu = swiglu
        self.weight_bytes = layout.FP8_BYTES if self.fp8 else _BYTES
        self.b_layout = layout.FP8_ACTIVATION_LAYOUT if self.fp8 else t.activation_layout
        self.out_columns = n // 2 if swiglu else n
        # k_split > 1: a cluster of k_split CTAs shares each output tile, CTA
        # (rank) r streaming K columns [r * k_cta, (r + 1) * k_cta)
        self.k_split = t.k_split
        self.split = t.k_split > 1
        self.k_cta = k // t.k_split
        self.k_tiles = self.k_cta // t.k_tile
        # k_first None: an even split, rank r's K share at r * k_cta
        self.k_first = None
        # an uneven split of FP8 weights with row copies of x and no L2
        # prefetch: every rank runs one loop of the longest share, a shorter
        # rank's last tile zero-filled (layout.one_loop_split): a third of
        # the code of a loop per rank
        self.one_loop = t.one_loop_split(k, self.fp8)
        if self.one_loop:  # rank 0's share is the longest
            self.k_tiles = layout.k_share(0, k // t.k_tile, t.k_split)[1]
        self.smem = t.smem_plan_for(self.fp8)
        self.a_threads = layout.A_LOADER_WARPS * layout.WARP
        self.b_threads = t.b_loader_warps * layout.WARP
        self.compute_threads = layout.COMPUTE_WARPS * layout.WARP
        self.threads = t.threads
        # a mixed grid (half_tiles): the last CTAs along N run a view of this
        # kernel with half the output tile, in this kernel's shared memory
        # plan (the larger one) and with its barriers
        self.full_tiles, self.half_tiles = layout.row_tiles(n, t.output_tile, t.half_tiles)
        self.half_view = None
        if t.half_tiles:
            half = copy.copy(self)
            half.tactic = dataclasses.replace(t, output_tile=t.output_tile // 2, half_tiles=0)
            self.half_view = half
        # an uneven split (K tiles past 64 that k_split does not divide; no
        # mixed grid) not run as one loop (above): each rank runs a view of
        # this kernel with its own static K share (layout.k_share), in the
        # same shared memory plan and barriers
        self.rank_views = None
        if t.k_split > 1 and (k // t.k_tile) % t.k_split and not self.one_loop:
            views = []
            for rank in range(t.k_split):
                view = copy.copy(self)
                first, view.k_tiles = layout.k_share(rank, k // t.k_tile, t.k_split)
                view.k_first = first * t.k_tile
                views.append(view)
            self.rank_views = views

    # ------------------------------------------------------------ launch

    @cute.jit
    def __call__(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
                 out: cute.Pointer, m: Int32, stream: cuda_driver.CUstream):
        # Base addresses and M are all the kernel uses of its operands (their
        # layouts are packed row-major by contract, checked by the caller), so
        # it takes pointers: a pointer argument costs the host ~1 us to build,
        # a DLPack tensor view with a dynamic extent ~20 us.
        t = self.tactic
        if cutlass.const_expr(t.x_copy == TMA):
            # The tensor map of x: built here, on the host, at every call (x's
            # address and M change between calls), and passed by value as a
            # kernel parameter, so a captured graph replays the map it was
            # captured with. Rows past M read as zeros.
            x_tensor = cute.make_tensor(x, cute.make_layout((m, self.k), stride=(self.k, 1)))
            tma_atom, tma_x = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), x_tensor, self._tma_box_layout(),
                (t.token_tile, layout.TMA_BOX_COLS))
            launch = self.kernel_tma(weight, x, bias, out, m, tma_atom, tma_x)
        else:
            launch = self.kernel(weight, x, bias, out, m)
        self._launch(launch, m, stream)

    def _launch(self, launch, m, stream):
        """Launch a traced kernel: one CTA per output tile, token tile and
        (k_split) share of K, the cluster, shared memory and PDL."""
        token_tiles = (m + (self.tactic.token_tile - 1)) // self.tactic.token_tile
        cluster = {"cluster": [1, 1, self.k_split]} if self.split else {}
        launch.launch(
            grid=[self.full_tiles + self.half_tiles, token_tiles, self.k_split],
            block=[self.threads, 1, 1],
            **cluster,
            smem=self.smem.total,
            stream=stream,
            use_pdl=self.use_pdl,
            # No `.minnctapersm` hint: with one, ptxas 13.4 spilled at register
            # counts it reaches without spilling when left free.
            # rings over L1: cp.async.cg bypasses L1 anyway
            preferred_smem_carveout=100,
        )

    def _tma_box_layout(self):
        """One ``[token_tile, 64]`` TMA box in shared memory: 128-byte rows
        under the 128-byte swizzle (``layout.tma_swizzle``); the swizzle is
        given in bytes (3 bits of 16-byte chunks, XORed from 128-byte rows)."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 4, 3), 0,
            cute.make_layout((8, layout.TMA_BOX_COLS), stride=(layout.TMA_BOX_COLS, 1)))
        return cute.tile_to_shape(atom, (self.tactic.token_tile, layout.TMA_BOX_COLS), (0, 1))

    # ------------------------------------------------------------ kernel

    @cute.kernel
    def kernel(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
               out: cute.Pointer, m: Int32):
        self.body(weight, x, bias, out, m, None)

    @cute.kernel
    def kernel_tma(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
                   out: cute.Pointer, m: Int32, tma_atom: cute.CopyAtom, tma_x: cute.Tensor):
        self.body(weight, x, bias, out, m, (tma_atom, tma_x))

    @cute.jit
    def body(self, weight, x, bias, out, m, tma):
        """The kernel, with or without a TMA atom and tensor map of x. A
        mixed grid (half_tiles) traces the roles twice, once per tile size,
        and each CTA runs the one its block index selects (the branch is
        uniform over the CTA)."""
        tidx, _, _ = cute.arch.thread_idx()
        tile_n, tile_t, rank = cute.arch.block_idx()  # rank: in the cluster (grid z = k_split)
        storage = cutlass.memory.SmemAllocator().allocate_array(
            cutlass.Int8, self.smem.total, byte_alignment=1024)
        smem = storage.toint()
        if cutlass.const_expr(self.rank_views is not None):
            # an uneven split (no mixed grid): each rank its own K share
            self.rank_roles(0, smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank)
        elif cutlass.const_expr(self.half_view is None):
            self.roles(smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank)
        else:
            if tile_n < self.full_tiles:
                self.roles(smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank)
            else:
                # rows from full_tiles * output_tile on, in half-tile units
                # (layout.cta_rows)
                self.half_view.roles(smem, weight, x, bias, out, m, tma, tidx,
                                     layout.half_tile_index(tile_n, self.full_tiles), tile_t,
                                     rank)

    @cute.jit
    def rank_roles(self, first, smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank):
        """An uneven split: the roles of the view of ``rank`` among
        ``rank_views[first:]``, one branch per rank (the last view takes the
        rest: with two ranks, ``rank == 0`` or not)."""
        if cutlass.const_expr(first == len(self.rank_views) - 1):
            self.rank_views[first].roles(smem, weight, x, bias, out, m, tma, tidx, tile_n,
                                         tile_t, rank)
        else:
            if rank == first:
                self.rank_views[first].roles(smem, weight, x, bias, out, m, tma, tidx, tile_n,
                                             tile_t, rank)
            else:
                self.rank_roles(first + 1, smem, weight, x, bias, out, m, tma, tidx, tile_n,
                                tile_t, rank)

    @cute.jit
    def roles(self, smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank):
        """Barriers, then each warp to its role, for weight rows
        ``tile_n * output_tile`` on."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first_a_warp = layout.COMPUTE_WARPS
        first_b_warp = first_a_warp + layout.A_LOADER_WARPS
        is_a_loader = warp >= first_a_warp and warp < first_b_warp

        # The weight does not depend on the previous kernel: tile 0 is in
        # flight before the barriers exist. Plain cp.async here (see ptx.py).
        if is_a_loader:
            self.issue_weight_tile(smem, weight, tidx - first_a_warp * layout.WARP, tile_n, 0,
                                   Int64(0), hinted=False, rank=rank)
        if tidx == 0:
            self.init_barriers(smem, rank)
        ptx.named_barrier(0, self.threads)
        if cutlass.const_expr(self.split):
            # cluster barrier phase 0, waited on before the first remote
            # operation: the first CTA's shared memory and mbarrier may be
            # written only once it runs and has initialised them (the init
            # fence orders thread 0's mbarrier.init before this arrival)
            ptx.cluster_arrive_relaxed()

        if warp < first_a_warp:
            self.compute(smem, tidx, warp, tile_n, tile_t, m, bias, out, rank)
        elif is_a_loader:
            self.weight_loader(smem, weight, tidx - first_a_warp * layout.WARP, tile_n, rank)
        elif cutlass.const_expr(self.tactic.x_copy == TMA):
            self.activation_tma(smem, tma, tidx - first_b_warp * layout.WARP, tile_t, rank)
        elif cutlass.const_expr(self.tactic.x_copy == BULK):
            self.activation_bulk(smem, x, tidx - first_b_warp * layout.WARP, tile_t, m, rank)
        else:
            self.activation_loader(smem, x, tidx - first_b_warp * layout.WARP, tile_t, m, rank)

    # ----------------------------------------------------- trace helpers
    # Plain Python from here on (but the two TMA helpers): not rewritten by
    # the DSL's preprocessor, so their loops unroll at trace time and their
    # branches are trace-time constants.

    def init_barriers(self, smem, rank):
        copy_engine_x = self.tactic.async_activation_ring
        for stage in range(self.tactic.stages):
            ptx.mbarrier_init(self._barrier(smem, self.smem.full_a, stage), self.a_threads)
            # bulk or TMA copies: one arrival (the local expect_tx) plus the stage's bytes
            ptx.mbarrier_init(self._barrier(smem, self.smem.full_b, stage),
                              1 if copy_engine_x else self.b_threads)
            ptx.mbarrier_init(self._barrier(smem, self.smem.empty, stage), self.compute_threads)
        if self.split:
            ptx.mbarrier_init(smem + self.smem.partials, 1)
        if cutlass.const_expr(self.smem.ring_free is not None):
            # the first CTA's one remote arrival: its ring is read (only the
            # others wait on theirs)
            ptx.mbarrier_init(smem + self.smem.ring_free, 1)
        ptx.fence_mbarrier_init()
        if self.split:
            # the first CTA expects every other CTA's partials: one arrival
            # (this one) and their bytes. The others' barrier is never
            # waited on. No st.async can land before this: each sender first
            # waits on cluster barrier phase 0, which this thread's arrival
            # (after it) completes.
            t = self.tactic
            ptx.mbarrier_arrive_expect_tx_if(
                smem + self.smem.partials,
                (self.k_split - 1) * layout.split_partial_bytes(t.output_tile, t.token_tile),
                cutlass.select_(rank == 0, Int32(1), Int32(0)))

    def _barrier(self, smem, region, stage):
        return smem + region + stage * layout.MBARRIER_BYTES

    def _k_base(self, rank, element_bytes=_BYTES):
        """Byte offset of this CTA's share of K within a row (of x, or of the
        weight with its ``element_bytes``): static in a rank's view of an
        uneven split."""
        if self.k_first is not None:
            return Int64(self.k_first * element_bytes)
        if self.one_loop:
            return Int64(self._one_loop_first_column(rank)) * element_bytes
        return Int64(rank) * (self.k_cta * element_bytes)

    def _one_loop_first_column(self, rank):
        """One loop for every rank (``layout.one_loop_split``): the first K
        column of ``rank``'s share, ``layout.k_share``'s first tile at run time."""
        base, extra = divmod(self.k // self.tactic.k_tile, self.k_split)
        r = Int32(rank)
        return (r * base + cutlass.select_(r < extra, r, Int32(extra))) * self.tactic.k_tile

    def _tile_present(self, rank, k_tile_index):
        """None where K tile ``k_tile_index`` of the loop is in every rank's
        share; else (the last tile of one loop for every rank) 1 where it is
        in ``rank``'s and 0 where it is past it, at run time
        (``layout.split_tile_present``)."""
        if not self.one_loop:
            return None
        base, extra = divmod(self.k // self.tactic.k_tile, self.k_split)
        if k_tile_index < base:
            return None
        return cutlass.select_(Int32(rank) < extra, Int32(1), Int32(0))

    # ---------------------------------------------------- weight loader

    def issue_weight_tile(self, smem, weight, thread, tile_n, k_tile_index, policy, hinted,
                          rank=None):
        t = self.tactic
        stage, _ = layout.ring_slot(k_tile_index, t.stages)
        # the tile's first weight row: tile_n * rows (with the SwiGLU
        # epilogue, tile_n * rows / 2 of the gate half)
        tile_rows = layout.output_rows(t.output_tile, self.swiglu)
        wb = self.weight_bytes
        base = weight.toint() + Int64(tile_n) * (tile_rows * self.k * wb)
        if self.split:
            base = base + self._k_base(rank, wb)
        elements = layout.FP8_CHUNK if self.fp8 else layout.CHUNK
        present = self._tile_present(rank, k_tile_index)
        for chunk in range(layout.copies_per_thread(t.output_tile, t.k_tile, self.a_threads,
                                                    elements)):
            row, col = layout.loader_copy(thread, chunk, t.k_tile, self.a_threads, elements)
            # one expression, in this order: the BF16 kernel's PTX is pinned
            dst = (smem + self.smem.a_ring + stage * self.smem.a_stage_bytes
                   + (layout.fp8_swizzle(row, col, t.k_tile) if self.fp8
                      else layout.swizzle(row, col, t.k_tile) * _BYTES))
            src = base + Int64((row * self.k + col) * wb) + k_tile_index * t.k_tile * wb
            if self.swiglu:
                # up rows: the same outputs' rows in the second half of W
                first_row, _ = layout.loader_copy(0, chunk, t.k_tile, self.a_threads, elements)
                src = src + layout.swiglu_row_shift(first_row, t.output_tile, self.n) * (
                    self.k * wb)
            if present is not None:
                # a tile past this rank's share: nothing read, zeros stored,
                # the address kept at the weight's start
                src = cutlass.select_(present != 0, src, weight.toint())
                ptx.cp_async_16_hinted_zfill(dst, src, policy, present * 16)
            elif hinted:
                ptx.cp_async_16_hinted(dst, src, policy)
            else:
                ptx.cp_async_16(dst, src)

    def prefetch_weight_tail(self, weight, thread, tile_n, rank):
        """l2_prefetch: ask L2 for each tile row's K past the ring's first
        fill (all of it, or ``l2_prefetch`` K tiles of it), one bulk
        prefetch per row (``layout.l2_prefetch_span``). Issued right after
        that fill, before any wait: the HBM stream of the rest of this CTA's
        weight then overlaps the previous grid (PDL) and the ring's drain,
        and the refills hit L2."""
        t = self.tactic
        first, count = layout.l2_prefetch_span(self.k_tiles, t.stages, t.k_tile,
                                               t.l2_prefetch)
        valid = thread < layout.l2_prefetch_threads(t.output_tile)  # row = thread
        wb = self.weight_bytes
        if self.swiglu:
            row = layout.weight_row(tile_n, cutlass.select_(valid, thread, Int32(0)),
                                    t.output_tile, self.n, True)
            src = weight.toint() + Int64(row) * (self.k * _BYTES) + first * _BYTES
        else:
            src = (weight.toint() + Int64(tile_n) * (t.output_tile * self.k * wb)
                   + Int64(cutlass.select_(valid, thread, Int32(0))) * (self.k * wb)
                   + first * wb)
        if self.split:
            src = src + self._k_base(rank, wb)
        ptx.cp_async_bulk_prefetch_l2_if(src, count * wb,
                                         cutlass.select_(valid, Int32(1), Int32(0)))

    def weight_loader(self, smem, weight, thread, tile_n, rank):
        """Warps 4-5: every K tile of this CTA's weight rows into the ring,
        each copy completing on the stage's ``full_a`` barrier."""
        t = self.tactic
        # a one-tile weight is all prologue: no hinted copy, no policy to make
        policy = ptx.l2_policy_evict_first() if self.k_tiles > 1 else None
        for i in range(self.k_tiles):
            stage, _ = layout.ring_slot(i, t.stages)
            if i > 0:
                parity = layout.empty_parity(i, t.stages)
                if parity is not None:
                    ptx.mbarrier_wait(self._barrier(smem, self.smem.empty, stage), parity)
                self.issue_weight_tile(smem, weight, thread, tile_n, i, policy, hinted=True,
                                       rank=rank)
            ptx.cp_async_mbarrier_arrive_noinc(self._barrier(smem, self.smem.full_a, stage))
            if t.l2_prefetch and i == t.stages - 1:
                self.prefetch_weight_tail(weight, thread, tile_n, rank)
        ptx.cp_async_wait_all()

    # ------------------------------------------------ activation loaders

    def _pdl_before_x(self):
        """An activation loader's PDL steps before its first read of x: the
        early trigger, then the wait for the previous grid (which wrote x)."""
        if cutlass.const_expr(self.use_pdl and self.tactic.early_launch):
            ptx.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.use_pdl):
            ptx.griddepcontrol_wait()

    def _pdl_after_x(self):
        """... and after its last tile is issued: the late trigger."""
        if cutlass.const_expr(self.use_pdl and not self.tactic.early_launch):
            ptx.griddepcontrol_launch_dependents()

    def activation_loader(self, smem, x, thread, tile_t, m, rank):
        """16-byte copies (the default): every activation-loader thread
        copies its chunks of each stage, rows past M zero-filled."""
        t = self.tactic
        copies = layout.copies_per_thread(t.token_tile, t.k_tile, self.b_threads)
        x_base = x.toint()
        if self.split:
            x_base = x_base + self._k_base(rank)
        first_token = tile_t * t.token_tile
        self._pdl_before_x()
        for i in range(self.k_tiles):
            stage, _ = layout.ring_slot(i, t.stages)
            parity = layout.empty_parity(i, t.stages)
            if parity is not None:
                ptx.mbarrier_wait(self._barrier(smem, self.smem.empty, stage), parity)
            present = self._tile_present(rank, i)
            for chunk in range(copies):
                row, col = layout.loader_copy(thread, chunk, t.k_tile, self.b_threads)
                token = first_token + row
                valid = token < m
                if present is not None:  # and the tile in this rank's share
                    valid = cutlass.select_(valid, present, Int32(0)) != 0
                # A row past M reads nothing (src-size 0) and points at row 0,
                # so no address outside x is ever formed. Recomputed per tile
                # rather than held: a register per copy would cap residency.
                src = x_base + Int64(cutlass.select_(valid, token, Int32(0)) * (self.k * _BYTES)
                                     + (col + i * t.k_tile) * _BYTES)
                if present is not None:  # past the share: x's start
                    src = cutlass.select_(present != 0, src, x.toint())
                dst = (smem + self.smem.b_ring + stage * self.smem.b_stage_bytes
                       + layout.b_offset(row, col, t.k_tile, self.b_layout) * _BYTES)
                ptx.cp_async_16_zfill(dst, src, cutlass.select_(valid, Int32(16), Int32(0)))
            ptx.cp_async_mbarrier_arrive_noinc(self._barrier(smem, self.smem.full_b, stage))
        self._pdl_after_x()
        ptx.cp_async_wait_all()

    def _arm_activation_stage(self, smem, i, nbytes, arm):
        """A copy-engine activation loader's turn at K tile ``i`` (bulk rows or
        TMA boxes): wait until the compute warps released the stage, then arm
        its full barrier for ``nbytes`` (lane ``arm``). Returns
        ``(stage, full barrier)``."""
        stage, _ = layout.ring_slot(i, self.tactic.stages)
        parity = layout.empty_parity(i, self.tactic.stages)
        if parity is not None:
            ptx.mbarrier_wait(self._barrier(smem, self.smem.empty, stage), parity)
        full = self._barrier(smem, self.smem.full_b, stage)
        ptx.mbarrier_arrive_expect_tx_if(full, nbytes, arm)
        return stage, full

    def activation_bulk(self, smem, x, lane, tile_t, m, rank):
        """Bulk copies: one warp; lane r issues token row r of each stage, when it
        is inside M, as one bulk copy into the row-padded stage; lane 0 arms
        the stage's full barrier for all of its rows. Rows past M are never
        written (their outputs are never stored). Fewer instructions after
        the dependency wait than 16-byte copies at M = 1; more from a few
        rows on."""
        t = self.tactic
        row_bytes = t.k_tile * _BYTES
        first_token = tile_t * t.token_tile
        valid_rows = cutlass.select_(m - first_token < t.token_tile, m - first_token,
                                     Int32(t.token_tile))
        token = first_token + lane
        issue = (cutlass.select_(lane < t.token_tile, Int32(1), Int32(0))
                 * cutlass.select_(token < m, Int32(1), Int32(0)))
        arm = cutlass.select_(lane == 0, Int32(1), Int32(0))
        # rows this lane never issues still form an address inside x
        src_row = x.toint() + Int64(cutlass.select_(issue != 0, token, Int32(0))) * (self.k * _BYTES)
        if self.split:
            src_row = src_row + self._k_base(rank)  # this CTA's share of K
        dst_row = smem + self.smem.b_ring + layout.padded(lane % t.token_tile, 0, t.k_tile) * _BYTES
        self._pdl_before_x()
        for i in range(self.k_tiles):
            stage, full = self._arm_activation_stage(smem, i, valid_rows * row_bytes, arm)
            dst, src = dst_row + stage * self.smem.b_stage_bytes, src_row + Int64(i * row_bytes)
            ptx.cp_async_bulk_if(dst, src, row_bytes, full, issue)
        self._pdl_after_x()

    def activation_tma(self, smem, tma, lane, tile_t, rank):
        """TMA copies: one warp; lane 0 arms the stage's full barrier for the whole
        stage (``token_tile x k_tile`` elements: TMA counts the zero-filled
        rows past M too) and one elected lane issues its ``k_tile / 64``
        boxes. The tensor map is a kernel parameter, independent of the
        previous grid: it is prefetched before the dependency wait."""
        t = self.tactic
        tma_atom, tma_tensor = tma
        box_bytes = t.token_tile * layout.TMA_BOX_COLS * _BYTES
        arm = cutlass.select_(lane == 0, Int32(1), Int32(0))
        # this CTA's token tile of x, as TMA coordinates: [token_tile, 64] boxes
        # along K, the first of this CTA's K share at box rank * k_cta / 64
        x_boxes = cute.local_tile(tma_tensor, (t.token_tile, layout.TMA_BOX_COLS),
                                  (tile_t, None))
        first_box = (rank * (self.k_cta // layout.TMA_BOX_COLS) if self.k_first is None
                     else self.k_first // layout.TMA_BOX_COLS)
        self._tma_prefetch_map(tma_atom, lane)
        self._pdl_before_x()
        for i in range(self.k_tiles):
            stage, full = self._arm_activation_stage(smem, i,
                                                     Int32(t.token_tile * t.k_tile * _BYTES), arm)
            # The whole warp enters each copy, which elects one lane to issue
            # it (elect.sync over all 32: a branch on the lane would leave it
            # waiting for lanes that never come)
            for box in range(layout.tma_boxes(t.k_tile)):
                dst = smem + self.smem.b_ring + stage * self.smem.b_stage_bytes + box * box_bytes
                self._tma_copy(tma_atom, x_boxes, first_box + i * layout.tma_boxes(t.k_tile) + box,
                               dst, full)
        self._pdl_after_x()

    @cute.jit
    def _tma_prefetch_map(self, tma_atom, lane):
        if lane == 0:
            cpasync.prefetch_descriptor(tma_atom)

    @cute.jit
    def _tma_copy(self, tma_atom, x_boxes, box_index, dst, full):
        """One box of x (column block ``box_index`` of this CTA's token tile)
        into shared memory at ``dst``, completing on mbarrier ``full``.
        Entered by the whole warp; one lane issues."""
        smem_box = cute.make_tensor(
            cute.make_ptr(cutlass.BFloat16, dst, cute.AddressSpace.smem,
                          assumed_align=layout.TMA_ALIGN, swizzle_=cute.make_swizzle(3, 4, 3)),
            self._tma_box_layout().outer)
        s_part, g_part = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(smem_box, 0, 2),
            cute.group_modes(x_boxes, 0, 2))
        barrier = cute.make_ptr(cutlass.Int64, full, cute.AddressSpace.smem, assumed_align=8)
        cute.copy(tma_atom, g_part[(None, box_index)], s_part, tma_bar_ptr=barrier)

    # ----------------------------------------------------------- compute

    def compute(self, smem, tidx, warp, tile_n, tile_t, m, bias, out, rank):
        """Warps 0-3: the K loop, the partials into the reduction buffer,
        then the sum over the warps (and the split's CTAs) and the store."""
        lane = tidx % layout.WARP
        if self.fp8:
            acc = self.fp8_mainloop(smem, lane, warp, tile_n, rank)
        else:
            acc = self.mma_mainloop(smem, lane, warp)
        self.store_partials(smem, acc, lane, warp, rank)
        self.epilogue(smem, tidx, tile_n, tile_t, m, bias, out, rank)

    def mma_mainloop(self, smem, lane, warp):
        """This warp's quarter of every K tile: ``ldmatrix`` fragments from
        the two rings into ``mma.sync``, each stage released once read.
        Returns the accumulators ``acc[m_iter][n_iter][reg]``."""
        t = self.tactic
        m_iters = t.output_tile // layout.MMA_M
        n_iters = layout.mma_token_blocks(t.token_tile)  # one for a narrow token tile
        steps = layout.k_steps(t.k_tile)
        pairs = steps // 2
        b_layout = t.activation_layout
        # per-lane fragment addresses, computed once; stage offsets are immediates
        a_addr = [[smem + self.smem.a_ring
                   + layout.a_fragment_offset(lane, warp, mi, s, t.k_tile) * _BYTES
                   for s in range(steps)] for mi in range(m_iters)]
        b_addr = [[smem + self.smem.b_ring
                   + layout.b_fragment_offset(lane, warp, ni, p, t.k_tile, b_layout,
                                              t.token_tile) * _BYTES
                   for p in range(pairs)] for ni in range(n_iters)]
        zero = Float32(0.0)
        acc = [[[zero] * 4 for _ in range(n_iters)] for _ in range(m_iters)]

        def consume(a_off, b_off, _tile):
            # K steps in pairs: one ldmatrix.x4 brings B of two steps for 8 tokens
            for p in range(pairs):
                b = [ptx.ldmatrix_x4(b_addr[ni][p] + b_off) for ni in range(n_iters)]
                for half in range(2):
                    s = 2 * p + half
                    for mi in range(m_iters):
                        a = ptx.ldmatrix_x4(a_addr[mi][s] + a_off)
                        for ni in range(n_iters):
                            b_step = (b[ni][2 * half], b[ni][2 * half + 1])
                            acc[mi][ni] = ptx.mma_m16n8k16_bf16(a, b_step, acc[mi][ni])

        self._stages_in_turn(smem, consume)
        return acc

    def _stages_in_turn(self, smem, consume):
        """The compute warps' walk over the ring: for each K tile, wait until
        both stages landed, ``consume(a_offset, b_offset)`` (the stage's byte
        offsets in the rings: its MMAs; and the tile's index), then release
        the stage."""
        t = self.tactic
        for i in range(self.k_tiles):
            stage, parity = layout.ring_slot(i, t.stages)
            ptx.mbarrier_wait(self._barrier(smem, self.smem.full_a, stage), parity)
            ptx.mbarrier_wait(self._barrier(smem, self.smem.full_b, stage), parity)
            consume(stage * self.smem.a_stage_bytes, stage * self.smem.b_stage_bytes, i)
            if t.async_activation_ring and layout.stage_refilled(i, t.stages, self.k_tiles):
                # The next copy into this activation stage is a TMA or bulk
                # copy: a write by the async proxy, which the mbarrier
                # release/acquire chain alone does not order after this
                # thread's ldmatrix reads (generic proxy). Without the fence
                # the refill lands before the reads on the H200
                # (docs/design-notes.md). cp.async (generic proxy) rings
                # need no fence, nor does a stage no copy refills.
                ptx.fence_proxy_async_shared()
            # Every lane releases the stage with its own arrival once its
            # ldmatrix reads are done (compute-sanitizer's racecheck follows
            # per-lane arrivals; one arrival per warp after a warp sync it
            # reports as a hazard).
            ptx.mbarrier_arrive(self._barrier(smem, self.smem.empty, stage))

    def fp8_mainloop(self, smem, lane, warp, tile_n, rank):
        """``mma_mainloop`` for e4m3 weights: per 16 weight rows and K pair one
        ``ldmatrix.x4`` of weight bytes (``layout.fp8_a_fragment_offset``),
        converted in registers (``ptx.fp8x4_to_bf16x2``: even and odd k of
        each lane's four), and per 8 tokens and k-step one 8-byte load of
        activations (``layout.fp8_b_offset``) permuted to the same k slots
        (``layout.fp8_k_of_slot``: ``(e0, e2)`` and ``(e1, e3)``). With block
        scales each 16 rows' scale of the tile is folded into their
        conversion (``ptx.block_multiplier``: the weights times the scale,
        rounded to BF16; ``_block_scales``)."""
        t = self.tactic
        m_iters = t.output_tile // layout.MMA_M
        n_iters = layout.mma_token_blocks(t.token_tile)
        pairs = layout.k_steps(t.k_tile) // 2
        a_addr = [[smem + self.smem.a_ring + layout.fp8_a_fragment_offset(lane, warp, mi, p,
                                                                          t.k_tile)
                   for p in range(pairs)] for mi in range(m_iters)]
        b_addr = [[[smem + self.smem.b_ring
                    + layout.fp8_b_offset(lane, warp, ni, p, s, t.k_tile, t.token_tile) * _BYTES
                    for s in range(2)] for p in range(pairs)] for ni in range(n_iters)]
        zero = Float32(0.0)
        acc = [[[zero] * 4 for _ in range(n_iters)] for _ in range(m_iters)]
        blocks = self.scales == "block128"
        scale_of = self._block_scales(warp, tile_n, rank) if blocks else None
        # block scales loaded a tile ahead, {tile: [scale per m_iter]}: the
        # first tile's before the ring's first wait, each next one's while
        # the tile before converts (its L2 latency then hides behind a whole
        # tile's work; the ring wait between tiles ends the span the
        # compiler schedules in)
        ahead = {0: [scale_of(mi, 0) for mi in range(m_iters)]} if blocks else {}

        def consume(a_off, b_off, tile):
            multipliers = [None] * m_iters
            if blocks:
                if tile + 1 < self.k_tiles:
                    ahead[tile + 1] = [scale_of(mi, tile + 1) for mi in range(m_iters)]
                # each 16 rows' block scale folded into their conversion
                multipliers = [ptx.block_multiplier(x) for x in ahead.pop(tile)]
            for p in range(pairs):
                b = [[self._fp8_b_step(b_addr[ni][p][s] + b_off) for s in range(2)]
                     for ni in range(n_iters)]
                for mi in range(m_iters):
                    regs = ptx.ldmatrix_x4(a_addr[mi][p] + a_off)
                    converted = [ptx.fp8x4_to_bf16x2(r, multipliers[mi])
                                 for r in regs]  # (even, odd) each
                    for s in range(2):
                        top, bottom = converted[2 * s], converted[2 * s + 1]
                        a = (top[0], bottom[0], top[1], bottom[1])
                        for ni in range(n_iters):
                            acc[mi][ni] = ptx.mma_m16n8k16_bf16(a, b[ni][s], acc[mi][ni])

        self._stages_in_turn(smem, consume)
        return acc

    def _block_scales(self, warp, tile_n, rank):
        """``scale_of(m_iter, tile)``: the block scale of this warp's quarter
        of K tile ``tile`` for the 16 rows of ``m_iter`` (one load, the same
        for every lane: ``layout.fp8_block_scale_index``)."""
        t = self.tactic
        # this warp's first k: its CTA's share of K, its quarter of a tile
        if self.one_loop:
            first = self._one_loop_first_column(rank)
        else:
            first = Int32(rank) * self.k_cta if self.k_first is None else Int32(self.k_first)
        k_start = first + layout.warp_k_start(warp, t.k_tile)

        def scale_of(m_iter, tile):
            # the weight row of the 16 (with the SwiGLU epilogue a tile's
            # second half holds up rows) and k of the warp's quarter
            row = layout.weight_row(Int32(tile_n), m_iter * layout.MMA_M, t.output_tile,
                                    self.n, self.swiglu)
            k_of = k_start + tile * t.k_tile
            present = self._tile_present(rank, tile)
            if present is not None:  # a zero tile past the share: any scale, k = 0's
                k_of = cutlass.select_(present != 0, k_of, Int32(0))
            index = layout.fp8_block_scale_index(row, k_of, self.k)
            return ptx.ld_global_f32(self.scale.toint() + Int64(index) * 4)
        return scale_of

    @staticmethod
    def _fp8_b_step(address):
        """The B registers of one k-step for 8 tokens: four activations
        ``e0..e3`` by one 8-byte load, as ``(e0, e2)`` and ``(e1, e3)``
        (the low halves of the two words, then the high ones)."""
        lo, hi = ptx.ld_shared_v2_b32(address)
        return ptx.prmt_b32(lo, hi, "0x5410"), ptx.prmt_b32(lo, hi, "0x7632")

    def store_partials(self, smem, acc, lane, warp, rank):
        """The accumulators into the reduction buffer (slot ``warp``), then a
        barrier of the compute warps. K split: the first CTA (rank 0) stores
        its own partials (slot ``warp``); the others send theirs (slot
        ``rank * 4 + warp``) into the first's buffer by ``st.async``, each
        completing 4 bytes of the first's ``partials`` mbarrier, and is done:
        no barrier holds it (only the first CTA's buffer is written
        remotely, and the first CTA cannot exit before the barrier
        completes), and the first waits for those bytes. A cluster whose
        buffer lies over the rings (``layout.split_over_rings``) sends only once
        the first CTA has freed it (``ring_free``)."""
        t = self.tactic
        red = smem + self.smem.reduction
        if self.split:
            # the first CTA's buffer and partials barrier, as the others address them
            first_red = ptx.map_shared_to_rank(red, Int32(0))
            first_partials = ptx.map_shared_to_rank(smem + self.smem.partials, Int32(0))
            ptx.cluster_wait()  # phase 0: every CTA of the cluster is running
            slot = rank * layout.COMPUTE_WARPS + warp
            remote = cutlass.select_(rank != 0, Int32(1), Int32(0))
            if cutlass.const_expr(self.smem.ring_free is not None):
                # the first CTA's buffer lies over its rings: no partial may
                # land there before its compute warps have all read their
                # last tile (the barrier; every copy into the rings completed
                # before those reads). Then one of its threads frees each
                # other CTA (release at cluster scope), and those wait for it
                # (acquire) before they send.
                ptx.named_barrier(1, self.compute_threads)
                first_thread = (cutlass.select_(rank == 0, Int32(1), Int32(0))
                                * cutlass.select_(warp == 0, Int32(1), Int32(0))
                                * cutlass.select_(lane == 0, Int32(1), Int32(0)))
                for peer in range(1, self.k_split):
                    ptx.mbarrier_arrive_remote_if(
                        ptx.map_shared_to_rank(smem + self.smem.ring_free, Int32(peer)),
                        first_thread)
                ptx.mbarrier_wait(smem + self.smem.ring_free, 0, cluster=True, predicate=remote)
        else:
            slot = warp
            if self.smem.reduction_aliased:
                # the buffer lies over the rings (a ring too deep for both):
                # no partial may land before every compute warp has read its
                # last tile; the copies into the rings all completed before
                # those reads (each waited on its stage's full barrier)
                ptx.named_barrier(1, self.compute_threads)
        for mi in range(len(acc)):
            for ni in range(len(acc[mi])):
                for reg in range(4):
                    row, token = layout.accumulator_coords(lane, mi, ni, reg)
                    offset = layout.reduction_offset(slot, token, row, t.output_tile, t.token_tile)
                    if self.split:
                        ptx.st_partial_f32(red + offset * 4, first_red + offset * 4,
                                           first_partials, acc[mi][ni][reg], remote)
                    else:
                        ptx.st_shared_f32(red + offset * 4, acc[mi][ni][reg])
        ptx.named_barrier(1, self.compute_threads)
        if self.split:
            # the first CTA: its own warps' partials are in (the barrier
            # above), then the others' bytes (acquire at cluster scope)
            ptx.mbarrier_wait(smem + self.smem.partials, 0, cluster=True,
                              predicate=cutlass.select_(rank == 0, Int32(1), Int32(0)))

    def epilogue(self, smem, tidx, tile_n, tile_t, m, bias, out, rank):
        """Each compute thread sums one 16-byte output vector over every
        warp's partials in warp order (bitwise reproducible), adds the bias
        and stores 8 BF16; rows past M and (K split) the other CTAs store
        nothing. With ``swiglu`` it sums the gate rows and the up rows half
        a tile further, adds their biases, and stores ``silu(gate) * up``
        (FP32 until the one BF16 rounding) into the ``[M, N / 2]`` output."""
        t = self.tactic
        red = smem + self.smem.reduction
        rows = layout.output_rows(t.output_tile, self.swiglu)
        vectors = layout.epilogue_vectors(t.output_tile, t.token_tile, self.swiglu)
        warps = layout.COMPUTE_WARPS * self.k_split

        def reduce(token, row):
            total = [Float32(0.0)] * layout.CHUNK
            for w in range(warps):
                offset = layout.reduction_offset(w, token, row, t.output_tile, t.token_tile)
                part = (ptx.ld_shared_v4_f32(red + offset * 4)
                        + ptx.ld_shared_v4_f32(red + (offset + 4) * 4))
                total = part if w == 0 else [total[j] + part[j] for j in range(layout.CHUNK)]
            return total

        for round_ in range(layout.epilogue_rounds(t.output_tile, t.token_tile, self.swiglu)):
            vector = round_ * self.compute_threads + tidx
            # threads past the tile's vectors read a valid slot and store nothing
            token, row = layout.epilogue_coords(vector % vectors, rows)
            if cutlass.const_expr(not self.swiglu):
                total = reduce(token, row)
            global_token = tile_t * t.token_tile + token
            n_index = tile_n * rows + row
            store = (cutlass.select_(vector < vectors, Int32(1), Int32(0))
                     * cutlass.select_(global_token < m, Int32(1), Int32(0)))
            if self.split:
                # only the first CTA holds the sums; the others read their own
                # (unused) buffer and stores nothing
                store = store * cutlass.select_(rank == 0, Int32(1), Int32(0))
            if cutlass.const_expr(self.swiglu):
                words = self._swiglu_words(reduce, token, row, rows, n_index, bias, store)
            else:
                if cutlass.const_expr(self.fp8):
                    total = self._scaled(total, n_index, store)
                if cutlass.const_expr(self.has_bias):
                    b_vals = ptx.ld_global_bf16x8_as_f32(
                        bias.toint() + Int64(n_index * _BYTES), store)
                    total = [total[j] + b_vals[j] for j in range(layout.CHUNK)]
                words = [ptx.pack_bf16x2(total[2 * j], total[2 * j + 1]) for j in range(4)]
            address = (out.toint() + Int64(global_token) * (self.out_columns * _BYTES)
                       + Int64(n_index * _BYTES))
            ptx.st_global_v4_b32_if(address, words, store)

    def _swiglu_words(self, reduce, token, row, rows, n_index, bias, store):
        """The four BF16x2 words of one SwiGLU output vector: the gate sums
        (row ``row``) and the up sums (``rows`` further) over the warps, each
        plus its bias, then ``silu(gate) * up`` in FP32 and one rounding."""
        gate = reduce(token, row)
        up = reduce(token, row + rows)
        if cutlass.const_expr(self.fp8):
            gate = self._scaled(gate, n_index, store)
            up = self._scaled(up, self.out_columns + n_index, store)
        if cutlass.const_expr(self.has_bias):
            gate_bias = ptx.ld_global_bf16x8_as_f32(bias.toint() + Int64(n_index * _BYTES), store)
            up_bias = ptx.ld_global_bf16x8_as_f32(
                bias.toint() + Int64((self.out_columns + n_index) * _BYTES), store)
            gate = [gate[j] + gate_bias[j] for j in range(layout.CHUNK)]
            up = [up[j] + up_bias[j] for j in range(layout.CHUNK)]
        out = [ptx.silu_mul_f32(gate[j], up[j]) for j in range(layout.CHUNK)]
        return [ptx.pack_bf16x2(out[2 * j], out[2 * j + 1]) for j in range(4)]


class WarpSplitKFp8Kernel(WarpSplitKKernel):
    """The kernel for e4m3 weights ``[N, K]`` (one byte each) and FP32 scales:
    ``out = x @ (scale * W)^T (+ bias)``, ``scales`` "tensor" (one value),
    "channel" (``[N]``) or "block128" (``layout.fp8_scale_blocks``). Same roles and rings, the weight
    stages half the bytes; the compute warps convert the weight in registers
    (``fp8_mainloop``) and the epilogue scales each column's sum before the
    bias. Its signature has a fifth pointer, the scales."""

    fp8 = True

    def __init__(self, tactic: WarpSplitKTactic, n: int, k: int, *, has_bias: bool = False,
                 use_pdl: bool = True, scales: str = "channel", swiglu: bool = False):
        # before the base makes a mixed grid's half view, a copy of this one
        self.scales = scales
        self.scale = None
        super().__init__(tactic, n, k, has_bias=has_bias, use_pdl=use_pdl, swiglu=swiglu)

    @cute.jit
    def __call__(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
                 scale: cute.Pointer, out: cute.Pointer, m: Int32,
                 stream: cuda_driver.CUstream):
        self._launch(self.kernel_fp8(weight, x, bias, scale, out, m), m, stream)

    @cute.kernel
    def kernel_fp8(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
                   scale: cute.Pointer, out: cute.Pointer, m: Int32):
        self._hold_scale(scale)
        self.body(weight, x, bias, out, m, None)

    def _hold_scale(self, scale):
        """The scales' pointer, for the epilogue (``_scaled``) to read at
        trace time; a mixed grid's half view too. Plain Python: not staged."""
        self.scale = scale
        for view in [self.half_view] + (self.rank_views or []):
            if view is not None:
                view.scale = scale

    def _scaled(self, total, n_index, store):
        """The 8 sums of one output vector times their columns' scales (or
        the one scale of the tensor)."""
        if self.scales == "block128":
            return total  # applied per K block in the mainloop
        if self.scales == "channel":
            address = self.scale.toint() + Int64(n_index * 4)
            scales = (ptx.ld_global_v4_f32_if(address, store)
                      + ptx.ld_global_v4_f32_if(address + 16, store))
        else:
            one = ptx.ld_global_f32(self.scale.toint())
            scales = [one] * layout.CHUNK
        return [total[j] * scales[j] for j in range(layout.CHUNK)]
