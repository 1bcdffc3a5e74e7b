"""The kernel on a real GPU: correctness over the shape table and more, graphs, bad input."""

import random

import pytest

torch = pytest.importorskip("torch")

from script_loader import load_script
from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic, default_tactic, legal_tactics
from warpsplitk.shapes import load
from warpsplitk.tactics import L2_PREFETCHES, X_COPIES

pytestmark = pytest.mark.gpu

MS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32)
EXTRA_SHAPES = [(256, 16384), (16, 1024), (4096, 4096), (112, 640), (8192, 1024)]
SHAPES = [(s["n"], s["k"]) for s in load()["shapes"]] + EXTRA_SHAPES


@pytest.fixture(scope="module", autouse=True)
def _default_tactics_compiled():
    """Every default tactic the module runs, compiled first in parallel (a
    process per core) into the disk cache: one by one, compiling is most of
    the module's time."""
    from warpsplitk.runtime.compile import device_arch
    from warpsplitk.runtime.precompile import precompile
    kernels = {(n, k, default_tactic(m, n, k), False, True) for n, k in SHAPES for m in MS}
    precompile(sorted(kernels), device_arch(torch.cuda.current_device()))


def rel_err(out, x, w, bias=None):
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref += bias.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_prepared_in_a_graph(prepared, m, n, k, w, bias=None):
    """Every M of ``prepared`` checked twice, then M = ``m`` captured as two
    launches back to back (PDL), replayed with new values."""
    for each in sorted(prepared.tactics):
        check(prepared, each, n, k, w, bias)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out2 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(x, out)
        prepared.run(x, out2)
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, x, w, bias) < 1e-2 and torch.equal(out, out2)


def check_tactic_with_and_without_bias(tactic, n, k, ms, graph_m):
    """One tactic prepared for ``ms`` on a random ``[n, k]`` weight, without
    and with a bias: every M checked, then ``graph_m`` in a graph (PDL)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for b in (None, bias):
        prepared = PreparedWarpSplitK(w, {m: tactic for m in ms}, bias=b)
        check_prepared_in_a_graph(prepared, graph_m, n, k, w, b)


def check(prepared, m, n, k, w, bias=None):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    prepared.run(x, out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs left"
    err = rel_err(out, x, w, bias)
    assert err < 1e-2, err
    first = out.clone()
    prepared.run(x, out)
    torch.cuda.synchronize()
    assert torch.equal(first, out), "repeated run differs"
    return err


@pytest.mark.parametrize("n,k", SHAPES)
def test_default_tactics(n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: default_tactic(m, n, k) for m in MS})
    for m in MS:
        check(prepared, m, n, k, w)


@pytest.mark.parametrize("n,k", SHAPES)
def test_random_legal_tactics(n, k):
    rng = random.Random(n * 100003 + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in rng.sample(MS, 3):
        # both PDL trigger points, both activation copies, with and without
        # the L2 prefetch: the shipped plans use them all
        tactic = rng.choice(legal_tactics(m, n, k, early_launches=(False, True),
                                          l2_prefetches=L2_PREFETCHES, x_copies=X_COPIES))
        prepared = PreparedWarpSplitK(w, {m: tactic})
        check(prepared, m, n, k, w)


def test_bias():
    n, k = 1024, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: default_tactic(m, n, k) for m in MS}, bias=bias)
    for m in MS:
        check(prepared, m, n, k, w, bias)


def test_graph_capture_and_replay_with_new_values():
    n, k = 2048, 7168
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: default_tactic(m, n, k) for m in (1, 8, 32)})
    for m in (1, 8, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)  # warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepared.run(x, out)
        for _ in range(3):
            x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert not torch.isnan(out).any()
            assert rel_err(out, x, w) < 1e-2


def test_bad_input_refused_before_launch():
    n, k = 256, 1024
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {8: default_tactic(8, n, k)})
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((8, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    big = torch.zeros(8 * k + 64, device="cuda", dtype=torch.bfloat16)
    bad = [
        (x.float(), out, ValueError),
        (x.cpu(), out, ValueError),
        (x[:, :k // 2], out, ValueError),
        (torch.randn(k, 8, device="cuda", dtype=torch.bfloat16).t(), out, ValueError),
        (big[1:1 + 8 * k].view(8, k), out, ValueError),  # misaligned by 2 bytes
        (big[8:8 + 8 * k].view(8, k), out, ValueError),  # misaligned by 16 bytes
        (x, out[:, :n // 2], ValueError),
        (x, out.float(), ValueError),
        (x[:7], out[:7], KeyError),
        (x.view(-1), out, ValueError),
    ]
    for bx, bo, error in bad:
        before = out.clone()
        with pytest.raises(error):
            prepared.run(bx, bo)
        torch.cuda.synchronize()
        assert torch.equal(out.isnan(), before.isnan())


def test_prepare_refuses_bad_weight():
    w = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    t = WarpSplitKTactic(16, 8, 128, 4, 1)
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w.float(), {1: t})
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w.t(), {1: t})
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w.cpu(), {1: t})
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w, {33: t})
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w[:, :1000], {1: t})
    with pytest.raises(ValueError):
        PreparedWarpSplitK(w, {1: WarpSplitKTactic(16, 8, 128, 16, 1)})


@pytest.mark.parametrize("tactic,n,k", [
    (WarpSplitKTactic(48, 32, 128, 4, 2), 3216, 7168),   # N = 48 * 67: two epilogue rounds
    (WarpSplitKTactic(64, 32, 128, 8, 2), 4608, 1536),   # 256 output vectors: two rounds
    (WarpSplitKTactic(48, 16, 128, 6, 1), 2112, 1536),
    (WarpSplitKTactic(64, 16, 128, 1, 2), 1024, 128),    # one K tile: unhinted prologue only
    (WarpSplitKTactic(32, 8, 256, 11, 1), 4224, 7168),   # the H200 plan's pick for M <= 8
])
def test_wide_tiles_and_plan_tactics(tactic, n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: tactic for m in (1, 15, 17, 32)})
    for m in (1, 15, 17, 32):
        check(prepared, m, n, k, w)


@pytest.mark.parametrize("text,n,k", [
    ("32,8,256,8,1+early+bulk", 2048, 2048),              # the H200 plan's pick at M = 1
    ("16,8,256,16,1+bulk", 2112, 7168),                   # a ring shorter than K
    ("32,8,256,10,1,2+early+prefetch+bulk", 768, 7168),   # k_split: each CTA its K share
    ("64,8,128,3,1+early+bulk", 7168, 384),
    ("32,16,256,4,1+bulk", 1024, 2048),                   # 16 and 32 rows, one per lane
    ("16,32,128,2,1+bulk", 512, 1024),
    ("32,8,128,1,1+bulk", 768, 128),                      # one K tile
    ("32,8,256,5,2+early+prefetch", 4608, 1536),
    ("64,16,128,4,2+early+prefetch", 7168, 768),
    ("48,32,128,3,2,2+prefetch", 3216, 7168),
    # the bounded prefetch (the tuner's picks): a few tiles past the ring
    ("16,8,256,16,1+early+prefetch4+bulk", 2112, 7168),
    ("32,8,256,10,1,2+early+prefetch2+tma", 1536, 7168),
    ("32,8,256,11,2+early+prefetch4+half100", 2624, 6144),
    ("32,32,256,7,1+early+prefetch2+tma+half63", 3216, 7168),
    ("32,16,256,9,1+early+prefetch1", 4224, 7168),
    ("16,8,256,2,2+prefetch3", 512, 2048),                # 8 tiles: 2 in the ring, 3 past it
])
def test_bulk_activations_and_l2_prefetch(text, n, k):
    """Bulk copies (rows past M never written) and the L2 prefetch (a hint,
    whole or bounded) give
    the same results as the 16-byte copies, every M, with and without bias,
    in a graph."""
    tactic = WarpSplitKTactic.parse(text)
    check_tactic_with_and_without_bias(tactic, n, k, MS, graph_m=min(tactic.token_tile, 9))


@pytest.mark.parametrize("text,n,k", [
    ("32,32,256,7,2+early", 2624, 6144),   # one stage deeper than fits beside the buffer
    ("48,32,128,11,2", 3216, 7168),
    ("64,32,128,9,2", 2624, 6144),         # two epilogue rounds out of the aliased buffer
    ("64,16,128,11,2+early", 1024, 2048),
    ("16,32,256,9,1+bulk", 512, 2560),     # rows past M never written, then the buffer over them
])
def test_reduction_buffer_over_the_rings(text, n, k):
    """A ring too deep for its own reduction buffer beside it gets the buffer
    laid over the rings (layout.smem_plan): every M, bias, graph."""
    from warpsplitk.kernel import layout
    tactic = WarpSplitKTactic.parse(text)
    t = tactic
    assert layout.smem_plan(t.output_tile, t.token_tile, t.k_tile, t.stages, t.k_split,
                            t.activation_layout).reduction_aliased
    check_tactic_with_and_without_bias(tactic, n, k, MS, graph_m=min(tactic.token_tile, 17))


@pytest.mark.parametrize("text,n,k", [
    ("32,8,256,4,1+tma", 2048, 2048),
    ("32,8,256,11,1+early+tma", 4224, 7168),              # a long K, the early trigger
    ("32,16,256,4,1+tma", 1024, 2048),                    # rows past M: zeros from the map
    ("16,32,256,4,1+early+prefetch+tma", 3216, 7168),
    ("64,8,128,3,1+tma", 7168, 384),                      # k_tile 128: two boxes per stage
    ("48,32,128,4,1,2+tma", 3216, 7168),                  # k_split: each CTA its K share
    ("32,8,256,10,1,2+early+prefetch+tma", 768, 7168),
    ("32,32,256,7,1+early+tma", 2624, 6144),              # the buffer over the rings
    ("32,8,128,1,1+tma", 768, 128),                       # one K tile
])
def test_tma_activations(text, n, k):
    """TMA copies (activation boxes by TMA through a per-call tensor map; rows
    past M zero-filled by the map's bounds) gives the same results as the
    16-byte copies: every M, with and without bias, in a graph."""
    tactic = WarpSplitKTactic.parse(text)
    check_tactic_with_and_without_bias(tactic, n, k, MS, graph_m=min(tactic.token_tile, 9))


def test_tma_activations_match_the_copies_bitwise():
    """Only how x reaches shared memory differs: the same bits come out."""
    n, k = 2048, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    plain = PreparedWarpSplitK(w, {m: WarpSplitKTactic(32, 32, 256, 4, 2) for m in (5, 32)})
    boxes = PreparedWarpSplitK(w, {m: WarpSplitKTactic(32, 32, 256, 4, 1, x_copy="tma")
                                   for m in (5, 32)})
    for m in (5, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a = plain.run(x, torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
        b = boxes.run(x, torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert torch.equal(a, b)


def test_tma_tensor_map_follows_x():
    """The tensor map is built per call: x at a new address, or a view with
    another M, is read from where it is now."""
    n, k = 1024, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: WarpSplitKTactic(32, 16, 256, 4, 1, x_copy="tma")
                                      for m in range(1, 17)})
    big = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
    for first, m in ((0, 16), (8, 3), (24, 16), (3, 1)):
        x = big[first:first + m]
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        torch.cuda.synchronize()
        assert rel_err(out, x, w) < 1e-2


@pytest.mark.parametrize("text,n,k", [
    ("32,32,256,7,1+early+tma+half63", 3216, 7168),     # 69 x 32 + 63 x 16 rows, one CTA per SM
    ("32,8,256,11,1+early+bulk+half63", 3216, 7168),
    ("32,16,256,9,2+early+half63", 3216, 7168),
    ("64,8,128,3,1+early+tma+half40", 7168, 384),       # 92 x 64 + 40 x 32
    ("32,8,128,1,2+half5", 32 * 3 + 16 * 5, 128),       # one K tile
    ("64,32,128,9,2+prefetch+half3", 64 * 4 + 32 * 3, 1536),
])
def test_mixed_grids(text, n, k):
    """half_tiles: the last CTAs along N run the half tile's
    code; every M, with and without bias, in a graph; bitwise equal to the
    half tile alone over the whole N (the same fixed-order sums)."""
    tactic = WarpSplitKTactic.parse(text)
    check_tactic_with_and_without_bias(tactic, n, k, MS, graph_m=min(tactic.token_tile, 9))
    import dataclasses
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    half = dataclasses.replace(tactic, output_tile=tactic.output_tile // 2, half_tiles=0,
                               stages=min(tactic.stages, 4))
    x = torch.randn(7, k, device="cuda", dtype=torch.bfloat16)
    a = PreparedWarpSplitK(w, {7: tactic}).run(x, torch.empty(7, n, device="cuda",
                                                              dtype=torch.bfloat16))
    b = PreparedWarpSplitK(w, {7: half}).run(x, torch.empty(7, n, device="cuda",
                                                            dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.parametrize("text,n,k", [
    ("16,1,256,24,1", 2112, 7168),                        # deeper than any 8-row ring
    ("16,1,256,12,1+early", 2112, 7168),                  # two CTAs per SM
    ("32,1,256,13,1,2", 1536, 7168),                      # k_split: each CTA its K share
    ("32,4,256,12,2+early", 4224, 7168),
    ("48,2,128,16,1,2+prefetch", 1536, 7168),
    ("32,4,256,12,1+early+half3", 2 * 32 + 3 * 16, 7168),   # a mixed grid
    ("16,4,128,2,2", 512, 256),
    ("32,2,256,1,1", 768, 256),                           # one K tile
    # bulk rows: wrong sums without the release fence
    ("16,1,256,12,1+early+bulk", 2112, 7168),
    ("64,1,128,13,1+early+bulk", 768, 7168),
    ("32,4,128,23,1+early+prefetch+bulk", 768, 7168),
    ("32,2,256,6,1,2+early+bulk", 1536, 7168),
])
def test_narrow_token_tiles(text, n, k):
    """Narrow token tiles (1, 2, 4 rows): every M, M past the tile
    included (several token tiles), with and without bias, in a graph; and
    bitwise equal to the 8-row tile with the same other fields, whose real
    columns are the same sums in the same order."""
    import dataclasses
    tactic = WarpSplitKTactic.parse(text)
    check_tactic_with_and_without_bias(tactic, n, k, MS,
                                       graph_m=max(m for m in MS if m <= tactic.token_tile))
    wide = dataclasses.replace(tactic, token_tile=8, stages=min(tactic.stages, 4),
                               b_loader_warps=1, early_launch=False)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in sorted({1, tactic.token_tile, 5}):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a = PreparedWarpSplitK(w, {m: tactic}).run(x, torch.empty(m, n, device="cuda",
                                                                  dtype=torch.bfloat16))
        b = PreparedWarpSplitK(w, {m: wide}).run(x, torch.empty(m, n, device="cuda",
                                                                dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert torch.equal(a, b), m


@pytest.mark.parametrize("text,n,k", [
    ("16,8,256,18,1+bulk", 2112, 7168),                   # the H200 plan's 2112x7168 M = 1
    ("16,8,256,18,2+early", 2112, 7168),
    ("32,8,128,22,1", 1024, 3072),
    ("16,16,128,28,2", 512, 4096),
])
def test_rings_deeper_than_16_stages(text, n, k):
    """Rings past 16 stages (up to 32: 8-token stages of 16 rows, narrow
    token tiles): every M, with and without bias, in a graph."""
    tactic = WarpSplitKTactic.parse(text)
    check_tactic_with_and_without_bias(tactic, n, k, MS, graph_m=min(tactic.token_tile, 9))


@pytest.mark.parametrize("text,n,k,m", [
    # without the release fence the third of these raced (its TMA refills
    # landed before the ldmatrix reads), as did bulk rows and 16-token boxes
    # on many CTAs
    ("16,2,128,2,1+early+prefetch", 7168, 384, 7),
    ("64,8,128,2,1+tma", 7168, 384, 9),
    ("16,8,128,2,1+early+tma", 7168, 384, 17),
    ("16,8,128,2,1+tma", 7168, 384, 25),
    ("16,8,128,2,1+bulk", 7168, 384, 25),
    ("16,16,128,2,1+early+tma", 7168, 384, 32),
    ("16,8,128,2,1+early+tma", 7168, 768, 17),
    # narrow tiles as a tuned plan picked them
    ("32,1,256,13,1+early+prefetch4", 2624, 6144, 1),
    ("32,4,256,12,1,2+early+prefetch1", 1536, 7168, 4),
])
def test_back_to_back_launches_stay_exact(text, n, k, m):
    """Four launches back to back (PDL overlaps them), eagerly and from a
    graph, fresh inputs each round: every output right against fp64 and
    all four bitwise equal (scripts/stress_tactics.py)."""
    wrong, differing, unwritten, worst = load_script("stress_tactics").stress(
        WarpSplitKTactic.parse(text), n, k, m, rounds=40)
    assert (wrong, differing, unwritten) == (0, 0, 0), worst
