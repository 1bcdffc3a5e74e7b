"""Merged projections on a real GPU: one launch per group, exact parts, graphs, a Llama."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from warpsplitk.nn.patch import patch_model, unpatch  # noqa: E402
from warpsplitk.nn.merge import merge_linears  # noqa: E402

pytestmark = pytest.mark.gpu

MS = (1, 8)


def qkv(bias=False):
    torch.manual_seed(0)
    return [nn.Linear(1024, n, bias=bias, device="cuda", dtype=torch.bfloat16)
            for n in (1024, 256, 256)]


def rel(out, x, lin_weight, lin_bias):
    ref = x.double() @ lin_weight.double().t()
    if lin_bias is not None:
        ref += lin_bias.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_one_launch_serves_every_part(bias):
    parts = merge_linears(qkv(bias), ms=MS)
    group = parts[0].group
    assert group.linear.prepared is not None
    for m in MS:
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        before = group.linear.kernel_calls
        outs = [part(x) for part in parts]
        assert group.linear.kernel_calls == before + 1
        for part, out in zip(parts, outs):
            assert out.shape == (m, part.out_features)
            assert rel(out, x, part.weight, part.bias) < 1e-2


def test_merged_parts_in_a_cuda_graph():
    parts = merge_linears(qkv(), ms=MS)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    for part in parts:  # warm: compile and cuBLAS workspaces before capture
        part(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [part(x) for part in parts]
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for part, out in zip(parts, outs):
        assert rel(out, x, part.weight, part.bias) < 1e-2


def cuda_llama(layers):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def inductor_logits(model, ids):
    """``model(ids)``'s logits (float64) compiled by Inductor, and the code of
    the graphs Dynamo handed it."""
    graphs = []
    inductor = torch._dynamo.lookup_backend("inductor")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return inductor(gm, example_inputs)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(ids, use_cache=False).logits.double()
    torch._dynamo.reset()
    return logits, graphs


def test_patch_model_merge_on_a_llama():
    model = cuda_llama(layers=2)
    ids = torch.randint(0, 512, (1, 6), device="cuda")
    with torch.no_grad():
        plain = model(ids).logits.double()
    report = patch_model(model, merge=True, ms=range(1, 9), progress=None)
    assert len(report.merged) == 4  # q/k/v and gate/up of two layers
    with torch.no_grad():
        patched = model(ids).logits.double()
    assert ((patched - plain).norm() / plain.norm()).item() < 1e-2
    assert torch.equal(patched[0, -1].argmax(), plain[0, -1].argmax())
    group = model.model.layers[0].self_attn.q_proj.group
    assert group.linear.kernel_calls > 0
    unpatch(model)
    with torch.no_grad():
        again = model(ids).logits.double()
    assert torch.equal(again, plain)


def test_llama_mlp_runs_the_swiglu_epilogue_in_a_graph():
    """patch_model(merge=True): a Llama MLP's gate/up run as one launch with
    the SwiGLU epilogue (down reads its output), against float64, eagerly
    and captured in a CUDA graph."""
    from warpsplitk.nn.merge import SwiGLUMLP
    model = cuda_llama(layers=1)
    mlp = model.model.layers[0].mlp
    w_gate, w_up, w_down = (mlp.gate_proj.weight.double(), mlp.up_proj.weight.double(),
                            mlp.down_proj.weight.double())
    patch_model(model, merge=True, ms=range(1, 9), progress=None)
    fused = model.model.layers[0].mlp
    assert isinstance(fused, SwiGLUMLP) and fused.group.swiglu_prepared is not None
    x = torch.randn(1, 8, 256, device="cuda", dtype=torch.bfloat16)

    def reference(x):
        h = x.double()
        return (torch.nn.functional.silu(h @ w_gate.t()) * (h @ w_up.t())) @ w_down.t()
    with torch.no_grad():
        out = fused(x)
        assert ((out.double() - reference(x)).norm() / reference(x).norm()).item() < 1e-2
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fused(static_x)
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(static_x)
        assert ((static_out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert fused.group.linear.kernel_calls == 0  # gate and up never ran apart


def test_compiled_merged_llama_runs_the_swiglu_op():
    """torch.compile (Inductor) over a merge=True model: the graphs call
    decode_swiglu once per layer, and the logits match the eager patched model."""
    model = cuda_llama(layers=2)
    patch_model(model, merge=True, ms=range(1, 9), progress=None)
    ids = torch.randint(0, 512, (8, 1), device="cuda")  # 8 decode rows
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits.double()
    compiled, graphs = inductor_logits(model, ids)
    assert sum(g.count("warpsplitk.decode_swiglu") for g in graphs) == 2
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2


def test_merged_llama_under_reduce_overhead():
    """mode="reduce-overhead" (CUDA graph trees) over a merge=True model: the
    merged weights are module Parameters, so the replays read them in place."""
    model = cuda_llama(layers=2)
    patch_model(model, merge=True, ms=range(1, 9), progress=None)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):  # warm-up, record, replays
            ids = torch.randint(0, 512, (8, 1), device="cuda")
            out = compiled(ids, use_cache=False).logits.double()  # copied: replays overwrite
            eager = model(ids, use_cache=False).logits.double()
            assert ((out - eager).norm() / eager.norm()).item() < 1e-2
    torch._dynamo.reset()


def test_fp8_llama_merges_qkv_and_runs_the_fp8_swiglu_epilogue():
    """A Llama of transformers' FP8Linear (128 x 128 block scales, as
    FineGrainedFP8Config quantizes), patch_model(merge=True): q/k/v one FP8
    kernel, gate/up the FP8 kernel with the SwiGLU epilogue (the merged plain
    kernel never runs), the logits within 1e-2 of the unmerged patched
    model's, eagerly and under torch.compile (decode_swiglu_fp8 per layer)."""
    import copy

    from fakes import quantize_fp8
    from warpsplitk.nn.merge import SwiGLUMLP
    model = cuda_llama(layers=2)
    quantize_fp8(model)
    unmerged = copy.deepcopy(model)
    # 7 FP8 linears a layer, and lm_head (BF16)
    assert len(patch_model(unmerged, ms=range(1, 9), progress=None).swapped) == 2 * 7 + 1
    report = patch_model(model, merge=True, ms=range(1, 9), progress=None)
    assert len(report.merged) == 4 and len(report.swiglu) == 2
    group = model.model.layers[0].self_attn.q_proj.group
    assert group.scale is not None and group.linear.prepared.fp8_scales == "block128"
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) and mlp.group.swiglu_prepared is not None
    ids = torch.randint(0, 512, (8, 1), device="cuda")  # 8 decode rows
    with torch.no_grad():
        plain = unmerged(ids, use_cache=False).logits.double()
        merged = model(ids, use_cache=False).logits.double()
    assert ((merged - plain).norm() / plain.norm()).item() < 1e-2
    assert group.linear.kernel_calls == 1 and mlp.group.linear.kernel_calls == 0
    compiled, graphs = inductor_logits(model, ids)
    assert sum(g.count("warpsplitk.decode_swiglu_fp8") for g in graphs) == 2
    assert ((compiled - plain).norm() / plain.norm()).item() < 1e-2


def test_fp8_phi3_gate_up_proj_runs_the_fp8_swiglu_epilogue():
    """A Phi-3 whose own ``gate_up_proj`` is transformers' FP8Linear (128 x
    128 blocks): patch_model(merge=True) runs it with the FP8 SwiGLU
    epilogue, the logits within 1e-2 of the model patched without it."""
    import copy

    from fakes import quantize_fp8
    from warpsplitk.nn.gate_up import GateUpSwiGLUMLP
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(hidden_size=256, intermediate_size=512,
                                     num_attention_heads=4, num_key_value_heads=4,
                                     num_hidden_layers=2, vocab_size=512, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    quantize_fp8(model, only=("gate_up_proj",))
    unfused = copy.deepcopy(model)
    patch_model(unfused, ms=range(1, 9), progress=None)
    report = patch_model(model, merge=True, ms=range(1, 9), progress=None)
    assert report.swiglu == ["model.layers.0.mlp", "model.layers.1.mlp"]
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, GateUpSwiGLUMLP) and mlp.prepared.fp8_scales == "block128"
    ids = torch.randint(0, 512, (8, 1), device="cuda")
    with torch.no_grad():
        plain = unfused(ids, use_cache=False).logits.double()
        fused = model(ids, use_cache=False).logits.double()
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-2
    assert mlp.gate_up_proj.kernel_calls == 0  # the epilogue's kernel ran instead
