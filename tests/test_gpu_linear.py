"""DecodeLinear and the custom op on a real GPU: accuracy, fallback, graphs, torch.compile."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F
from torch import nn

from warpsplitk.nn import ops
from warpsplitk.nn.linear import DecodeLinear
from warpsplitk.nn.patch import patch_model, unpatch

pytestmark = pytest.mark.gpu

N, K = 1024, 2048
MS = (1, 8, 32)  # fewer Ms, fewer compiles


def rel_err(out, x, w, bias=None):
    ref = x.double() @ w.double().t()
    if bias is not None:
        ref += bias.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def make(bias=True, n=N, k=K, ms=MS):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    return lin, DecodeLinear.from_linear(lin, ms=ms)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", MS)
def test_matches_reference(m, bias):
    lin, mod = make(bias)
    assert mod.prepared is not None, mod.extra_repr()
    x = bf16(m, K)
    with torch.no_grad():
        out = mod(x)
    torch.cuda.synchronize()
    assert (out.shape, out.dtype) == ((m, N), torch.bfloat16)
    assert mod.kernel_calls == 1 and mod.fallback_calls == 0
    assert rel_err(out, x, lin.weight, lin.bias) < 1e-2


def test_leading_dims():
    lin, mod = make()
    x = bf16(2, 4, K)
    with torch.no_grad():
        out = mod(x)
    assert out.shape == (2, 4, N) and mod.kernel_calls == 1
    assert rel_err(out.reshape(8, N), x.reshape(8, K), lin.weight, lin.bias) < 1e-2


def test_fallbacks():
    lin, mod = make()
    x = bf16(33, K)
    with torch.no_grad():
        assert torch.equal(mod(x), F.linear(x, lin.weight, lin.bias))  # M=33: not prepared
        assert torch.equal(mod(x[:5]), F.linear(x[:5], lin.weight, lin.bias))  # M=5 not in MS
        with pytest.raises(RuntimeError):
            mod(x[:8].float())  # as nn.Linear: F.linear refuses fp32 x with a bf16 weight
    assert mod.kernel_calls == 0 and mod.fallback_calls == 2

    lin32 = nn.Linear(K, N, device="cuda")  # fp32 weight: never prepared, plain F.linear
    mod32 = DecodeLinear.from_linear(lin32, ms=MS)
    assert mod32.prepared is None and "float32" in mod32.extra_repr()
    x32 = torch.randn(8, K, device="cuda")
    with torch.no_grad():
        assert torch.equal(mod32(x32), lin32(x32))
    assert mod32.fallback_calls == 1


def test_cuda_graph_capture():
    lin, mod = make()
    x = bf16(8, K)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        mod(x)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = mod(x)
    x.copy_(bf16(8, K))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, x, lin.weight, lin.bias) < 1e-2


@pytest.mark.parametrize("bias", [False, True])
def test_plan_with_cublas_entries_mixes_both_paths_in_one_graph(bias):
    """A plan that runs M = 8 on cuBLAS (plans.CUBLAS) and M = 1, 32 on the
    kernel: DecodeLinear prepares a PreparedDecode; every M matches fp64,
    eagerly and replayed from one CUDA graph holding both paths."""
    from warpsplitk.planning.plans import CUBLAS, DecodePlan
    from warpsplitk.runtime.prepared import PreparedDecode
    from warpsplitk.planning.choose import default_tactic
    plan = DecodePlan()
    plan.set(N, K, 1, default_tactic(1, N, K))
    plan.set(N, K, 8, CUBLAS)
    plan.set(N, K, 32, default_tactic(32, N, K))
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias, device="cuda", dtype=torch.bfloat16)
    mod = DecodeLinear.from_linear(lin, plan=plan, ms=MS)
    assert isinstance(mod.prepared, PreparedDecode) and mod.prepared.cublas_ms == (8,)
    xs = {m: bf16(m, K) for m in MS}
    with torch.no_grad():
        for m, x in xs.items():
            assert rel_err(mod(x), x, lin.weight, lin.bias) < 1e-2
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x in xs.values():
                mod(x)  # warm up (cuBLAS's workspace) outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = {m: mod(x) for m, x in xs.items()}
    for x in xs.values():
        x.copy_(bf16(*x.shape))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in xs.items():
        assert rel_err(ys[m], x, lin.weight, lin.bias) < 1e-2, m


def test_compile_fullgraph():
    lin, mod = make()
    compiled = torch.compile(mod, fullgraph=True)
    with torch.no_grad():
        for shape in [(1, K), (2, 4, K), (32, K)]:  # M = 1, 8, 32
            x = bf16(*shape)
            out = compiled(x)
            assert torch.equal(out, mod(x))
            assert rel_err(out.reshape(-1, N), x.reshape(-1, K), lin.weight, lin.bias) < 1e-2


def test_compile_dynamic_m():
    lin, mod = make(ms=range(1, 33))
    compiled = torch.compile(mod, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (3, 17, 32, 33):
            x = bf16(m, K)
            assert rel_err(compiled(x), x, lin.weight, lin.bias) < 1e-2


def test_compile_reduce_overhead():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N), nn.SiLU(), nn.Linear(N, K)).cuda().to(torch.bfloat16)
    ref = [model[0], model[2]]
    report = patch_model(model, ms=MS)
    assert report.swapped == ["0", "2"], str(report)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):  # warm-up, record, replays
            x = bf16(8, K)
            out = compiled(x).clone()  # graph outputs are overwritten by the next replay
            expected = ref[1](F.silu(ref[0](x)))
            assert ((out - expected).float().norm() / expected.float().norm()).item() < 2e-2


def test_load_state_dict_reprepares():
    lin, mod = make()
    handle = mod._handle
    x = bf16(8, K)
    with torch.no_grad():
        before = mod(x).clone()
        new = nn.Linear(K, N, device="cuda", dtype=torch.bfloat16)
        mod.load_state_dict(new.state_dict())  # in place: same memory, same handle
        after = mod(x)
        assert mod._handle == handle and mod.kernel_calls == 2
        assert not torch.equal(before, after)
        assert rel_err(after, x, new.weight, new.bias) < 1e-2
        new = nn.Linear(K, N, device="cuda", dtype=torch.bfloat16)
        mod.load_state_dict(new.state_dict(), assign=True)  # new tensors: re-prepared
        assert mod._handle != handle
        assert mod.prepared.weight.data_ptr() == mod.weight.data_ptr() == new.weight.data_ptr()
        assert rel_err(mod(x), x, new.weight, new.bias) < 1e-2
    assert mod.kernel_calls == 3


def test_compiled_after_reprepare():
    _, mod = make()
    compiled = torch.compile(mod, fullgraph=True)
    x = bf16(8, K)
    with torch.no_grad():
        compiled(x)
        new = nn.Linear(K, N, device="cuda", dtype=torch.bfloat16)
        mod.load_state_dict(new.state_dict(), assign=True)  # new handle: guards recompile
        assert rel_err(compiled(x), x, new.weight, new.bias) < 1e-2


def test_cpu_module_moved_to_cuda_prepares():
    mod = DecodeLinear(torch.randn(N, K, dtype=torch.bfloat16), ms=MS)
    assert mod.prepared is None
    mod.cuda()
    assert mod.prepared is not None
    x = bf16(1, K)
    with torch.no_grad():
        assert rel_err(mod(x), x, mod.weight) < 1e-2
    assert mod.kernel_calls == 1


def test_autograd_through_kernel_path():
    lin, mod = make()
    x = bf16(8, K).requires_grad_()
    out = mod(x)
    assert mod.kernel_calls == 1
    grad = bf16(8, N)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    lin.weight.grad = None
    F.linear(x_ref, lin.weight, lin.bias).backward(grad)
    assert torch.allclose(x.grad.float(), x_ref.grad.float(), rtol=2e-2, atol=2e-2)


def test_patch_model_and_unpatch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, 100), nn.Linear(100, 64))
    model = model.cuda().to(torch.bfloat16)
    originals = list(model)
    x = bf16(8, K)  # an M among the prepared MS
    with torch.no_grad():
        expected = model(x)
        report = patch_model(model, ms=MS)
        assert report.swapped == ["0"] and [n for n, _ in report.skipped] == ["2", "3"]
        out = model(x)
    assert model[0].kernel_calls == 1
    assert ((out - expected).float().norm() / expected.float().norm()).item() < 2e-2
    unpatch(model)
    assert all(a is b for a, b in zip(model, originals))


def test_op_fake_matches_real():
    # Not the whole opcheck: it clones the inputs, and the op refuses a weight
    # other than the one its handle was prepared for (test_op_refuses_other_weight).
    _, mod = make()
    args = (bf16(8, K), mod.weight.detach(), mod.bias.detach(), mod._handle)
    torch.library.opcheck(torch.ops.warpsplitk.decode_linear.default, args,
                          test_utils="test_autograd_registration")
    real = torch.ops.warpsplitk.decode_linear(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.warpsplitk.decode_linear(*(mode.from_tensor(a) if torch.is_tensor(a) else a
                                                    for a in args))
    assert (fake.shape, fake.stride(), fake.dtype, fake.device) == \
        (real.shape, real.stride(), real.dtype, real.device)


def test_op_refuses_other_weight():
    _, mod = make()
    with pytest.raises(ValueError, match="not the tensors"):
        torch.ops.warpsplitk.decode_linear(bf16(8, K), bf16(N, K), mod.bias, mod._handle)
    with pytest.raises(KeyError):
        ops.lookup(-1)


def test_fp8_decode_linear_eager_graph_and_compiled():
    """``DecodeLinear.from_fp8``: the FP8 kernel for M <= 32 (eager, in a CUDA
    graph, under torch.compile with CUDA graphs), the dequantized fallback
    beyond, every path within 1e-2 of float64 of the dequantized weight."""
    torch.manual_seed(3)
    w8 = (torch.randn(N, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(N, 1, device="cuda") * 1e-3 + 1e-3
    bias = bf16(N)
    mod = DecodeLinear.from_fp8(w8, scale, bias, ms=MS)
    assert mod.prepared is not None and mod.prepared.fp8_scales == "channel"
    dequant = w8.float() * scale
    for m in MS:
        x = bf16(m, K)
        assert mod.accepts(x)
        assert rel_err(mod(x), x, dequant, bias) < 1e-2
    x = bf16(40, K)  # M past 32: the fallback
    assert not mod.accepts(x) and rel_err(mod(x), x, dequant, bias) < 1e-2
    x = bf16(8, K)
    eager = mod(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mod(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    compiled = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        out = compiled(x)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("block_size", [(128, 128), None], ids=["block128", "tensor"])
def test_patch_model_swaps_transformers_fine_grained_fp8_linear(block_size):
    """transformers' own ``FP8Linear`` (its fine-grained FP8 quantization:
    ``weight_scale_inv`` per 128 x 128 block, or one when ``block_size`` is
    None), swapped by ``patch_model`` and computing ``x @ (w * s)^T`` within
    1e-2 of float64 at M <= 32; unpatch gives it back."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    torch.manual_seed(5)
    n, k = 1536, 2048
    layer = fp8.FP8Linear(k, n, block_size=block_size).cuda()
    with torch.no_grad():
        layer.weight.copy_((torch.randn(n, k, device="cuda") * 64).clamp(-448, 448)
                           .to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand_like(layer.weight_scale_inv) * 1e-3 + 1e-3)
    model = nn.Sequential(layer)
    report = patch_model(model, ms=MS, progress=None)
    assert report.swapped == ["0"] and isinstance(model[0], DecodeLinear)
    scale = layer.weight_scale_inv.float()
    if block_size is not None:
        scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    dequant = layer.weight.float() * scale
    for m in MS:
        x = bf16(m, k)
        assert model[0].accepts(x)
        assert rel_err(model(x), x, dequant) < 1e-2
    assert unpatch(model) == ["0"] and model[0] is layer
