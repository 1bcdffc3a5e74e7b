"""The SwiGLU epilogue on a real GPU: every M 1..32 over several gate/up
shapes, with and without biases, against a float64 reference; bitwise
repeatable; two launches in a CUDA graph (PDL) replayed with new values."""

import pytest

torch = pytest.importorskip("torch")

from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic, default_tactic  # noqa: E402
from warpsplitk.tactics import is_legal  # noqa: E402

pytestmark = pytest.mark.gpu

MS = tuple(range(1, 33))
#: [gate; up] weights: Llama-3-8B's MLP (I = 14336) and its TP-8 shard, a
#: Qwen3-4B TP-2 shard, a small one
SHAPES = [(2 * 14336, 4096), (2 * 1792, 4096), (2 * 4864, 2560), (2 * 512, 1024)]


FAMILIES = ["32,8,256,6,2", "16,1,256,8,1", "64,16,128,4,2,2", "32,32,256,4,1+tma",
            "32,8,256,4,1+prefetch2", "32,4,256,4,1+bulk"]
FAMILY_SHAPE = (2 * 1792, 4096)


@pytest.fixture(scope="module", autouse=True)
def _kernels_compiled():
    """Every kernel the module runs, compiled first in parallel into the
    disk cache (one by one, compiling is most of the module's time)."""
    from warpsplitk.runtime.compile import device_arch
    from warpsplitk.runtime.precompile import precompile
    kernels = {(n, k, t, bias, True, True) for n, k in SHAPES for t in tactics_for(n, k).values()
               for bias in (False, True)}
    kernels |= {(*FAMILY_SHAPE, WarpSplitKTactic.parse(text), True, True, True)
                for text in FAMILIES}
    precompile(sorted(kernels), device_arch(torch.cuda.current_device()))


def swiglu_reference(x, w, bias=None):
    x, w = x.double(), w.double()
    i = w.shape[0] // 2
    g, u = x @ w[:i].t(), x @ w[i:].t()
    if bias is not None:
        g, u = g + bias[:i].double(), u + bias[i:].double()
    return torch.nn.functional.silu(g) * u


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def tactics_for(n, k):
    """The SwiGLU epilogue's default tactic of each M."""
    found = {m: default_tactic(m, n, k, swiglu=True) for m in MS}
    assert all(is_legal(t, n, k, swiglu=True) for t in found.values())
    return found


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_every_m_against_float64(n, k, with_bias):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    tactics = tactics_for(n, k)
    assert len(tactics) == len(MS)
    prepared = PreparedWarpSplitK(w, tactics, bias=bias, swiglu=True)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"M={m}: unwritten outputs"
        assert rel_err(out, swiglu_reference(x, w, bias)) < 1e-2, m
        again = torch.full_like(out, float("nan"))
        prepared.run(x, again)
        torch.cuda.synchronize()
        assert torch.equal(out, again), f"M={m}: not repeatable"


@pytest.mark.parametrize("text", FAMILIES)
def test_option_families(text):
    n, k = FAMILY_SHAPE
    tactic = WarpSplitKTactic.parse(text)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 3, 8, 17, 32):
        if m > tactic.token_tile and tactic.token_tile < 8:
            continue
        prepared = PreparedWarpSplitK(w, {m: tactic}, bias=bias, swiglu=True)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        torch.cuda.synchronize()
        assert rel_err(out, swiglu_reference(x, w, bias)) < 1e-2, (text, m)


def test_graph_capture_and_replay_with_new_values():
    n, k, m = 2 * 1792, 4096, 8
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    prepared = PreparedWarpSplitK(w, {m: default_tactic(m, n, k, swiglu=True)}, swiglu=True)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    out2 = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run(x, out)
        prepared.run(x, out2)
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, swiglu_reference(x, w)) < 1e-2 and torch.equal(out, out2)


def test_prepare_where_the_default_is_a_mixed_grid():
    """A [gate; up] weight whose plain default at M = 8 is a mixed grid
    (2560-row halves, 80 CTAs of 64 rows): prepare(swiglu=True) takes the
    epilogue's default instead, and computes."""
    from warpsplitk import prepare
    n, k, m = 2 * 2560, 7168, 8
    if not default_tactic(m, n, k).half_tiles:  # (132 or 148 SMs; 114: 70% busy, no)
        pytest.skip("on this GPU's SM count the default here is no mixed grid")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    prepared = prepare(w, None, ms=[m], swiglu=True)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    prepared.run(x, out)
    torch.cuda.synchronize()
    assert rel_err(out, swiglu_reference(x, w)) < 1e-2


def test_refuses_a_mixed_grid_and_a_full_width_output():
    n, k = 2 * 1792, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="SwiGLU epilogue pairs"):
        PreparedWarpSplitK(w, {1: WarpSplitKTactic(32, 8, 256, 4, 1, half_tiles=2)},
                           swiglu=True)
    prepared = PreparedWarpSplitK(w, {1: default_tactic(1, n, k, swiglu=True)}, swiglu=True)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 1792\)"):
        prepared.run(x, torch.empty(1, n, device="cuda", dtype=torch.bfloat16))


def test_layer_path_benchmark_runs_checked():
    """bench --layer on a small model: every path checked against float64
    (it raises otherwise), and each timed."""
    from warpsplitk.measure.layer_bench import bench_layer_path
    rows = bench_layer_path("llama-3.2-1b", 1, ms=(1, 8), rounds=1, progress=lambda line: None)
    assert [r.m for r in rows] == [1, 8]
    for r in rows:
        assert min(r.fused_us, r.unmerged_us, r.cublas_us, r.mlp_fused_us) > 0
