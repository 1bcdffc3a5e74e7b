"""examples/llama_decode.py on the GPU with a tiny Llama: the real kernels in
a transformers model, logits within BF16 tolerance of the plain model."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_decode.py"


def test_tiny_llama_decodes_with_the_kernels(tmp_path):
    spec = importlib.util.spec_from_file_location("llama_decode", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "llama.json"
    assert example.main(["--device", "cuda", "--tiny", "--batch", "1", "8", "--steps", "8",
                         "--iters", "3", "--reps", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["swapped"] and data["accuracy_ok"]
    for row in data["results"]:
        assert row["kernel_calls"] > 0
        assert row["rel_err"] < 5e-2 and row["top1_agree"] >= 0.5
