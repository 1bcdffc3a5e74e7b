"""A NumPy model of the kernel's data movement, built on ``layout.py``.

It does what the CTA does, thread by thread and lane by lane, with the same
address functions the kernel traces: every loader thread's 16-byte copies
into the swizzled ring stages, every lane's ``ldmatrix.x4`` row address and
the registers it receives, ``mma.sync.m16n8k16``'s fragment semantics, the
split-K reduction through the padded shared buffer and the epilogue's
vector stores. If an offset in ``layout.py`` is wrong, the result here is
wrong; if the result here equals ``x @ W^T`` exactly on integer inputs, the
offsets are a correct mapping.

The bank-conflict and coverage checks at the bottom read the same functions.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from . import layout
from ..tactics import BULK, MAX_M, TMA, WarpSplitKTactic, check_tactic

# ----------------------------------------------------------- primitives


def ldmatrix_x4(smem: np.ndarray, lane_offsets) -> np.ndarray:
    """Registers ``[lane, matrix, 2]`` of ``ldmatrix.sync.m8n8.x4.b16``.

    Lane ``8 j + r`` gives the address of row ``r`` of matrix ``j`` (8
    consecutive elements); lane ``t`` receives elements ``2 (t % 4)`` and
    ``+1`` of row ``t // 4`` of each matrix.
    """
    regs = np.empty((layout.WARP, 4, 2), dtype=smem.dtype)
    for lane in range(layout.WARP):
        for j in range(4):
            row_start = lane_offsets[8 * j + lane // 4]
            first = row_start + 2 * (lane % 4)
            regs[lane, j] = smem[first:first + 2]
    return regs


def mma_m16n8k16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``d = A @ B + C`` with operands given as per-lane registers.

    a: ``[lane, 4, 2]`` (a0..a3), b: ``[lane, 2, 2]`` (b0, b1),
    c: ``[lane, 4]`` FP32 (c0..c3). Lane ``l`` has group ``g = l // 4`` and
    ``q = l % 4``: a0 = A[g, 2q:2q+2], a1 = A[g+8, 2q:], a2 = A[g, 2q+8:],
    a3 = A[g+8, 2q+8:]; b0 = B[2q:2q+2, g], b1 = B[2q+8:2q+10, g];
    c0, c1 = C[g, 2q], C[g, 2q+1]; c2, c3 = C[g+8, 2q], C[g+8, 2q+1].
    """
    A = np.zeros((16, 16), dtype=np.float32)
    B = np.zeros((16, 8), dtype=np.float32)
    C = np.zeros((16, 8), dtype=np.float32)
    for lane in range(layout.WARP):
        g, q = lane // 4, lane % 4
        A[g, 2 * q:2 * q + 2] = a[lane, 0]
        A[g + 8, 2 * q:2 * q + 2] = a[lane, 1]
        A[g, 2 * q + 8:2 * q + 10] = a[lane, 2]
        A[g + 8, 2 * q + 8:2 * q + 10] = a[lane, 3]
        B[2 * q:2 * q + 2, g] = b[lane, 0]
        B[2 * q + 8:2 * q + 10, g] = b[lane, 1]
        C[g, 2 * q:2 * q + 2] = c[lane, 0:2]
        C[g + 8, 2 * q:2 * q + 2] = c[lane, 2:4]
    D = (A @ B + C).astype(np.float32)
    d = np.empty((layout.WARP, 4), dtype=np.float32)
    for lane in range(layout.WARP):
        g, q = lane // 4, lane % 4
        d[lane, 0:2] = D[g, 2 * q:2 * q + 2]
        d[lane, 2:4] = D[g + 8, 2 * q:2 * q + 2]
    return d


def round_bf16(values: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 (round to nearest even) -> FP32, as ``cvt.rn.bf16x2.f32``."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    nan = np.isnan(values)
    out = rounded.view(np.float32).copy()
    out[nan] = np.nan
    return out


# ------------------------------------------------------------ the CTA


def _load_stage(ring, stage_base, source_rows, k_tile_index, rows, k_tile, threads, writes=None,
                kind="swizzle"):
    """Every loader thread's copies of one K tile. ``source_rows[row]`` is the
    global row (None: past M, zero-filled without a read). ``kind``: the
    stage layout (``layout.B_LAYOUTS``' 16-byte-copy ones, or "fp8" for an
    FP8 weight stage, 16 bytes of ``layout.FP8_CHUNK`` weights per copy)."""
    chunk = layout.FP8_CHUNK if kind == "fp8" else layout.CHUNK
    for thread in range(threads):
        for copy in range(layout.copies_per_thread(rows, k_tile, threads, chunk)):
            row, col = layout.loader_copy(thread, copy, k_tile, threads, chunk)
            dst = stage_base + (layout.fp8_swizzle(row, col, k_tile) if kind == "fp8"
                                else layout.b_offset(row, col, k_tile, kind))
            src = source_rows[row]
            if src is None:
                ring[dst:dst + chunk] = 0
            else:
                start = k_tile_index * k_tile + col
                ring[dst:dst + chunk] = src[start:start + chunk]
            if writes is not None:
                writes[dst:dst + chunk] += 1


def _bulk_stage(ring, source_rows, k_tile_index, k_tile, writes=None):
    """An activation stage filled by bulk copies (``x_copy`` bulk): one bulk
    copy per token row inside M, whole, into the row-padded stage; rows past M are not
    copied and keep whatever the stage held (their outputs are never stored)."""
    for row, src in enumerate(source_rows):
        if src is None:
            continue
        dst = layout.padded(row, 0, k_tile)
        start = k_tile_index * k_tile
        ring[dst:dst + k_tile] = src[start:start + k_tile]
        if writes is not None:
            writes[dst:dst + k_tile] += 1


def _tma_stage(ring, source_rows, k_tile_index, token_tile, k_tile, writes=None):
    """An activation stage filled by TMA boxes (``x_copy`` tma): box ``b``
    holds 64 columns of every token row of the tile, 16-byte chunks placed by
    ``layout.tma_swizzle``; rows past M arrive as zeros (the tensor map's
    bounds), like every other row written exactly once."""
    first = k_tile_index * k_tile
    for box in range(layout.tma_boxes(k_tile)):
        for row, src in enumerate(source_rows):
            for chunk in range(layout.TMA_BOX_COLS // layout.CHUNK):
                col = box * layout.TMA_BOX_COLS + chunk * layout.CHUNK
                dst = layout.tma_swizzle(row, col, k_tile, token_tile)
                ring[dst:dst + layout.CHUNK] = (0.0 if src is None
                                                else src[first + col:first + col + layout.CHUNK])
                if writes is not None:
                    writes[dst:dst + layout.CHUNK] += 1


def _check_stage_coverage(i, a_writes, b_writes, token_rows, t, bulk):
    """Every element of K tile ``i``'s stages written exactly once (with
    bulk copies: each token row inside M once, no pad and no row past M)."""
    if bulk:
        b_stage = len(b_writes)
        expected = np.zeros(b_stage, dtype=np.int64)
        for row, src in enumerate(token_rows):
            if src is not None:
                start = layout.padded(row, 0, t.k_tile)
                expected[start:start + t.k_tile] = 1
        b_ok = np.array_equal(b_writes, expected)
    else:
        b_ok = np.all(b_writes == 1)
    if not (np.all(a_writes == 1) and b_ok):
        raise AssertionError(f"stage of K tile {i}: elements written "
                             f"{sorted(set(a_writes) | set(b_writes))} times, expected once")


def _mma_tile(acc, a_view, b_view, t, kind):
    """The four compute warps' MMAs over one K tile's stages, into ``acc``:
    each warp its quarter of the tile's K steps, fragments by ``ldmatrix``."""
    lanes = range(layout.WARP)
    m_iters, n_iters = acc.shape[1], acc.shape[2]
    for warp in range(layout.COMPUTE_WARPS):
        for p in range(layout.k_steps(t.k_tile) // 2):
            b_regs = [ldmatrix_x4(b_view, [layout.b_fragment_offset(lane, warp, ni, p, t.k_tile,
                                                                    kind, t.token_tile)
                                           for lane in lanes])
                      for ni in range(n_iters)]
            for half in range(2):
                s = 2 * p + half
                for mi in range(m_iters):
                    a_regs = ldmatrix_x4(a_view, [layout.a_fragment_offset(lane, warp, mi, s,
                                                                           t.k_tile)
                                                  for lane in lanes])
                    for ni in range(n_iters):
                        b_step = b_regs[ni][:, 2 * half:2 * half + 2]
                        acc[warp, mi, ni] = mma_m16n8k16(a_regs, b_step, acc[warp, mi, ni])


def fp8_to_bf16(codes) -> np.ndarray:
    """e4m3 bytes -> the BF16 values the kernel multiplies (as float32): the
    bits ``layout.fp8_to_bf16_bits`` makes, times ``2 ** FP8_BF16_SHIFT``
    (one BF16x2 multiply, exact). The NaN codes 0x7f and 0xff come out as
    +-480: the kernel does not see NaN, so prepared FP8 weights are checked
    for them once, on the host."""
    bits = layout.fp8_to_bf16_bits(np.asarray(codes, dtype=np.uint32)) << 16
    return bits.astype(np.uint32).view(np.float32) * np.float32(2.0 ** layout.FP8_BF16_SHIFT)


def fp8x4_to_bf16x2(codes, multiplier=None) -> tuple[np.ndarray, np.ndarray]:
    """The two BF16x2 registers the kernel makes of one 32-bit register of
    four e4m3 bytes (``ptx.fp8x4_to_bf16x2``, ``codes[..., 4]``): the even
    bytes ``(0, 2)`` and the odd ``(1, 3)``, each pair's first in the low
    half. They become the mma's a0/a1 and a2/a3 registers as they are.
    ``multiplier``: a block scale as ``block_multiplier`` makes it, each
    weight times it rounded to BF16 (the product of a 4-bit and an 8-bit
    significand is exact in FP32, so one rounding, as the BF16x2 multiply)."""
    values = fp8_to_bf16(codes)
    if multiplier is not None:
        values = round_bf16((values.astype(np.float64) * multiplier).astype(np.float32))
    return values[..., [0, 2]], values[..., [1, 3]]


def block_multiplier(scale) -> np.float64:
    """The block scale the kernel folds into a conversion
    (``ptx.block_multiplier``): ``scale * 2 ** 120`` rounded to BF16, so the
    scale to BF16's 8 significant bits (``contract.FP8_BLOCK_SCALE_BOUND``
    keeps it finite)."""
    shifted = np.float32(np.float64(np.float32(scale)) * 2.0 ** layout.FP8_BF16_SHIFT)
    return np.float64(round_bf16(shifted.reshape(1))[0]) * 2.0 ** -layout.FP8_BF16_SHIFT


def e4m3_value(codes) -> np.ndarray:
    """The value of each e4m3 byte by the format's definition (bias 7,
    subnormals, NaN at 0x7f and 0xff, no infinities): float64."""
    codes = np.asarray(codes, dtype=np.int64)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6,
                         (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where(codes & 0x80, -magnitude, magnitude)
    return np.where((codes & 0x7F) == 0x7F, np.nan, value)


def ld_shared_v2(view: np.ndarray, lane_offsets) -> np.ndarray:
    """Four consecutive elements per lane (one 8-byte ``ld.shared.v2.b32``
    of BF16): ``[lane, 4]``."""
    return np.stack([view[o:o + 4] for o in lane_offsets])


def _fp8_mma_tile(acc, a_view, b_view, t, multipliers=None):
    """``_mma_tile`` for FP8 weights: one ``ldmatrix.x4`` of weight bytes per
    16 rows and K pair, converted (``fp8x4_to_bf16x2``; ``multipliers[warp,
    m_iter]``: the block scale folded in) into the permuted k slots
    (``layout.fp8_k_of_slot``); the activations of each step by 8-byte loads,
    their B registers permuted alike."""
    lanes = range(layout.WARP)
    m_iters, n_iters = acc.shape[1], acc.shape[2]
    # which of lane t's four activations (k 4t .. 4t + 3) go into its B
    # register of slots (2t, 2t + 1), and into that of (2t + 8, 2t + 9)
    low = [layout.fp8_k_of_slot(slot) for slot in (0, 1)]
    high = [layout.fp8_k_of_slot(slot) for slot in (8, 9)]
    for warp in range(layout.COMPUTE_WARPS):
        for p in range(layout.k_steps(t.k_tile) // 2):
            b_regs = {}
            for ni in range(n_iters):
                for step in range(2):
                    e = ld_shared_v2(b_view, [layout.fp8_b_offset(lane, warp, ni, p, step,
                                                                  t.k_tile, t.token_tile)
                                              for lane in lanes])
                    b_regs[ni, step] = np.stack([e[:, low], e[:, high]], axis=1)
            for mi in range(m_iters):
                offs = [layout.fp8_a_fragment_offset(lane, warp, mi, p, t.k_tile)
                        for lane in lanes]
                # lane 4g + t of matrix j: row g's bytes 4t .. 4t + 3
                codes = np.stack([[a_view[offs[8 * j + lane // 4] + 4 * (lane % 4):][:4]
                                   for j in range(4)] for lane in lanes])
                even, odd = fp8x4_to_bf16x2(  # [lane, matrix, 2] each
                    codes, None if multipliers is None else multipliers[warp][mi])
                for step in range(2):
                    top, bottom = 2 * step, 2 * step + 1  # rows 0-7, rows 8-15
                    a_regs = np.stack([even[:, top], even[:, bottom],
                                       odd[:, top], odd[:, bottom]], axis=1)
                    for ni in range(n_iters):
                        acc[warp, mi, ni] = mma_m16n8k16(a_regs, b_regs[ni, step],
                                                         acc[warp, mi, ni])


def _accumulate(x, weight, tactic, tile_n, tile_t, check_coverage, swiglu=False, fp8=False,
                blocks=None):
    """One CTA's K loop over ``x`` and ``weight`` (its share of K): the four
    compute warps' FP32 accumulators ``[warp, m_iter, n_iter, lane, reg]``.
    ``fp8``: ``weight`` holds e4m3 bytes (uint8). ``blocks``: ``(block
    scales [N / 128, K / 128], k of this share's first column, its K
    tiles)``: each
    warp's conversion of 16 rows of a tile folds in their block's scale
    (``_tile_multipliers``)."""
    t = tactic
    m, k = x.shape
    k_tiles = k // t.k_tile
    bulk = t.x_copy == BULK  # row-padded stages filled by bulk copies
    kind = layout.FP8_ACTIVATION_LAYOUT if fp8 else t.activation_layout
    a_stage = t.output_tile * t.k_tile
    b_stage = t.token_tile * (t.k_tile + (layout.B_ROW_PAD if bulk else 0))
    # an FP8 ring starts as 0x7f bytes, which convert to 480, never a weight
    # of the integer tests: a missed copy shows
    a_ring = (np.full(t.stages * a_stage, 0x7F, dtype=np.uint8) if fp8 else
              np.full(t.stages * a_stage, np.nan, dtype=np.float32))
    b_ring = np.full(t.stages * b_stage, np.nan, dtype=np.float32)
    a_threads = layout.A_LOADER_WARPS * layout.WARP
    b_threads = t.b_loader_warps * layout.WARP
    n = weight.shape[0]
    weight_rows = [weight[layout.weight_row(tile_n, r, t.output_tile, n, swiglu)]
                   for r in range(t.output_tile)]
    token_rows = []
    for r in range(t.token_tile):
        token = tile_t * t.token_tile + r
        token_rows.append(x[token] if token < m else None)
    m_iters = t.output_tile // layout.MMA_M
    n_iters = layout.mma_token_blocks(t.token_tile)
    acc = np.zeros((layout.COMPUTE_WARPS, m_iters, n_iters, layout.WARP, 4), dtype=np.float32)
    for i in range(k_tiles):
        stage, _ = layout.ring_slot(i, t.stages)
        a_writes = np.zeros(a_stage, dtype=np.int64) if check_coverage else None
        b_writes = np.zeros(b_stage, dtype=np.int64) if check_coverage else None
        a_view = a_ring[stage * a_stage:(stage + 1) * a_stage]
        b_view = b_ring[stage * b_stage:(stage + 1) * b_stage]
        a_view[:] = 0x7F if fp8 else np.nan  # a stale stage must not hide a missed copy
        b_view[:] = np.nan
        _load_stage(a_view, 0, weight_rows, i, t.output_tile, t.k_tile, a_threads, a_writes,
                    "fp8" if fp8 else "swizzle")
        if t.x_copy == TMA:
            _tma_stage(b_view, token_rows, i, t.token_tile, t.k_tile, b_writes)
        elif bulk:
            _bulk_stage(b_view, token_rows, i, t.k_tile, b_writes)
        else:
            _load_stage(b_view, 0, token_rows, i, t.token_tile, t.k_tile, b_threads, b_writes,
                        kind)
        if check_coverage:
            _check_stage_coverage(i, a_writes, b_writes, token_rows, t, bulk)
        if blocks is not None:
            _fp8_mma_tile(acc, a_view, b_view, t,
                          _tile_multipliers(blocks, t, tile_n, i, n, swiglu, acc.shape[1]))
        elif fp8:
            _fp8_mma_tile(acc, a_view, b_view, t)
        else:
            _mma_tile(acc, a_view, b_view, t, kind)
    return acc


def silu_mul(gate, up):
    """``silu(gate) * up`` in FP32 as the SwiGLU epilogue computes it:
    ``exp(-g)`` as ``2 ** (g * -log2(e))`` (``ex2.approx``), the reciprocal
    of ``1 + exp(-g)`` (``rcp.approx``), times g, times ``up``; each step
    rounded to FP32 (the GPU's approximations differ in the last bit or
    two)."""
    g = np.asarray(gate, dtype=np.float32)
    with np.errstate(over="ignore", divide="ignore"):
        e = np.exp2((g * NEG_LOG2E).astype(np.float32)).astype(np.float32)
        rcp = (np.float32(1.0) / (e + np.float32(1.0)).astype(np.float32)).astype(np.float32)
    silu = (g * rcp).astype(np.float32)
    return (silu * np.asarray(up, dtype=np.float32)).astype(np.float32)


#: -log2(e) rounded to FP32, the constant the SwiGLU epilogue multiplies by
NEG_LOG2E = np.float32(-1.4426950408889634)


def emulate_cta(x, weight, tactic, tile_n, tile_t, bias=None, *, swiglu=False,
                check_coverage=False, scale=None):
    """Output vectors ``{(token, first output column): 8 FP32}`` one CTA
    (with ``k_split`` > 1: one cluster of CTAs sharing K) stores. Every
    warp's partials land in the first CTA's buffer (slot ``rank * 4 +
    warp``), each word once. With ``swiglu``, each vector is ``silu(gate) *
    up`` of the tile's gate rows and the up rows half a tile further. With
    ``scale`` (float32 ``[N]``), ``weight`` is e4m3 bytes and each output
    column's sum is multiplied by its scale before the bias; with a 2-D
    ``scale`` (block scales, ``layout.fp8_scale_blocks``) each weight is,
    in its conversion."""
    blocks = scale if scale is not None and scale.ndim == 2 else None
    buf = _reduction_buffer(x, weight, tactic, tile_n, tile_t, swiglu, check_coverage,
                            scale is not None, blocks)
    return _epilogue(buf, x.shape[0], weight.shape[0] // 2, tactic, tile_n, tile_t, bias, swiglu,
                     None if blocks is not None else scale)


def _tile_multipliers(blocks, t, tile_n, tile, n, swiglu, m_iters):
    """``[warp][m_iter]``: the ``block_multiplier`` of each warp's quarter of
    K tile ``tile`` and of the weight rows its 16 hold (``blocks``: the
    scales, this share's first k and its tile count (a tile past it, a
    zero tile of one loop for every rank, reads the scale at k = 0); ``n``
    rows; ``swiglu``: gate or up rows)."""
    scales, k_first, share_tiles = blocks
    k_total = scales.shape[1] * layout.FP8_SCALE_BLOCK
    flat = scales.reshape(-1)
    out = []
    for warp in range(layout.COMPUTE_WARPS):
        k0 = (k_first + tile * t.k_tile + layout.warp_k_start(warp, t.k_tile)
              if tile < share_tiles else 0)
        rows = [layout.weight_row(tile_n, mi * layout.MMA_M, t.output_tile, n, swiglu)
                for mi in range(m_iters)]
        out.append([block_multiplier(flat[layout.fp8_block_scale_index(row, k0, k_total)])
                    for row in rows])
    return out


def _reduction_buffer(x, weight, t, tile_n, tile_t, swiglu, check_coverage, fp8=False,
                      blocks=None):
    """The first CTA's reduction buffer (the only one a K split writes):
    each CTA of the cluster accumulates its share of K, each warp stores its
    accumulators into its slot."""
    slots = t.k_split * layout.COMPUTE_WARPS
    words = slots * layout.reduction_tokens(t.token_tile) * layout.reduction_row_words(t.output_tile)
    buf = np.full(words, np.nan, dtype=np.float32)
    k_tiles = x.shape[1] // t.k_tile
    one_loop = t.one_loop_split(x.shape[1], fp8)
    for rank in range(t.k_split):
        # this CTA's K tiles (an uneven split: the first CTAs one more)
        first, tiles = layout.k_share(rank, k_tiles, t.k_split)
        share = slice(first * t.k_tile, (first + tiles) * t.k_tile)
        xs, ws = x[:, share], weight[:, share]
        if one_loop and not layout.split_tile_present(rank, tiles, k_tiles, t.k_split):
            # one loop for every rank: a shorter rank's last tile, past its
            # share, is copied as zeros (its block scale read at k = 0)
            xs = np.concatenate([xs, np.zeros((xs.shape[0], t.k_tile), xs.dtype)], axis=1)
            ws = np.concatenate([ws, np.zeros((ws.shape[0], t.k_tile), ws.dtype)], axis=1)
        acc = _accumulate(xs, ws, t, tile_n, tile_t, check_coverage, swiglu, fp8,
                          None if blocks is None else (blocks, share.start, tiles))
        for warp, mi, ni, lane, reg in np.ndindex(acc.shape):
            row, token = layout.accumulator_coords(lane, mi, ni, reg)
            off = layout.reduction_offset(rank * layout.COMPUTE_WARPS + warp, token, row,
                                          t.output_tile, t.token_tile)
            if check_coverage and not np.isnan(buf[off]):
                raise AssertionError(f"reduction word {off} written twice")
            buf[off] = acc[warp, mi, ni, lane, reg]
    return buf


def _epilogue(buf, m, half, t, tile_n, tile_t, bias, swiglu, scale=None):
    """What the epilogue threads store from ``buf``: every warp's partials
    summed in slot order (the kernel's fixed order), the bias added, the
    SwiGLU applied."""
    slots = t.k_split * layout.COMPUTE_WARPS
    rows = layout.output_rows(t.output_tile, swiglu)
    vectors = layout.epilogue_vectors(t.output_tile, t.token_tile, swiglu)
    threads = layout.COMPUTE_WARPS * layout.WARP
    coords = [layout.epilogue_coords(v % vectors, rows)
              for round_ in range(layout.epilogue_rounds(t.output_tile, t.token_tile, swiglu))
              for v in range(round_ * threads, (round_ + 1) * threads)]

    def reduce(token, row):
        total = np.zeros(layout.CHUNK, dtype=np.float32)
        for slot in range(slots):
            off = layout.reduction_offset(slot, token, row, t.output_tile, t.token_tile)
            total = (total + buf[off:off + layout.CHUNK]).astype(np.float32)
        return total

    stores = {}
    for vector, (token, row) in enumerate(coords):
        total = reduce(token, row)
        up = reduce(token, row + rows) if swiglu else None
        global_token = tile_t * t.token_tile + token
        if vector < vectors and global_token < m:
            n0 = tile_n * rows + row
            if scale is not None:
                total = (total * scale[n0:n0 + layout.CHUNK]).astype(np.float32)
                if swiglu:
                    up = (up * scale[half + n0:half + n0 + layout.CHUNK]).astype(np.float32)
            if bias is not None:
                total = (total + bias[n0:n0 + layout.CHUNK]).astype(np.float32)
                if swiglu:
                    up = (up + bias[half + n0:half + n0 + layout.CHUNK]).astype(np.float32)
            if swiglu:
                total = silu_mul(total, up)
            if (global_token, n0) in stores:
                raise AssertionError(f"output vector {(global_token, n0)} stored twice")
            stores[(global_token, n0)] = total
    return stores


def _float32(name, value):
    """``value`` (a NumPy array or scalar, or a torch tensor of any dtype on
    any device) as a float32 NumPy array."""
    torch = sys.modules.get("torch")  # not loaded: value is no tensor
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        # NumPy has no bfloat16 or float8; float32 holds every narrower float
        # exactly, and float64 goes through NumPy's rounding as an array would
        if value.dtype.is_floating_point and value.dtype != torch.float64:
            value = value.float()
        value = value.resolve_conj().resolve_neg().numpy()
    elif not isinstance(value, (np.ndarray, np.generic)):
        raise ValueError(f"{name} must be a NumPy array or a torch.Tensor, "
                         f"got {type(value).__name__}")
    return np.asarray(value, dtype=np.float32)


def emulate(x, weight, tactic: WarpSplitKTactic, bias=None, *, swiglu=False, round_output=True,
            check_coverage=False) -> np.ndarray:
    """What the kernel writes for ``out = x @ weight.T (+ bias)``, as float32;
    with ``swiglu`` (``weight`` is ``[gate; up]``, ``N = 2 I``), ``out[:, j] =
    silu(g_j) * u_j`` where ``g = x @ gate.T (+ bias[:I])`` and ``u = x @
    up.T (+ bias[I:])``, ``[M, I]``.

    ``round_output`` applies the kernel's final BF16 rounding; without it the
    FP32 sums come back (exact for small-integer inputs). Raises if any output
    element is written twice or not at all. ``x``, ``weight`` and ``bias``:
    NumPy arrays or torch tensors (any dtype, any device), rounded to BF16
    first, as the kernel's operands are (BF16 values pass unchanged).
    """
    x = round_bf16(_float32("x", x))
    weight = round_bf16(_float32("weight", weight))
    n, k = _problem_shape(x, weight)
    check_tactic(tactic, n, k, swiglu=swiglu)
    out = _run_grid(x, weight, tactic, _bias(bias, n), swiglu, check_coverage)
    return round_bf16(out) if round_output else out


def _problem_shape(x, weight) -> tuple[int, int]:
    """``(N, K)`` of ``x [M, K]`` and ``weight [N, K]``; ``ValueError``
    unless both are 2-D, K agrees and M is in 1..``MAX_M``."""
    if x.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"x [M, K] and weight [N, K] must be 2-D, got shapes {x.shape} and "
                         f"{weight.shape}")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w:
        raise ValueError(f"x has K={k} but weight has K={k_w}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M must be in 1..{MAX_M}, got {m}")
    return n, k


def _bias(bias, n):
    """``bias`` as BF16-rounded float32 ``[n]`` (None stays None)."""
    if bias is None:
        return None
    bias = _float32("bias", bias)
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    return round_bf16(bias)


def _run_grid(x, weight, tactic, bias, swiglu, check_coverage, scale=None):
    """Every CTA of the grid, each output element checked stored once: FP32."""
    m = x.shape[0]
    n = weight.shape[0]
    columns = n // 2 if swiglu else n
    out = np.full((m, columns), np.nan, dtype=np.float32)
    written = np.zeros((m, columns), dtype=np.int64)
    # a mixed grid (half_tiles): its last CTAs along N run the half tile's code
    full, half = layout.row_tiles(n, tactic.output_tile, tactic.half_tiles)
    half_tactic = dataclasses.replace(tactic, output_tile=tactic.output_tile // 2, half_tiles=0)
    for tile_n in range(full + half):
        rows, index = layout.cta_rows(tile_n, tactic.output_tile, full)
        cta_tactic = tactic if rows == tactic.output_tile else half_tactic
        for tile_t in range(-(-m // tactic.token_tile)):
            stores = emulate_cta(x, weight, cta_tactic, index, tile_t, bias, swiglu=swiglu,
                                 check_coverage=check_coverage, scale=scale)
            for (token, n0), values in stores.items():
                out[token, n0:n0 + layout.CHUNK] = values
                written[token, n0:n0 + layout.CHUNK] += 1
    if not np.all(written == 1):
        raise AssertionError("output elements written "
                             f"{sorted(set(written.ravel().tolist()))} times, expected once")
    return out


def _fp8_codes(weight) -> np.ndarray:
    """``weight`` (a torch float8_e4m3fn tensor or e4m3 bytes as uint8) as a uint8 array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(weight, torch.Tensor):
        if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"weight must be float8_e4m3fn (or its bytes as uint8), "
                             f"got {weight.dtype}")
        return weight.detach().cpu().contiguous().view(torch.uint8).numpy()
    if not isinstance(weight, np.ndarray) or weight.dtype != np.uint8:
        raise ValueError("weight must be e4m3 bytes: a uint8 NumPy array or a float8_e4m3fn "
                         f"tensor, got {type(weight).__name__} {getattr(weight, 'dtype', '')}")
    return weight


def emulate_fp8(x, weight, scale, tactic: WarpSplitKTactic, bias=None, *, swiglu=False,
                round_output=True, check_coverage=False) -> np.ndarray:
    """What the FP8-weight kernel writes for ``out = x @ (scale * W)^T (+
    bias)``, as float32: ``weight`` ``[N, K]`` e4m3 (a float8_e4m3fn tensor or
    its bytes as uint8), ``scale`` one FP32 for the tensor or ``[N]`` per
    output channel or ``layout.fp8_scale_blocks(N, K)`` per 128 x 128 block,
    ``x`` and ``bias`` rounded to BF16 as for ``emulate``.
    The weights go through the kernel's conversion (``fp8_to_bf16``), its
    k permutation and its loads; the scale multiplies each column's FP32
    sum (a block scale: each weight in its conversion, rounded to BF16), then the
    bias is added; with ``swiglu`` (``weight`` is ``[gate; up]``) the gate
    and up sums, each so, make ``silu(gate) * up`` as ``emulate``'s."""
    x = round_bf16(_float32("x", x))
    codes = _fp8_codes(weight)
    n, k = _problem_shape(x, codes)
    check_tactic(tactic, n, k, swiglu=swiglu, fp8=True)
    scale = _float32("scale", scale)
    if scale.shape == layout.fp8_scale_blocks(n, k) and scale.size > 1 and scale.ndim == 2:
        if tactic.half_tiles:
            raise ValueError("block scales take no mixed grid (half_tiles)")
    else:
        scale = scale.reshape(-1)
        if scale.shape not in ((1,), (n,)):
            raise ValueError(f"scale must be one value, [N] = ({n},) or the block scales "
                             f"{layout.fp8_scale_blocks(n, k)}, got shape {scale.shape}")
        scale = np.broadcast_to(scale, (n,)).astype(np.float32)
    out = _run_grid(x, codes, tactic, _bias(bias, n), swiglu, check_coverage, scale)
    return round_bf16(out) if round_output else out


# ------------------------------------------------------- bank checks


BANKS = 32


def conflict_free(byte_addresses, nbytes) -> bool:
    """True if one shared-memory wavefront serves all these accesses: the
    words they touch fall in distinct banks (same-word broadcasts aside)."""
    seen = {}
    for address in byte_addresses:
        for w in range(nbytes // 4):
            word = address // 4 + w
            bank = word % BANKS
            if seen.setdefault(bank, word) != word:
                return False
    return True


def ldmatrix_phases(lane_offsets_elements):
    """The four 8-lane phases of an ``ldmatrix.x4``: each reads 8 rows of 16 B."""
    return [[lane_offsets_elements[8 * j + r] * layout.ELEMENT_BYTES for r in range(8)]
            for j in range(4)]


def _bf16_stage_byte(row, col, k_tile):
    return layout.swizzle(row, col, k_tile) * layout.ELEMENT_BYTES


def copy_store_phases(rows, k_tile, threads, copy, chunk=layout.CHUNK, place=_bf16_stage_byte):
    """Quarter-warp phases (8 threads x 16 B) of one cp.async copy round of
    ``chunk`` elements per copy, each at byte ``place(row, col, k_tile)``."""
    phases = []
    for first in range(0, threads, 8):
        group = []
        for thread in range(first, first + 8):
            row, col = layout.loader_copy(thread, copy, k_tile, threads, chunk)
            group.append(place(row, col, k_tile))
        phases.append(group)
    return phases


def bank_conflicts(tactic: WarpSplitKTactic) -> list[str]:
    """Every shared-memory access pattern of the tactic that needs more than
    one wavefront per phase; empty when the layout is conflict-free."""
    t = tactic
    problems = []
    lanes = range(layout.WARP)
    bulk = t.async_activation_ring
    kind = t.activation_layout
    copied = [(t.output_tile, layout.A_LOADER_WARPS * layout.WARP, "A copy")]
    if not bulk:  # these stages are written by bulk or TMA copies, not by threads
        copied.append((t.token_tile, t.b_loader_warps * layout.WARP, "B copy"))
    for rows, threads, name in copied:
        for copy in range(layout.copies_per_thread(rows, t.k_tile, threads)):
            for phase in copy_store_phases(rows, t.k_tile, threads, copy):
                if not conflict_free(phase, 16):
                    problems.append(f"{name} round {copy}: {phase}")
    for warp in range(layout.COMPUTE_WARPS):
        for s in range(layout.k_steps(t.k_tile)):
            for mi in range(t.output_tile // layout.MMA_M):
                offs = [layout.a_fragment_offset(lane, warp, mi, s, t.k_tile) for lane in lanes]
                for phase in ldmatrix_phases(offs):
                    if not conflict_free(phase, 16):
                        problems.append(f"A ldmatrix warp {warp} step {s} m {mi}: {phase}")
        for p in range(layout.k_steps(t.k_tile) // 2):
            for ni in range(layout.mma_token_blocks(t.token_tile)):
                offs = [layout.b_fragment_offset(lane, warp, ni, p, t.k_tile, kind, t.token_tile)
                        for lane in lanes]
                for phase in ldmatrix_phases(offs):
                    if not conflict_free(phase, 16):
                        problems.append(f"B ldmatrix warp {warp} pair {p} n {ni}: {phase}")
        for mi in range(t.output_tile // layout.MMA_M):
            for ni in range(layout.mma_token_blocks(t.token_tile)):
                for reg in range(4):
                    addrs = []
                    for lane in lanes:
                        row, token = layout.accumulator_coords(lane, mi, ni, reg)
                        addrs.append(4 * layout.reduction_offset(warp, token, row, t.output_tile,
                                                                 t.token_tile))
                    if not conflict_free(addrs, 4):
                        problems.append(f"reduction store warp {warp} m {mi} n {ni} reg {reg}")
    return problems


def fp8_bank_conflicts(tactic: WarpSplitKTactic) -> list[str]:
    """``bank_conflicts`` for the FP8-weight kernel: its weight copies and
    ``ldmatrix`` reads of byte stages (``layout.fp8_swizzle``), its
    activation copies into "pairs" stages and their 8-byte B loads (two
    16-lane phases each), and the reduction stores."""
    t = tactic
    problems = []
    lanes = range(layout.WARP)
    a_threads = layout.A_LOADER_WARPS * layout.WARP
    b_threads = t.b_loader_warps * layout.WARP
    copied = [(t.output_tile, a_threads, layout.FP8_CHUNK, layout.fp8_swizzle, "A copy"),
              (t.token_tile, b_threads, layout.CHUNK,
               lambda r, c, kt: layout.swizzle_pairs(r, c, kt) * layout.ELEMENT_BYTES, "B copy")]
    for rows, threads, chunk, place, name in copied:
        for copy in range(layout.copies_per_thread(rows, t.k_tile, threads, chunk)):
            for phase in copy_store_phases(rows, t.k_tile, threads, copy, chunk, place):
                if not conflict_free(phase, 16):
                    problems.append(f"{name} round {copy}: {phase}")
    for warp in range(layout.COMPUTE_WARPS):
        for p in range(layout.k_steps(t.k_tile) // 2):
            for mi in range(t.output_tile // layout.MMA_M):
                offs = [layout.fp8_a_fragment_offset(lane, warp, mi, p, t.k_tile)
                        for lane in lanes]
                for j in range(4):
                    if not conflict_free([offs[8 * j + r] for r in range(8)], 16):
                        problems.append(f"A ldmatrix warp {warp} pair {p} m {mi} matrix {j}")
            for ni in range(layout.mma_token_blocks(t.token_tile)):
                for step in range(2):
                    addrs = [layout.ELEMENT_BYTES * layout.fp8_b_offset(
                        lane, warp, ni, p, step, t.k_tile, t.token_tile) for lane in lanes]
                    for half in (addrs[:16], addrs[16:]):
                        if not conflict_free(half, 8):
                            problems.append(f"B load warp {warp} pair {p} n {ni} step {step}")
    return problems + [p for p in bank_conflicts(t) if p.startswith("reduction")]
