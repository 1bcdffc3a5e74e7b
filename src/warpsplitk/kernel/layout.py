"""Address math of the warp split-K kernel, in plain integer arithmetic.

Every function here is written with ``+ - * // % ^`` only, so the same code
runs on Python ``int`` (the NumPy emulator, the tests, the bank-conflict
checks) and on the CuTe DSL's ``Int32`` (the kernel, at trace time). There is
exactly one definition of where a byte goes; the emulator proves it and the
kernel uses it.

Conventions
-----------
The kernel computes ``out^T[N, M] = W[N, K] @ x[M, K]^T`` tile by tile, so in
``mma.sync.m16n8k16`` terms the *weight* is operand A (16 weight rows x 16 K)
and the *activations* are operand B (16 K x 8 tokens). One CTA owns
``output_tile`` weight rows and ``token_tile`` token rows; every shared stage
holds a ``[rows, k_tile]`` BF16 tile of each operand, rows of ``k_tile``
elements (256 or 512 bytes). All offsets below are in BF16 elements unless
the name says bytes or words.

The swizzle XORs the 16-byte chunk index inside a row with ``row % 8``. A row
is a multiple of 128 bytes, so without it the 8 rows an ``ldmatrix`` phase
reads would all start in bank 0; with it, the 8 rows' chunks land in 8
distinct 16-byte bank groups, and 8 consecutive chunks of one row (one
quarter-warp of ``cp.async`` stores) stay in distinct groups too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: mma.sync shape (rows of A, columns of B, K), BF16 inputs, FP32 accumulators.
MMA_M, MMA_N, MMA_K = 16, 8, 16
#: compute warps; each owns one quarter of every stage's K slice.
COMPUTE_WARPS = 4
#: weight (operand A) loader warps.
A_LOADER_WARPS = 2
WARP = 32
#: BF16 elements per 16-byte cp.async / ldmatrix row.
CHUNK = 8
ELEMENT_BYTES = 2
#: FP32 words of padding per row of the split-K reduction buffer: makes the
#: accumulator stores of a warp hit 32 distinct banks (see reduction_offset).
REDUCTION_PAD = 4
MBARRIER_BYTES = 8
#: shared memory the kernel's regions are aligned to.
REGION_ALIGN = 128


def swizzle(row, col, k_tile):
    """Element offset of logical ``(row, col)`` in a swizzled ``[rows, k_tile]`` stage."""
    return row * k_tile + (col ^ ((row % 8) * CHUNK))


def swizzle_pairs(row, col, k_tile):
    """Element offset of activation ``(row, col)`` in the stage of a kernel
    with FP8 weights: the 16-byte chunk index XORed with ``2 * (row % 8)``,
    so the 32-byte span each row gives an FP8 k-step's B loads
    (``fp8_b_offset``) lands in its own quarter of the banks for 4
    consecutive rows (with ``swizzle`` rows 2r and 2r + 1 share one)."""
    return row * k_tile + (col ^ ((row % 8) * 2 * CHUNK))


#: Dynamic shared memory a block may opt into on sm_90 and sm_100.
SMEM_PER_BLOCK = 227 * 1024

#: Elements of padding after each activation row of a bulk-copied stage.
B_ROW_PAD = CHUNK


def padded(row, col, k_tile):
    """Element offset of ``(row, col)`` in a row-padded ``[rows, k_tile + 8]``
    activation stage (bulk copies). A bulk copy writes one row of x as it
    is in memory, so the stage cannot be swizzled; the 16-byte pad shifts each
    row by four banks instead, which keeps the ldmatrix phases (8 rows x 16 B
    at one column) on 32 distinct banks."""
    return row * (k_tile + B_ROW_PAD) + col


#: Columns of one TMA box of activations: 64 BF16 = 128 bytes, the span of
#: the tensor-memory accelerator's 128-byte swizzle.
TMA_BOX_COLS = 64
#: Shared-memory alignment of a TMA stage: its 128-byte swizzle XORs byte
#: address bits 4-6 with bits 7-9, so a box must start on a 1024-byte boundary
#: for the pattern to be ``tma_swizzle``'s.
TMA_ALIGN = 1024


def tma_swizzle(row, col, k_tile, token_tile):
    """Element offset of activation ``(row, col)`` in a TMA-filled stage
    (TMA copies): the stage is ``k_tile / 64`` boxes of ``[token_tile, 64]``,
    one after the other, each row 128 bytes with its 16-byte chunk index
    XORed with ``row % 8`` (the hardware's 128-byte swizzle). An ldmatrix
    phase (8 rows x 16 B at one column) then reads 8 distinct chunk slots of
    8 consecutive 128-byte rows: 32 distinct banks, as with ``swizzle``."""
    box, within = col // TMA_BOX_COLS, col % TMA_BOX_COLS
    return (box * token_tile * TMA_BOX_COLS + row * TMA_BOX_COLS
            + (within ^ ((row % 8) * CHUNK)))


def tma_boxes(k_tile):
    """TMA boxes per activation stage."""
    return k_tile // TMA_BOX_COLS


#: How an activation stage is laid out, by how it is filled:
#: 16-byte cp.async copies (swizzled), one bulk copy per row (row-padded),
#: or TMA boxes (128-byte swizzled boxes); "pairs": 16-byte copies beside
#: FP8 weights (``swizzle_pairs``).
B_LAYOUTS = ("swizzle", "padded", "tma", "pairs")


def b_offset(row, col, k_tile, kind="swizzle", token_tile=0):
    """Element offset of activation ``(row, col)`` in its ring stage, for
    stage layout ``kind`` (``B_LAYOUTS``; ``token_tile`` for "tma")."""
    if kind == "padded":
        return padded(row, col, k_tile)
    if kind == "tma":
        return tma_swizzle(row, col, k_tile, token_tile)
    if kind == "pairs":
        return swizzle_pairs(row, col, k_tile)
    return swizzle(row, col, k_tile)


# ---------------------------------------------------------------- loaders


def copies_per_thread(rows, k_tile, threads, chunk=CHUNK):
    """16-byte copies one loader thread issues per stage of a ``[rows,
    k_tile]`` tile of ``chunk`` elements per copy (``FP8_CHUNK`` for FP8 weights)."""
    return rows * k_tile // (chunk * threads)


def loader_copy(thread, copy, k_tile, threads, chunk=CHUNK):
    """Logical ``(row, col)`` of copy ``copy`` of loader thread ``thread``.

    Consecutive threads take consecutive 16-byte chunks of a row, so a warp's
    global reads are whole 128-byte lines; each further copy moves all
    threads on by ``threads * chunk`` elements (a whole number of rows).
    """
    linear = thread * chunk + copy * threads * chunk
    return linear // k_tile, linear % k_tile


# ------------------------------------------------------- the L2 prefetch


def l2_prefetch_threads(output_tile):
    """Weight-loader threads that issue the L2 prefetch: thread ``r`` of the
    first ``output_tile`` takes tile row ``r`` (one bulk prefetch per row;
    a tile has at most 64 rows, the weight loaders are 64 threads)."""
    if output_tile > A_LOADER_WARPS * WARP:
        raise ValueError(f"{output_tile} rows, {A_LOADER_WARPS * WARP} weight-loader threads")
    return output_tile


def l2_prefetch_span(k_tiles, stages, k_tile, tiles=0):
    """``(first, count)``: the elements of each row of a CTA's K share past
    the ring's first fill, which a tactic's ``l2_prefetch`` asks L2 for
    before the dependency wait (``count`` 0 when the ring holds them all);
    with ``tiles`` > 0 (a bounded prefetch) at most that many K tiles of
    them, else (0, or ``PREFETCH_ALL``'s -1) all."""
    first = min(stages, k_tiles) * k_tile
    rest = k_tiles * k_tile - first
    return first, min(rest, tiles * k_tile) if tiles > 0 else rest


# -------------------------------------------------------- fragment loads


def k_steps(k_tile):
    """m16n8k16 steps per compute warp per stage (its K quarter / 16)."""
    return k_tile // COMPUTE_WARPS // MMA_K


def a_fragment_offset(lane, warp, m_iter, step, k_tile):
    """Element offset of lane's ``ldmatrix.x4`` row address for operand A (weight).

    The four 8x8 matrices are (rows 0-7, k 0-7), (rows 8-15, k 0-7),
    (rows 0-7, k 8-15), (rows 8-15, k 8-15) of the 16x16 block at weight row
    ``16 * m_iter`` and K column ``16 * step`` of this warp's quarter: in that
    order they are exactly the a0..a3 registers of m16n8k16.
    """
    row = lane % 16 + m_iter * MMA_M
    col = (lane // 16) * CHUNK + step * MMA_K + warp * (k_tile // COMPUTE_WARPS)
    return swizzle(row, col, k_tile)


def mma_token_blocks(token_tile):
    """m16n8k16 blocks along the tokens of a CTA's tile: a token tile
    narrower than the mma's 8 columns still takes one."""
    return max(1, token_tile // MMA_N)


def stage_row(token, token_tile):
    """Activation stage row that mma column ``token`` of a CTA's tile reads.

    A narrow token tile (1, 2 or 4 rows, for M <= 4) keeps only its own rows
    in the stage, where an 8-row tile would hold 4-7 rows that M never
    fills: at M = 1 with 16-row weight tiles that is a third of every stage
    of shared memory, given back to the ring as depth. The mma still
    multiplies 8 columns; columns past the tile read a duplicate of a real
    row (``token % token_tile``: same-address lanes of an ldmatrix phase are
    a broadcast, not a bank conflict, and nothing is read that the stage's
    full barrier does not cover), and their sums are never stored."""
    return token % token_tile if token_tile < MMA_N else token


def b_fragment_offset(lane, warp, n_iter, pair, k_tile, kind="swizzle", token_tile=MMA_N):
    """Element offset of lane's ``ldmatrix.x4`` row address for operand B (activations).

    Matrix ``j = lane // 8`` is tokens ``8 * n_iter .. +7`` at K columns
    ``8 j .. 8 j + 7`` of the 32-wide K pair ``pair``: registers 0, 1 are
    b0, b1 of k-step ``2 * pair`` and registers 2, 3 those of ``2 * pair + 1``.
    With a narrow ``token_tile`` the rows past it fold back (``stage_row``).
    """
    row = stage_row(lane % 8 + n_iter * MMA_N, token_tile)
    col = (lane // 8) * CHUNK + pair * 2 * MMA_K + warp * (k_tile // COMPUTE_WARPS)
    return b_offset(row, col, k_tile, kind, token_tile)


# -------------------------------------------------- FP8 (e4m3) weights
#
# A weight stage of FP8 is ``[rows, k_tile]`` bytes, swizzled as BF16 stages
# are (16-byte chunk index XOR ``row % 8``). ``ldmatrix`` reads its bytes as
# b16 pairs: of each 8-row x 16-byte matrix, lane ``4 g + t`` receives row g's
# bytes ``4 t .. 4 t + 3``, four weights of consecutive k. The conversion
# (``fp8_to_bf16_bits``) makes of them two BF16x2 registers, the even k
# ``(4 t, 4 t + 2)`` and the odd ``(4 t + 1, 4 t + 3)``, which go into the
# mma as its k slots ``(2 t, 2 t + 1)`` and ``(2 t + 8, 2 t + 9)``: a fixed
# permutation of the 16 k of a step (``fp8_k_of_slot``), which the
# activations' B registers follow (``fp8_b_offset``), so the mma's sum over
# its slots is the sum over the step's k.

#: bytes of one FP8 weight, and FP8 weights per 16-byte copy.
FP8_BYTES = 1
#: the activation stage layout (``B_LAYOUTS``) of an FP8-weight kernel
FP8_ACTIVATION_LAYOUT = "pairs"
FP8_CHUNK = 16
#: the BF16 that ``fp8_to_bf16_bits`` makes of an e4m3 byte is the weight
#: times 2 ** -FP8_BF16_SHIFT: exact for every code, subnormals included
#: (e4m3's exponent bias is 7, BF16's 127); one BF16x2 multiply by 2 ** 120
#: restores it.
FP8_BF16_SHIFT = 120


def fp8_swizzle(row, col, k_tile):
    """Byte offset of weight ``(row, col)`` in a swizzled ``[rows, k_tile]`` FP8 stage."""
    return row * k_tile + (col ^ ((row % 8) * FP8_CHUNK))


def fp8_a_fragment_offset(lane, warp, m_iter, pair, k_tile):
    """Byte offset of lane's ``ldmatrix.x4`` row address for FP8 operand A.

    One x4 covers two k-steps (32 K) of 16 weight rows: matrix ``j = lane //
    8`` is rows ``8 (j % 2) .. +7`` at the step ``j // 2``'s 16 bytes, of
    the K pair ``pair`` of this warp's quarter. Registers 0, 1 are rows 0-7
    and 8-15 of step ``2 pair``, registers 2, 3 of step ``2 pair + 1``.
    """
    j = lane // 8
    row = lane % 8 + (j % 2) * 8 + m_iter * MMA_M
    col = (j // 2) * MMA_K + pair * 2 * MMA_K + warp * (k_tile // COMPUTE_WARPS)
    return fp8_swizzle(row, col, k_tile)


def fp8_k_of_slot(slot):
    """The k (0..15) within a step that mma k slot ``slot`` multiplies in an
    FP8-weight kernel: slots ``2 t, 2 t + 1`` hold lane t's even weights
    ``4 t, 4 t + 2``, slots ``2 t + 8, 2 t + 9`` its odd ones ``4 t + 1, 4 t + 3``."""
    t = (slot % 8) // 2
    return 4 * t + 2 * (slot % 2) + slot // 8


def fp8_b_offset(lane, warp, n_iter, pair, step, k_tile, token_tile=MMA_N):
    """Element offset of the 4 activations (8 bytes, one ``ld.shared.v2``)
    lane ``4 g + t`` loads for k-step ``step`` (0, 1) of K pair ``pair``:
    token ``g`` of block ``n_iter`` at k ``4 t .. 4 t + 3`` of the step.
    Its B registers are ``(e0, e2)`` and ``(e1, e3)`` (``fp8_k_of_slot``).
    The stage is laid out "pairs" (``swizzle_pairs``)."""
    row = stage_row(lane // 4 + n_iter * MMA_N, token_tile)
    col = ((lane % 4) * 4 + step * MMA_K + pair * 2 * MMA_K
           + warp * (k_tile // COMPUTE_WARPS))
    return swizzle_pairs(row, col, k_tile)


#: Block scales: one FP32 per ``FP8_SCALE_BLOCK`` x ``FP8_SCALE_BLOCK``
#: block of the weight (DeepSeek's and transformers' ``weight_scale_inv``),
#: row-major ``[ceil(N / 128), ceil(K / 128)]``. A compute warp's quarter of
#: a K tile (32 or 64 K) never straddles two K blocks, nor its 16-row mma
#: block two row blocks: each warp converts a tile's weights with one scale
#: per mma row block folded in (``ptx.block_multiplier``).
FP8_SCALE_BLOCK = 128


def fp8_scale_blocks(n, k):
    """The shape of an ``[n, k]`` weight's block scales."""
    return -(-n // FP8_SCALE_BLOCK), -(-k // FP8_SCALE_BLOCK)


def fp8_block_scale_index(row, k, k_total):
    """Index, in the row-major block scales of a weight of ``k_total``
    columns, of the scale of weight ``(row, k)``."""
    return (row // FP8_SCALE_BLOCK) * (-(-k_total // FP8_SCALE_BLOCK)) + k // FP8_SCALE_BLOCK


def warp_k_start(warp, k_tile):
    """The first k, within a K tile, of compute warp ``warp``'s quarter."""
    return warp * (k_tile // COMPUTE_WARPS)


def fp8_to_bf16_bits(code):
    """The BF16 bits the kernel makes of e4m3 byte ``code``: sign to bit 15,
    exponent and mantissa (7 bits) shifted left by 4, so the BF16 is the
    weight times ``2 ** -FP8_BF16_SHIFT``. The kernel does it for two bytes
    of each half of a register at once (``ptx.fp8x4_to_bf16x2``)."""
    return (code // 128) * 0x8000 + (code % 128) * 16


# ------------------------------------------------------ split-K reduction


def reduction_row_words(output_tile):
    """FP32 words per token row of one warp's partial tile."""
    return output_tile + REDUCTION_PAD


def reduction_tokens(token_tile):
    """Token rows per warp in the reduction buffer: every mma column, so a
    narrow tile's accumulators (8 columns, ``token_tile`` of them real) land
    without a branch; the epilogue reads the real ones only."""
    return max(token_tile, MMA_N)


def reduction_offset(warp, token, weight_row, output_tile, token_tile):
    """Word offset of a partial sum in the ``[warp][token][weight_row]`` buffer."""
    row_words = reduction_row_words(output_tile)
    return (warp * reduction_tokens(token_tile) + token) * row_words + weight_row


def accumulator_coords(lane, m_iter, n_iter, reg):
    """(weight row, token) of accumulator register ``reg`` (0..3) of m16n8k16 block
    ``(m_iter, n_iter)``: c0, c1 are row ``lane // 4`` and c2, c3 row ``+ 8``;
    the odd registers are the next token."""
    weight_row = m_iter * MMA_M + lane // 4 + (reg // 2) * 8
    token = n_iter * MMA_N + (lane % 4) * 2 + reg % 2
    return weight_row, token


def output_rows(output_tile, swiglu=False):
    """Output columns a CTA stores per token: its weight rows, or with the
    SwiGLU epilogue half of them (each gate row's output times its up row's)."""
    return output_tile // 2 if swiglu else output_tile


def epilogue_vectors(output_tile, token_tile, swiglu=False):
    """16-byte output vectors (8 BF16 outputs of one token) of a CTA's tile."""
    return token_tile * output_rows(output_tile, swiglu) // CHUNK


def epilogue_rounds(output_tile, token_tile, swiglu=False):
    """Passes the 128 compute threads make over the tile's output vectors."""
    threads = COMPUTE_WARPS * WARP
    return -(-epilogue_vectors(output_tile, token_tile, swiglu) // threads)


def epilogue_coords(vector, rows):
    """(token, first row) of output vector ``vector`` of a tile of ``rows``
    output rows (``output_rows``): 8 outputs one compute thread sums over
    the warps' partials and stores as 16 bytes; vector ``round * 128 +
    thread`` in round ``round``. With the SwiGLU epilogue the row is a gate
    row of the tile; its up row is ``rows`` further."""
    chunks_per_token = rows // CHUNK
    return vector // chunks_per_token, (vector % chunks_per_token) * CHUNK


def weight_row(tile_n, row, output_tile, n, swiglu=False):
    """The row of the ``[n, K]`` weight that row ``row`` of CTA ``tile_n``'s
    tile holds. With the SwiGLU epilogue the weight is ``[gate; up]`` (``n =
    2 I``): the tile's first half holds gate rows ``tile_n * output_tile / 2
    + row`` and its second half the up rows of the same outputs, ``I``
    further, so that one CTA reduces both halves of its outputs."""
    if not swiglu:
        return tile_n * output_tile + row
    half = output_tile // 2
    return tile_n * half + row + swiglu_row_shift(row, output_tile, n)


def swiglu_row_shift(row, output_tile, n):
    """``weight_row(tile_n, row, swiglu=True) - (tile_n * output_tile / 2 +
    row)``: 0 for the tile's gate rows, ``n / 2 - output_tile / 2`` for its
    up rows. The rows of one weight-loader copy (``loader_copy``: whole rows,
    2 or 4 of them) never straddle the half, so the kernel takes the shift
    of each copy from thread 0's row at trace time and the copy's addresses
    stay one base plus constants."""
    half = output_tile // 2
    return (row // half) * (n // 2 - half)


# ------------------------------------------------------------ row tiles


def row_tiles(n, output_tile, half_tiles=0):
    """``(full, half)``: CTAs along N of ``output_tile`` rows, then of
    ``output_tile / 2`` rows (a mixed grid, ``half_tiles`` > 0: the last
    ``half_tiles`` CTAs along N own half as many rows, so that N spreads
    evenly over the SMs where no single tile size does)."""
    return (n - half_tiles * (output_tile // 2)) // output_tile, half_tiles


def cta_rows(tile_n, output_tile, full_tiles):
    """``(rows, index)`` of CTA ``tile_n`` along N in a grid whose first
    ``full_tiles`` CTAs own ``output_tile`` rows and the rest half as many:
    its first weight row is ``index * rows`` (the half tiles start at row
    ``full_tiles * output_tile = (full_tiles + full_tiles) * output_tile / 2``)."""
    if tile_n < full_tiles:
        return output_tile, tile_n
    return output_tile // 2, half_tile_index(tile_n, full_tiles)


def half_tile_index(tile_n, full_tiles):
    """Row-tile index, in half-tile units, of CTA ``tile_n >= full_tiles`` of
    a mixed grid (the kernel's half path addresses its rows with it)."""
    return tile_n + full_tiles


# ---------------------------------------------------------- shared memory


#: FP8 clusters of this many CTAs or more lay the reduction buffer over the
#: rings (``split_over_rings``): beside them its ``k_split * 4`` slots held
#: 72 of the 96 KB of a 32 x 32 FP8 tile on four CTAs, two CTAs per SM.
#: Splits in two keep their layout (and the shipped kernels theirs).
ALIASED_SPLIT = 3


def split_over_rings(k_split, weight_bytes):
    """Whether a K split's reduction buffer lies over the rings, the first
    CTA freeing it for the others (``SmemPlan.ring_free``): FP8 weights on
    ``ALIASED_SPLIT`` CTAs or more. BF16 keeps its buffer beside the rings
    (its rings are twice the bytes; the design notes give the A/B)."""
    return k_split >= ALIASED_SPLIT and weight_bytes == FP8_BYTES


def _align(value, alignment):
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class SmemPlan:
    """Byte offsets of the kernel's shared-memory regions."""

    a_stage_bytes: int
    b_stage_bytes: int
    a_ring: int
    b_ring: int
    reduction: int
    full_a: int  # stages mbarriers: weight stage landed
    full_b: int  # stages mbarriers: activation stage landed
    empty: int  # stages mbarriers: stage consumed by the 4 compute warps
    total: int
    #: the reduction buffer lies over the rings (see smem_plan)
    reduction_aliased: bool = False
    #: k_split > 1: one mbarrier, the other CTAs' partial sums landed in the
    #: first CTA's buffer (their bytes complete it); None without a split
    partials: int | None = None
    #: a split whose buffer lies over the rings (``split_over_rings``): one
    #: mbarrier in each CTA, the first CTA's ring read to the end (its one
    #: remote arrival), which the others wait for before they send
    ring_free: int | None = None


@functools.lru_cache(maxsize=65536)  # a pure function of a few ints: ranking asks often
def smem_plan(output_tile, token_tile, k_tile, stages, k_split=1, b_layout="swizzle",
              weight_bytes=ELEMENT_BYTES):
    """Where the two rings, the reduction buffer and the mbarriers live.

    With ``k_split`` CTAs per cluster sharing K, the reduction buffer holds
    the partials of every compute warp of the cluster (``[k_split * 4]``
    warps): the other CTAs write theirs into the first CTA's buffer, and
    their bytes complete its ``partials`` mbarrier. ``b_layout`` is the
    activation stages' (``B_LAYOUTS``): "padded" rows (``padded``) for bulk
    copies, "tma" boxes (``tma_swizzle``, 1024-byte aligned) for TMA ones.
    ``weight_bytes``: 2 for BF16 weights, 1 (``FP8_BYTES``) for FP8 ones.

    A ring too deep to fit beside the reduction buffer in one block
    (``SMEM_PER_BLOCK``) gets the buffer laid over its start instead
    (``reduction_aliased``; without a split, where no other CTA writes into
    it): the rings are dead once every compute warp has read its last tile,
    which the kernel makes sure of with a barrier of the compute warps
    before the first partial is stored. Only then: a ring that fits either
    way keeps its own buffer, and with it the kernel the tuner measured.
    An FP8 cluster of ``ALIASED_SPLIT`` CTAs or more (``split_over_rings``)
    always lays the buffer over the rings (it holds ``k_split * 4`` warps'
    partials, more than the ring of a short K share), and the first CTA
    tells the others when its ring is dead (``ring_free``)."""
    a_stage = output_tile * k_tile * weight_bytes
    b_row = k_tile + (B_ROW_PAD if b_layout == "padded" else 0)
    # 16-byte aligned rows either way (a multiple of 128 B from 8 rows on)
    b_stage = token_tile * b_row * ELEMENT_BYTES
    a_ring = 0
    # TMA boxes need 1024-byte aligned stages (a_stage and b_stage are
    # multiples of 1024 then: 16+ rows x 256+ bytes, 8+ rows x 128 bytes x boxes)
    b_ring = _align(a_ring + stages * a_stage, TMA_ALIGN if b_layout == "tma" else REGION_ALIGN)
    rings_end = _align(b_ring + stages * b_stage, REGION_ALIGN)
    reduction_bytes = (k_split * COMPUTE_WARPS * reduction_tokens(token_tile)
                       * reduction_row_words(output_tile) * 4)

    def plan(reduction, barriers, aliased):
        full_a = barriers
        full_b = full_a + stages * MBARRIER_BYTES
        empty = full_b + stages * MBARRIER_BYTES
        total = empty + stages * MBARRIER_BYTES
        partials = ring_free = None
        if k_split > 1:
            partials, total = total, total + MBARRIER_BYTES
            if aliased:
                ring_free, total = total, total + MBARRIER_BYTES
        return SmemPlan(a_stage, b_stage, a_ring, b_ring, reduction, full_a, full_b, empty, total,
                        aliased, partials, ring_free)

    if split_over_rings(k_split, weight_bytes):
        return plan(a_ring, _align(max(rings_end, reduction_bytes), REGION_ALIGN), True)
    separate = plan(rings_end, _align(rings_end + reduction_bytes, REGION_ALIGN), False)
    if separate.total <= SMEM_PER_BLOCK or k_split > 1 or reduction_bytes > rings_end:
        return separate
    aliased = plan(a_ring, rings_end, True)
    return aliased if aliased.total <= SMEM_PER_BLOCK else separate  # too deep either way


# ------------------------------------------------------------- the ring


def k_share(rank, k_tiles, k_split):
    """``(first tile, tiles)`` of K that CTA ``rank`` of a split streams:
    ``k_tiles // k_split`` each, the first ``k_tiles % k_split`` CTAs one
    more (an uneven split: K tiles past 64 that ``k_split`` does not divide)."""
    base, extra = divmod(k_tiles, k_split)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def one_loop_split(k_tiles, k_split, l2_prefetch, row_copies, fp8):
    """Whether an uneven split of ``k_tiles`` over ``k_split`` CTAs traces
    one K loop for every rank, of the longest share (``k_tiles // k_split +
    1``), the shorter ranks' last tile zero-filled (``split_tile_present``),
    rather than one loop per rank of its own length: a third to a quarter
    of the code (8192 x 29568 FP8: 148 KB, not 557 KB), the same for every
    rank. Per-rank loops measured 1.09-1.71x the time of one loop (H100,
    8192 x 24448 and 8192 x 29568, M 1-32; an even split of the same code
    size, 8192 x 24192, streams per byte as fast as one loop): the
    instructions of four loops, not the weight, set their pace. Only with
    16-byte activation copies (``row_copies``: a row is zero-filled by
    reading nothing; bulk and TMA copies of a tile past the share would
    read the next rank's K), no L2 prefetch (its span is a rank's own
    tiles), and for FP8 weights (``fp8``; the BF16 kernel's uneven splits
    keep their measured loops per rank)."""
    return bool(fp8 and k_split > 1 and k_tiles % k_split and not l2_prefetch and row_copies)


def split_tile_present(rank, tile, k_tiles, k_split):
    """Whether tile ``tile`` of ``rank``'s one traced loop (``one_loop_split``)
    is in its share: all but the last (index ``k_tiles // k_split``), which
    only the first ``k_tiles % k_split`` ranks have; the others' is zeros."""
    base, extra = divmod(k_tiles, k_split)
    return tile < base or rank < extra


def split_partial_bytes(output_tile, token_tile):
    """Bytes of partial sums one CTA of a K split sends the first CTA: each
    compute lane's accumulators, one f32 per store (the first CTA's
    ``partials`` barrier expects ``k_split - 1`` times this)."""
    return (COMPUTE_WARPS * WARP * (output_tile // MMA_M) * mma_token_blocks(token_tile)
            * 4 * 4)


def ring_slot(k_tile_index, stages):
    """(stage, parity) of K tile ``k_tile_index``: the full barrier of that stage
    completes its phase ``parity`` when the tile has landed."""
    return k_tile_index % stages, (k_tile_index // stages) % 2


def stage_refilled(k_tile_index, stages, k_tiles):
    """Whether the stage K tile ``k_tile_index`` occupies is refilled later
    (with tile ``k_tile_index + stages``): only then must its release be
    ordered before another copy's writes."""
    return k_tile_index + stages < k_tiles


def empty_parity(k_tile_index, stages):
    """Parity a loader waits on before refilling a stage for ``k_tile_index``
    (``None`` for the first ``stages`` tiles, whose stages start empty)."""
    if k_tile_index < stages:
        return None
    return (k_tile_index // stages - 1) % 2
