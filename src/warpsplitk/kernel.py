"""The warp split-K BF16 GEMM for decode, in the CuTe DSL.

``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` for M <= 32.

One CTA owns ``output_tile`` weight rows and ``token_tile`` token rows and
walks all of K through two shared-memory rings of ``stages`` slots:

* warps 0-3, the compute warps: each owns one quarter of every stage's K
  slice, so all four consume every stage at once and accumulate
  ``mma.sync.m16n8k16`` partial sums of the whole output tile (warp
  split-K). At the end the partials meet in a padded shared buffer and the
  128 compute threads add them in warp order (bitwise reproducible) and
  store BF16.
* warps 4-5 stream the weight with 16-byte ``cp.async.cg`` copies carrying an
  L2 evict_first policy: the weight is read once, the activations are read by
  every CTA of a row of tiles, so the weight must not push them out of L2.
* warps 6(-7) stream the activations; rows past M are zero-filled, never read.
  With ``bulk_x`` (and with the multicast, unless by TMA) one warp does it instead,
  one ``cp.async.bulk`` per token row inside M and stage, into row-padded
  stages; rows past M are then never written (their outputs never stored).
  Fewer instructions after the dependency wait: 3-10% faster at M = 1, but
  slower from a few rows on, where many small bulk copies cost more than
  16-byte copies (docs/NOTES.md).
  With ``tma_x`` one warp copies each stage as ``k_tile / 64`` TMA boxes
  of ``[token_tile, 64]`` through a tensor map of x built on the host at
  every call (rows past M arrive as zeros), into 128-byte-swizzled stages;
  with ``x_multicast`` > 1 as well, each cluster member issues its share of
  the boxes into every member's stage.
* ``half_tiles``: a mixed grid whose last CTAs along N run
  the same roles for half as many weight rows (``body`` traces both).
* ``l2_prefetch``: once the weight ring's first fill is issued, each weight
  loader thread asks L2 for the rest of one tile row's K share with one
  ``cp.async.bulk.prefetch.L2``, so that stream does not wait for the ring
  to drain (a hint; measured per cell, it wins on some 11-14 MB weights);
  ``prefetch_tiles`` bounds it to a few K tiles past the ring.

Each stage has three mbarriers: ``full_a`` / ``full_b`` complete when a
stage's copies land (``cp.async.mbarrier.arrive.noinc`` by every loader
thread) and ``empty`` when the four compute warps are done with it.

PDL: the weight does not depend on the previous kernel in the stream, so the
weight loaders start at once and issue their first tile before the barriers
even exist. Only the activation loaders ``griddepcontrol.wait``; they let the
next kernel launch (``launch_dependents``) once their last tile is issued.
The compute warps write ``out`` after consuming activation tiles, hence after
the previous grid has completed: the PDL overlap is safe for chained
projections. (A weight rewritten by the kernel right before is not ordered;
decode weights are constants.)

The compute loop is unrolled over the static K-tile count, so every ring
slot, parity and stage offset is a constant and every ``ldmatrix`` address is
a per-lane register plus an immediate.
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
from .tactics import WarpSplitKTactic

_BYTES = layout.ELEMENT_BYTES

#: The diagnostic ``stamps`` build (``scripts/stamps.py``): what each CTA
#: records, one 16-byte slot each (``{%globaltimer, %clock64}``; ``smid``:
#: the SM index), in this order, then from slot ``STAMP_STAGE_SLOT`` on when
#: each of its first ``STAMP_STAGES`` K tiles was ready for compute warp 0;
#: ``STAMP_BYTES`` per CTA.
STAMP_SLOTS = ("start", "x_wait_released", "first_stage_ready", "last_stage_ready",
               "partials_stored", "reduced", "stored", "weight_landed", "smid")
STAMP_STAGE_SLOT = 16
STAMP_STAGES = 48
STAMP_BYTES = 16 * (STAMP_STAGE_SLOT + STAMP_STAGES)

#: The diagnostic ``x_smem`` builds (``scripts/build_ab.py --compare
#: x-smem``): the activations' shared-memory traffic as shipped ("full"),
#: without the compute warps' reads of it ("no-read"), or without any of it
#: ("none"). The last two give wrong results by design.
X_SMEM = ("full", "no-read", "none")
#: How the CTAs of a K split reduce (``split_reduce``; ``scripts/build_ab.py
#: --compare split-reduce``). Shipped, "mbarrier": each other CTA stores its
#: partial sums into the first CTA's buffer by ``st.async``, whose bytes
#: complete an mbarrier there, and only the first CTA waits (on it).
#: "vector" (experimental, correct): every CTA first sums its own four
#: warps' partials, and the others send those sums, one 8-float vector per
#: output vector (``st.async`` .v4, a quarter of the bytes), into the
#: first CTA's slots ``layout.split_sum_slot``.
#: "barrier" (the protocol before, correct): plain remote stores, then a
#: cluster barrier every thread of every CTA arrives on and waits for.
#: Diagnostics with wrong results: "no-remote" (the barrier protocol with the
#: partials stored locally), "no-barrier" (a cluster launch without any
#: barrier or remote store), "none" (no cluster: each CTA sums its own
#: warps and stores).
SPLIT_REDUCE = ("mbarrier", "vector", "barrier", "no-remote", "no-barrier", "none")


class WarpSplitKKernel:
    """One compiled kernel per (N, K, tactic, bias?, PDL?); M is dynamic."""

    def __init__(self, tactic: WarpSplitKTactic, n: int, k: int, *, has_bias: bool = False,
                 use_pdl: bool = True, loader_thread_arrive: bool = False,
                 compute_thread_arrive: bool = True, early_launch: bool = False,
                 dependency_wait: bool = True, release_fence: str = "proxy",
                 stamps: bool = False, remote_release: str = "cluster",
                 x_smem: str = "full", split_reduce: str = "mbarrier"):
        self.tactic = tactic
        self.n, self.k = n, k
        self.has_bias = has_bias
        self.use_pdl = use_pdl
        # Who arrives on the ring barriers.
        # compute_thread_arrive (shipped): every compute lane releases a stage
        # with its own arrival on the empty barrier once its ldmatrix reads
        # are done. One arrival per warp by lane 0 after bar.warp.sync is
        # also correct under the PTX memory model, but compute-sanitizer's
        # racecheck does not follow it and reports every refill as a hazard;
        # per-lane arrivals it follows, and on the H200 they cost nothing
        # measurable (scripts/build_ab.py --compare release: 0.99-1.01x over 10
        # shape/M cells).
        # False builds the lane-0 release, kept for that comparison.
        # loader_thread_arrive (diagnostic, never shipped): a loader waits for
        # its copies of a tile (cp.async.wait_all) and arrives itself, instead
        # of the copies' completion arriving for it
        # (cp.async.mbarrier.arrive.noinc), which gives up copy overlap.
        self.loader_thread_arrive = loader_thread_arrive
        self.compute_thread_arrive = compute_thread_arrive
        # early launch (the tactic's early_launch, or early_launch=True for
        # a whole-process build, scripts/build_ab.py --compare pdl-trigger):
        # let the next kernel launch before this one's griddepcontrol.wait
        # instead of after the last activation tile is issued. Its CTAs can
        # then become resident and prefetch their weight while this grid
        # (and the one before it) still runs; its own wait still orders
        # every read of x and write of out after this grid completes. The
        # cost: the early-launched CTAs hold shared memory while they wait,
        # so a grid that does not fit beside them leaves stragglers.
        self.early_launch = early_launch or tactic.early_launch
        # dependency_wait=False (diagnostic, scripts/build_ab.py --compare pdl
        # only; nothing in the library builds it): no griddepcontrol.wait, so
        # x may be read before the previous kernel wrote it. It measures what
        # the wait's serialisation costs on calls whose inputs are in fact
        # independent.
        self.dependency_wait = dependency_wait
        # release_fence (compile.RELEASE_FENCES): the cross-proxy fence before
        # a stage a copy refills is released (see compute): "proxy" (shipped),
        # "release" (experimental, uni-directional), "loader" (experimental:
        # the refilling thread fences instead) or "none" (diagnostic: races)
        self.release_fence = release_fence
        # stamps (diagnostic, scripts/stamps.py only; never cached or
        # shipped): each CTA writes STAMP_SLOTS through the bias pointer,
        # which then is a buffer of STAMP_BYTES per CTA, to show where a
        # call's time goes between its start, the dependency wait's release
        # and its last store
        if stamps and has_bias:
            raise ValueError("the stamps build takes its buffer through the bias pointer: "
                             "build it without a bias")
        self.stamps = stamps
        self._stamp_base = None
        # remote_release (compile.REMOTE_RELEASES): the scope of a compute
        # lane's release of a multicast stage to each member's empty barrier
        self.remote_release = remote_release
        # x_smem (diagnostic, scripts/build_ab.py --compare x-smem only;
        # wrong results, never cached or shipped): how much of the time
        # after the dependency wait is the activations' shared-memory
        # traffic. "no-read": the compute warps take constant B fragments
        # instead of their ldmatrix reads; "none": the loader copies no x
        # either (its barrier arrivals stay). 16-byte activation copies only.
        if x_smem not in X_SMEM:
            raise ValueError(f"x_smem must be one of {X_SMEM}, got {x_smem!r}")
        if x_smem != "full" and (tactic.bulk_activations or tactic.tma_x):
            raise ValueError("the x_smem diagnostic takes 16-byte activation copies: "
                             "no bulk_x, tma_x or x_multicast")
        self.x_smem = x_smem
        t = tactic
        # k_split > 1: a cluster of k_split CTAs shares each output tile, CTA
        # (rank) r streaming K columns [r * k_cta, (r + 1) * k_cta)
        self.k_split = t.k_split
        self.k_cta = k // t.k_split
        self.k_tiles = self.k_cta // t.k_tile
        # x_multicast > 1: a cluster of x_multicast CTAs along N (consecutive
        # output tiles, the same token tile) shares every activation stage
        self.x_multicast = t.x_multicast
        self.multicast = t.x_multicast > 1
        # activation rows by bulk copy into row-padded stages (bulk_x, or the
        # multicast): the same loader, its cluster of one CTA or of several
        self.bulk_activations = t.bulk_activations
        # activation stages by TMA boxes (tma_x): a tensor map of x per call
        self.tma_activations = t.tma_x
        self.b_layout = t.activation_layout
        # split_reduce (SPLIT_REDUCE): "mbarrier" is shipped, "vector" an
        # experimental build variant (WARPSPLITK_SPLIT_REDUCE); the others
        # are for scripts/build_ab.py --compare split-reduce only, never cached
        if split_reduce not in SPLIT_REDUCE:
            raise ValueError(f"split_reduce must be one of {SPLIT_REDUCE}, got {split_reduce!r}")
        if split_reduce != "mbarrier" and (t.k_split == 1 or t.x_multicast > 1):
            raise ValueError("the split_reduce diagnostic is for a K split (k_split > 1) "
                             "without the activation multicast")
        self.split_reduce = split_reduce
        # the K split's CTAs form a cluster and reduce through its shared memory
        self.cluster_split = self.k_split > 1 and split_reduce not in ("none", "no-barrier")
        # ... the others' partials completing the first CTA's mbarrier
        self.split_mbarrier = self.cluster_split and split_reduce in ("mbarrier", "vector")
        # ... as one sum per CTA and output vector
        self.split_vector = self.cluster_split and split_reduce == "vector"
        # a cluster barrier (phase 0 at least: every CTA running, its
        # mbarriers initialised, before the first remote operation)
        self.clustered = self.cluster_split or self.multicast
        self.cluster_launch = self.clustered or split_reduce == "no-barrier"
        self.smem = layout.smem_plan(t.output_tile, t.token_tile, t.k_tile, t.stages, t.k_split,
                                     t.x_multicast, t.bulk_x, t.tma_x)
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

    # ------------------------------------------------------------ launch

    @cute.jit
    def __call__(self, weight: cute.Pointer, x: cute.Pointer, bias: cute.Pointer,
                 out: cute.Pointer, m: Int32, stream: cuda_driver.CUstream):
        # Base addresses and M are all the kernel uses of its operands (their
        # layouts are packed row-major by contract, checked by the caller), so
        # it takes pointers: a pointer argument costs the host ~1 us to build,
        # a DLPack tensor view with a dynamic extent ~20 us.
        t = self.tactic
        token_tiles = (m + (t.token_tile - 1)) // t.token_tile
        cluster = ({"cluster": [self.x_multicast, 1, self.k_split]} if self.cluster_launch
                   else {})
        if cutlass.const_expr(self.tma_activations):
            # The tensor map of x: built here, on the host, at every call (x's
            # address and M change between calls), and passed by value as a
            # kernel parameter, so a captured graph replays the map it was
            # captured with. Rows past M read as zeros.
            x_tensor = cute.make_tensor(x, cute.make_layout((m, self.k), stride=(self.k, 1)))
            op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.multicast
                  else cpasync.CopyBulkTensorTileG2SOp())
            tma_atom, tma_x = cpasync.make_tiled_tma_atom(
                op, x_tensor, self._tma_box_layout(), (t.token_tile, layout.TMA_BOX_COLS))
            launch = self.kernel_tma(weight, x, bias, out, m, tma_atom, tma_x)
        else:
            launch = self.kernel(weight, x, bias, out, m)
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
        if cutlass.const_expr(self.stamps):
            grid_x, grid_y, _ = cute.arch.grid_dim()
            cta = tile_n + grid_x * (tile_t + grid_y * rank)
            base = bias.toint() + Int64(cta) * STAMP_BYTES
            # trace-time state: both views' helpers stamp into this CTA's slots
            self._stamp_base = base
            if cutlass.const_expr(self.half_view is not None):
                self.half_view._stamp_base = base
        if cutlass.const_expr(self.half_view is None):
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
    def roles(self, smem, weight, x, bias, out, m, tma, tidx, tile_n, tile_t, rank):
        """Barriers, then each warp to its role, for weight rows
        ``tile_n * output_tile`` on."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first_a_warp = layout.COMPUTE_WARPS
        first_b_warp = first_a_warp + layout.A_LOADER_WARPS
        is_a_loader = warp >= first_a_warp and warp < first_b_warp
        self._stamp("start", tidx == 0)
        self._stamp("smid", tidx == 0)

        # The weight does not depend on the previous kernel: tile 0 is in
        # flight before the barriers exist. Plain cp.async here (see ptx.py).
        if is_a_loader:
            self.issue_weight_tile(smem, weight, tidx - first_a_warp * layout.WARP, tile_n, 0,
                                   Int64(0), hinted=False, rank=rank)
        if tidx == 0:
            self.init_barriers(smem, rank)
        ptx.named_barrier(0, self.threads)
        if cutlass.const_expr(self.clustered):
            # cluster barrier phase 0, waited on before the first remote
            # operation: another CTA's shared memory and mbarriers may be
            # written only once it runs and has initialised them (the init
            # fence orders thread 0's mbarrier.init before this arrival)
            ptx.cluster_arrive(relaxed=True)

        if warp < first_a_warp:
            self.compute(smem, tidx, warp, tile_n, tile_t, m, bias, out, rank)
        elif is_a_loader:
            self.weight_loader(smem, weight, tidx - first_a_warp * layout.WARP, tile_n, rank)
        elif cutlass.const_expr(self.tma_activations):
            self.activation_tma(smem, tma, tidx - first_b_warp * layout.WARP, tile_n, tile_t,
                                rank)
        elif cutlass.const_expr(self.bulk_activations):
            self.activation_bulk(smem, x, tidx - first_b_warp * layout.WARP, tile_n, tile_t, m,
                                 rank)
        else:
            self.activation_loader(smem, x, tidx - first_b_warp * layout.WARP, tile_t, m, rank)

    # ----------------------------------------------------- trace helpers
    # Plain Python: not rewritten by the DSL's preprocessor, so their loops
    # unroll at trace time and their branches are trace-time constants.

    def init_barriers(self, smem, rank):
        for stage in range(self.tactic.stages):
            ptx.mbarrier_init(self._barrier(smem, self.smem.full_a, stage), self.a_threads)
            # bulk copies: one arrival (the local expect_tx) plus the stage's bytes
            ptx.mbarrier_init(self._barrier(smem, self.smem.full_b, stage),
                              1 if self.bulk_activations or self.tma_activations
                              else self.b_threads)
            # multicast: every compute lane (or, in the lane-0 build, every
            # compute warp) of every member releases every stage (the stage's
            # next rows come from all of them)
            per_cta = (self.compute_threads if self.compute_thread_arrive
                       else layout.COMPUTE_WARPS)
            releases = per_cta * self.x_multicast if self.multicast else per_cta
            ptx.mbarrier_init(self._barrier(smem, self.smem.empty, stage), releases)
        if self.split_mbarrier:
            ptx.mbarrier_init(smem + self.smem.partials, 1)
        ptx.fence_mbarrier_init()
        if self.split_mbarrier:
            # the first CTA expects every other CTA's partials: one arrival
            # (this one) and their bytes. The others' barrier is never
            # waited on. No st.async can land before this: each sender first
            # waits on cluster barrier phase 0, which this thread's arrival
            # (after it) completes.
            t = self.tactic
            per_cta = (layout.split_vector_bytes if self.split_vector
                       else layout.split_partial_bytes)(t.output_tile, t.token_tile)
            ptx.mbarrier_arrive_expect_tx_if(
                smem + self.smem.partials, (self.k_split - 1) * per_cta,
                cutlass.select_(rank == 0, Int32(1), Int32(0)))

    def _loader_arrive(self, barrier):
        """A loader thread's arrival on a full barrier once its copies of the tile land."""
        if self.loader_thread_arrive:
            ptx.cp_async_wait_all()
            ptx.mbarrier_arrive(barrier)
        else:
            ptx.cp_async_mbarrier_arrive_noinc(barrier)

    def _stamp(self, slot, condition):
        """Diagnostic ``stamps`` build: record ``slot`` (a name of
        STAMP_SLOTS, or a K tile index: that tile ready) where ``condition``
        (a per-thread Boolean) holds; nothing in any other build."""
        if self.stamps:
            index = (STAMP_STAGE_SLOT + slot if isinstance(slot, int)  # a K tile
                     else STAMP_SLOTS.index(slot))
            address = self._stamp_base + Int64(16 * index)
            flag = cutlass.select_(condition, Int32(1), Int32(0))
            if slot == "smid":
                ptx.smid_if(address, flag)
            else:
                ptx.stamp_if(address, flag)

    def _barrier(self, smem, region, stage):
        return smem + region + stage * layout.MBARRIER_BYTES

    def _k_base(self, rank):
        """Byte offset of this CTA's share of K within a row."""
        return Int64(rank) * (self.k_cta * _BYTES)

    def _cluster_done(self, waited=False):
        """A loader's part of the cluster barrier: phase 0 (long complete by
        now; unless ``waited`` already), then phase 1, which the first CTA
        waits on before its epilogue (k_split, "barrier" build) or every CTA
        before it exits (multicast). The shipped K split has no phase 1: a
        loader arrived on phase 0 at the start and has no remote operation
        to order."""
        if self.clustered and not self.split_mbarrier:
            if not waited:
                ptx.cluster_wait()
            ptx.cluster_arrive()

    def _pdl_before_x(self, thread):
        """An activation loader's PDL steps before its first read of x: the
        early trigger, then the wait for the previous grid (which wrote x)."""
        if cutlass.const_expr(self.use_pdl and self.early_launch):
            ptx.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.use_pdl and self.dependency_wait):
            ptx.griddepcontrol_wait()
        self._stamp("x_wait_released", thread == 0)

    def _pdl_after_x(self):
        """... and after its last tile is issued: the late trigger."""
        if cutlass.const_expr(self.use_pdl and not self.early_launch):
            ptx.griddepcontrol_launch_dependents()

    def issue_weight_tile(self, smem, weight, thread, tile_n, k_tile_index, policy, hinted,
                          rank=None):
        t = self.tactic
        stage, _ = layout.ring_slot(k_tile_index, t.stages)
        base = weight.toint() + Int64(tile_n) * (t.output_tile * self.k * _BYTES)
        if self.k_split > 1:
            base = base + self._k_base(rank)
        for chunk in range(layout.copies_per_thread(t.output_tile, t.k_tile, self.a_threads)):
            row, col = layout.loader_copy(thread, chunk, t.k_tile, self.a_threads)
            dst = (smem + self.smem.a_ring + stage * self.smem.a_stage_bytes
                   + layout.swizzle(row, col, t.k_tile) * _BYTES)
            src = base + Int64((row * self.k + col) * _BYTES) + k_tile_index * t.k_tile * _BYTES
            if hinted:
                ptx.cp_async_16_hinted(dst, src, policy)
            else:
                ptx.cp_async_16(dst, src)

    def prefetch_weight_tail(self, weight, thread, tile_n, rank):
        """l2_prefetch: ask L2 for each tile row's K past the ring's first
        fill (all of it, or ``prefetch_tiles`` K tiles of it), one bulk
        prefetch per row (``layout.l2_prefetch_span``). Issued
        right after that fill, before any wait: the HBM stream of the rest
        of this CTA's weight then overlaps the previous grid (PDL) and the
        ring's drain, and the refills hit L2."""
        t = self.tactic
        first, count = layout.l2_prefetch_span(self.k_tiles, t.stages, t.k_tile,
                                               t.prefetch_tiles)
        valid = thread < layout.l2_prefetch_threads(t.output_tile)  # row = thread
        src = (weight.toint() + Int64(tile_n) * (t.output_tile * self.k * _BYTES)
               + Int64(cutlass.select_(valid, thread, Int32(0))) * (self.k * _BYTES)
               + first * _BYTES)
        if self.k_split > 1:
            src = src + self._k_base(rank)
        ptx.cp_async_bulk_prefetch_l2_if(src, count * _BYTES,
                                         cutlass.select_(valid, Int32(1), Int32(0)))

    def weight_loader(self, smem, weight, thread, tile_n, rank):
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
            self._loader_arrive(self._barrier(smem, self.smem.full_a, stage))
            if t.l2_prefetch and i == t.stages - 1:
                self.prefetch_weight_tail(weight, thread, tile_n, rank)
        ptx.cp_async_wait_all()
        self._stamp("weight_landed", thread == 0)
        self._cluster_done()

    def activation_loader(self, smem, x, thread, tile_t, m, rank):
        t = self.tactic
        copies = layout.copies_per_thread(t.token_tile, t.k_tile, self.b_threads)
        x_base = x.toint()
        if self.k_split > 1:
            x_base = x_base + self._k_base(rank)
        first_token = tile_t * t.token_tile
        self._pdl_before_x(thread)
        for i in range(self.k_tiles):
            stage, _ = layout.ring_slot(i, t.stages)
            parity = layout.empty_parity(i, t.stages)
            if parity is not None:
                ptx.mbarrier_wait(self._barrier(smem, self.smem.empty, stage), parity)
            for chunk in range(copies):
                row, col = layout.loader_copy(thread, chunk, t.k_tile, self.b_threads)
                token = first_token + row
                valid = token < m
                # A row past M reads nothing (src-size 0) and points at row 0,
                # so no address outside x is ever formed. Recomputed per tile
                # rather than held: a register per copy would cap residency.
                src = x_base + Int64(cutlass.select_(valid, token, Int32(0)) * (self.k * _BYTES)
                                     + (col + i * t.k_tile) * _BYTES)
                dst = (smem + self.smem.b_ring + stage * self.smem.b_stage_bytes
                       + layout.swizzle(row, col, t.k_tile) * _BYTES)
                if cutlass.const_expr(self.x_smem != "none"):
                    ptx.cp_async_16_zfill(dst, src, cutlass.select_(valid, Int32(16), Int32(0)))
            self._loader_arrive(self._barrier(smem, self.smem.full_b, stage))
        self._pdl_after_x()
        ptx.cp_async_wait_all()
        self._cluster_done()

    def _arm_activation_stage(self, smem, i, nbytes, arm):
        """A copy-engine activation loader's turn at K tile ``i`` (bulk rows or
        TMA boxes): wait until the stage is released (by every member, with
        the multicast), then arm its full barrier for ``nbytes`` (lane
        ``arm``). Returns ``(stage, full barrier)``."""
        stage, _ = layout.ring_slot(i, self.tactic.stages)
        parity = layout.empty_parity(i, self.tactic.stages)
        if parity is not None:
            ptx.mbarrier_wait(self._barrier(smem, self.smem.empty, stage), parity,
                              cluster=self.multicast)
            if self.release_fence == "loader":
                # experimental: the cross-proxy fence on the refilling side,
                # once per refill, after the acquire that made the compute
                # threads' reads of the stage precede this thread's next
                # operations (compile.RELEASE_FENCES)
                if self.multicast:
                    ptx.fence_proxy_async()
                else:
                    ptx.fence_proxy_async_shared()
        full = self._barrier(smem, self.smem.full_b, stage)
        ptx.mbarrier_arrive_expect_tx_if(full, nbytes, arm)
        return stage, full

    def activation_bulk(self, smem, x, lane, tile_n, tile_t, m, k_rank):
        """bulk_x or x_multicast > 1: one warp; lane r issues token row r of
        each stage when it is inside M (and, multicast, this CTA owns it:
        ``layout.multicast_rows``) as one bulk copy, into this CTA's stage
        or, multicast, into the stage of every CTA of the cluster. Lane 0
        arms this CTA's full barrier for all the stage's rows, whoever sends
        them. A stage is refilled once the compute warps (multicast: every
        member's) released it (the empty barrier counts them all)."""
        t = self.tactic
        c = self.x_multicast
        rank = tile_n % c  # the multicast cluster spans c consecutive output tiles
        row_bytes = t.k_tile * _BYTES
        first_token = tile_t * t.token_tile
        valid_rows = cutlass.select_(m - first_token < t.token_tile, m - first_token,
                                     Int32(t.token_tile))
        token = first_token + lane
        issue = (cutlass.select_(lane < t.token_tile, Int32(1), Int32(0))
                 * cutlass.select_(layout.multicast_owner(lane, c) == rank, Int32(1), Int32(0))
                 * cutlass.select_(token < m, Int32(1), Int32(0)))
        arm = cutlass.select_(lane == 0, Int32(1), Int32(0))
        # rows this lane never issues still form an address inside x
        src_row = x.toint() + Int64(cutlass.select_(issue != 0, token, Int32(0))) * (self.k * _BYTES)
        if self.k_split > 1:
            src_row = src_row + self._k_base(k_rank)  # this CTA's share of K
        dst_row = smem + self.smem.b_ring + layout.padded(lane % t.token_tile, 0, t.k_tile) * _BYTES
        mask = (1 << c) - 1
        self._pdl_before_x(lane)
        if cutlass.const_expr(self.multicast):
            ptx.cluster_wait()  # phase 0: every member's barriers exist
        for i in range(self.k_tiles):
            stage, full = self._arm_activation_stage(smem, i, valid_rows * row_bytes, arm)
            dst, src = dst_row + stage * self.smem.b_stage_bytes, src_row + Int64(i * row_bytes)
            if self.multicast:
                ptx.cp_async_bulk_multicast_if(dst, src, row_bytes, full, mask, issue)
            else:
                ptx.cp_async_bulk_if(dst, src, row_bytes, full, issue)
        self._pdl_after_x()
        self._cluster_done(waited=self.multicast)

    def activation_tma(self, smem, tma, lane, tile_n, tile_t, k_rank):
        """tma_x: one warp; lane 0 arms this CTA's full barrier for the whole
        stage (``token_tile x k_tile`` elements: TMA counts the zero-filled
        rows past M too) and one elected lane issues the boxes this CTA owns
        (``layout.tma_owned_boxes``: all of them, or, multicast, its share,
        written into every member's stage). The tensor map is a kernel
        parameter, independent of the previous grid: it is prefetched before
        the dependency wait."""
        t = self.tactic
        tma_atom, tma_tensor = tma
        c = self.x_multicast
        rank = tile_n % c  # the multicast cluster spans c consecutive output tiles
        box_bytes = t.token_tile * layout.TMA_BOX_COLS * _BYTES
        arm = cutlass.select_(lane == 0, Int32(1), Int32(0))
        # this CTA's token tile of x, as TMA coordinates: [token_tile, 64] boxes
        # along K, the first of this CTA's K share at box k_rank * k_cta / 64
        x_boxes = cute.local_tile(tma_tensor, (t.token_tile, layout.TMA_BOX_COLS),
                                  (tile_t, None))
        first_box = k_rank * (self.k_cta // layout.TMA_BOX_COLS)
        self._tma_prefetch_map(tma_atom, lane)
        self._pdl_before_x(lane)
        if cutlass.const_expr(self.multicast):
            ptx.cluster_wait()  # phase 0: every member's barriers exist
        for i in range(self.k_tiles):
            stage, full = self._arm_activation_stage(smem, i,
                                                     Int32(t.token_tile * t.k_tile * _BYTES), arm)
            # the rank is dynamic: every box is traced, each issued by its owner.
            # The whole warp enters the copy, which elects one lane to issue
            # it (elect.sync over all 32: a branch on the lane would leave it
            # waiting for lanes that never come)
            for box in range(layout.tma_boxes(t.k_tile)):
                dst = smem + self.smem.b_ring + stage * self.smem.b_stage_bytes + box * box_bytes
                issue = cutlass.select_(layout.tma_box_owner(box, c) == rank, Int32(1), Int32(0))
                self._tma_copy(tma_atom, x_boxes, first_box + i * layout.tma_boxes(t.k_tile) + box,
                               dst, full, issue)
        self._pdl_after_x()
        self._cluster_done(waited=self.multicast)

    @cute.jit
    def _tma_prefetch_map(self, tma_atom, lane):
        if lane == 0:
            cpasync.prefetch_descriptor(tma_atom)

    @cute.jit
    def _tma_copy(self, tma_atom, x_boxes, box_index, dst, full, issue):
        """One box of x (column block ``box_index`` of this CTA's token tile)
        into shared memory at ``dst``, completing on mbarrier ``full``; with
        the multicast, into every cluster member's ``dst`` and ``full``.
        Entered by the whole warp (``issue`` is warp-uniform); one lane issues."""
        if issue != 0:
            smem_box = cute.make_tensor(
                cute.make_ptr(cutlass.BFloat16, dst, cute.AddressSpace.smem,
                              assumed_align=layout.TMA_ALIGN, swizzle_=cute.make_swizzle(3, 4, 3)),
                self._tma_box_layout().outer)
            s_part, g_part = cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1), cute.group_modes(smem_box, 0, 2),
                cute.group_modes(x_boxes, 0, 2))
            barrier = cute.make_ptr(cutlass.Int64, full, cute.AddressSpace.smem, assumed_align=8)
            if cutlass.const_expr(self.multicast):
                cute.copy(tma_atom, g_part[(None, box_index)], s_part, tma_bar_ptr=barrier,
                          mcast_mask=cutlass.Int16((1 << self.x_multicast) - 1))
            else:
                cute.copy(tma_atom, g_part[(None, box_index)], s_part, tma_bar_ptr=barrier)

    def compute(self, smem, tidx, warp, tile_n, tile_t, m, bias, out, rank):
        t = self.tactic
        lane = tidx % layout.WARP
        m_iters = t.output_tile // layout.MMA_M
        n_iters = layout.mma_token_blocks(t.token_tile)  # one for a narrow token tile
        steps = layout.k_steps(t.k_tile)
        pairs = steps // 2
        # per-lane fragment addresses, computed once; stage offsets are immediates
        a_addr = [[smem + self.smem.a_ring
                   + layout.a_fragment_offset(lane, warp, mi, s, t.k_tile) * _BYTES
                   for s in range(steps)] for mi in range(m_iters)]
        b_addr = [[smem + self.smem.b_ring
                   + layout.b_fragment_offset(lane, warp, ni, p, t.k_tile, self.b_layout,
                                              t.token_tile) * _BYTES
                   for p in range(pairs)] for ni in range(n_iters)]
        if cutlass.const_expr(self.multicast):
            ptx.cluster_wait()  # phase 0: every member's empty barriers exist
            # each member's empty barriers, in shared::cluster addresses
            empty_of = [ptx.map_shared_to_rank(smem + self.smem.empty, Int32(q))
                        for q in range(self.x_multicast)]
        zero = Float32(0.0)
        acc = [[[zero] * 4 for _ in range(n_iters)] for _ in range(m_iters)]
        for i in range(self.k_tiles):
            stage, parity = layout.ring_slot(i, t.stages)
            ptx.mbarrier_wait(self._barrier(smem, self.smem.full_a, stage), parity)
            ptx.mbarrier_wait(self._barrier(smem, self.smem.full_b, stage), parity)
            if i == 0:
                self._stamp("first_stage_ready", tidx == 0)
            if i == self.k_tiles - 1:
                self._stamp("last_stage_ready", tidx == 0)
            if i < STAMP_STAGES:
                self._stamp(i, tidx == 0)
            a_off = stage * self.smem.a_stage_bytes
            b_off = stage * self.smem.b_stage_bytes
            # K steps in pairs: one ldmatrix.x4 brings B of two steps for 8 tokens
            for p in range(pairs):
                if cutlass.const_expr(self.x_smem == "full"):
                    b = [ptx.ldmatrix_x4(b_addr[ni][p] + b_off) for ni in range(n_iters)]
                else:  # diagnostic: B without its shared-memory reads; a constant
                    # per block, distinct, so no two mma chains fold into one
                    b = [[Int32(0x3F803F80 + 4 * ni + r) for r in range(4)]
                         for ni in range(n_iters)]
                for half in range(2):
                    s = 2 * p + half
                    for mi in range(m_iters):
                        a = ptx.ldmatrix_x4(a_addr[mi][s] + a_off)
                        for ni in range(n_iters):
                            b_step = (b[ni][2 * half], b[ni][2 * half + 1])
                            acc[mi][ni] = ptx.mma_m16n8k16_bf16(a, b_step, acc[mi][ni])
            if (t.async_activation_ring and self.release_fence in ("proxy", "release")
                    and layout.stage_refilled(i, t.stages, self.k_tiles)):
                # The next copy into this activation stage is a TMA or bulk
                # copy: a write by the async proxy, which the mbarrier
                # release/acquire chain alone does not order after this
                # thread's ldmatrix reads (generic proxy). Without the
                # fence the refill landed before the reads on the H200 (runs
                # 50-52: 16,8,128,2,1+tma on 7168x384, M = 17, 34 of 160
                # outputs wrong, each with a quarter of K tile 0 read from
                # K tile 2). cp.async (generic proxy) rings need no fence,
                # nor does a stage no copy refills (the fence costs ~80 ns
                # on the path: run 53).
                if self.release_fence == "release":
                    ptx.fence_proxy_async_release_shared()
                else:
                    ptx.fence_proxy_async_shared()
            if self.multicast and self.compute_thread_arrive:
                # the next rows of this stage come from every member: release it to all
                for q in range(self.x_multicast):
                    ptx.mbarrier_arrive_cluster(empty_of[q] + stage * layout.MBARRIER_BYTES,
                                                self.remote_release)
            elif self.multicast:
                # lane-0 build: one remote arrival per warp and member instead of
                # 32 (measured next: whether the 128 c remote arrivals per stage
                # are what makes the multicast slow, docs/NOTES.md)
                ptx.syncwarp()
                for q in range(self.x_multicast):
                    ptx.mbarrier_arrive_cluster_lane0(
                        empty_of[q] + stage * layout.MBARRIER_BYTES, lane)
            elif self.compute_thread_arrive:
                ptx.mbarrier_arrive(self._barrier(smem, self.smem.empty, stage))
            else:
                ptx.syncwarp()
                ptx.mbarrier_arrive_lane0(self._barrier(smem, self.smem.empty, stage), lane)
        if cutlass.const_expr(self.multicast):
            # phase 1: this lane's last remote arrival is made; every CTA waits
            # on it before exiting, so none goes while another may still
            # arrive on its barriers
            ptx.cluster_arrive()

        # split-K reduction: partials to shared, then a fixed-order sum
        red = smem + self.smem.reduction
        if self.split_mbarrier:
            # the first CTA's buffer and partials barrier, as the others address them
            first_red = ptx.map_shared_to_rank(red, Int32(0))
            first_partials = ptx.map_shared_to_rank(smem + self.smem.partials, Int32(0))
        if not self.cluster_split or self.split_vector:
            # (the vector hand-over: each CTA's warps into its own buffer first)
            dest, slot, store = red, warp, ptx.st_shared_f32
            if self.smem.reduction_aliased:
                # the buffer lies over the rings (a ring too deep for both):
                # no partial may land before every compute warp has read its
                # last tile; the copies into the rings all completed before
                # those reads (each waited on its stage's full barrier)
                ptx.named_barrier(1, self.compute_threads)
        elif self.split_mbarrier:
            # The first CTA (rank 0) stores its own partials (slot warp);
            # every other CTA sends its partials (slot rank * 4 + warp) into
            # the first's buffer by st.async, each completing 4 bytes of the
            # first's `partials` mbarrier, and is done: no barrier holds it
            # (only the first CTA's buffer is written remotely, and the first
            # CTA cannot exit before the barrier completes).
            ptx.cluster_wait()  # phase 0: every CTA of the cluster is running
            slot = rank * layout.COMPUTE_WARPS + warp
            remote = cutlass.select_(rank != 0, Int32(1), Int32(0))
        else:
            # "barrier" build: every CTA of the cluster writes its partials
            # into the first CTA's buffer (slot rank * 4 + warp), through
            # distributed shared memory; the first CTA (rank 0) maps to itself.
            ptx.cluster_wait()  # phase 0: every CTA of the cluster is running
            dest = ptx.map_shared_to_rank(red, Int32(0))
            slot = rank * layout.COMPUTE_WARPS + warp
            store = ptx.st_shared_cluster_f32
            if cutlass.const_expr(self.split_reduce == "no-remote"):
                dest, store = red, ptx.st_shared_f32  # diagnostic: the partials stay here
        for mi in range(m_iters):
            for ni in range(n_iters):
                for reg in range(4):
                    row, token = layout.accumulator_coords(lane, mi, ni, reg)
                    offset = layout.reduction_offset(slot, token, row, t.output_tile, t.token_tile)
                    if self.split_mbarrier and not self.split_vector:
                        ptx.st_partial_f32(red + offset * 4, first_red + offset * 4,
                                           first_partials, acc[mi][ni][reg], remote)
                    else:
                        store(dest + offset * 4, acc[mi][ni][reg])
        self._stamp("partials_stored", tidx == 0)
        if not self.cluster_split:
            ptx.named_barrier(1, self.compute_threads)
        elif self.split_vector:
            # this CTA's warps' partials in; phase 0 (every CTA of the
            # cluster running, the first's mbarrier armed) before the sends
            ptx.named_barrier(1, self.compute_threads)
            ptx.cluster_wait()
        elif self.split_mbarrier:
            # the first CTA: its own warps' partials, then the others' bytes
            # (acquire at cluster scope); the others store nothing after this
            ptx.named_barrier(1, self.compute_threads)
            ptx.mbarrier_wait(smem + self.smem.partials, 0, cluster=True,
                              predicate=cutlass.select_(rank == 0, Int32(1), Int32(0)))
        else:
            # phase 1: all partials written (release) and visible (acquire);
            # rank 0 also cannot exit before the others' stores have landed.
            # Every interleaving of this protocol: tests/test_layout.py
            # (explore_cluster).
            ptx.cluster_arrive()
            ptx.cluster_wait()
        self._stamp("reduced", tidx == 0)
        vectors = layout.epilogue_vectors(t.output_tile, t.token_tile)
        for round_ in range(layout.epilogue_rounds(t.output_tile, t.token_tile)):
            vector = round_ * self.compute_threads + tidx
            # threads past the tile's vectors read a valid slot and store nothing
            token, row = layout.epilogue_coords(vector % vectors, t.output_tile)
            total = [Float32(0.0)] * layout.CHUNK
            warps = (layout.COMPUTE_WARPS * self.k_split
                     if self.cluster_split and not self.split_vector else layout.COMPUTE_WARPS)
            for w in range(warps):
                offset = layout.reduction_offset(w, token, row, t.output_tile, t.token_tile)
                part = (ptx.ld_shared_v4_f32(red + offset * 4)
                        + ptx.ld_shared_v4_f32(red + (offset + 4) * 4))
                total = part if w == 0 else [total[j] + part[j] for j in range(layout.CHUNK)]
            if self.split_vector:
                # the others send this CTA's sum (rank 0 would send to slot 3,
                # its own warp's, if it sent: it does not), the first adds
                # theirs in rank order once its mbarrier says all are in
                send = (cutlass.select_(vector < vectors, Int32(1), Int32(0))
                        * cutlass.select_(rank != 0, Int32(1), Int32(0)))
                offset = layout.reduction_offset(layout.split_sum_slot(rank), token, row,
                                                 t.output_tile, t.token_tile)
                ptx.st_async_v4_f32_if(first_red + offset * 4, first_partials, total[:4], send)
                ptx.st_async_v4_f32_if(first_red + (offset + 4) * 4, first_partials, total[4:],
                                       send)
                ptx.mbarrier_wait(smem + self.smem.partials, 0, cluster=True,
                                  predicate=cutlass.select_(rank == 0, Int32(1), Int32(0)))
                for q in range(1, self.k_split):
                    offset = layout.reduction_offset(layout.split_sum_slot(q), token, row,
                                                     t.output_tile, t.token_tile)
                    part = (ptx.ld_shared_v4_f32(red + offset * 4)
                            + ptx.ld_shared_v4_f32(red + (offset + 4) * 4))
                    total = [total[j] + part[j] for j in range(layout.CHUNK)]
            global_token = tile_t * t.token_tile + token
            n_index = tile_n * t.output_tile + row
            store = (cutlass.select_(vector < vectors, Int32(1), Int32(0))
                     * cutlass.select_(global_token < m, Int32(1), Int32(0)))
            if self.cluster_split:
                # only the first CTA holds the sums; the others read their own
                # (unused) buffer and store nothing
                store = store * cutlass.select_(rank == 0, Int32(1), Int32(0))
            if cutlass.const_expr(self.has_bias):
                b_vals = ptx.ld_global_bf16x8_as_f32(
                    bias.toint() + Int64(n_index * _BYTES), store)
                total = [total[j] + b_vals[j] for j in range(layout.CHUNK)]
            words = [ptx.pack_bf16x2(total[2 * j], total[2 * j + 1]) for j in range(4)]
            address = (out.toint()
                       + Int64(global_token) * (self.n * _BYTES) + Int64(n_index * _BYTES))
            ptx.st_global_v4_b32_if(address, words, store)
        self._stamp("stored", tidx == 0)
        if cutlass.const_expr(self.multicast):
            ptx.cluster_wait()  # phase 1 (see above)
