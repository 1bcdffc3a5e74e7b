"""transformers' generate() on a patched model (merge=True), eager and with
the decode step under torch.compile(fullgraph=True, mode="reduce-overhead"):
no graph break, the merged and SwiGLU kernels inside the compiled graph, and
the compiled run's greedy tokens equal to the eager run's. A Llama (merged
q/k/v and gate/up) and a Phi-3 (its own qkv_proj and [gate; up] gate_up_proj)."""

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from warpsplitk import patch_model  # noqa: E402

SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
             num_hidden_layers=2, vocab_size=4096, max_position_embeddings=256, pad_token_id=0)
FAMILIES = {"llama": dict(num_key_value_heads=2), "phi3": dict(num_key_value_heads=8)}
BATCH, PROMPT, NEW = 2, 8, 12


def build(family):
    config = transformers.AutoConfig.for_model(family, **SIZES, **FAMILIES[family])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval()


def generate(model, prompt, **mode):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             cache_implementation="static", pad_token_id=0, eos_token_id=None,
                             **mode)
    return out[:, PROMPT:]


def compiled_ops(model, prompt):
    """The call targets of the graph torch.compile(fullgraph=True) records for
    one decode step over a static cache (a graph break is an error)."""
    recorded = []

    def recorder(gm, example_inputs):
        recorded.extend(str(node.target) for node in gm.graph.nodes
                        if node.op == "call_function")
        return gm.forward

    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + 4)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    with torch.no_grad():
        model(input_ids=prompt, **{name: cache}, use_cache=True)
        step = torch.compile(model.forward, backend=recorder, fullgraph=True)
        step(input_ids=prompt[:, -1:], **{name: cache}, use_cache=True,
             cache_position=torch.tensor([PROMPT], device="cuda"))
    return recorded


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_is_fused_and_the_same_eager_and_compiled(family):
    from transformers import CompileConfig
    model = build(family)
    prompt = torch.randint(SIZES["vocab_size"], (BATCH, PROMPT), device="cuda")
    report = patch_model(model, merge=True, ms=[BATCH], progress=None)
    layers = SIZES["num_hidden_layers"]
    assert len(report.swiglu) == layers, report     # every MLP's gate/up one SwiGLU launch
    if family == "llama":
        assert len(report.merged) == 2 * layers     # q/k/v and gate/up merged
    eager = generate(model, prompt, disable_compile=True)
    torch._dynamo.reset()
    ops = compiled_ops(model, prompt)
    assert sum("warpsplitk.decode_swiglu" in op for op in ops) == layers, ops
    # q/k/v (one merged or the model's own qkv_proj), o_proj and down per layer
    assert sum("warpsplitk.decode_linear" in op for op in ops) >= 3 * layers, ops
    torch._dynamo.reset()
    compiled = generate(model, prompt,
                        compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert torch.equal(compiled, eager)
