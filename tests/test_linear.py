"""DecodeLinear, the custom op and patch_model on a CPU: fallback, tracing, swapping.

The kernel branch is exercised on meta tensors: ``contract.DEVICE_TYPE`` is
pointed at "meta" and ``prepare`` replaced by a stand-in, so the op runs its
fake implementation (shapes only).
"""

import copy
import logging
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F
from torch import nn

from warpsplitk import contract
from warpsplitk.nn import linear, ops
from warpsplitk.planning import plans
from warpsplitk.nn.linear import DecodeLinear
from warpsplitk.nn.patch import PatchReport, patch_model, unpatch

from fakes import (FakePrepared, FineGrainedFP8Linear, RowwiseFP8Linear,  # noqa: E402
                   fp8_weight)


@pytest.fixture
def meta_kernel(monkeypatch):
    """The kernel "runs" on meta tensors; prepare() records its calls."""
    calls = []

    def fake_prepare(weight, plan=None, ms=range(1, 33), bias=None):
        calls.append((tuple(weight.shape), bias is not None))
        return FakePrepared(weight, plan, ms, bias)

    monkeypatch.setattr(contract, "DEVICE_TYPE", "meta")
    monkeypatch.setattr(plans, "prepare", fake_prepare)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


@pytest.fixture
def cpu_kernel(meta_kernel, monkeypatch):
    """As meta_kernel, on CPU tensors (real addresses; only fallback_reason is safe to call)."""
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    return meta_kernel


def graph_recorder():
    """A torch.compile backend that keeps each FX graph it is given (and runs it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend, graphs


def meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


# ----------------------------------------------------------- CPU fallback


def test_cpu_falls_back_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    mod = DecodeLinear.from_linear(lin)
    assert mod.prepared is None and "cpu" in mod.extra_repr()
    for shape in [(256,), (3, 256), (2, 4, 256), (2, 1, 3, 256)]:
        x = torch.randn(*shape)
        out = mod(x)
        assert out.shape == (*shape[:-1], 64)
        assert torch.equal(out, F.linear(x, lin.weight, lin.bias))
    assert (mod.kernel_calls, mod.fallback_calls) == (0, 4)


def test_fallback_logged_once_per_reason(caplog):
    mod = DecodeLinear(torch.randn(32, 128, dtype=torch.bfloat16))
    with caplog.at_level(logging.DEBUG, logger="warpsplitk"):
        for _ in range(3):
            mod(torch.randn(2, 128, dtype=torch.bfloat16))
    fallbacks = [r for r in caplog.records if "fallback" in r.getMessage()]
    assert len(fallbacks) == 1 and "cpu" in fallbacks[0].getMessage()
    assert mod.fallback_calls == 3


def test_state_dict_matches_linear_and_reprepares(monkeypatch):
    lin = nn.Linear(128, 32)
    mod = DecodeLinear.from_linear(lin)
    assert list(mod.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    no_bias = DecodeLinear(torch.zeros(32, 128))
    assert list(no_bias.state_dict()) == list(nn.Linear(128, 32, bias=False).state_dict())

    calls = []
    monkeypatch.setattr(DecodeLinear, "reprepare", lambda self: calls.append(self))
    new = nn.Linear(128, 32).state_dict()
    mod.load_state_dict(new)
    assert calls == [mod]
    x = torch.randn(4, 128)
    assert torch.equal(mod(x), F.linear(x, new["weight"], new["bias"]))
    mod.load_state_dict(nn.Linear(128, 32).state_dict(), assign=True)
    assert len(calls) == 2


def test_plain_tensor_weight_is_frozen_parameter():
    mod = DecodeLinear(torch.randn(16, 128), torch.randn(16))
    assert isinstance(mod.weight, nn.Parameter) and not mod.weight.requires_grad
    assert isinstance(mod.bias, nn.Parameter)
    assert (mod.in_features, mod.out_features) == (128, 16)


# --------------------------------------------------------------- the op


def test_op_registered_with_schema():
    schema = str(torch.ops.warpsplitk.decode_linear.default._schema)
    assert schema.startswith("warpsplitk::decode_linear(Tensor x, Tensor weight, Tensor? bias,")
    assert schema.endswith("-> Tensor")


def test_op_fake_impl_meta_and_fake_mode():
    out = torch.ops.warpsplitk.decode_linear(meta(5, 256), meta(48, 256), meta(48), 1)
    assert (out.shape, out.dtype, out.device.type) == ((5, 48), torch.bfloat16, "meta")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(7, 512, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(64, 512, device="cuda", dtype=torch.bfloat16)
        out = torch.ops.warpsplitk.decode_linear(x, w, None, 12345)
        assert (out.shape, out.dtype, out.device.type) == ((7, 64), torch.bfloat16, "cuda")
    with pytest.raises(Exception, match="disagree on K"):
        torch.ops.warpsplitk.decode_linear(meta(5, 256), meta(48, 128), None, 1)


def test_op_traces_under_compile_and_make_fx():
    def f(x, w, b):
        return torch.ops.warpsplitk.decode_linear(x, w, b, 3).float() * 2

    x, w, b = meta(4, 256), meta(32, 256), meta(32)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        out = torch.compile(f, fullgraph=True, backend=backend)(x, w, b)
        assert (out.shape, out.dtype) == ((4, 32), torch.float32)
    from torch.fx.experimental.proxy_tensor import make_fx
    code = make_fx(f, tracing_mode="fake")(x, w, b).code
    assert "warpsplitk.decode_linear.default" in code
    torch._dynamo.reset()


def test_op_impl_repacks_and_refuses_stale_weight():
    w, b = torch.randn(32, 128, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    prepared = FakePrepared(w, bias=b)
    handle = ops.register(prepared)
    try:
        base = torch.randn(3, 129, dtype=torch.bfloat16)
        x = base[:, 1:]  # neither packed nor aligned: the impl must copy
        out = ops._decode_linear_cuda(x, w, b, handle)
        assert prepared.runs == 1 and torch.equal(out, F.linear(x, w, b))
        with pytest.raises(ValueError, match="not the tensors"):
            ops._decode_linear_cuda(x, w.clone(), b, handle)
        with pytest.raises(ValueError, match="not the tensors"):
            ops._decode_linear_cuda(x, w, None, handle)
    finally:
        ops.unregister(handle)
    with pytest.raises(KeyError, match="no prepared weight"):
        ops.lookup(handle)


def test_registry_is_weak():
    prepared = FakePrepared(torch.zeros(16, 128))
    handle = ops.register(prepared)
    assert ops.lookup(handle) is prepared
    del prepared
    import gc
    gc.collect()
    with pytest.raises(KeyError):
        ops.lookup(handle)


def test_backward_matches_f_linear():
    torch.manual_seed(1)
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(16, 64, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    grad = torch.randn(5, 16)
    F.linear(x, w, b).backward(grad)
    ctx = types.SimpleNamespace(needs_input_grad=(True, True, True, False))
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    ops._setup_context(ctx, (x.detach(), w.detach(), b, 0), None)
    gx, gw, gb, gh = ops._linear_backward(ctx, grad)
    assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad) and torch.allclose(gb, b.grad)
    assert gh is None


# ------------------------------------------------ kernel branch (on meta)


def test_kernel_branch_on_meta(meta_kernel):
    mod = DecodeLinear(meta(64, 256), meta(64))
    assert meta_kernel == [((64, 256), True)] and mod.prepared is not None
    assert mod(meta(2, 4, 256)).shape == (2, 4, 64)
    assert mod(meta(256)).shape == (64,)
    assert mod(meta(32, 256)).shape == (32, 64)
    assert (mod.kernel_calls, mod.fallback_calls) == (3, 0)
    assert mod(meta(33, 256)).shape == (33, 64)  # M=33: F.linear
    assert (mod.kernel_calls, mod.fallback_calls) == (3, 1)


def test_fallback_reasons(meta_kernel):
    mod = DecodeLinear(meta(64, 256), ms=(1, 2, 4))
    assert mod.unprepared_reason is None
    assert mod.fallback_reason(meta(4, 256)) is None and mod.accepts(meta(4, 256))
    assert not mod.accepts(meta(3, 256))
    assert "not among the prepared Ms 1, 2, 4" in mod.fallback_reason(meta(3, 256))
    assert "not among" in mod.fallback_reason(meta(33, 256))
    assert "float32" in mod.fallback_reason(meta(2, 256).float())
    assert "cpu" in mod.fallback_reason(torch.zeros(2, 256, dtype=torch.bfloat16))
    assert "expected [..., 256]" in mod.fallback_reason(meta(2, 128))
    mod._ptrs = (1, None)  # as if the weight had been replaced behind the module's back
    assert "reprepare" in mod.fallback_reason(meta(2, 256))


def test_fallback_reasons_layout(cpu_kernel):
    mod = DecodeLinear(torch.zeros(64, 256, dtype=torch.bfloat16))
    assert mod.prepared is not None
    x = torch.zeros(2, 3, 256, dtype=torch.bfloat16)
    assert mod.fallback_reason(x) is None
    assert mod.fallback_reason(x.transpose(0, 1)) is None  # reshape copies it: packed
    assert "packed" in mod.fallback_reason(torch.zeros(2, 512, dtype=torch.bfloat16)[:, :256])
    flat = torch.zeros(4 * 256 + 1, dtype=torch.bfloat16)
    assert "aligned" in mod.fallback_reason(flat[1:].view(4, 256))  # 2 bytes off
    mod.weight = nn.Parameter(mod.weight.clone())
    assert "reprepare" in mod.fallback_reason(x)


def test_ineligible_weight_falls_back(meta_kernel):
    for weight, words in [(meta(100, 256), "multiple of 16"), (meta(64, 200), "multiple of 128"),
                          (meta(64, 65536 + 256), "65536"), (meta(64, 32768 + 128), "32768"),
                          (meta(64, 256).float(), "float32"),
                          (meta(64, 512)[:, :256], "packed row-major")]:
        mod = DecodeLinear(weight)
        assert mod.prepared is None and words in mod.unprepared_reason, mod.unprepared_reason
    assert meta_kernel == []


def test_eligibility_is_the_contracts_weight_rules(meta_kernel):
    for weight in (meta(64, 256), meta(100, 256), meta(64, 200), meta(64, 256).float(),
                   torch.zeros(64, 256, dtype=torch.bfloat16)):
        assert linear.ineligibility(weight) == contract.weight_refusal(weight)
    assert linear.ineligibility(meta(64, 256), meta(32)) == contract.weight_refusal(
        meta(64, 256), meta(32)) == "bias must have shape (64,), got (32,)"
    assert linear.ineligibility(meta(64, 256), ms=()) == linear.NO_MS
    assert DecodeLinear(meta(64, 256), ms=()).unprepared_reason == f"not prepared: {linear.NO_MS}"


def test_nn_imports_run_one_way_and_name_nothing_private():
    """nn/ imports its own modules at the top, one way (no loop), and no
    private name of another module; nothing outside nn/ imports nn/."""
    import ast
    from pathlib import Path
    package = Path(ops.__file__).resolve().parents[1]
    edges, found = {}, []
    for path in sorted(package.rglob("*.py")):
        inside = path.parent.name == "nn"
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            parts = path.relative_to(package).parts[:-1]
            base = parts[:len(parts) - node.level + 1]
            module = ".".join(base + tuple((node.module or "").split(".")) if node.module else base)
            targets = ([f"{module}.{a.name}" for a in node.names] if not node.module
                       else [module])
            for target in targets:
                if not inside and (target == "nn" or target.startswith("nn.")):
                    found.append(f"{path.name} imports {target}")
                if inside and target.startswith("nn."):
                    edges.setdefault(path.stem, set()).add(target[3:])
                    if id(node) not in top:
                        found.append(f"{path.name} imports {target} inside a function")
            if inside and node.module:
                found += [f"{path.name} imports {module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]

    def reaches(start, goal, seen=()):
        return any(m == goal or (m not in seen and reaches(m, goal, seen + (m,)))
                   for m in edges.get(start, ()))
    found += [f"{m} is part of an import loop" for m in edges if reaches(m, m)]
    assert edges["merge"] >= {"linear"} and edges["patch"] >= {"linear", "merge"}
    assert found == []


def test_compile_fullgraph_kernel_branch(meta_kernel):
    mod = DecodeLinear(meta(64, 256), meta(64))
    backend, graphs = graph_recorder()
    compiled = torch.compile(mod, fullgraph=True, backend=backend)
    assert compiled(meta(2, 3, 256)).shape == (2, 3, 64)
    assert compiled(meta(2, 3, 256)).shape == (2, 3, 64)
    assert len(graphs) == 1, "recompiled: counters must not be traced"
    assert "warpsplitk.decode_linear" in graphs[0].code
    assert (mod.kernel_calls, mod.fallback_calls) == (0, 0)  # compiled calls are not counted


def test_compile_dynamic_m_does_not_specialise(meta_kernel):
    mod = DecodeLinear(meta(64, 256))
    backend, graphs = graph_recorder()
    compiled = torch.compile(mod, fullgraph=True, backend=backend, dynamic=True)
    for m in (40, 41, 50, 3, 4, 32):
        assert compiled(meta(m, 256)).shape == (m, 64)
    # one graph for M > 32 (F.linear), one for 1 <= M <= 32 (the op): no graph per M
    assert len(graphs) == 2
    assert sum("warpsplitk.decode_linear" in g.code for g in graphs) == 1


def test_compile_fullgraph_cpu_fallback():
    torch._dynamo.reset()
    lin = nn.Linear(128, 32)
    mod = DecodeLinear.from_linear(lin)
    x = torch.randn(2, 5, 128)
    out = torch.compile(mod, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(out, lin(x))
    torch._dynamo.reset()


def test_reprepare_on_load_and_to(cpu_kernel):
    mod = DecodeLinear(torch.zeros(64, 256, dtype=torch.bfloat16))
    handle = mod._handle
    mod.load_state_dict({"weight": torch.ones(64, 256)})  # copied in place: same memory
    assert len(cpu_kernel) == 1 and mod._handle == handle and mod.prepared.weight[0, 0] == 1
    mod.load_state_dict({"weight": torch.ones(64, 256, dtype=torch.bfloat16)}, assign=True)
    assert len(cpu_kernel) == 2 and mod._handle != handle
    assert mod.prepared.weight.data_ptr() == mod.weight.data_ptr()
    with pytest.raises(KeyError):
        ops.lookup(handle)  # the old prepared weight is released
    handle = mod._handle
    mod.to(torch.bfloat16)  # a no-op conversion keeps the prepared code
    assert mod._handle == handle and len(cpu_kernel) == 2
    mod.to(torch.float32)  # the kernel cannot take it any more: fall back
    assert mod.prepared is None and "float32" in mod.unprepared_reason
    mod.to(torch.bfloat16)
    assert mod.prepared is not None and len(cpu_kernel) == 3


def test_deepcopy_reprepares(meta_kernel):
    mod = DecodeLinear(meta(64, 256))
    twin = copy.deepcopy(mod)
    assert twin.prepared is not None and twin._handle != mod._handle
    assert twin.prepared.weight is not mod.prepared.weight
    assert twin(meta(3, 256)).shape == (3, 64)


# ------------------------------------------------------------ patch_model


def test_constructor_refusals():
    weight = torch.zeros(64, 256, dtype=torch.bfloat16)
    for bad, given in ((None, "NoneType"), (torch.zeros(64), r"shape \(64,\)"),
                       (torch.zeros(2, 64, 256), r"shape \(2, 64, 256\)")):
        with pytest.raises(ValueError, match=r"^weight must be a 2-D torch\.Tensor "
                                             rf"\[out_features, in_features\], got {given}$"):
            DecodeLinear(bad)
    # Ms the kernel never sees would leave a module that silently always falls back
    for ms, given in (([0, 50], "0"), ([1.0], "1.0"), ("ab", "'a'")):
        with pytest.raises(ValueError, match=rf"M must be in 1\.\.32, got {given}$"):
            DecodeLinear(weight, ms=ms)
    with pytest.raises(ValueError, match="ms must be an iterable"):
        DecodeLinear(weight, ms=None)
    for plan in ("h200", 123, {}):
        with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto', got "):
            DecodeLinear(weight, plan=plan)
    from warpsplitk.nn.merge import merge_linears
    with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto', got 'bogus'"):
        merge_linears([nn.Linear(256, 64), nn.Linear(256, 64)], plan="bogus")
    with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got 33$"):
        patch_model(nn.Sequential(nn.Linear(256, 64)), ms=[1, 33])
    assert DecodeLinear(weight, ms=()).ms == ()  # nothing prepared: always F.linear


def test_bias_of_another_shape_or_type_is_refused_at_construction():
    weight = torch.zeros(64, 256)
    for bias, given in ((torch.randn(10), r"shape \(10,\)"),
                        (torch.zeros(1, 64), r"shape \(1, 64\)"), ([0.0] * 64, "list")):
        with pytest.raises(ValueError, match=r"^bias must be None or a tensor of shape \(64,\), "
                                             rf"got {given}$"):
            DecodeLinear(weight, bias)
    assert DecodeLinear(weight, torch.zeros(64)).bias.shape == (64,)


def test_patch_model_cpu_skips_everything():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 16))
    before = list(model)
    report = patch_model(model)
    assert isinstance(report, PatchReport)
    assert report.swapped == []
    assert [name for name, _ in report.skipped] == ["0", "2"]
    assert all("cpu" in reason for _, reason in report.skipped)
    assert list(model) == before
    assert "skipped 2" in str(report)


def test_patch_and_unpatch(meta_kernel):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(256, 512, bias=False, device="meta", dtype=torch.bfloat16)
            self.odd = nn.Linear(256, 100, device="meta", dtype=torch.bfloat16)  # N % 16
            self.mha = nn.MultiheadAttention(128, 4, device="meta", dtype=torch.bfloat16)
            self.hooked = nn.Linear(256, 64, device="meta", dtype=torch.bfloat16)
            self.hooked.register_forward_hook(lambda *a: None)
            self.wrapped = nn.Linear(256, 64, device="meta", dtype=torch.bfloat16)
            self.wrapped.forward = lambda x: x  # as accelerate's add_hook_to_module does
            self.down = nn.Linear(512, 256, device="meta", dtype=torch.bfloat16)

        def forward(self, x):
            return self.down(self.up(x))

    model = nn.Sequential(Block(), nn.Linear(256, 128, device="meta", dtype=torch.bfloat16))
    model[0].alias = model[1]  # one Linear under two names stays one module
    originals = {name: m for name, m in model.named_modules(remove_duplicate=False)
                 if isinstance(m, nn.Linear)}
    keys = list(model.state_dict())

    report = patch_model(model, filter=lambda name, mod: name != "0.down")
    assert report.swapped == ["0.up", "0.alias"]
    skipped = dict(report.skipped)
    assert "multiple of 16" in skipped["0.odd"]
    assert "not a plain nn.Linear" in skipped["0.mha.out_proj"]
    assert "hooks" in skipped["0.hooked"]
    assert "overridden" in skipped["0.wrapped"]
    assert skipped["0.down"] == "excluded by filter"
    assert isinstance(model[0].up, DecodeLinear) and model[1] is model[0].alias
    assert model[0].up.weight is originals["0.up"].weight  # shared, not copied
    assert list(model.state_dict()) == keys
    assert model(meta(4, 256)).shape == (4, 128)
    assert model[0].up.kernel_calls == 1 and model[1].kernel_calls == 1

    assert patch_model(model).swapped == ["0.down"]  # idempotent on what is already swapped
    restored = unpatch(model)
    assert restored == ["0.up", "0.down", "0.alias"]
    after = {name: m for name, m in model.named_modules(remove_duplicate=False)
             if isinstance(m, nn.Linear)}
    assert after.keys() == originals.keys()
    assert all(after[name] is originals[name] for name in originals)
    assert not any(isinstance(m, DecodeLinear) for m in model.modules())
    assert list(model.state_dict()) == keys


def test_unpatch_rebuilds_linear_without_original(meta_kernel):
    model = nn.Sequential(DecodeLinear(meta(64, 256), meta(64)))
    weight = model[0].weight
    assert unpatch(model) == ["0"]
    assert type(model[0]) is nn.Linear and model[0].weight is weight
    assert (model[0].in_features, model[0].out_features) == (256, 64)


def test_patch_root_linear_is_skipped(meta_kernel):
    lin = nn.Linear(256, 64, device="meta", dtype=torch.bfloat16)
    report = patch_model(lin)
    assert report.swapped == [] and "root module" in report.skipped[0][1]


def test_eager_inference_calls_the_prepared_kernel_directly(meta_kernel):
    """No dispatcher round trip in eager inference; the op (whose meta
    implementation is shape-only) when autograd needs it."""
    mod = DecodeLinear(meta(64, 256))
    assert mod(meta(4, 256)).shape == (4, 64)
    assert mod.prepared.runs == 1
    with torch.no_grad():
        mod(meta(2, 256))
    assert mod.prepared.runs == 2
    mod.weight.requires_grad_(True)
    assert mod(meta(4, 256)).shape == (4, 64)
    assert mod.prepared.runs == 2  # through torch.ops.warpsplitk.decode_linear
    assert mod.kernel_calls == 3


def test_op_fake_impl_says_what_it_was_given():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 256, dtype=torch.bfloat16)
        w = torch.empty(64, 256, dtype=torch.bfloat16)
        cases = [
            ((x, w.to(torch.int8), None), r"x and weight must be bfloat16, got torch\.bfloat16 "
                                          r"and torch\.int8"),
            ((x, w[0], None), "weight must be \\[N, K\\], got 1-D"),
            ((x, w[:, :128], None), r"x \[M, 256\] and weight \[N, 128\] disagree on K"),
            ((x, w, torch.empty(7, dtype=torch.bfloat16)), r"bias must be \[64\], got \(7,\)"),
        ]
        for args, match in cases:
            with pytest.raises(Exception, match=match):
                torch.ops.warpsplitk.decode_linear(*args, 0)


# ------------------------------------------------------------ FP8 weights


@pytest.mark.parametrize("scale_shape", [(), (1,), (160,), (160, 1), (2, 3)])
def test_fp8_cpu_falls_back_to_the_dequantized_weight(scale_shape):
    torch.manual_seed(1)
    w8 = fp8_weight(160, 384)
    scale = torch.rand(scale_shape) * 1e-2 + 1e-3
    bias = torch.randn(160, dtype=torch.bfloat16)
    mod = DecodeLinear.from_fp8(w8, scale, bias)
    assert mod.prepared is None and "cpu" in mod.unprepared_reason and "fp8" in mod.extra_repr()
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    if len(scale_shape) == 2 and scale_shape[1] != 1:  # 128 x 128 blocks, the last rows partial
        full = torch.cat([scale[0].repeat_interleave(128)[None].expand(128, 384),
                          scale[1].repeat_interleave(128)[None].expand(32, 384)])
    else:
        full = scale.reshape(-1, 1)
    expected = F.linear(x, (w8.float() * full).to(torch.bfloat16), bias)
    assert torch.equal(mod(x), expected)
    assert set(mod.state_dict()) == {"weight", "weight_scale", "bias"}
    with pytest.raises(ValueError, match="has no nn.Linear to give back"):
        mod.to_linear()


@pytest.fixture
def meta_fp8(monkeypatch):
    """The FP8 kernel "runs" on meta tensors: prepare() records its weight scales."""
    calls = []

    def fake_prepare(weight, plan=None, ms=range(1, 33), bias=None, *, weight_scale=None):
        calls.append((tuple(weight.shape), weight_scale is not None))
        prepared = FakePrepared(weight, plan, ms, bias)
        prepared.weight_scale = weight_scale
        return prepared

    monkeypatch.setattr(contract, "DEVICE_TYPE", "meta")
    monkeypatch.setattr(contract, "fp8_value_refusal", lambda weight, scale: None)  # no values
    monkeypatch.setattr(plans, "prepare", fake_prepare)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def test_fp8_compile_fullgraph_runs_the_fp8_op(meta_fp8):
    w8 = torch.empty(64, 256, device="meta", dtype=torch.float8_e4m3fn)
    scale = torch.empty(64, 1, device="meta", dtype=torch.float32)
    mod = DecodeLinear.from_fp8(w8, scale, meta(64))
    assert meta_fp8 == [((64, 256), True)] and mod.accepts(meta(5, 256))
    backend, graphs = graph_recorder()
    compiled = torch.compile(mod, fullgraph=True, backend=backend)
    assert compiled(meta(2, 3, 256)).shape == (2, 3, 64)
    assert len(graphs) == 1 and "warpsplitk.decode_linear_fp8" in graphs[0].code
    assert "warpsplitk.decode_linear.default" not in graphs[0].code


def test_fp8_ineligibility_names_the_fp8_rules(monkeypatch):
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    scale = torch.ones(64)
    bf16 = torch.randn(64, 256, dtype=torch.bfloat16)
    assert linear.ineligibility(bf16, None, weight_scale=scale) == (
        "weight must be float8_e4m3fn, got torch.bfloat16")
    w8 = fp8_weight(64, 256)
    assert linear.ineligibility(w8, None, weight_scale=torch.ones(3)).startswith(
        "weight_scale must have shape")
    w8.view(torch.uint8)[0, 0] = 0xFF
    assert "NaN code" in linear.ineligibility(w8, None, weight_scale=scale)
    assert linear.ineligibility(fp8_weight(40, 256), None, weight_scale=torch.ones(1)) == (
        contract.shape_refusal(40, 256))


def test_fp8_op_refuses_a_stale_scale_and_keeps_its_input_gradient():
    w8 = fp8_weight(32, 128)
    scale = torch.rand(32) + 0.5
    prepared = FakePrepared(w8.float().mul(scale[:, None]).bfloat16())
    prepared.weight, prepared.weight_scale = w8, scale
    handle = ops.register(prepared)
    try:
        with pytest.raises(ValueError, match="not the tensors"):
            ops._decode_linear_fp8_cuda(torch.randn(2, 128, dtype=torch.bfloat16), w8,
                                        scale.clone(), None, handle)
    finally:
        ops.unregister(handle)
    x = torch.randn(2, 128, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(2, 32)

    class Ctx:
        saved_tensors = (x, w8, scale)
        needs_input_grad = (True, False, False, False, False)
    grad_x, *rest = ops._fp8_backward(Ctx, grad)
    assert torch.allclose(grad_x, grad @ (w8.float() * scale[:, None])) and rest == [None] * 4


def test_patch_model_swaps_fp8_linears_and_unpatch_restores_them(meta_fp8, monkeypatch):
    """FP8 linears are swapped with their own Parameters (the scales under
    their own names, so the state_dict keeps its keys); unrecognised ones
    are skipped with the reason; unpatch gives the modules back."""
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "precompile_fp8", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    model = nn.Sequential(FineGrainedFP8Linear(256, 384, bias=True), RowwiseFP8Linear(64, 256),
                          FineGrainedFP8Linear(64, 256, block_size=(64, 64)),
                          FineGrainedFP8Linear(64, 256, activation_scale=nn.Parameter(
                              torch.ones(()), requires_grad=False)))
    keys = list(model.state_dict())
    originals = list(model)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    before = model[1](model[0](x))
    report = patch_model(model, ms=(1, 8), progress=None)
    assert report.swapped == ["0", "1"]
    assert dict(report.skipped) == {"2": "block scales of (64, 64), not 128 x 128",
                                    "3": "a static activation scale (activation_scheme='static')"}
    assert meta_fp8 == [((256, 384), True), ((64, 256), True)]
    assert isinstance(model[0], DecodeLinear) and model[0].fp8_scale is originals[0].weight_scale_inv
    assert model[0].weight is originals[0].weight and model[0].bias is originals[0].bias
    assert list(model.state_dict()) == keys
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cuda")  # run the CPU fallback
    model[0].reprepare(), model[1].reprepare()
    assert torch.equal(model[1](model[0](x)), before)
    assert unpatch(model) == ["0", "1"] and list(model) == originals


def test_fp8_linear_scale_names_what_it_does_not_take():
    assert linear.fp8_linear_scale(nn.Linear(8, 8))[1] == "Linear has no float8_e4m3fn weight"
    plain = RowwiseFP8Linear(16, 128)
    del plain.weight_scale
    assert linear.fp8_linear_scale(plain)[1] == (
        "RowwiseFP8Linear has no scales named weight_scale_inv or weight_scale")
