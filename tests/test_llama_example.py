"""examples/llama_decode.py end to end on a CPU: a real transformers Llama,
patched by patch_model, generating, compared and timed.

The kernel itself cannot run here: ``prepare`` is replaced by a stand-in
whose run() is F.linear, and the kernel device type pointed at "cpu", so
every eligible linear is swapped and its DecodeLinear kernel path runs.
"""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from warpsplitk import contract  # noqa: E402
from warpsplitk.planning import plans  # noqa: E402

from fakes import FakePrepared  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_decode.py"


def load_example():
    spec = importlib.util.spec_from_file_location("llama_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_patches_generates_and_agrees(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False:
                        FakePrepared(weight, plan, ms, bias, swiglu))
    out = tmp_path / "llama.json"
    code = load_example().main(["--device", "cpu", "--tiny", "--batch", "1", "3", "--steps", "4",
                                "--iters", "2", "--reps", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr().out[-2000:]
    data = json.loads(out.read_text())
    layers = data["config"]["num_hidden_layers"]
    # q, k, v, o, gate, up, down per layer; lm_head's vocab is not eligible or is skipped
    assert len(data["swapped"]) >= 7 * layers
    assert data["accuracy_ok"] is True
    for row in data["results"]:
        assert row["kernel_calls"] > 0, row          # the decode steps took the kernel path
        assert row["rel_err"] == 0.0 and row["top1_agree"] == 1.0  # the stand-in is exact
        # ... so against the float64 model it errs exactly as the plain BF16 model does
        assert row["rel_err_fp64"] == row["torch"]["rel_err_fp64"]
        assert 0.0 < row["rel_err_fp64"] < 5e-2
    assert data["gpu"] == "cpu" and data["command"].startswith("python examples/llama_decode.py")
    assert [r["batch"] for r in data["results"]] == [1, 3]
    # merge=True after unpatch: q/k/v and gate/up of each layer, one weight each
    merged = data["merge"]
    assert len(merged["merged"]) == 2 * layers
    assert [n.rsplit(".", 1)[1] for n in merged["merged"][0]] == ["q_proj", "k_proj", "v_proj"]
    assert len(merged["swiglu"]) == layers  # every MLP: gate/up with the SwiGLU epilogue
    for row in merged["results"]:
        assert row["kernel_calls"] > 0, row
        assert row["rel_err"] < 1e-2 and row["top1_agree"] == 1.0


def test_example_refuses_a_missing_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert load_example().main(["--device", "cuda", "--tiny"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_config_takes_a_models_sizes(capsys):
    example = load_example()
    args = example.parse_args(["--config", "llama-3-8b", "--layers", "1", "--device", "meta"])
    model, config = example.build_model(args, torch, torch.device("meta"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (4096, 1024)
    assert mlp.gate_proj.out_features == 14336 and config.vocab_size == 128256
    assert example.main(["--device", "cpu", "--config", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert example.main(["--device", "cpu", "--config", "deepseek-v3"]) == 2
    assert "a mla model; this example builds" in capsys.readouterr().err
    assert example.main(["--device", "cpu", "--config", "gpt-oss-20b"]) == 2
    err = capsys.readouterr().err
    assert "every MLP a mixture of experts" in err and len(err.splitlines()) == 1


def test_plan_is_read_as_the_cli_reads_it(tmp_path, capsys):
    """--plan takes 'h200', 'none' or a plan file, like the CLI; one it
    cannot read exits 2 before any model is built (no silent default)."""
    example = load_example()
    assert example.load_plan("none") is None
    assert example.load_plan("h200").lookup(4224, 7168, 1) is not None
    bad = tmp_path / "plan.json"
    bad.write_text("{")
    for spec in (str(bad), str(tmp_path / "missing.json"), "builtin:h200"):
        assert example.main(["--device", "cpu", "--tiny", "--plan", spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err


def test_no_speedup_is_reported_where_nothing_ran_the_kernel(tmp_path, capsys):
    """On a CPU with no stand-in, every linear falls back: the table gives no
    speedup and a note says why."""
    out = tmp_path / "llama.json"
    code = load_example().main(["--device", "cpu", "--tiny", "--batch", "1", "--steps", "2",
                                "--iters", "1", "--reps", "1", "--layers", "1",
                                "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    rows = [line.split() for line in printed.splitlines() if line.strip().startswith("warpsplitk")
            and len(line.split()) == 11]
    assert rows and all(row[6] == "-" for row in rows), printed[-2000:]
    data = json.loads(out.read_text())
    assert all(r["speedup"] is None for r in data["results"])


def test_a_phi3_step_runs_its_own_gate_up_with_the_swiglu_epilogue(tmp_path, monkeypatch, capsys):
    """--family phi3: the model's own fused projections; with merge=True its
    MLPs run gate_up with the SwiGLU epilogue (a stand-in kernel here)."""
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "prepare",
                        lambda weight, plan=None, ms=range(1, 33), bias=None, swiglu=False:
                        FakePrepared(weight, plan, ms, bias, swiglu))
    out = tmp_path / "phi3.json"
    code = load_example().main(["--device", "cpu", "--tiny", "--family", "phi3", "--layers", "2",
                                "--batch", "2", "--steps", "3", "--iters", "1", "--reps", "1",
                                "--json", str(out)])
    assert code == 0, capsys.readouterr().out[-2000:]
    data = json.loads(out.read_text())
    assert data["merge"]["swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(row["kernel_calls"] > 0 and row["rel_err"] < 1e-2
               for row in data["merge"]["results"])


def test_phi3_mini_sizes_by_name():
    example = load_example()
    args = example.parse_args(["--config", "phi-3-mini", "--layers", "1", "--device", "meta"])
    model, config = example.build_model(args, torch, torch.device("meta"))
    mlp = model.model.layers[0].mlp
    assert config.model_type == "phi3" and mlp.gate_up_proj.out_features == 2 * 8192


def test_fp8_quantization_is_transformers_fine_grained_fp8():
    """``quantize_fp8``: transformers' own FP8Linear, e4m3 weights and one
    scale per 128 x 128 block (largest magnitude / 448), lm_head kept; the
    dequantized weight within e4m3's rounding of the BF16 one, and exactly
    what the kernel path dequantizes."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    from torch import nn
    from warpsplitk.nn.ops import dequantized
    example = load_example()
    torch.manual_seed(0)
    model = nn.ModuleDict({"proj": nn.Linear(384, 256, dtype=torch.bfloat16),
                           "lm_head": nn.Linear(256, 512, bias=False, dtype=torch.bfloat16)})
    original = model["proj"].weight.detach().float().clone()
    assert example.quantize_fp8(torch, model) == ["proj"]
    layer = model["proj"]
    assert type(layer).__name__ == "FP8Linear" and type(model["lm_head"]) is nn.Linear
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (2, 3)
    assert torch.allclose(layer.weight_scale_inv[0, 0],
                          original[:128, :128].abs().max() / 448)
    back = dequantized(layer.weight, layer.weight_scale_inv, torch.float32)
    assert ((back - original).norm() / original.norm()).item() < 0.05
    assert layer.weight.float().abs().max() <= 448
