"""Inline-PTX building blocks of the kernel.

Each helper emits one PTX instruction (or a tiny fixed sequence) on raw
addresses: 32-bit shared-window addresses and 64-bit global addresses. The
kernel keeps every address computation in its own hands (through
``layout.py``), so what the emulator proves is what the PTX does.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _asm(result_type, operands, text, constraints, loc, ip, side_effects=True):
    return llvm.inline_asm(
        result_type,
        [o.ir_value(loc=loc, ip=ip) for o in operands],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _struct(element_type, count):
    return llvm.StructType.get_literal([element_type] * count)


def _unpack(struct_value, element_type, count, wrap, loc, ip):
    return [wrap(llvm.extractvalue(element_type, struct_value, [i], loc=loc, ip=ip))
            for i in range(count)]


# ------------------------------------------------------------ copies


@dsl_user_op
def l2_policy_evict_first(*, loc=None, ip=None):
    """A 64-bit L2 policy: evict_first for all of an access (fraction 1.0).

    Made at run time on purpose: fed the equivalent constant, ptxas 13.0
    encodes the hinted LDGSTS with an invalid odd uniform-register descriptor.
    """
    return Int64(_asm(Int64.mlir_type, [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;",
                      "=l", loc, ip, side_effects=False))


@dsl_user_op
def cp_async_16_hinted(dst, src, policy, *, loc=None, ip=None):
    """16-byte ``cp.async.cg`` global->shared carrying an L2 cache-policy hint."""
    _asm(None, [Int32(dst), Int64(src), Int64(policy)],
         "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;", "r,l,l", loc, ip)


@dsl_user_op
def cp_async_16_hinted_zfill(dst, src, policy, src_bytes, *, loc=None, ip=None):
    """``cp_async_16_hinted`` that reads ``src_bytes`` (16 or 0) and zero-fills
    the rest: a weight tile past a rank's K share (``layout.one_loop_split``)."""
    _asm(None, [Int32(dst), Int64(src), Int32(src_bytes), Int64(policy)],
         "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2, $3;", "r,l,r,l", loc, ip)


@dsl_user_op
def cp_async_16(dst, src, *, loc=None, ip=None):
    """16-byte ``cp.async.cg`` global->shared, no hint (the pre-barrier prologue)."""
    _asm(None, [Int32(dst), Int64(src)], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", loc, ip)


@dsl_user_op
def cp_async_16_zfill(dst, src, src_bytes, *, loc=None, ip=None):
    """16-byte ``cp.async.cg`` that reads ``src_bytes`` (16 or 0) and zero-fills the rest.

    With 0 nothing is read from global memory: rows past M are never touched.
    """
    _asm(None, [Int32(dst), Int64(src), Int32(src_bytes)],
         "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", loc, ip)


@dsl_user_op
def cp_async_bulk_prefetch_l2_if(src, nbytes, predicate, *, loc=None, ip=None):
    """Ask L2 to fetch ``nbytes`` (a multiple of 16) of global memory from
    ``src`` (16-byte aligned), only if ``predicate`` is non-zero: one
    instruction for a whole row segment, no shared memory, nothing to wait
    for. A hint: a later copy of the same bytes is correct whether it hits
    or not."""
    _asm(None, [Int64(src), Int32(nbytes), Int32(predicate)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $2, 0;\n"
         "@P1 cp.async.bulk.prefetch.L2.global [$0], $1;\n}", "l,r,r", loc, ip)


@dsl_user_op
def cp_async_mbarrier_arrive_noinc(barrier, *, loc=None, ip=None):
    """Arrive on ``barrier`` once all this thread's earlier cp.async have landed.

    ``.noinc``: the arrival is one of the barrier's expected count, so the
    barrier is initialised with the number of loader threads.
    """
    _asm(None, [Int32(barrier)], "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r", loc, ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None):
    """Keep a loader thread alive until its copies have landed."""
    _asm(None, [], "cp.async.wait_all;", "~{memory}", loc, ip)


# --------------------------------------------------------- mbarriers


@dsl_user_op
def mbarrier_init(barrier, count, *, loc=None, ip=None):
    _asm(None, [Int32(barrier), Int32(count)], "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def mbarrier_wait(barrier, parity, cluster=False, predicate=None, *, loc=None, ip=None):
    """Spin (with the hardware's suspend hint) until phase ``parity`` of ``barrier``
    completed. ``cluster``: acquire at cluster scope, for a barrier other CTAs
    whose bytes other CTAs of the cluster stored into this CTA with
    ``st.async``. ``predicate``
    (non-zero; uniform over the warp): wait only where it holds."""
    scope = ".acquire.cluster" if cluster else ""
    loop = ("WSK_WAIT_${:uid}:\n"
            f"mbarrier.try_wait.parity{scope}.shared::cta.b64 P1, [$0], $1;\n"
            "@!P1 bra WSK_WAIT_${:uid};\n")
    if predicate is None:
        _asm(None, [Int32(barrier), Int32(parity)], "{\n.reg .pred P1;\n" + loop + "}",
             "r,r,~{memory}", loc, ip)
        return
    _asm(None, [Int32(barrier), Int32(parity), Int32(predicate)],
         "{\n.reg .pred P1;\n.reg .pred P2;\nsetp.ne.u32 P2, $2, 0;\n"
         "@!P2 bra WSK_SKIP_${:uid};\n" + loop + "WSK_SKIP_${:uid}:\n}",
         "r,r,r,~{memory}", loc, ip)


@dsl_user_op
def mbarrier_arrive(barrier, *, loc=None, ip=None):
    """This thread arrives on ``barrier`` (release)."""
    _asm(None, [Int32(barrier)], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}",
         loc, ip)


@dsl_user_op
def named_barrier(barrier_id, threads, *, loc=None, ip=None):
    _asm(None, [], f"bar.sync {int(barrier_id)}, {int(threads)};", "~{memory}", loc, ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None):
    """Order this thread's generic-proxy accesses of shared memory before later
    async-proxy ones (a TMA or bulk copy into what it just read)."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", loc, ip)


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None):
    _asm(None, [], "fence.mbarrier_init.release.cluster;", "~{memory}", loc, ip)


# ----------------------------------------------------------- clusters
# For k_split > 1: the CTAs of a cluster share K, and the partial sums of
# the others go into the first CTA's shared memory (distributed shared memory).


@dsl_user_op
def cluster_arrive_relaxed(*, loc=None, ip=None):
    """Arrive on the cluster barrier, ordering nothing (its wait only says
    every CTA of the cluster is running and past this point)."""
    _asm(None, [], "barrier.cluster.arrive.relaxed;", "~{memory}", loc, ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None):
    """Wait until every thread of the cluster has arrived (acquire)."""
    _asm(None, [], "barrier.cluster.wait.acquire;", "~{memory}", loc, ip)


@dsl_user_op
def map_shared_to_rank(address, rank, *, loc=None, ip=None):
    """The shared::cluster address of ``address`` in the cluster CTA ``rank``."""
    return Int32(_asm(Int32.mlir_type, [Int32(address), Int32(rank)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", loc, ip))


@dsl_user_op
def mbarrier_arrive_remote_if(remote_barrier, predicate, *, loc=None, ip=None):
    """If ``predicate`` (non-zero): arrive on another CTA's mbarrier at
    ``remote_barrier`` (shared::cluster), releasing at cluster scope what
    this CTA did before (its waiter acquires it with ``mbarrier_wait(...,
    cluster=True)``)."""
    _asm(None, [Int32(remote_barrier), Int32(predicate)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $1, 0;\n"
         "@P1 mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];\n}",
         "r,r,~{memory}", loc, ip)


@dsl_user_op
def st_partial_f32(local, remote, remote_barrier, value, is_remote, *, loc=None, ip=None):
    """One partial sum of a K split: if ``is_remote`` (non-zero), into another
    CTA's shared memory at ``remote`` (shared::cluster) by ``st.async``, its 4
    bytes completing that CTA's mbarrier ``remote_barrier``; else into this
    CTA's own at ``local``. Only the receiving CTA waits: the sender needs no
    barrier of its own after it."""
    _asm(None, [Int32(local), Int32(remote), Int32(remote_barrier), Float32(value),
                Int32(is_remote)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $4, 0;\n"
         "@P1 st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$1], $3, [$2];\n"
         "@!P1 st.shared.f32 [$0], $3;\n}",
         "r,r,r,f,r,~{memory}", loc, ip)


@dsl_user_op
def mbarrier_arrive_expect_tx_if(barrier, nbytes, predicate, *, loc=None, ip=None):
    """If ``predicate`` (non-zero): arrive on ``barrier`` and expect ``nbytes`` more
    from bulk copies in this phase (they may land before or after the arrival:
    the transaction count may go negative meanwhile)."""
    _asm(None, [Int32(barrier), Int32(nbytes), Int32(predicate)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $2, 0;\n"
         "@P1 mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;\n}",
         "r,r,r,~{memory}", loc, ip)


@dsl_user_op
def cp_async_bulk_if(dst, src, nbytes, barrier, predicate, *, loc=None, ip=None):
    """If ``predicate``: copy ``nbytes`` (a multiple of 16) from global ``src`` to
    this CTA's shared ``dst``, completing ``nbytes`` on the mbarrier at
    ``barrier`` (the ``shared::cluster`` form: a launch without a cluster is
    a cluster of one CTA)."""
    _asm(None, [Int32(dst), Int64(src), Int32(nbytes), Int32(barrier), Int32(predicate)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $4, 0;\n"
         "@P1 cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
         " [$0], [$1], $2, [$3];\n}",
         "r,l,r,r,r,~{memory}", loc, ip)


@dsl_user_op
def griddepcontrol_wait(*, loc=None, ip=None):
    """Block until the previous grid in the stream has completed and flushed."""
    _asm(None, [], "griddepcontrol.wait;", "~{memory}", loc, ip)


@dsl_user_op
def griddepcontrol_launch_dependents(*, loc=None, ip=None):
    """Let the next grid in the stream start launching (its prologue overlaps our tail)."""
    _asm(None, [], "griddepcontrol.launch_dependents;", "~{memory}", loc, ip)


# ------------------------------------------------------- tensor cores


@dsl_user_op
def ldmatrix_x4(address, *, loc=None, ip=None):
    """Four 8x8 b16 matrices; lane ``8 j + r`` gives row ``r`` of matrix ``j``."""
    i32 = Int32.mlir_type
    res = _asm(_struct(i32, 4), [Int32(address)],
               "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r", loc, ip)
    return _unpack(res, i32, 4, Int32, loc, ip)


@dsl_user_op
def mma_m16n8k16_bf16(a, b, c, *, loc=None, ip=None):
    """``d = a @ b + c`` on one m16n8k16 block, BF16 in, FP32 accumulate."""
    f32 = Float32.mlir_type
    res = _asm(_struct(f32, 4), [*a, *b, *c],
               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip, side_effects=False)
    return _unpack(res, f32, 4, Float32, loc, ip)


@dsl_user_op
def fp8x4_to_bf16x2(word, multiplier=None, *, loc=None, ip=None):
    """Four e4m3 bytes -> two BF16x2: ``(even, odd)``, bytes (0, 2) and
    (1, 3), each pair's first in the low half. Per half: the sign to bit 15,
    the 7 exponent and mantissa bits shifted right by 4 from the byte's place
    (``layout.fp8_to_bf16_bits``: the weight times 2 ** -120, subnormals
    too), then one BF16x2 multiply: by 2 ** 120 (0x7B80: exact), or by
    ``multiplier`` (``block_multiplier``: a block scale folded in, rounded
    to nearest even)."""
    i32 = Int32.mlir_type
    operands = [Int32(word)] + ([] if multiplier is None else [Int32(multiplier)])
    factor = "mov.b32 f, 0x7B807B80;\n" if multiplier is None else "mov.b32 f, $3;\n"
    res = _asm(_struct(i32, 2), operands,
               "{\n.reg .b32 s, m, w, f;\n"
               + factor +
               "shl.b32 w, $2, 8;\n"
               "and.b32 s, w, 0x80008000;\n"
               "and.b32 m, w, 0x7f007f00;\n"
               "shr.b32 m, m, 4;\n"
               "or.b32 $0, s, m;\n"
               "mul.rn.bf16x2 $0, $0, f;\n"
               "and.b32 s, $2, 0x80008000;\n"
               "and.b32 m, $2, 0x7f007f00;\n"
               "shr.b32 m, m, 4;\n"
               "or.b32 $1, s, m;\n"
               "mul.rn.bf16x2 $1, $1, f;\n}",
               "=r,=r,r" + ("" if multiplier is None else ",r"), loc, ip, side_effects=False)
    return _unpack(res, i32, 2, Int32, loc, ip)


@dsl_user_op
def block_multiplier(scale, *, loc=None, ip=None):
    """A 128 x 128 block scale as ``fp8x4_to_bf16x2``'s multiplier: ``scale
    * 2 ** 120`` (exact in FP32 below ``contract.FP8_BLOCK_SCALE_BOUND``)
    rounded to nearest-even BF16, in both halves."""
    return Int32(_asm(Int32.mlir_type, [Float32(scale)],
                      "{\n.reg .f32 t;\nmul.f32 t, $1, 0f7B800000;\n"
                      "cvt.rn.bf16x2.f32 $0, t, t;\n}",
                      "=r,f", loc, ip, side_effects=False))


@dsl_user_op
def ld_shared_v2_b32(address, *, loc=None, ip=None):
    """Eight bytes of shared memory as two words."""
    i32 = Int32.mlir_type
    res = _asm(_struct(i32, 2), [Int32(address)], "ld.shared.v2.b32 {$0, $1}, [$2];",
               "=r,=r,r", loc, ip)
    return _unpack(res, i32, 2, Int32, loc, ip)


@dsl_user_op
def prmt_b32(a, b, selector, *, loc=None, ip=None):
    """``prmt.b32``: four bytes picked from ``(b, a)`` by ``selector``."""
    return Int32(_asm(Int32.mlir_type, [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {selector};",
                      "=r,r,r", loc, ip, side_effects=False))


# --------------------------------------------------------- epilogue


@dsl_user_op
def ld_global_f32(address, *, loc=None, ip=None):
    """One FP32 from global memory (read-only path)."""
    return Float32(_asm(Float32.mlir_type, [Int64(address)], "ld.global.nc.f32 $0, [$1];",
                        "=f,l", loc, ip))


@dsl_user_op
def ld_global_v4_f32_if(address, predicate, *, loc=None, ip=None):
    """Four FP32 (one 16-byte load, if ``predicate``); zeros otherwise."""
    return [Float32(_asm(Float32.mlir_type, [w], "mov.b32 $0, $1;", "=f,r", loc, ip,
                         side_effects=False))
            for w in ld_global_v4_b32_if(address, predicate, loc=loc, ip=ip)]


@dsl_user_op
def st_shared_f32(address, value, *, loc=None, ip=None):
    _asm(None, [Int32(address), Float32(value)], "st.shared.f32 [$0], $1;", "r,f", loc, ip)


@dsl_user_op
def ld_shared_v4_f32(address, *, loc=None, ip=None):
    f32 = Float32.mlir_type
    res = _asm(_struct(f32, 4), [Int32(address)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
               "=f,=f,=f,=f,r", loc, ip)
    return _unpack(res, f32, 4, Float32, loc, ip)


@dsl_user_op
def ld_global_v4_b32_if(address, predicate, *, loc=None, ip=None):
    """Four words (one 16-byte read-only load, if ``predicate``); zeros otherwise."""
    i32 = Int32.mlir_type
    res = _asm(_struct(i32, 4), [Int64(address), Int32(predicate)],
               "{\n.reg .pred P1;\nsetp.ne.u32 P1, $5, 0;\n"
               "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
               "@P1 ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];\n}",
               "=r,=r,=r,=r,l,r", loc, ip)
    return _unpack(res, i32, 4, Int32, loc, ip)


@dsl_user_op
def ld_global_bf16x8_as_f32(address, predicate, *, loc=None, ip=None):
    """Eight BF16 (one 16-byte load, if ``predicate``) widened to FP32; zeros otherwise."""
    words = ld_global_v4_b32_if(address, predicate, loc=loc, ip=ip)
    out = []
    for w in words:
        out.append(bf16_low_to_f32(w, loc=loc, ip=ip))
        out.append(bf16_high_to_f32(w, loc=loc, ip=ip))
    return out


@dsl_user_op
def bf16_low_to_f32(word, *, loc=None, ip=None):
    return Float32(_asm(Float32.mlir_type, [Int32(word)], "shl.b32 $0, $1, 16;", "=f,r", loc, ip,
                        side_effects=False))


@dsl_user_op
def bf16_high_to_f32(word, *, loc=None, ip=None):
    return Float32(_asm(Float32.mlir_type, [Int32(word)], "and.b32 $0, $1, 0xffff0000;", "=f,r",
                        loc, ip, side_effects=False))


@dsl_user_op
def silu_mul_f32(gate, up, *, loc=None, ip=None):
    """``silu(gate) * up`` in FP32 (the SwiGLU epilogue): ``exp(-g)`` as
    ``ex2.approx(g * -log2(e))``, ``1 / (1 + exp(-g))`` by ``rcp.approx``
    (a large negative g gives inf, so 0, so -0), times g, times ``up``.
    Not ``div.rn``: its slow path is a subroutine call with a stack frame
    (16 spilled bytes on 64 capped registers, measured in the compile)."""
    return Float32(_asm(Float32.mlir_type, [Float32(gate), Float32(up)],
                        "{\n.reg .f32 e, d;\n"
                        "mul.f32 e, $1, 0fBFB8AA3B;\n"
                        "ex2.approx.ftz.f32 e, e;\n"
                        "add.f32 d, e, 0f3F800000;\n"
                        "rcp.approx.ftz.f32 d, d;\n"
                        "mul.f32 e, $1, d;\n"
                        "mul.f32 $0, e, $2;\n}",
                        "=f,f,f", loc, ip, side_effects=False))


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None):
    """Round two FP32 to nearest-even BF16, ``lo`` in the low half."""
    return Int32(_asm(Int32.mlir_type, [Float32(hi), Float32(lo)], "cvt.rn.bf16x2.f32 $0, $1, $2;",
                      "=r,f,f", loc, ip, side_effects=False))


@dsl_user_op
def st_global_v4_b32_if(address, words, predicate, *, loc=None, ip=None):
    """16-byte store of four words, only if ``predicate`` is non-zero."""
    _asm(None, [Int64(address), *[Int32(w) for w in words], Int32(predicate)],
         "{\n.reg .pred P1;\nsetp.ne.u32 P1, $5, 0;\n"
         "@P1 st.global.v4.b32 [$0], {$1, $2, $3, $4};\n}",
         "l,r,r,r,r,r,~{memory}", loc, ip)
