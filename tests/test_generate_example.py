"""examples/generate.py on a CPU: transformers' generate() with a static
cache, plain and after patch_model(merge=True); where nothing ran the kernel
it says so and reports no speedup."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"


def load_example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", ["llama-3-8b", "phi-3-mini"])
def test_generate_runs_both_variants_and_reports_honestly(tmp_path, capsys, config):
    out = tmp_path / "generate.json"
    code = load_example().main(["--device", "cpu", "--tiny", "--config", config, "--layers", "1",
                                "--batch", "1", "2", "--tokens", "10", "--reps", "1",
                                "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    assert "nothing here ran the warpsplitk kernel" in printed and "plain ms" not in printed
    data = json.loads(out.read_text())
    assert data["gpu"] == "cpu" and data["command"].startswith("python examples/generate.py")
    assert data["model"]["model_type"] == {"llama-3-8b": "llama", "phi-3-mini": "phi3"}[config]
    cells = {(r["variant"], r["mode"], r["batch"]) for r in data["rows"]}
    assert cells == {(v, "eager", b) for v in ("plain", "patched") for b in (1, 2)}
    # the patched model falls back to F.linear on a CPU: the same greedy tokens
    assert all(r["tokens_agree_plain"] == 1.0 for r in data["rows"] if r["variant"] == "patched")
    assert all(r["proj_separated_us"] >= 0 and r["proj_us"] > 0 for r in data["rows"])


def test_compare_pairs_each_round_of_the_two_models():
    """``speedup`` is the ratio of the medians; ``speedup_paired`` the median
    of each round's ratio, which a slow spell of the host (both models of
    round 2 slow) leaves alone."""
    plain = {"variant": "plain", "mode": "eager", "batch": 1, "ms_per_token": 10.0,
             "samples_ms": [10.0, 20.0, 10.0], "proj_us": 0.0, "proj_separated_us": 0.0,
             "tokens": [[1]]}
    patched = dict(plain, variant="patched", ms_per_token=18.0, samples_ms=[9.0, 18.0, 9.5])
    load_example().compare([plain, patched])
    assert patched["speedup"] == pytest.approx(10.0 / 18.0)
    assert patched["speedup_paired"] == pytest.approx(10.0 / 9.0)
    assert patched["tokens_agree_plain"] == 1.0
