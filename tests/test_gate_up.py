"""nn/gate_up.py on a CPU: a Phi-3 MLP's own [gate; up] projection runs with
the SwiGLU epilogue (a stand-in kernel), exactly where its DecodeLinear would
run the kernel; everything else runs the MLP as transformers wrote it."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402

from fakes import FakePrepared  # noqa: E402
from warpsplitk import contract  # noqa: E402
from warpsplitk.nn.gate_up import GateUpSwiGLUMLP, gate_up_refusal  # noqa: E402
from warpsplitk.nn.patch import patch_model, unpatch  # noqa: E402
from warpsplitk.planning import plans  # noqa: E402


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False:
                        FakePrepared(weight, plan, ms, bias, swiglu))


def tiny_phi3(act="silu", intermediate=64):
    config = transformers.Phi3Config(hidden_size=128, intermediate_size=intermediate,
                                     num_attention_heads=4, num_key_value_heads=4,
                                     num_hidden_layers=2, vocab_size=96, pad_token_id=0,
                                     hidden_act=act)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).eval().to(torch.bfloat16)


def test_phi3_mlps_run_with_the_swiglu_epilogue(cpu_kernel):
    model = tiny_phi3()
    ids = torch.randint(96, (2, 3))
    with torch.no_grad():
        before = model(ids).logits
        before_step = model(ids[:, -1:]).logits  # M = 2: the fused path after patching
    report = patch_model(model, merge=True, ms=[1, 2, 4], progress=None)
    assert report.swiglu == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "model.layers.0.mlp.gate_up_proj" in report.swapped
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, GateUpSwiGLUMLP) and mlp.prepared.swiglu
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    w = mlp.gate_up_proj.weight
    with torch.no_grad():
        fused = mlp.fused(x)
        expected = F.silu(F.linear(x, w[:64])) * F.linear(x, w[64:])
        assert torch.equal(fused, expected.to(torch.bfloat16))
        assert mlp.prepared.runs == 1
        assert mlp.fused(x[:3]) is None             # M 3 not prepared
        assert mlp.fused(x.float()) is None         # not BF16
        # the whole model at M = 2: the logits of before, up to BF16 rounding
        runs = mlp.prepared.runs
        after = model(ids[:, -1:]).logits
        assert mlp.prepared.runs == runs + 1
        assert torch.allclose(after.float(), before_step.float(), rtol=5e-2, atol=5e-2)
    x.requires_grad_(True)
    assert mlp.fused(x) is None                     # autograd needs a graph
    with torch.no_grad():
        unpatch(model)
        assert type(model.model.layers[0].mlp).__name__ == "Phi3MLP"
        assert torch.equal(model(ids).logits, before)


def test_refusals(cpu_kernel):
    gelu = tiny_phi3(act="gelu_pytorch_tanh")
    assert gate_up_refusal(gelu.model.layers[0].mlp, [1]) == "its activation is not SiLU"
    assert patch_model(gelu, merge=True, ms=[1], progress=None).swiglu == []
    model = tiny_phi3()
    assert gate_up_refusal(model.model.layers[0].self_attn, [1]).startswith(
        "Phi3Attention is not one of")
    assert patch_model(model, merge=False, ms=[1], progress=None).swiglu == []
    with pytest.raises(ValueError, match="a GateUpSwiGLUMLP wraps a"):
        GateUpSwiGLUMLP(gelu.model.layers[0].mlp)


@pytest.fixture
def cpu_fp8_kernel(monkeypatch):
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False,
                        weight_scale=None, scale_kind=None:
                        FakePrepared(weight, plan, ms, bias, swiglu, weight_scale))


def test_an_fp8_gate_up_proj_runs_with_the_swiglu_epilogue(cpu_fp8_kernel):
    """A Phi-3 MLP whose ``gate_up_proj`` is transformers' FP8Linear (128 x
    128 blocks): the FP8 SwiGLU kernel with its scales, ``silu(gate) * up``
    of the dequantized halves; ``unpatch`` gives the FP8Linear back."""
    from fakes import quantize_fp8
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from warpsplitk.nn.ops import dequantized
    model = tiny_phi3(intermediate=128)
    quantize_fp8(model, only=("gate_up_proj",))
    original = model.model.layers[0].mlp.gate_up_proj
    report = patch_model(model, merge=True, ms=[1, 2], progress=None)
    assert report.swiglu == ["model.layers.0.mlp", "model.layers.1.mlp"]
    mlp = model.model.layers[0].mlp
    assert mlp.prepared.swiglu and mlp.prepared.weight_scale is not None
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    w = dequantized(original.weight, original.weight_scale_inv, torch.bfloat16)
    with torch.no_grad():
        expected = F.silu(F.linear(x, w[:128]).float()) * F.linear(x, w[128:]).float()
        torch.testing.assert_close(mlp.fused(x).float(), expected, rtol=2e-2, atol=2e-2)
        unpatch(model)
    assert model.model.layers[0].mlp.gate_up_proj is original
    assert isinstance(original, FP8Linear)
