"""The SwiGLU epilogue without a GPU: the gate/up row pairing (layout), the
emulator's accumulation (exact on small integers) and activation (within
FP32 rounding of float64), check_tactic's rule, the PTX audit on sm_90a
compiles, the disk-cache key and run's output shape."""

import math

import numpy as np
import pytest

from warpsplitk.kernel import emulator, layout
from warpsplitk.planning.choose import default_tactic
from warpsplitk.tactics import WarpSplitKTactic as T, check_tactic, is_legal


@pytest.mark.parametrize("output_tile", [16, 32, 48, 64])
def test_tiles_pair_each_gate_row_with_its_up_row(output_tile):
    n = output_tile * 6  # [gate; up], I = 3 tiles
    half, rows = output_tile // 2, []
    for tile_n in range(n // output_tile):
        tile = [layout.weight_row(tile_n, r, output_tile, n, swiglu=True)
                for r in range(output_tile)]
        gate, up = tile[:half], tile[half:]
        # the tile's first half: gate rows of its outputs; second: the same
        # outputs' up rows, I further
        assert gate == list(range(tile_n * half, (tile_n + 1) * half))
        assert up == [g + n // 2 for g in gate]
        rows += tile
    assert sorted(rows) == list(range(n))  # every weight row read once
    # without the epilogue: the plain row tiles
    assert [layout.weight_row(2, r, output_tile, n) for r in range(3)] == \
        [2 * output_tile + r for r in range(3)]
    assert layout.output_rows(output_tile, swiglu=True) == half
    assert layout.epilogue_vectors(output_tile, 8, swiglu=True) == 8 * half // layout.CHUNK


def _reference(x, w, bias):
    x, w = x.astype(np.float64), w.astype(np.float64)
    i = w.shape[0] // 2
    g, u = x @ w[:i].T, x @ w[i:].T
    if bias is not None:
        g, u = g + bias[:i], u + bias[i:]
    return g, u


CASES = [
    (T(16, 8, 128, 2, 1), 64, 256, 3),
    (T(32, 8, 256, 2, 2), 128, 512, 8),
    (T(48, 16, 128, 3, 1), 96, 384, 16),
    (T(64, 32, 128, 2, 2), 128, 256, 32),
    (T(64, 8, 128, 2, 1, 2), 128, 512, 5),                   # K split in a cluster of 2
    (T(32, 1, 256, 2, 1), 64, 512, 1),                       # narrow token tile
    (T(32, 4, 256, 2, 1, x_copy="bulk"), 64, 512, 3),          # bulk activation rows
    (T(32, 16, 256, 2, 1, x_copy="tma"), 64, 512, 17),         # TMA boxes, two token tiles
    (T(16, 8, 128, 3, 1, l2_prefetch=1), 32, 768, 7),
]


@pytest.mark.parametrize("tactic,n,k,m", CASES, ids=[c[0].short() for c in CASES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_emulator_accumulates_exactly_and_activates_in_fp32(tactic, n, k, m, with_bias):
    rng = np.random.default_rng(n * 31 + k + m)
    x = rng.integers(-2, 3, (m, k)).astype(np.float32)
    w = rng.integers(-2, 3, (n, k)).astype(np.float32)
    bias = rng.integers(-4, 5, n).astype(np.float32) if with_bias else None
    out = emulator.emulate(x, w, tactic, bias, swiglu=True, round_output=False,
                          check_coverage=True)
    assert out.shape == (m, n // 2)
    g, u = _reference(x, w, bias)
    # small integers: both sums are exact in FP32, so the epilogue sees the
    # exact gate and up, and its output is silu_mul of them bit for bit
    exact = emulator.silu_mul(g.astype(np.float32), u.astype(np.float32))
    assert np.array_equal(out, exact)
    # and within FP32 rounding of the float64 activation
    ref = g / (1 + np.exp(-g)) * u
    assert np.max(np.abs(out - ref) / np.maximum(np.abs(ref), 1.0)) < 4e-7
    rounded = emulator.emulate(x, w, tactic, bias, swiglu=True)
    assert np.array_equal(rounded, emulator.round_bf16(out))


def test_silu_mul_at_the_extremes():
    g = np.array([-200.0, -88.0, -1.0, 0.0, 1.0, 30.0, 200.0], dtype=np.float32)
    out = emulator.silu_mul(g, np.ones_like(g))
    assert np.all(np.isfinite(out))
    assert out[0] == 0.0 and out[3] == 0.0 and out[-1] == 200.0  # exp overflow -> -0
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    assert np.allclose(out, ref, rtol=1e-6, atol=1e-30)


def test_the_epilogue_constant_is_minus_log2_e_in_fp32():
    bits = int(np.array([emulator.NEG_LOG2E], dtype=np.float32).view(np.uint32)[0])
    assert bits == 0xBFB8AA3B
    assert float(emulator.NEG_LOG2E) == pytest.approx(-1 / math.log(2), rel=1e-7)
    ptx_source = (layout.__file__.replace("layout.py", "ptx.py"))
    assert "0fBFB8AA3B" in open(ptx_source).read()


def test_check_tactic_refuses_mixed_grids_with_swiglu():
    mixed = T(32, 8, 256, 4, 1, half_tiles=2)
    check_tactic(mixed, 32 * 10 + 16 * 2, 1024)
    with pytest.raises(ValueError, match="SwiGLU epilogue pairs the gate and up halves"):
        check_tactic(mixed, 32 * 10 + 16 * 2, 1024, swiglu=True)
    assert not is_legal(mixed, 352, 1024, swiglu=True)
    assert is_legal(T(32, 8, 256, 4, 1), 1024, 1024, swiglu=True)


def test_disk_cache_keys_tell_the_epilogue_apart():
    from warpsplitk.runtime import disk_cache
    t = T(32, 8, 256, 4, 1)
    plain = disk_cache.key("sm_90a", 1024, 1024, t, False, True)
    assert disk_cache.key("sm_90a", 1024, 1024, t, False, True, False) == plain
    assert disk_cache.key("sm_90a", 1024, 1024, t, False, True, True) != plain


def test_run_wants_the_half_width_output():
    torch = pytest.importorskip("torch")
    from warpsplitk import PreparedWarpSplitK
    p = PreparedWarpSplitK.__new__(PreparedWarpSplitK)
    n, k = 64, 256
    p.weight, p.bias = torch.zeros(n, k, dtype=torch.bfloat16), None
    p.n, p.k, p.swiglu, p.out_columns = n, k, True, n // 2
    p.device = torch.device("cpu")
    p.tactics = {1: T(16, 8, 128, 2, 1)}
    p._launchers = {1: lambda *a: (_ for _ in ()).throw(AssertionError("launched"))}
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 32\), got \(1, 64\)"):
        p.run(x, torch.zeros(1, n, dtype=torch.bfloat16))


SM90 = [(T(32, 8, 256, 4, 1), 1024, 2048, False),
        (T(16, 1, 256, 4, 1), 256, 1024, True),
        (T(48, 16, 128, 3, 2), 96 * 4, 1024, True),
        (T(64, 8, 128, 3, 2, 2, l2_prefetch=2), 1024, 4096, True),
        (T(32, 32, 256, 4, 1, x_copy="tma"), 1024, 2048, False)]


@pytest.mark.parametrize("tactic,n,k,with_bias", SM90, ids=[c[0].short() for c in SM90])
def test_compiles_for_sm90a_and_passes_the_audit(tactic, n, k, with_bias):
    from warpsplitk.runtime.compile import audit_ptx, compile_for_arch
    report = compile_for_arch(n, k, tactic, "sm_90a", has_bias=with_bias, swiglu=True)
    assert report.audit() == []
    assert report.spill_bytes == 0
    # the epilogue's instructions are what the audit keys on: the same PTX
    # audited as a plain kernel is refused
    assert any("without swiglu" in p for p in audit_ptx(
        report.ptx, k_tiles=k // (tactic.k_tile * tactic.k_split), k_split=tactic.k_split,
        l2_prefetch=bool(tactic.l2_prefetch), tma_x=tactic.x_copy == "tma",
        stages=tactic.stages))


FP8_SM90 = [(T(32, 8, 256, 5, 2, 2), 2048, 4096, "block128", True),
            (T(64, 8, 128, 5, 2), 2048, 4096, "channel", False),
            (T(32, 32, 256, 2, 2), 1024, 2048, "tensor", True),
            (T(32, 8, 128, 3, 2, 2), 1024, 65 * 128, "block128", False)]  # uneven split


@pytest.mark.parametrize("tactic,n,k,scales,with_bias", FP8_SM90,
                         ids=[f"{c[0].short()}-{c[3]}" for c in FP8_SM90])
def test_fp8_weights_with_the_epilogue_compile_and_pass_the_audit(tactic, n, k, scales,
                                                                    with_bias):
    """An e4m3 ``[gate; up]`` weight: the FP8 kernel with the SwiGLU
    epilogue, audited as both, no local memory."""
    from warpsplitk.runtime.compile import compile_for_arch
    report = compile_for_arch(n, k, tactic, "sm_90a", has_bias=with_bias, swiglu=True,
                              fp8_scales=scales)
    assert report.audit() == []
    assert report.spill_bytes == 0 and report.local_bytes == 0
    assert report.smem_bytes < tactic.smem_bytes  # byte stages


def test_a_plain_kernel_fails_the_swiglu_audit():
    from warpsplitk.runtime.compile import compile_for_arch
    report = compile_for_arch(256, 1024, T(16, 8, 128, 4, 1), "sm_90a")
    report.swiglu = True
    assert any(p.startswith("missing SwiGLU") for p in report.audit())


@pytest.mark.parametrize("output_tile,k_tile,chunk", [
    (16, 128, layout.CHUNK), (16, 256, layout.CHUNK), (32, 128, layout.CHUNK),
    (32, 256, layout.CHUNK), (48, 128, layout.CHUNK), (64, 128, layout.CHUNK),
    # e4m3 weights: 16 elements a copy, twice the rows a round (tiles of 32 and more)
    (32, 128, layout.FP8_CHUNK), (32, 256, layout.FP8_CHUNK), (48, 128, layout.FP8_CHUNK),
    (64, 128, layout.FP8_CHUNK)])
def test_a_loader_copy_never_straddles_the_gate_and_up_halves(output_tile, k_tile, chunk):
    """The kernel shifts each weight copy to the up half by its first row's
    side (``swiglu_row_shift`` of thread 0's row): every thread's row of
    that copy must be on the same side."""
    threads = layout.A_LOADER_WARPS * layout.WARP
    n, half = output_tile * 8, output_tile // 2
    for copy in range(layout.copies_per_thread(output_tile, k_tile, threads, chunk)):
        rows = {layout.loader_copy(thread, copy, k_tile, threads, chunk)[0]
                for thread in range(threads)}
        shifts = {layout.swiglu_row_shift(r, output_tile, n) for r in rows}
        assert len(shifts) == 1
        first = layout.loader_copy(0, copy, k_tile, threads, chunk)[0]
        for r in rows:
            assert layout.weight_row(3, r, output_tile, n, swiglu=True) == \
                3 * half + r + layout.swiglu_row_shift(first, output_tile, n)


def test_prepare_picks_tactics_the_epilogue_takes():
    from warpsplitk.planning.plans import CUBLAS, DecodePlan, swiglu_tactic
    n, k = 2 * 14336, 4096
    for m in (1, 8, 32):
        check_tactic(swiglu_tactic(None, m, n, k, 132), n, k, swiglu=True)
    # where the default is a mixed grid (5120 x 7168 at M = 8; a merged
    # [gate; up] of 2560-row halves), the epilogue's default is not
    assert default_tactic(8, 5120, 7168, 132).half_tiles
    check_tactic(swiglu_tactic(None, 8, 5120, 7168, 132), 5120, 7168, swiglu=True)
    # a plan's mixed grid or cuBLAS entry cannot carry the epilogue: the
    # default replaces it; a tactic it takes is kept
    n, k = 32 * 10 + 16 * 2, 1024
    plan = DecodePlan()
    plan.set(n, k, 1, T(32, 8, 256, 4, 1, half_tiles=2))
    plan.set(n, k, 8, CUBLAS)
    plan.set(n, k, 16, T(16, 16, 256, 4, 2))
    assert not swiglu_tactic(plan, 1, n, k, 132).half_tiles
    assert swiglu_tactic(plan, 8, n, k, 132) != CUBLAS
    assert swiglu_tactic(plan, 16, n, k, 132) == T(16, 16, 256, 4, 2)


def test_the_call_before_down_triggers_early():
    """gate/up's output feeds down's kernel: the SwiGLU call takes the
    early PDL trigger at M <= 8, whatever chose its tactic; cuBLAS stays
    cuBLAS."""
    from dataclasses import replace
    from warpsplitk.planning.plans import (BEFORE_DOWN_MAX_M, CUBLAS, DecodePlan, before_down,
                                           swiglu_tactic)
    n, k = 2 * 14336, 4096  # a 235 MB weight: no early trigger as an independent call
    for m in (1, 8, 32):
        assert not default_tactic(m, n, k, 132, swiglu=True).early_launch
        chosen = swiglu_tactic(None, m, n, k, 132)
        assert chosen.early_launch == (m <= BEFORE_DOWN_MAX_M)
        assert chosen == replace(default_tactic(m, n, k, 132, swiglu=True),
                                 early_launch=chosen.early_launch)
    plan = DecodePlan()
    plan.set(n, k, 8, T(32, 8, 256, 4, 1))
    assert swiglu_tactic(plan, 8, n, k, 132) == T(32, 8, 256, 4, 1, early_launch=True)
    assert before_down(CUBLAS, 1) == CUBLAS
    early = T(16, 8, 256, 4, 1, early_launch=True)
    assert before_down(early, 1) == early and before_down(early, 32) == early
