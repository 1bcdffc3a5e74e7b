"""Decode projections of open models, per tensor-parallel rank.

Package data (``data/models.json``) holds the linear-layer dimensions of
common open models, taken from their public ``config.json``. A model and a
tensor-parallel degree ``tp`` expand into the GEMMs one rank runs per decode
step, merged and sharded as vLLM lays them out:

* ``qkv``: q, k and v as one column-parallel weight. Each rank holds
  ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads, or one
  replica of a key/value head when ``tp`` exceeds ``kv_heads``:
  ``N = (heads / tp + 2 * max(1, kv_heads / tp)) * head_dim``, ``K = hidden``.
* ``o``: row-parallel, ``N = hidden``, ``K = heads * head_dim / tp``.
* ``gate_up``: gate and up as one column-parallel weight,
  ``N = 2 * intermediate / tp``, ``K = hidden`` (models whose every MLP is a
  mixture of experts have none); ``down``: row-parallel,
  ``N = hidden``, ``K = intermediate / tp``.
* ``lm_head``: column-parallel over the vocabulary padded to a multiple of
  64, ``N = padded / tp``, ``K = hidden``.
* Multi-head latent attention (DeepSeek-V3, Kimi-K2): ``qkv_a`` (the q and
  kv down-projections as one replicated weight, ``N = q_lora_rank +
  kv_lora_rank + qk_rope_head_dim``, ``K = hidden``), ``q_b``
  (column-parallel, ``N = heads * (qk_nope + qk_rope) / tp``, ``K =
  q_lora_rank``) and ``o`` (row-parallel, ``K = heads * v_head_dim / tp``).
  The kv up-projection is absorbed into attention at decode, no GEMM.

A model the table lacks is read from its own Hugging Face ``config.json``
(:func:`hf_config`), named by its path or, once downloaded, by its model id
(:func:`hub_config_path`): the same fields under transformers' names.

Whether the kernel takes a shape is a separate question
(``tactics.shape_refusal``); a shape it refuses runs on cuBLAS.
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from pathlib import Path


#: vLLM pads the vocabulary of a parallel LM head to a multiple of this.
VOCAB_PADDING = 64
#: A layer's projections in the order a decode step runs them: the chain
#: ``bench --chain`` times (attention's own kernels sit between qkv and o).
LAYER_ORDER = ("qkv_a", "q_b", "qkv", "o", "gate_up", "down")


@cache
def _table() -> dict:
    return json.loads(resources.files("warpsplitk").joinpath("data/models.json").read_text())


def model_names() -> list[str]:
    """Every model name the table knows (aliases not included)."""
    return sorted(_table()["models"])


def config(name) -> dict:
    """The table's entry for model ``name`` (case-insensitive; aliases
    resolved); else, for the path of a Hugging Face ``config.json`` or of the
    folder holding one, or for a model id (``org/name``) in the local
    Hugging Face cache, that config's (:func:`hf_config`); ``ValueError``
    naming the known models otherwise."""
    table = _table()
    key = str(name).strip().lower()
    key = table["aliases"].get(key, key)
    if key in table["models"]:
        return {"name": key, **table["models"][key]}
    path = Path(name)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return hf_config(path)
    downloaded = hub_config_path(str(name))
    if downloaded is not None:
        return hf_config(downloaded, str(name).rpartition("/")[2])
    raise ValueError(f"unknown model {name!r}: give the path of its config.json, the id of a "
                     f"model in the Hugging Face cache ({hub_cache()}), or one of "
                     f"{', '.join(model_names())} "
                     f"(aliases: {', '.join(sorted(table['aliases']))})")


def hub_cache() -> Path:
    """The local Hugging Face hub cache: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_config_path(model_id: str) -> Path | None:
    """The ``config.json`` of Hugging Face model ``model_id`` (``org/name``)
    in the local cache: of the snapshot ``refs/main`` names, else of the
    newest; None when it was not downloaded."""
    org, slash, repo = model_id.partition("/")
    if not (org and slash and repo) or "/" in repo:
        return None
    folder = hub_cache() / f"models--{org}--{repo}"
    snapshots = folder / "snapshots"
    main = folder / "refs" / "main"
    found = []
    try:
        if main.is_file():
            found.append(snapshots / main.read_text().strip() / "config.json")
        if snapshots.is_dir():
            found += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime,
                            reverse=True)
    except OSError:
        return None
    return next((p for p in found if p.is_file()), None)


#: Keys of a config.json that count a model's routed experts (DeepSeek and
#: Kimi; Mixtral, gpt-oss, Llama 4 and transformers' Qwen MoE; older Qwen MoE)
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def _with_class_defaults(data: dict) -> dict:
    """``data`` completed by its transformers config class: a config.json
    saved by transformers leaves out, in nested configs such as Gemma 3's
    ``text_config``, what equals the class's defaults. As it is without
    transformers, or for a ``model_type`` it does not know (custom code)."""
    try:
        import transformers
        fields = {key: value for key, value in data.items() if key != "model_type"}
        return transformers.AutoConfig.for_model(data["model_type"], **fields).to_dict()
    except Exception:  # no transformers, no or an unknown model_type, fields it refuses
        return data


def hf_config(path, name: str | None = None) -> dict:
    """A table entry (``config``'s form) from a Hugging Face ``config.json``
    (``path``: the file or its folder). A multimodal config's decoder is its
    ``text_config``. Attention is multi-head latent where ``kv_lora_rank`` is
    set, else grouped-query (``num_key_value_heads``, else one per head;
    ``head_dim``, else ``hidden_size / num_attention_heads``). With routed
    experts only the layers with a dense MLP have a ``gate_up`` and ``down``
    (DeepSeek's ``first_k_dense_replace``, Qwen's ``decoder_sparse_step`` and
    ``mlp_only_layers``, Llama 4's ``interleave_moe_layer_step``; else none);
    experts, shared ones included, are not projections of this table."""
    from .jsonfile import read_json
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    data = read_json(file, "Hugging Face config.json")
    if not isinstance(data, dict):
        raise ValueError(f"{file}: a config.json holds a JSON object, got {type(data).__name__}")
    data = _with_class_defaults(data)
    text = data["text_config"] if isinstance(data.get("text_config"), dict) else data

    def get(key, default=None, required=True):
        value = text.get(key, data.get(key))
        if value is None and not required:
            return default
        if type(value) is not int or value < 1:
            what = "missing" if value is None else f"got {value!r}"
            raise ValueError(f"{file}: {key!r} must be a positive integer ({what}); a decoder "
                             "config names hidden_size, num_attention_heads, "
                             "num_hidden_layers, vocab_size and intermediate_size")
        return value

    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    if name is None:
        name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    entry = {"name": name, "source": str(file), "hidden": hidden, "heads": heads,
             "layers": layers, "vocab": get("vocab_size")}
    if text.get("kv_lora_rank") is not None:
        if text.get("q_lora_rank") is None:
            raise ValueError(f"{file}: multi-head latent attention without a query LoRA rank "
                             "(q_lora_rank null: one q projection) is not modelled")
        entry.update(attention="mla", **{key: get(key) for key in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")})
    else:
        if get("head_dim", required=False) is None and hidden % heads:
            raise ValueError(f"{file}: no 'head_dim', and hidden_size {hidden} is not a multiple "
                             f"of num_attention_heads {heads}")
        entry.update(attention="gqa", kv_heads=get("num_key_value_heads", heads, required=False),
                     head_dim=get("head_dim", hidden // heads, required=False))
    experts = next((text[key] for key in EXPERT_KEYS if text.get(key)), 0)
    dense, key = layers, "intermediate_size"
    if experts:
        if "first_k_dense_replace" in text:
            dense = text["first_k_dense_replace"]
        elif "decoder_sparse_step" in text or "mlp_only_layers" in text:
            step = text.get("decoder_sparse_step") or 1
            only = set(text.get("mlp_only_layers") or ())
            dense = sum(1 for i in range(layers) if i in only or (i + 1) % step)
        elif (text.get("interleave_moe_layer_step") or 1) > 1:
            dense = layers - layers // text["interleave_moe_layer_step"]
            key = "intermediate_size_mlp"
        else:
            dense = 0
        if type(dense) is not int or not 0 <= dense <= layers:
            raise ValueError(f"{file}: the dense MLP layers come to {dense!r} of {layers}")
    if dense:
        entry["intermediate"] = get(key)
        if dense < layers:
            entry["dense_layers"] = dense
    else:
        entry["mlp"] = "moe"
    return entry


def _shard(what: str, size: int, tp: int, model: str) -> int:
    if size % tp:
        raise ValueError(f"{model}: {what} {size} does not split over tp {tp}")
    return size // tp


def projections(name: str, tp: int = 1, lm_head: bool = True) -> list[dict]:
    """The GEMMs one rank of ``name`` runs per decode step at tensor-parallel
    degree ``tp``: ``[{"n", "k", "model", "projection", "parallel", "per_step"}]``,
    one entry per distinct projection of a layer (``per_step``: how many
    layers run it), then the LM head (with ``lm_head``)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    c = config(name)
    model = c["name"]
    label = model if tp == 1 else f"{model} tp{tp}"
    heads = _shard("heads", c["heads"], tp, model)
    layers = c["layers"]
    found = []

    def add(projection, n, k, parallel, per_step):
        found.append({"n": n, "k": k, "model": label, "projection": projection,
                      "parallel": parallel, "per_step": per_step})

    if c["attention"] == "mla":
        add("qkv_a", c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"], c["hidden"],
            "replicated", layers)
        add("q_b", heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"],
            "column", layers)
        add("o", c["hidden"], heads * c["v_head_dim"], "row", layers)
    else:
        kv = c["kv_heads"]
        if kv >= tp:
            kv_per_rank = _shard("kv_heads", kv, tp, model)
        elif tp % kv:
            raise ValueError(f"{model}: {kv} kv heads are replicated only over a tp that is "
                             f"a multiple of them, got tp {tp}")
        else:
            kv_per_rank = 1
        add("qkv", (heads + 2 * kv_per_rank) * c["head_dim"], c["hidden"], "column", layers)
        add("o", c["hidden"], heads * c["head_dim"], "row", layers)
    if "intermediate" in c:
        dense = c.get("dense_layers", layers)
        inter = _shard("intermediate", c["intermediate"], tp, model)
        add("gate_up", 2 * inter, c["hidden"], "column", dense)
        add("down", c["hidden"], inter, "row", dense)
    if lm_head:
        padded = -(-c["vocab"] // VOCAB_PADDING) * VOCAB_PADDING
        add("lm_head", _shard("padded vocabulary", padded, tp, model), c["hidden"], "column", 1)
    return found


def layer_chain(name: str, tp: int = 1) -> list[dict]:
    """One layer's projections in the order a decode step runs them
    (``LAYER_ORDER``; the LM head is not part of a layer)."""
    shapes = {p["projection"]: p for p in projections(name, tp, lm_head=False)}
    return [shapes[p] for p in LAYER_ORDER if p in shapes]
