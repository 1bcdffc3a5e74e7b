"""The decode-layer path benchmark (warpsplitk.measure.layer_bench, bench --layer):
the sizes it takes from the model table, what it refuses, its CLI errors.
CPU only;
the timing itself runs on a GPU (tests/test_gpu_swiglu.py runs it once)."""

import pytest

from warpsplitk.measure import layer_bench


def test_sizes_of_a_llama_layer_and_its_tp_shard():
    s = layer_bench.layer_shape("llama-3-8b")
    assert (s.hidden, s.q, s.kv, s.inter, s.qkv) == (4096, 4096, 1024, 14336, 6144)
    s8 = layer_bench.layer_shape("llama-3-70b", 8)
    # 64 query heads and 8 kv heads of 128 over 8 ranks; 28672 / 8 intermediate
    assert (s8.hidden, s8.q, s8.kv, s8.inter) == (8192, 1024, 128, 3584)


@pytest.mark.parametrize("name,tp,message", [
    ("deepseek-v3", 1, "grouped-query attention layers with a dense MLP"),
    ("llama-3.1-8b", 3, "does not split over tp 3"),
    ("no-such-model", 1, "unknown model"),
])
def test_refusals_name_the_reason(name, tp, message):
    with pytest.raises(ValueError, match=message):
        layer_bench.layer_shape(name, tp)


def test_cli_checks_its_arguments(capsys):
    from warpsplitk.cli import main
    assert main(["bench", "--layer"]) == 2
    assert "--layer: needs --model" in capsys.readouterr().err
    assert main(["bench", "--layer", "--model", "llama-3-8b", "--chain"]) == 2
    assert "not with --chain" in capsys.readouterr().err
    assert main(["bench", "--layer", "--model", "kimi-k2"]) == 2
    assert "attention" in capsys.readouterr().err
