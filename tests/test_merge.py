"""Merged projections (warpsplitk.nn.merge) and patch_model(merge=True), on the CPU."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from warpsplitk.nn.patch import patch_model, unpatch  # noqa: E402
from warpsplitk.nn.merge import (  # noqa: E402
    MergedPart, MergedWeight, merge_linears, merge_refusal)
from fakes import (FineGrainedFP8Linear, RowwiseFP8Linear, fp8_weight,  # noqa: E402
                   quantize_fp8)


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def own_storage(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def linears(sizes=(64, 16, 16), k=32, bias=False, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Linear(k, n, bias=bias, device=device, dtype=dtype) for n in sizes]


@pytest.mark.parametrize("bias", [False, True])
def test_parts_are_views_of_one_storage_and_compute_as_before(bias):
    lins = linears(bias=bias)
    x = torch.randn(3, 32)
    expected = [F.linear(x, lin.weight, lin.bias) for lin in lins]
    values = [lin.weight.detach().clone() for lin in lins]
    parts = merge_linears(lins)
    group = parts[0].group
    assert isinstance(group.storage, MergedWeight) and group.parts == parts
    assert group.weight is group.storage.weight and group.bias is group.storage.bias
    assert group.weight.shape == (96, 32) and (group.bias is not None) == bias
    for part, (start, end), value in zip(parts, group.storage.offsets(), values):
        assert same_storage(part.weight, group.weight) and torch.equal(part.weight, value)
        assert part.weight.data_ptr() == group.weight[start:end].data_ptr()
    # on a CPU the kernel takes nothing: each part is its own F.linear, bit for bit
    assert [torch.equal(part(x), e) for part, e in zip(parts, expected)] == [True] * 3
    # the originals keep no second copy
    assert all(lin.weight is None for lin in lins)


def test_load_state_dict_writes_through_and_assign_remerges():
    parts = merge_linears(linears())
    group = parts[0].group
    new = {"weight": torch.full((16, 32), 2.0)}
    parts[1].load_state_dict(new)
    assert torch.equal(group.weight[64:80], new["weight"]) and group.merged()
    parts[2].load_state_dict({"weight": torch.full((16, 32), 3.0)}, assign=True)
    # new tensors: the group is stacked again, the parts views of it once more
    assert group.merged() and torch.equal(group.weight[80:], torch.full((16, 32), 3.0))
    assert torch.equal(group.weight[64:80], new["weight"])
    assert same_storage(parts[2].weight, group.weight)


def test_to_restacks_once_every_part_has_moved():
    parts = merge_linears(linears())
    container = nn.ModuleList(parts)
    container.to(torch.float64)
    group = parts[0].group
    assert group.weight.dtype == torch.float64 and group.merged()
    assert all(same_storage(p.weight, group.weight) for p in parts)


def test_the_merged_output_is_computed_once_per_input():
    parts = merge_linears(linears())
    group = parts[0].group
    calls = []

    class Kernel:  # stands in for a prepared DecodeLinear of the merged weight
        prepared = object()

        def __call__(self, x):
            calls.append(x)
            return F.linear(x, group.weight)

    group.linear = Kernel()
    x = torch.randn(2, 32)
    outs = [part(x) for part in parts]  # q, k, v in call order: one GEMM
    assert len(calls) == 1
    for part, out in zip(parts, outs):
        assert torch.allclose(out, F.linear(x, part.weight))
    assert group._stash is None  # every part served: nothing held
    y = torch.randn(2, 32)
    parts[0](x), parts[1](y)  # another input: computed again
    assert len(calls) == 3
    parts[0](y)  # the same input as the last call: its output serves this part too
    assert len(calls) == 3
    parts[0](y)  # a part twice for one input: a new call, computed again
    assert len(calls) == 4


def test_merge_refusals_name_the_problem():
    a, b = linears((16, 16))
    assert merge_refusal([a]) == "fewer than two linears"
    assert merge_refusal([a, a]) == "the same linear twice"
    c = nn.Linear(48, 16)
    assert "in_features differ" in merge_refusal([a, c])
    d = nn.Linear(32, 16, bias=True)
    assert merge_refusal([a, d]) == "some have a bias and some do not"
    hooked = nn.Linear(32, 16)
    hooked.register_forward_hook(lambda *args: None)
    assert "hooks" in merge_refusal([a, hooked])
    with pytest.raises(ValueError, match="cannot merge these linears: fewer than two"):
        merge_linears([a])
    tied = nn.Linear(32, 16, bias=False)
    tied.weight = b.weight
    assert merge_refusal([b, tied]) == "two of them share a Parameter (merging would split it)"
    merge_linears([a, b])
    with pytest.raises(ValueError, match=r"a linear without a weight \(merged already\?\)$"):
        merge_linears([a, b])


def test_patch_model_merges_no_linear_used_elsewhere_or_tied():
    """A linear shared by two layers (or one whose Parameter another module
    holds) is not merged: merging would leave the other place with no
    weight, or split the tie. Shared whole layers still merge, once."""
    model = tiny_llama()
    layers = model.model.layers
    layers[1].self_attn.q_proj = layers[0].self_attn.q_proj  # one q_proj in two layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight  # a tied Parameter
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids).logits
    report = patch_model(model, merge=True, progress=None)
    skipped = dict(report.skipped)
    for layer in (0, 1):
        assert skipped[f"model.layers.{layer}.self_attn.q_proj + model.layers.{layer}."
                       "self_attn.k_proj + model.layers.{layer}.self_attn.v_proj".format(
                           layer=layer)] == "not merged: a linear is also used elsewhere in the model"
        assert skipped[f"model.layers.{layer}.mlp.gate_proj + model.layers.{layer}.mlp.up_proj"] \
            == "not merged: a Parameter is also held by another module (tied)"
    assert report.merged == []
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert layers[1].mlp.up_proj.weight is layers[0].mlp.up_proj.weight
    unpatch(model)
    # a whole attention module shared by both layers merges once
    model = tiny_llama()
    model.model.layers[1].self_attn = model.model.layers[0].self_attn
    with torch.no_grad():
        before = model(ids).logits
    report = patch_model(model, merge=True, progress=None)
    assert [n[0] for n in report.merged].count("model.layers.0.self_attn.q_proj") == 1
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_refusals_of_what_is_no_model_or_no_swiglu_mlp():
    for call in (patch_model, unpatch):
        with pytest.raises(ValueError, match="^model must be a torch.nn.Module, got NoneType$"):
            call(None)
    from warpsplitk.nn.merge import SwiGLUMLP
    mlp = tiny_llama().model.layers[0].mlp  # gate and up not merged
    with pytest.raises(ValueError, match="SwiGLUMLP wraps .*: gate_proj and up_proj are not one "
                                         "merged group in that order$"):
        SwiGLUMLP(mlp)


def test_bookkeeping_on_meta_tensors():
    parts = merge_linears(linears(device="meta"))
    assert parts[0].group.weight.device.type == "meta"
    assert [p.weight.shape for p in parts] == [(64, 32), (16, 32), (16, 32)]


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=97)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_patch_model_merge_on_a_cpu_llama_keeps_outputs_names_and_unpatches():
    model = tiny_llama()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids).logits
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    report = patch_model(model, merge=True, progress=None)
    assert report.merged[0] == [f"model.layers.0.self_attn.{p}"
                                for p in ("q_proj", "k_proj", "v_proj")]
    assert [n[0] for n in report.merged] == ["model.layers.0.self_attn.q_proj",
                                             "model.layers.0.mlp.gate_proj",
                                             "model.layers.1.self_attn.q_proj",
                                             "model.layers.1.mlp.gate_proj"]
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, MergedPart)
    assert same_storage(attn.k_proj.weight, attn.q_proj.group.weight)
    # the state dict: the same keys and values
    state = model.state_dict()
    assert list(state) == list(keys) and all(torch.equal(state[k], keys[k]) for k in keys)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    # a deep copy is merged in storage of its own
    import copy
    twin = copy.deepcopy(model)
    twin_attn = twin.model.layers[0].self_attn
    assert twin_attn.q_proj.group.merged() and twin.model.layers[1].mlp.group.merged()
    assert not same_storage(twin_attn.k_proj.weight, attn.k_proj.weight)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, before)
    # load_state_dict writes through into the merged storage
    model.load_state_dict(keys)
    assert attn.q_proj.group.merged()
    assert len(unpatch(model)) == 10  # 4 groups: 3 + 2 parts each, twice
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.up_proj):
            assert type(lin) is nn.Linear and own_storage(lin.weight)
    state = model.state_dict()
    assert list(state) == list(keys) and all(torch.equal(state[k], keys[k]) for k in keys)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_llama_mlps_run_with_the_swiglu_epilogue_or_as_before():
    """patch_model(merge=True) wraps each Llama MLP in a SwiGLUMLP (gate/up
    one merged weight with the SwiGLU epilogue): the same submodules and
    state-dict keys; on a CPU (no kernel) the MLP's own computation, so the
    logits are identical; unpatch puts the original MLP objects back."""
    from warpsplitk.nn.merge import SwiGLUMLP, swiglu_refusal
    model = tiny_llama()
    originals = [layer.mlp for layer in model.model.layers]
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = model(ids).logits
    keys = list(model.state_dict())
    report = patch_model(model, merge=True, progress=None)
    assert report.swiglu == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "2 MLPs with the SwiGLU epilogue" in str(report)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) and mlp.group.swiglu
    assert mlp.group.swiglu_prepared is None  # a CPU weight: no kernel
    x = torch.randn(3, 64)
    assert mlp.group.swiglu_output(x) is None
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    unpatch(model)
    assert [layer.mlp for layer in model.model.layers] == originals
    assert all(type(layer.mlp.gate_proj) is nn.Linear for layer in model.model.layers)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    # what cannot take the epilogue is said
    assert "not one merged group" in swiglu_refusal(originals[0])
    gelu = tiny_llama()
    gelu.model.layers[0].mlp.act_fn = nn.GELU()
    assert swiglu_refusal(gelu.model.layers[0].mlp) == "its activation is not SiLU"
    report = patch_model(gelu, merge=True, progress=None)
    assert report.swiglu == ["model.layers.1.mlp"]


def test_swiglu_output_runs_where_the_merged_linear_would_and_nowhere_else(monkeypatch):
    """The fused MLP takes x exactly where the merged weight's DecodeLinear
    would take the kernel (a stand-in for it on the CPU) and returns
    silu(gate(x)) * up(x); elsewhere None, and the MLP runs as before."""
    from fakes import FakePrepared
    from warpsplitk import contract
    from warpsplitk.planning import plans
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False:
                        FakePrepared(weight, plan, ms, bias, swiglu))
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=128,  # K the kernel takes
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, vocab_size=96)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    assert patch_model(model, merge=True, ms=[1, 4], progress=None).swiglu
    mlp = model.model.layers[0].mlp
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    x = torch.randn(4, gate.shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        fused = mlp.group.swiglu_output(x)
        assert fused is not None and fused.shape == (4, gate.shape[0])
        expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
        assert torch.allclose(fused.float(), expected.float(), rtol=1e-2, atol=1e-2)
        assert mlp.group.swiglu_output(x[:3]) is None           # M 3 not prepared
        assert mlp.group.swiglu_output(x.float()) is None       # not BF16
        assert mlp.group.swiglu_output(x.t().contiguous().t()) is None  # not packed
    x.requires_grad_(True)
    assert mlp.group.swiglu_output(x) is None                   # autograd needs a graph


# ------------------------------------------------------------ torch.compile


@pytest.fixture
def cpu_ops(monkeypatch):
    """The kernel "runs" on the CPU: prepare() gives stand-ins (FP8 weights
    dequantized), and the custom ops get CPU implementations that are their
    CUDA ones (handle lookup, weight checks, then the stand-in's run)."""
    from fakes import FakePrepared
    from warpsplitk import contract
    from warpsplitk.nn import ops
    from warpsplitk.planning import plans
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False,
                        weight_scale=None:
                        FakePrepared(weight, plan, ms, bias, swiglu, weight_scale))
    lib = torch.library.Library("warpsplitk", "IMPL")
    for name in ("decode_linear", "decode_swiglu", "decode_linear_fp8", "decode_swiglu_fp8"):
        lib.impl(name, getattr(ops, f"_{name}_cuda"), "CPU")
    torch._dynamo.reset()
    yield
    lib._destroy()
    torch._dynamo.reset()


def bf16_llama(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=128,  # K the kernel takes
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=96)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)


def recording_backend(graphs):
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)
    return backend


def test_compiled_merged_model_runs_one_gemm_per_group_and_the_fused_mlp(cpu_ops):
    """Under torch.compile a merged model traces into one graph: per layer one
    decode_linear for q/k/v, one decode_swiglu for gate/up, and the logits
    of the unpatched model."""
    import copy
    model = bf16_llama()
    plain = copy.deepcopy(model)
    patch_model(model, merge=True, ms=[1, 4], progress=None)
    graphs = []
    ids = torch.tensor([[3], [5], [7], [11]])  # M = 4 decode rows
    with torch.no_grad():
        logits = torch.compile(model, backend=recording_backend(graphs))(ids, use_cache=False).logits
        assert torch.equal(logits, plain(ids, use_cache=False).logits)
    assert len(graphs) == 1
    # per layer: q/k/v merged, o, down; and lm_head
    assert graphs[0].count("warpsplitk.decode_swiglu") == 2
    assert graphs[0].count("warpsplitk.decode_linear") == 2 * 3 + 1


def test_compiled_merged_group_recompiles_when_a_part_is_replaced(cpu_ops):
    """A Parameter replaced by hand leaves the merged storage: the compiled
    code is guarded on the parts' Parameters and runs that group's parts
    apart, as eager does."""
    model = bf16_llama(layers=1)
    patch_model(model, merge=True, ms=[1, 4], progress=None)
    attn = model.model.layers[0].self_attn
    graphs = []
    compiled = torch.compile(lambda x: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
                             fullgraph=True, backend=recording_backend(graphs))
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
        assert graphs[-1].count("warpsplitk.decode_linear") == 1
        new = torch.randn_like(attn.k_proj.weight)
        attn.k_proj.weight = nn.Parameter(new)
        q, k, v = compiled(x)
    assert len(graphs) == 2 and "warpsplitk" not in graphs[-1]
    assert torch.equal(k, F.linear(x, new))


def test_swiglu_op_checks_its_handle_and_weight(cpu_ops):
    from fakes import FakePrepared
    from warpsplitk.nn import ops
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    fused, plain = FakePrepared(weight, swiglu=True), FakePrepared(weight)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    handles = [ops.register(fused), ops.register(plain)]
    try:
        out = torch.ops.warpsplitk.decode_swiglu(x, weight, None, handles[0])
        assert torch.equal(out, F.silu(F.linear(x, weight[:32])) * F.linear(x, weight[32:]))
        with pytest.raises(ValueError, match="without the SwiGLU epilogue"):
            torch.ops.warpsplitk.decode_swiglu(x, weight, None, handles[1])
        with pytest.raises(ValueError, match="with the SwiGLU epilogue"):
            torch.ops.warpsplitk.decode_linear(x, weight, None, handles[0])
        with pytest.raises(ValueError, match="not the tensors handle"):
            torch.ops.warpsplitk.decode_swiglu(x, weight.clone(), None, handles[0])
    finally:
        for handle in handles:
            ops.unregister(handle)


@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_op_backward_matches_autograd(cpu_ops, with_bias):
    """The op's backward (the kernel is forward-only) against autograd through
    silu(x W_gate^T + b_gate) * (x W_up^T + b_up), in float64."""
    from fakes import FakePrepared
    from warpsplitk.nn import ops
    torch.manual_seed(0)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(8, dtype=torch.float64, requires_grad=True) if with_bias else None
    handle = ops.register(prepared := FakePrepared(weight, bias=bias, swiglu=True))
    try:
        # BF16 values: the op's output (so its incoming gradient) is BF16
        grad = torch.randn(3, 4).bfloat16().double()
        inputs = [x, weight] + ([bias] if with_bias else [])
        ours = torch.autograd.grad(ops.decode_swiglu(x, weight, bias, handle), inputs, grad)
    finally:
        ops.unregister(handle)
    pre = F.linear(x, weight, bias)
    want = torch.autograd.grad(F.silu(pre[:, :4]) * pre[:, 4:], inputs, grad)
    assert prepared.runs == 1
    for a, b in zip(ours, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_merged_model_is_merged_in_storage_of_its_own(how, monkeypatch):
    """deepcopy or pickle gives each part a Parameter of its own: the copy
    stacks its parts again (views of one new storage, its own kernel), or it
    would run every part apart for good. The original is untouched."""
    import copy
    import pickle

    from warpsplitk import contract
    from warpsplitk.planning import plans
    from fakes import FakePrepared
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare", lambda weight, plan=None, ms=range(1, 33), bias=None:
                        FakePrepared(weight, plan, ms, bias))
    torch.manual_seed(0)
    holder = nn.Module()
    holder.a, holder.b = (nn.Linear(256, n, dtype=torch.bfloat16) for n in (64, 32))
    holder.a, holder.b = merge_linears([holder.a, holder.b])
    group = holder.a.group
    twin = copy.deepcopy(holder) if how == "deepcopy" else pickle.loads(pickle.dumps(holder))
    copied = twin.a.group
    assert copied is twin.b.group and copied is not group
    assert copied.merged() and copied.linear.prepared is not None
    assert same_storage(twin.a.weight, copied.weight) and same_storage(twin.b.bias, copied.bias)
    assert not same_storage(copied.weight, group.weight) and group.merged()
    for name in ("a", "b"):
        assert torch.equal(getattr(twin, name).weight, getattr(holder, name).weight)
        x = torch.randn(3, 256, dtype=torch.bfloat16)
        assert torch.equal(getattr(twin, name)(x), getattr(holder, name)(x))


# ------------------------------------------------------------ FP8 linears


def fp8_qkv(kind):
    """q, k, v FP8 linears with 128 x 128 block scales (and biases; v not
    whole blocks of rows: the last part may be) or per-row scales, in a holder."""
    torch.manual_seed(0)
    holder = nn.Module()
    if kind == "block128":
        holder.q, holder.k, holder.v = (FineGrainedFP8Linear(n, 256, bias=True)
                                        for n in (256, 128, 64))
    else:
        holder.q, holder.k, holder.v = (RowwiseFP8Linear(n, 128) for n in (64, 32, 48))
    return holder, [holder.q, holder.k, holder.v]


def test_fp8_refusals_name_the_problem():
    def block(n, **kwargs):
        return FineGrainedFP8Linear(n, 256, **kwargs)
    assert merge_refusal([block(64), block(128)]) == (
        "block scales stack only where every part but the last has a multiple of 128 rows, "
        "got a part of 64 rows")
    assert merge_refusal([block(128), block(64)]) is None  # the last part may end mid-block
    tensor = [block(64, block_size=None), block(64, block_size=None)]
    assert merge_refusal(tensor) == (
        "tensor scales (one per linear) cannot be views of one merged weight's scales; "
        "per-row or 128 x 128 block scales can")
    with pytest.raises(ValueError, match=r"^cannot merge these linears: tensor scales"):
        merge_linears(tensor)
    assert merge_refusal([block(128), block(64, block_size=None)]) == (
        "scale kinds differ (block128 and tensor)")
    assert merge_refusal([block(128), RowwiseFP8Linear(64, 256)]) == (
        "mixed classes (FineGrainedFP8Linear and RowwiseFP8Linear)")
    assert merge_refusal([nn.Linear(256, 64), block(64)]) == (
        "mixed classes (Linear and FineGrainedFP8Linear)")
    assert merge_refusal([block(128), block(64, block_size=(64, 64))]) == (
        "block scales of (64, 64), not 128 x 128")
    static = block(64, activation_scale=nn.Parameter(torch.ones(()), requires_grad=False))
    assert merge_refusal([block(128), static]) == (
        "a static activation scale (activation_scheme='static')")
    extra = block(64)
    extra.register_buffer("input_scale", torch.ones(1))
    assert merge_refusal([block(128), extra]) == (
        "FineGrainedFP8Linear holds input_scale besides weight, bias and weight_scale_inv")
    double = block(64)
    double.weight_scale_inv = nn.Parameter(double.weight_scale_inv.double())
    assert merge_refusal([block(128), double]) == "scales differ in dtype or device"


@pytest.mark.parametrize("kind", ["block128", "channel"])
def test_fp8_parts_keep_their_scales_and_compute_as_the_originals(kind):
    """FP8 parts: weight, bias and scales (under the linear's own name) views
    of the merged storage, the state dict's keys and values as before; on a
    CPU each part is its original module's output; load_state_dict writes
    through (assign=True stacks again); unpatch gives the originals back."""
    holder, lins = fp8_qkv(kind)
    name = {"block128": "weight_scale_inv", "channel": "weight_scale"}[kind]
    state = {key: value.clone() for key, value in holder.state_dict().items()}
    x = torch.randn(3, lins[0].in_features, dtype=torch.bfloat16)
    expected = [lin(x) for lin in lins]
    holder.q, holder.k, holder.v = parts = merge_linears(lins)
    group = parts[0].group
    assert group.storage.scale_name == name and group.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(group.scale.flatten(), torch.cat([state[f"{p}.{name}"].flatten()
                                                         for p in "qkv"]))
    for part in parts:
        assert part.fp8_scale is getattr(part, name) and same_storage(part.fp8_scale, group.scale)
        assert same_storage(part.weight, group.weight)
    assert all(lin.weight is None and getattr(lin, name) is None for lin in lins)
    now = holder.state_dict()
    assert list(now) == list(state) and all(torch.equal(now[k], state[k]) for k in state)
    assert [torch.equal(part(x), e) for part, e in zip(parts, expected)] == [True] * 3
    new = dict(state, **{"k.weight": fp8_weight(*state["k.weight"].shape),
                         f"k.{name}": torch.rand_like(state[f"k.{name}"]) + 0.5})
    holder.load_state_dict(new)
    assert group.merged() and torch.equal(holder.k.weight, new["k.weight"])
    assert torch.equal(group.scale[slice(*group.storage.scale_rows[1])].flatten(),
                       new[f"k.{name}"].flatten())
    holder.load_state_dict(state, assign=True)  # new tensors: stacked again
    assert group.merged() and all(same_storage(getattr(p, name), group.scale) for p in parts)
    import copy
    twin = copy.deepcopy(holder)  # merged again, scales included, in storage of its own
    copied = twin.q.group
    assert copied.merged() and same_storage(getattr(twin.v, name), copied.scale)
    assert not same_storage(copied.scale, group.scale) and torch.equal(copied.scale, group.scale)
    assert torch.equal(twin.k(x), expected[1])
    assert unpatch(holder) == ["q", "k", "v"]
    assert [holder.q, holder.k, holder.v] == lins and own_storage(getattr(lins[1], name))
    now = holder.state_dict()
    assert list(now) == list(state) and all(torch.equal(now[k], state[k]) for k in state)
    assert [torch.equal(lin(x), e) for lin, e in zip(lins, expected)] == [True] * 3


def fp8_llama(only=None, dtype=torch.float32, layers=2):
    """A Llama whose linears (``only`` those named, else all but lm_head) are
    transformers' FP8Linear (128 x 128 block scales), and a copy whose those
    are nn.Linear holding the dequantized weights (what the FP8 fallback
    computes)."""
    import copy
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(dtype)
    replaced = quantize_fp8(model, only)
    reference = copy.deepcopy(model)
    for name, (_, plain) in replaced.items():
        parent, _, attr = name.rpartition(".")
        setattr(reference.get_submodule(parent), attr, plain)
    return model, reference, replaced


def test_patch_model_merges_an_fp8_llama_and_unpatches():
    """transformers' FP8Linear q/k/v and gate/up (block scales) merge as BF16
    ones do: reported, the Llama MLP wrapped for the SwiGLU epilogue, the
    state dict unchanged; on a CPU every part computes the dequantized
    linear, so the logits are the dequantized model's; unpatch gives back
    the FP8Linear objects."""
    from warpsplitk.nn.merge import SwiGLUMLP
    model, reference, replaced = fp8_llama(only=("q_proj", "k_proj", "v_proj", "gate_proj",
                                                 "up_proj"))
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = reference(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = patch_model(model, merge=True, progress=None)
    assert [n[0] for n in report.merged] == ["model.layers.0.self_attn.q_proj",
                                             "model.layers.0.mlp.gate_proj",
                                             "model.layers.1.self_attn.q_proj",
                                             "model.layers.1.mlp.gate_proj"]
    assert report.swiglu == ["model.layers.0.mlp", "model.layers.1.mlp"]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.v_proj, MergedPart) and isinstance(mlp, SwiGLUMLP)
    assert same_storage(attn.v_proj.weight_scale_inv, attn.q_proj.group.scale)
    assert attn.q_proj.group.scale.shape == (4, 2)  # 256 + 128 + 128 rows, K 256
    now = model.state_dict()
    assert list(now) == list(state) and all(torch.equal(now[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    unpatch(model)
    for name, (fp8, _) in replaced.items():
        assert model.get_submodule(name) is fp8
    now = model.state_dict()
    assert list(now) == list(state) and all(torch.equal(now[k], state[k]) for k in state)


def test_compiled_fp8_llama_runs_one_fp8_gemm_per_group_and_the_fp8_swiglu_op(cpu_ops):
    """An FP8 Llama merged on the stand-in kernel: q/k/v one FP8 kernel, gate/up
    the FP8 SwiGLU kernel (prepared with the merged scales); under
    torch.compile(fullgraph=True) one decode_linear_fp8 per q/k/v, o and down
    and one decode_swiglu_fp8 per layer, the dequantized model's logits."""
    model, reference, _ = fp8_llama(dtype=torch.bfloat16)
    patch_model(model, merge=True, ms=[1, 4], progress=None)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    group = attn.q_proj.group
    assert group.linear.fp8_scale.data_ptr() == group.scale.data_ptr()
    assert mlp.group.swiglu_prepared.weight_scale is mlp.group.scale
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    plain = reference.model.layers[0].mlp
    with torch.no_grad():
        assert torch.equal(mlp.group.swiglu_output(x),
                           plain.act_fn(plain.gate_proj(x)) * plain.up_proj(x))
    graphs = []
    ids = torch.tensor([[3], [5], [7], [11]])  # M = 4 decode rows
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))
    with torch.no_grad():
        logits = compiled(ids, use_cache=False).logits
        assert torch.equal(logits, reference(ids, use_cache=False).logits)
    assert len(graphs) == 1
    assert graphs[0].count("warpsplitk.decode_swiglu_fp8") == 2
    assert graphs[0].count("warpsplitk.decode_linear_fp8") == 2 * 3


@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_swiglu_op_backward_matches_autograd(cpu_ops, with_bias):
    """decode_swiglu_fp8's backward: the input's gradient through silu(gate) *
    up of the dequantized weight (the e4m3 weight and scales get none)."""
    from fakes import FakePrepared
    from warpsplitk.nn import ops
    torch.manual_seed(0)
    x = torch.randn(3, 128, dtype=torch.float64, requires_grad=True)
    w8, scale = fp8_weight(64, 128), torch.rand(64) + 0.5
    bias = torch.randn(64, dtype=torch.float64) if with_bias else None
    handle = ops.register(prepared := FakePrepared(w8, bias=bias, swiglu=True,
                                                   weight_scale=scale))
    try:
        grad = torch.randn(3, 32).bfloat16().double()
        out = ops.decode_swiglu_fp8(x, w8, scale, bias, handle)
        assert out.shape == (3, 32)
        ours, = torch.autograd.grad(out, [x], grad)
        with pytest.raises(ValueError, match="not the tensors handle"):
            ops.decode_swiglu_fp8(x, w8, scale.clone(), bias, handle)
    finally:
        ops.unregister(handle)
    pre = F.linear(x, ops.dequantized(w8, scale, torch.float64), bias)
    want, = torch.autograd.grad(F.silu(pre[:, :32]) * pre[:, 32:], [x], grad)
    assert prepared.runs == 1 and torch.allclose(ours, want, rtol=1e-10, atol=1e-12)
