"""Model shape tables (warpsplitk.models) and the reference wave heuristic, on the CPU."""

import json
import re
from pathlib import Path

import pytest

from warpsplitk import models, shapes as shape_table
from warpsplitk.cli import main
from warpsplitk.planning.choose import reference_tactic
from warpsplitk.tactics import check_tactic, ctas_per_sm, grid_ctas


LOG = Path(__file__).resolve().parent.parent / "bench/results/h200-tune-log.jsonl"


def shapes(name, tp=1, lm_head=True):
    return {p["projection"]: (p["n"], p["k"]) for p in models.projections(name, tp, lm_head)}


def test_llama_3_8b_merged_as_vllm_does():
    # q 32 x 128 + k, v 8 x 128 each; gate and up 14336 each
    assert shapes("llama-3.1-8b") == {"qkv": (6144, 4096), "o": (4096, 4096),
                                      "gate_up": (28672, 4096), "down": (4096, 14336),
                                      "lm_head": (128256, 4096)}
    assert shapes("llama-3-8b") == shapes("LLaMA-3.1-8B")  # alias, any case


def test_tensor_parallel_shards_columns_and_rows():
    # 70B at tp 8: 8 query heads and 1 kv head per rank; vocab 128256 / 8
    assert shapes("llama-3-70b", 8) == {"qkv": (1280, 8192), "o": (8192, 1024),
                                        "gate_up": (7168, 8192), "down": (8192, 3584),
                                        "lm_head": (16032, 8192)}
    # kv heads replicated once tp exceeds them: Qwen2.5-7B has 4
    assert shapes("qwen2.5-7b", 4)["qkv"] == ((7 + 2) * 128, 3584)
    assert shapes("qwen2.5-0.5b", 2)["qkv"] == ((7 + 2) * 64, 896)
    # every column-parallel N and row-parallel K is the tp-1 one over tp
    one = shapes("llama-3.1-405b")
    eight = shapes("llama-3.1-405b", 8)
    assert eight["gate_up"][0] * 8 == one["gate_up"][0] and eight["down"][1] * 8 == one["down"][1]
    assert eight["o"][0] == one["o"][0]


def test_vocab_padded_to_64_before_the_split():
    # Gemma 3's 262208 is a multiple of 64; gpt-oss's 201088 too; a tp of 16 still splits it
    assert shapes("gemma-3-12b", 2)["lm_head"] == (131104, 3840)
    assert shapes("kimi-k2", 16)["lm_head"] == (10240, 7168)


def test_latent_attention_projections():
    # DeepSeek-V3: q and kv down-projections as one replicated weight (2112 = 1536 + 512 + 64)
    v3 = shapes("deepseek-v3", 8)
    assert v3["qkv_a"] == (2112, 7168) and shapes("deepseek-v3")["qkv_a"] == (2112, 7168)
    assert v3["q_b"] == (128 // 8 * 192, 1536) and v3["o"] == (7168, 128 // 8 * 128)
    assert v3["gate_up"] == (2 * 18432 // 8, 7168) and v3["down"] == (7168, 18432 // 8)
    assert "qkv" not in v3
    per_step = {p["projection"]: p["per_step"] for p in models.projections("deepseek-v3", 8)}
    assert per_step["gate_up"] == 3 and per_step["q_b"] == 61 and per_step["lm_head"] == 1
    assert shapes("kimi-k2", 8)["q_b"] == (64 // 8 * 192, 1536)


def test_mixture_of_experts_models_list_attention_only():
    assert set(shapes("gpt-oss-120b")) == {"qkv", "o", "lm_head"}
    assert shapes("gpt-oss-120b")["qkv"] == ((64 + 16) * 64, 2880)


def test_layer_chain_runs_a_layer_in_order():
    assert [p["projection"] for p in models.layer_chain("llama-3.1-8b")] == \
        ["qkv", "o", "gate_up", "down"]
    assert [p["projection"] for p in models.layer_chain("deepseek-v3", 8)] == \
        ["qkv_a", "q_b", "o", "gate_up", "down"]


@pytest.mark.parametrize("name,tp,problem", [
    ("qwen2.5-7b", 8, "heads 28 does not split over tp 8"),
    ("qwen2.5-0.5b", 7, "2 kv heads are replicated only over a tp that is a multiple"),
    ("llama-9b", 1, "unknown model 'llama-9b'"),
])
def test_refused_shardings_and_names(name, tp, problem):
    with pytest.raises(ValueError, match=problem):
        models.projections(name, tp)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        models.projections("llama-3.1-8b", 0)


def test_every_model_expands_at_every_tp_it_divides():
    for name in models.model_names():
        for tp in (1, 2, 4, 8):
            try:
                found = models.projections(name, tp)
            except ValueError as error:
                # a refusal only where the sizes do not divide (never at tp 1)
                split = re.search(r" (\d+) does not split over tp (\d+)$", str(error))
                kv = re.search(r" (\d+) kv heads are replicated only over a tp that is a "
                               r"multiple of them, got tp (\d+)$", str(error))
                assert tp > 1 and (split or kv), str(error)
                size, told = (split or kv).groups()
                assert int(told) == tp and (tp % int(size) if kv else int(size) % tp)
                continue
            assert found and all(p["n"] > 0 and p["k"] > 0 for p in found)


def test_plan_view_of_a_model_on_a_cpu(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--tp", "8", "--m", "1,8",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("llama-3.1-70b tp8")]
    assert len(rows) == 10 and all(" default " in row for row in rows)
    assert any("gate_up" in row and " 7168  8192 " in row for row in rows)


def test_plan_view_leaves_refused_shapes_to_cublas(capsys):
    assert main(["plan", "--model", "gpt-oss-20b", "--m", "1", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "cublas" in out and "K must be a positive multiple of 128" in out and "got 2880" in out
    assert " default " in out  # o_proj (2880 x 4096) takes the kernel


def test_every_model_of_the_shape_table_is_a_model_name(capsys):
    """The built-in shape table's models (kimi-k3, glm-5.2: no config here)
    are --model names: their rows are the table's, as listed."""
    table = shape_table.load()["shapes"]
    named = sorted({s["model"] for s in table})
    assert named == ["glm-5.2", "kimi-k3"] and set(named) <= set(models.names())
    for name in named:
        rows = [(s["n"], s["k"], s["projection"]) for s in table if s["model"] == name]
        assert [(p["n"], p["k"], p["projection"]) for p in models.projections(name)] == rows
        assert main(["plan", "--no-compile", "--model", name.upper(), "--m", "1"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert sum(line.startswith(f"{name} ") for line in out) == len(rows)
        assert not any(line.startswith("# ") and "alias" in line for line in out)
    with pytest.raises(ValueError, match="kimi-k3: no layer config, only the built-in shape "
                                         "table's rows"):
        models.config("kimi-k3")
    with pytest.raises(ValueError, match="glm-5.2: the built-in shape table lists its "
                                         "projections but not a layer"):
        models.layer_chain("glm-5.2")
    assert main(["plan", "--no-compile", "--model", "kimi-k3", "--tp", "8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "kimi-k3: the built-in shape table lists its shapes as they " \
        "are (full weights and marked TP shards); no --tp for it (got tp 8)" in err[0]


def test_an_alias_says_what_it_stands_for_once(capsys):
    assert main(["plan", "--no-compile", "--model", "llama-3-70b", "--m", "1,8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# llama-3-70b: alias of llama-3.1-70b"
    assert sum("alias" in line for line in out) == 1
    assert models.alias_of("LLAMA-3-70B") == "llama-3.1-70b"
    assert models.alias_of("llama-3.1-70b") is None
    assert main(["plan", "--no-compile", "--model", "llama-3.1-70b", "--m", "1"]) == 0
    assert "alias" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "bench", "tune"])
def test_model_list_prints_every_name_one_a_line(command, capsys):
    """--model list: every name, one a line (an alias and a shape-table model
    say what they are), exit 0 before anything else (no GPU, no -o)."""
    assert main([command, "--model", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == models.names()
    assert "llama-3-70b       (alias of llama-3.1-70b)" in lines
    assert "kimi-k3           (the built-in shape table's rows; no config, no --tp)" in lines
    assert "llama-3.1-8b" in lines


@pytest.mark.parametrize("name,closest", [
    ("kimi-k4", "kimi-k3, kimi-k2"), ("qwen3-30b", "qwen3-32b, qwen3-0.6b, qwen3-8b"),
    ("Llama-3.1-8B-Instruct", "llama-3.1-8b, llama-3.1-70b, llama-3-8b"), ("glm-5", "glm-5.2")])
def test_an_unknown_model_gets_the_closest_names_not_all(name, closest, capsys):
    assert main(["plan", "--no-compile", "--model", name]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"unknown model {name!r}: closest {closest} (every name: " \
        "`warpsplitk plan --model list`)" in err[0]
    assert len(err[0]) < 300 and "qwen2.5-0.5b" not in err[0]
    with pytest.raises(ValueError) as refused:
        models.config("nope")
    assert "closest" not in str(refused.value)  # nothing near it


@pytest.mark.parametrize("argv,problem", [
    (["plan", "--tp", "8"], "argument --tp: shards a --model's projections"),
    (["plan", "--model", "nope"], "argument --model: unknown model 'nope'"),
    (["plan", "--model", "qwen2.5-7b", "--tp", "8"], "does not split over tp 8"),
    (["plan", "--model", "llama-3.1-8b", "--tp", "0"], "argument --tp"),
    (["bench", "--model", "qwen2.5-7b", "--tp", "8", "--chain"], "does not split over tp 8"),
    (["tune", "--model", "llama-3.1-8b", "--from-log", "--log", str(LOG), "-o", "x.json"],
     "not with --from-log"),
])
def test_model_arguments_are_checked_in_one_line(capsys, argv, problem):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0]


# ------------------------------------------- the reference wave heuristic


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32])
@pytest.mark.parametrize("n,k", [(16, 128), (48, 16384), (768, 7168), (1152, 1536),
                                 (2880, 4096), (4608, 1536), (5120, 5120), (128256, 4096),
                                 (1280, 8192), (7168, 8192)])
def test_reference_tactic_is_legal_everywhere(m, n, k):
    tactic = reference_tactic(m, n, k, sm_count=132)
    check_tactic(tactic, n, k)
    assert tactic.token_tile >= 8 and tactic.k_split == 1 and not tactic.early_launch


def test_reference_tactic_follows_its_rules():
    # 4608 rows at M = 1: 16-row tiles are 288 CTAs (3 waves: 48 rows on the busiest SM),
    # 32 rows 144 (2 waves: 64), 48 rows 96 (1 wave: 48): the wider of the two 48s
    t = reference_tactic(1, 4608, 1536, sm_count=132)
    assert t.output_tile == 48 and t.k_tile == 128  # wide tiles take 128-wide K tiles
    # the token tile halves while the doubled grid fits in one wave: 768 rows, M = 32
    t = reference_tactic(32, 768, 7168, sm_count=132)
    assert t.output_tile == 16 and t.token_tile == 16 and grid_ctas(t, 32, 768) == 96
    # two activation warps from 16 token rows or 8 K tiles on
    assert reference_tactic(1, 1152, 1536, sm_count=132).b_loader_warps == 1  # 6 K tiles
    assert reference_tactic(1, 5120, 5120, sm_count=132).b_loader_warps == 2  # 20 K tiles
    # more CTAs than SMs: the deepest ring that keeps two per SM
    t = reference_tactic(1, 5120, 5120, sm_count=132)
    assert grid_ctas(t, 1, 5120) > 132 and ctas_per_sm(t) >= 2
    deeper = type(t)(t.output_tile, t.token_tile, t.k_tile, t.stages + 1, t.b_loader_warps)
    assert ctas_per_sm(deeper) < 2
    # a grid within the SMs: the deepest legal ring (here all of K)
    t = reference_tactic(1, 1152, 1536, sm_count=132)
    assert grid_ctas(t, 1, 1152) <= 132 and t.stages == 1536 // t.k_tile


def test_reference_tactic_refuses_what_the_kernel_refuses():
    with pytest.raises(ValueError, match="K must be"):
        reference_tactic(1, 2880, 2880)
    with pytest.raises(ValueError, match="M must be in 1..32"):
        reference_tactic(33, 4096, 4096)


# ------------------------------------------- a model's own Hugging Face config.json


def _hf_config(entry):
    """The config.json transformers writes for a table entry: its own config
    class, every field under transformers' name (``to_dict``: all of them)."""
    transformers = pytest.importorskip("transformers")
    source = entry["source"]
    common = dict(hidden_size=entry["hidden"], num_attention_heads=entry["heads"],
                  num_hidden_layers=entry["layers"], vocab_size=entry["vocab"])
    if entry["attention"] == "mla":
        return transformers.DeepseekV3Config(
            **common, intermediate_size=entry["intermediate"], n_routed_experts=256,
            first_k_dense_replace=entry["dense_layers"], q_lora_rank=entry["q_lora_rank"],
            kv_lora_rank=entry["kv_lora_rank"], qk_nope_head_dim=entry["qk_nope_head_dim"],
            qk_rope_head_dim=entry["qk_rope_head_dim"], v_head_dim=entry["v_head_dim"]).to_dict()
    common.update(num_key_value_heads=entry["kv_heads"])
    if source.startswith("openai/gpt-oss"):
        return transformers.GptOssConfig(**common, head_dim=entry["head_dim"],
                                         num_local_experts=32).to_dict()
    common.update(intermediate_size=entry["intermediate"])
    if source.startswith("Qwen/Qwen2.5"):  # no head_dim field: hidden / heads
        assert entry["head_dim"] * entry["heads"] == entry["hidden"]
        return transformers.Qwen2Config(**common).to_dict()
    cls = {"meta-llama/": transformers.LlamaConfig, "mistralai/": transformers.MistralConfig,
           "Qwen/Qwen3": transformers.Qwen3Config, "google/gemma-2": transformers.Gemma2Config,
           "google/gemma-3": transformers.Gemma3TextConfig}
    text = next(c for prefix, c in cls.items() if source.startswith(prefix))(
        **common, head_dim=entry["head_dim"])
    if source.startswith("google/gemma-3") and entry["hidden"] > 1152:  # 4b and up: multimodal
        return transformers.Gemma3Config(text_config=text.to_dict()).to_dict()
    return text.to_dict()


@pytest.mark.parametrize("name", models.model_names())
def test_a_config_json_expands_as_the_table_does(name, tmp_path):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_hf_config(models.config(name))))
    for tp in (1, 2, 8):
        try:
            expected = models.projections(name, tp)
        except ValueError as error:
            with pytest.raises(ValueError, match=re.escape(str(error).split(": ", 1)[1])):
                models.projections(str(folder), tp)
            continue
        found = models.projections(str(folder), tp)  # the folder, or the file itself
        assert found == models.projections(str(folder / "config.json"), tp)
        label = name if tp == 1 else f"{name} tp{tp}"
        assert [dict(p, model=label) for p in found] == expected
    assert [dict(p, model=name) for p in models.layer_chain(str(folder))] == \
        models.layer_chain(name)


def test_config_json_mixtures_of_experts(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"

    def gate_ups(config):
        path.write_text(json.dumps(config))
        return [(p["n"], p["k"], p["per_step"]) for p in models.projections(str(path))
                if p["projection"] in ("gate_up", "down")]
    # every MLP routed: no dense gate/up or down
    assert gate_ups(transformers.MixtralConfig().to_dict()) == []
    assert gate_ups(transformers.Qwen3MoeConfig().to_dict()) == []
    # Qwen MoE with dense layers by step and by list: 24 layers, every 2nd sparse, plus layer 1
    qwen = transformers.Qwen3MoeConfig(decoder_sparse_step=2, mlp_only_layers=[1]).to_dict()
    assert gate_ups(qwen) == [(2 * 6144, 2048, 13), (2048, 6144, 13)]
    # an older Qwen MoE config counts its experts as num_experts
    older = {k: v for k, v in qwen.items() if k != "num_local_experts"}
    assert gate_ups(dict(older, num_experts=60)) == gate_ups(qwen)
    # Llama 4's dense MLP layers between the MoE ones are intermediate_size_mlp wide
    llama4 = {"text_config": {"hidden_size": 5120, "num_attention_heads": 40,
                              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
                              "num_hidden_layers": 48, "intermediate_size": 8192,
                              "intermediate_size_mlp": 16384, "num_local_experts": 128,
                              "interleave_moe_layer_step": 3}}
    # every 3rd layer routed: 32 of 48 dense
    assert gate_ups(llama4) == [(32768, 5120, 32), (5120, 16384, 32)]


@pytest.mark.parametrize("config,match", [
    ([1, 2], "a config.json holds a JSON object, got list"),
    ({"num_attention_heads": 32}, r"'hidden_size' must be a positive integer \(missing\)"),
    ({"hidden_size": 4096.0}, r"'hidden_size' must be a positive integer \(got 4096\.0\)"),
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2,
      "vocab_size": 1000, "intermediate_size": True}, "'intermediate_size' must be .*got True"),
    ({"hidden_size": 4100, "num_attention_heads": 32, "num_hidden_layers": 2, "vocab_size": 1000,
      "intermediate_size": 11008}, "no 'head_dim', and hidden_size 4100 is not a multiple of "
                                   "num_attention_heads 32"),
    ({"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 27, "vocab_size": 1000,
      "kv_lora_rank": 512, "q_lora_rank": None}, "multi-head latent .*q_lora_rank null"),
])
def test_config_json_refusals_name_the_file(config, match, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {match}"):
        models.projections(str(path))


def test_unknown_model_says_a_config_json_would_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=rf"unknown model 'llama-9': closest llama-3-8b, "
                                         rf"llama-3-70b, llama-3\.2-3b \(every name: "
                                         rf"`warpsplitk plan --model list`\); or give the path of "
                                         rf"its config\.json or the id of a model in the Hugging "
                                         rf"Face cache \({re.escape(str(tmp_path / 'hub'))}\)$"):
        models.config("llama-9")
    empty = tmp_path / "empty"
    empty.mkdir()  # a folder without a config.json is no model either
    with pytest.raises(ValueError, match="unknown model"):
        models.config(str(empty))
    # the CLI takes the path wherever it takes a name
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"hidden_size": 2048, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "num_hidden_layers": 16,
                                  "vocab_size": 128256, "intermediate_size": 8192}))
    assert main(["plan", "--model", str(config.parent), "--tp", "2", "--m", "1",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "tiny tp2" in out and " 1536  2048 " in out  # qkv: (16 + 2 * 4) * 64 rows


def test_a_downloaded_model_is_found_by_its_id(tmp_path, monkeypatch):
    """The Hugging Face cache's layout: models--org--name/snapshots/<rev>/,
    refs/main naming the current revision."""
    import os
    import time
    llama = _hf_config(models.config("llama-3.1-8b"))
    hub = tmp_path / "hub"
    folder = hub / "models--acme--Llama-8B"
    for rev, hidden in (("old", 2048), ("current", 4096), ("newer-unreferenced", 1024)):
        (folder / "snapshots" / rev).mkdir(parents=True)
        (folder / "snapshots" / rev / "config.json").write_text(
            json.dumps(dict(llama, hidden_size=hidden)))
        time.sleep(0.01)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("current\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert models.hub_cache() == hub
    assert models.hub_config_path("acme/Llama-8B") == folder / "snapshots/current/config.json"
    found = models.projections("acme/Llama-8B", 8)
    assert [dict(p, model="llama-3.1-8b tp8") for p in found] == models.projections(
        "llama-3.1-8b", 8)
    assert found[0]["model"] == "Llama-8B tp8"
    # without refs/main: the newest snapshot
    (folder / "refs" / "main").unlink()
    assert models.hub_config_path("acme/Llama-8B").parent.name == "newer-unreferenced"
    for missing in ("acme/Other", "acme", "a/b/c", "/x"):
        assert models.hub_config_path(missing) is None
    # HF_HOME, else the home folder
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert models.hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HOME")
    assert models.hub_cache() == Path(os.path.expanduser("~/.cache/huggingface/hub"))


def test_a_config_json_leaving_out_class_defaults_is_completed(tmp_path):
    """Gemma 3's config.json as the Hub has it: its text_config names only
    what differs from Gemma3TextConfig's defaults (heads, kv heads,
    head_dim and vocabulary are those)."""
    pytest.importorskip("transformers")
    path = tmp_path / "gemma-3-4b-it" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "sliding_window": 1024}}))
    assert [dict(p, model="gemma-3-4b") for p in models.projections(str(path))] == \
        models.projections("gemma-3-4b")
    # a model type transformers does not know: the file as it is, its gaps named
    path.write_text(json.dumps({"model_type": "no-such-type", "hidden_size": 2560}))
    with pytest.raises(ValueError, match="'num_attention_heads' must be a positive integer "
                                         r"\(missing\)"):
        models.projections(str(path))


# ------------------------------------------- a hostile or broken config.json


def _llama(**changes):
    """A small Llama-like decoder config (no model_type: read as it is),
    with ``changes`` (a None value drops that key)."""
    config = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 16, "vocab_size": 128256, "intermediate_size": 8192}
    config.update(changes)
    return {key: value for key, value in config.items() if value is not None}


def _moe(**changes):
    return _llama(**{"num_experts": 64, **changes})


def _mla(**changes):
    return _llama(**{"num_key_value_heads": None, "kv_lora_rank": 512, "q_lora_rank": 1536,
                     "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                     **changes})


@pytest.mark.parametrize("config,key,problem", [
    # every size: a positive integer (a bool, a float, text or a list is none)
    (_llama(num_hidden_layers=1e9), "num_hidden_layers", "at most 1024"),
    (_llama(num_hidden_layers=10**9), "num_hidden_layers", r"at most 1024, several times "
                                                           r"the largest open model's \(got "
                                                           r"1000000000\)"),
    (_llama(num_hidden_layers=2.0), "num_hidden_layers", r"positive integer \(got 2\.0\)"),
    (_llama(hidden_size=1 << 20), "hidden_size", "at most 131072"),
    (_llama(hidden_size="2048"), "hidden_size", "positive integer .got '2048'"),
    (_llama(vocab_size=1 << 30), "vocab_size", "at most 4194304"),
    (_llama(vocab_size=0), "vocab_size", r"positive integer \(got 0\)"),
    (_llama(intermediate_size=1 << 21), "intermediate_size", "at most 1048576"),
    (_llama(intermediate_size=[8192, 8192]), "intermediate_size", "positive integer"),
    (_llama(num_attention_heads=True), "num_attention_heads", r"positive integer \(got True\)"),
    (_llama(num_attention_heads=2048, hidden_size=2048 * 64), "num_attention_heads",
     "at most 1024"),
    (_llama(head_dim=8192), "head_dim", "at most 4096"),
    (_llama(head_dim=-64), "head_dim", "positive integer"),
    (_llama(num_key_value_heads="8"), "num_key_value_heads", "positive integer"),
    # grouped-query attention: key/value heads at most the heads, and dividing them
    (_llama(num_key_value_heads=64), "num_key_value_heads",
     r"at most num_attention_heads 32 and divide it \(got 64\)"),
    (_llama(num_key_value_heads=12), "num_key_value_heads",
     r"at most num_attention_heads 32 and divide it \(got 12\)"),
    # latent attention's ranks and head widths
    (_mla(kv_lora_rank=1 << 16), "kv_lora_rank", "at most 32768"),
    (_mla(q_lora_rank="1536"), "q_lora_rank", "positive integer"),
    (_mla(qk_rope_head_dim=1 << 13), "qk_rope_head_dim", "at most 4096"),
    (_mla(v_head_dim=None), "v_head_dim", r"positive integer \(missing\)"),
    # the expert counts
    (_llama(num_experts="64"), "num_experts", r"integer in 0\.\.16384 \(routed experts\) "
                                              r"\(got '64'\)"),
    (_llama(n_routed_experts=1 << 20), "n_routed_experts", "at most 16384"),
    (_llama(num_local_experts=-1), "num_local_experts", r"integer in 0\.\.16384"),
    (_llama(num_local_experts=8, num_experts=True), "num_experts", "got True"),
    # which layers are dense
    (_moe(first_k_dense_replace=17), "first_k_dense_replace",
     r"integer in 0\.\.16 \(the leading dense layers of 16\) \(got 17\)"),
    (_moe(first_k_dense_replace="3"), "first_k_dense_replace", "got '3'"),
    (_moe(first_k_dense_replace=10**9), "first_k_dense_replace", "at most 1024"),
    (_moe(decoder_sparse_step="2"), "decoder_sparse_step", r"integer in 1 or more .* "
                                                           r"\(got '2'\)"),
    (_moe(decoder_sparse_step=0), "decoder_sparse_step", r"\(got 0\)"),
    (_moe(mlp_only_layers=5), "mlp_only_layers", r"list of layer indices in 0\.\.15 "
                                                 r"\(got 5\)"),
    (_moe(mlp_only_layers=[1, 16]), "mlp_only_layers", r"0\.\.15 \(got \[1, 16\]\)"),
    (_moe(mlp_only_layers=[1, "2"]), "mlp_only_layers", "got"),
    (_moe(mlp_only_layers=[True]), "mlp_only_layers", r"got \[True\]"),
    (_moe(interleave_moe_layer_step=0), "interleave_moe_layer_step", r"\(got 0\)"),
    (_moe(interleave_moe_layer_step=2.5), "interleave_moe_layer_step", r"\(got 2\.5\)"),
    # a multimodal config's decoder is an object
    (_llama(text_config="llama"), "text_config", r"be an object .*\(got 'llama'\)"),
    (_llama(text_config=[1]), "text_config", r"be an object"),
    (_llama(text_config=_llama(num_hidden_layers=1 << 20)), "text_config.num_hidden_layers",
     "at most 1024"),
])
def test_config_json_values_are_checked_by_name(config, key, problem, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {re.escape(repr(key))} "
                                         f"must .*{problem}") as refused:
        models.projections(str(path))
    assert "\n" not in str(refused.value)


def test_a_billion_layers_are_refused_before_anything_counts_them(tmp_path, monkeypatch):
    """Refused by the bound, before transformers' config classes (which
    build a list per layer) or the dense-layer count see the file."""
    def no_class_defaults(data):
        raise AssertionError("transformers was given an absurd config")
    monkeypatch.setattr(models, "_with_class_defaults", no_class_defaults)
    path = tmp_path / "config.json"
    for config in (_moe(num_hidden_layers=10**9, decoder_sparse_step=2),
                   _moe(num_hidden_layers=10**9, model_type="qwen3_moe"),
                   {"model_type": "gemma3", "text_config": _llama(num_hidden_layers=10**9)},
                   {"model_type": "gemma3", "vision_config": {"num_hidden_layers": 10**9}}):
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match="num_hidden_layers' must be at most 1024"):
            models.hf_config(path)


def test_a_hostile_value_is_shown_short(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(hidden_size="x" * 100_000)))
    with pytest.raises(ValueError, match=r"got 'xxx+\.\.\.\)") as refused:
        models.hf_config(path)
    assert len(str(refused.value)) < 400


def test_dense_layers_are_counted_without_a_loop(tmp_path):
    path = tmp_path / "config.json"

    def dense(**changes):
        path.write_text(json.dumps(_moe(**changes)))
        entry = models.hf_config(path)
        assert ("intermediate" in entry) != (entry.get("mlp") == "moe")
        return entry.get("dense_layers", entry["layers"] if "intermediate" in entry else 0)
    # 16 layers: every 2nd routed, 8 dense, plus listed routed layers 1 and 3 (0 is dense)
    assert dense(decoder_sparse_step=2) == 8
    assert dense(decoder_sparse_step=2, mlp_only_layers=[0, 1, 3, 3]) == 10
    assert dense(decoder_sparse_step=3, mlp_only_layers=[]) == 11
    assert dense(decoder_sparse_step=1) == 0
    assert dense(decoder_sparse_step=None, mlp_only_layers=[15]) == 1
    assert dense(decoder_sparse_step=100) == 16  # a step past the last layer routes none
    assert dense(first_k_dense_replace=0) == 0
    assert dense(first_k_dense_replace=16) == 16
    assert dense(interleave_moe_layer_step=4, intermediate_size_mlp=16384) == 12
    assert dense() == 0  # experts and no rule: every MLP routed
    # the counts agree with walking the layers
    for step in range(1, 6):
        for only in ([], [0], [4, 9, 15], list(range(16))):
            walked = sum(1 for i in range(16) if i in only or (i + 1) % step)
            assert dense(decoder_sparse_step=step, mlp_only_layers=only) == walked


def test_plan_refuses_a_hostile_config_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    for config, problem in ((_llama(num_hidden_layers=10**9), "'num_hidden_layers' must be at "
                                                              "most 1024"),
                            (_moe(mlp_only_layers=5), "'mlp_only_layers' must be a list"),
                            (_moe(decoder_sparse_step="2"), "'decoder_sparse_step' must be"),
                            (_llama(num_key_value_heads=64), "'num_key_value_heads' must be"),
                            (_llama(text_config=3), "'text_config' must be an object")):
        path.write_text(json.dumps(config))
        assert main(["plan", "--model", str(path), "--m", "1", "--no-compile"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0] and str(path) in err[0], err
    path.write_text('{"hidden_size": 2048, "hidden_size": 4096}')
    assert main(["plan", "--model", str(path), "--m", "1", "--no-compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "duplicate key 'hidden_size'" in err[0]


def test_every_table_model_is_within_the_config_bounds():
    """The bounds are generous: every model of the table passes them, as do
    its key/value heads (at most the heads, dividing them)."""
    bounds = {"layers": models.MAX_LAYERS, "hidden": models.MAX_HIDDEN,
              "intermediate": models.MAX_INTERMEDIATE, "vocab": models.MAX_VOCAB,
              "heads": models.MAX_HEADS, "kv_heads": models.MAX_HEADS,
              "head_dim": models.MAX_HEAD_DIM, "qk_nope_head_dim": models.MAX_HEAD_DIM,
              "qk_rope_head_dim": models.MAX_HEAD_DIM, "v_head_dim": models.MAX_HEAD_DIM,
              "q_lora_rank": models.MAX_LORA_RANK, "kv_lora_rank": models.MAX_LORA_RANK}
    for name in models.model_names():
        entry = models.config(name)
        sizes = {key: entry[key] for key in bounds if key in entry}
        assert {"layers", "hidden", "vocab", "heads"} <= set(sizes), name
        for key, value in sizes.items():
            # at most a quarter of the bound: the bounds leave room for bigger models
            assert type(value) is int and 1 <= value <= bounds[key] // 4, (name, key, value)
        if "kv_heads" in entry:
            assert entry["heads"] % entry["kv_heads"] == 0, name
        assert 0 <= entry.get("dense_layers", 0) <= entry["layers"], name
