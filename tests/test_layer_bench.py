"""The decode-layer path benchmark (warpsplitk.layer_bench, bench --layer):
the sizes it takes from the model table, what it refuses, its CLI errors,
and the merged gate/up tactic it runs with the SwiGLU epilogue. CPU only;
the timing itself runs on a GPU (tests/test_gpu_swiglu.py runs it once)."""

import pytest

from warpsplitk import layer_bench
from warpsplitk.decode import DecodePlan
from warpsplitk.tactics import WarpSplitKTactic as T
from warpsplitk.tactics import check_tactic


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


def test_gate_up_tactic_takes_the_epilogue():
    n, k = 2 * 14336, 4096
    for m in (1, 8, 32):
        check_tactic(layer_bench.swiglu_tactic(None, m, n, k), n, k, swiglu=True)
    # a plan's mixed grid cannot carry the epilogue: the default replaces it
    mixed = T(32, 8, 256, 4, 1, half_tiles=2)
    plan = DecodePlan.__new__(DecodePlan)
    plan.tactic_for = lambda n_, k_, m_: mixed
    chosen = layer_bench.swiglu_tactic(plan, 8, 32 * 10 + 16 * 2, 1024)
    assert not chosen.half_tiles


def test_cli_checks_its_arguments(capsys):
    from warpsplitk.cli import main
    assert main(["bench", "--layer"]) == 2
    assert "--layer: needs --model" in capsys.readouterr().err
    assert main(["bench", "--layer", "--model", "llama-3-8b", "--chain"]) == 2
    assert "not with --chain" in capsys.readouterr().err
    assert main(["bench", "--layer", "--model", "kimi-k2"]) == 2
    assert "attention" in capsys.readouterr().err
