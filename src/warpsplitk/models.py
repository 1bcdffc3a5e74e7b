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

The models the built-in shape table (``shapes.load()``) names without a
config here (``shape_table_models``) are reachable by name too: their
projections are that table's rows, as listed (full weights and marked TP
shards), with no layer config behind them.

Whether the kernel takes a shape is a separate question
(``tactics.shape_refusal``); a shape it refuses runs on cuBLAS.
"""

from __future__ import annotations

import difflib
import os
from functools import cache
from importlib import resources
from pathlib import Path

from . import shapes as shape_table
from .jsonfile import loads, read_json


#: vLLM pads the vocabulary of a parallel LM head to a multiple of this.
VOCAB_PADDING = 64
#: A layer's projections in the order a decode step runs them: the chain
#: ``bench --chain`` times (attention's own kernels sit between qkv and o).
LAYER_ORDER = ("qkv_a", "q_b", "qkv", "o", "gate_up", "down")
#: An unknown name's suggestions are the known names at least this similar
#: (difflib's ratio): "qwen3-30b" finds qwen3-32b, "nope" nothing.
CLOSE_NAME_CUTOFF = 0.5


@cache
def _table() -> dict:
    text = resources.files("warpsplitk").joinpath("data/models.json").read_text(encoding="utf-8")
    return loads(text, "built-in model table")


def model_names() -> list[str]:
    """Every model name the table knows (aliases not included)."""
    return sorted(_table()["models"])


@cache
def _shape_table_rows() -> dict:
    """``{model: ((n, k, projection), ...)}`` of the built-in shape table's
    models the model table lacks."""
    rows = {}
    for shape in shape_table.load()["shapes"]:
        model = str(shape.get("model", "")).lower()
        if model and model not in _table()["models"]:
            rows.setdefault(model, []).append((shape["n"], shape["k"],
                                               shape.get("projection", "")))
    return {model: tuple(found) for model, found in rows.items()}


def shape_table_models() -> list[str]:
    """The models the built-in shape table names that the model table lacks:
    their projections are the shape table's rows."""
    return sorted(_shape_table_rows())


def names() -> list[str]:
    """Every name ``--model`` takes from the package: the table's models,
    their aliases and the shape table's models (``shape_table_models``)."""
    return sorted({*_table()["models"], *_table()["aliases"], *shape_table_models()})


def alias_of(name) -> str | None:
    """The model ``name`` is an alias of (any case), or None."""
    return _table()["aliases"].get(str(name).strip().lower())


def listing() -> list[str]:
    """One line per name of ``names()``: the name, and what an alias or a
    shape-table model stands for."""
    notes = {alias: f"alias of {target}" for alias, target in _table()["aliases"].items()}
    notes.update({model: "the built-in shape table's rows; no config, no --tp"
                  for model in shape_table_models()})
    width = max(map(len, names()))
    return [f"{name:<{width}}  ({notes[name]})" if name in notes else name for name in names()]


def _shape_table_model(name) -> str | None:
    """``name`` (any case) where it is one of ``shape_table_models()``."""
    key = str(name).strip().lower()
    return key if key in _shape_table_rows() else None


def config(name) -> dict:
    """The table's entry for model ``name`` (case-insensitive; aliases
    resolved); else, for the path of a Hugging Face ``config.json`` or of the
    folder holding one, or for a model id (``org/name``) in the local
    Hugging Face cache, that config's (:func:`hf_config`); ``ValueError``
    naming the closest known models otherwise (and for a model of the shape
    table alone, which has no config)."""
    table = _table()
    key = str(name).strip().lower()
    key = table["aliases"].get(key, key)
    if key in table["models"]:
        return {"name": key, **table["models"][key]}
    if _shape_table_model(name):
        raise ValueError(f"{key}: no layer config, only the built-in shape table's rows "
                         f"(`warpsplitk plan --model {key}` lists them)")
    path = Path(name)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return hf_config(path)
    downloaded = hub_config_path(str(name))
    if downloaded is not None:
        return hf_config(downloaded, str(name).rpartition("/")[2])
    closest = difflib.get_close_matches(key, names(), n=3, cutoff=CLOSE_NAME_CUTOFF)
    hint = f": closest {', '.join(closest)}" if closest else ""
    raise ValueError(f"unknown model {name!r}{hint} (every name: "
                     f"`warpsplitk plan --model list`); or give the path of its config.json "
                     f"or the id of a model in the Hugging Face cache ({hub_cache()})")


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

# Bounds on the sizes a config.json names. Each is several times the largest
# open model's today, so no real model meets one; they refuse a broken or
# hostile file before it asks for absurd work (transformers' config classes
# build lists per layer) or absurd GEMMs.
#: Layers: Llama 3.1 405B has 126.
MAX_LAYERS = 1024
#: Hidden size: Nemotron-4 340B has 18432, Llama 3.1 405B 16384.
MAX_HIDDEN = 1 << 17
#: MLP width: Nemotron-4 340B has 73728, Llama 3.1 405B 53248.
MAX_INTERMEDIATE = 1 << 20
#: Vocabulary: Gemma 3 has 262208.
MAX_VOCAB = 1 << 22
#: Attention heads (and so key/value heads): Llama 3.1 405B and DeepSeek-V3 have 128.
MAX_HEADS = 1024
#: A head's width (any of MLA's parts too): Gemma 2 and 3 have 256.
MAX_HEAD_DIM = 4096
#: MLA's LoRA ranks: DeepSeek-V3's q_lora_rank is 1536, its kv_lora_rank 512.
MAX_LORA_RANK = 1 << 15
#: Routed experts: Qwen3-Next has 512, Kimi K2 384.
MAX_EXPERTS = 1 << 14

#: Each size :func:`hf_config` reads, and its bound.
SIZE_BOUNDS = {
    "num_hidden_layers": MAX_LAYERS, "hidden_size": MAX_HIDDEN,
    "intermediate_size": MAX_INTERMEDIATE, "intermediate_size_mlp": MAX_INTERMEDIATE,
    "vocab_size": MAX_VOCAB, "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM, "qk_nope_head_dim": MAX_HEAD_DIM,
    "qk_rope_head_dim": MAX_HEAD_DIM, "v_head_dim": MAX_HEAD_DIM,
    "q_lora_rank": MAX_LORA_RANK, "kv_lora_rank": MAX_LORA_RANK,
    **{key: MAX_EXPERTS for key in EXPERT_KEYS},
}
#: What is held to a bound before transformers sees the file, wherever it
#: sits: its config classes also loop over the dense layers DeepSeek-style
#: configs name.
_EARLY_BOUNDS = {**SIZE_BOUNDS, "first_k_dense_replace": MAX_LAYERS}


def _given(value) -> str:
    """``value`` for a message: its repr, cut short (a hostile file's value
    may be megabytes)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _too_big(file, key: str, value, bound: int) -> ValueError:
    return ValueError(f"{file}: {key!r} must be at most {bound}, several times the largest "
                      f"open model's (got {_given(value)})")


def _refuse_absurd_sizes(data, file) -> None:
    """Every size in ``data``, nested objects included, at most its bound: run
    before transformers' config classes, which build a list per layer (a
    billion layers would take most of an hour and gigabytes)."""
    stack = [("", data)]
    while stack:  # no recursion: the parser took nesting deeper than Python's stack
        path, node = stack.pop()
        if isinstance(node, dict):  # (where, key, value); where: e.g. text_config.head_dim
            items = [(f"{path}.{key}" if path else key, key, value) for key, value in node.items()]
        else:
            items = [(f"{path}[{i}]", None, value) for i, value in enumerate(node)]
        for where, key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((where, value))
            elif (key in _EARLY_BOUNDS and type(value) in (int, float)
                  and value > _EARLY_BOUNDS[key]):
                raise _too_big(file, where, value, _EARLY_BOUNDS[key])


def _size(file, key: str, value) -> int:
    """``value`` of ``key``, checked to be a positive integer within its bound."""
    if type(value) is not int or value < 1:  # not bool: True is no size
        what = "missing" if value is None else f"got {_given(value)}"
        raise ValueError(f"{file}: {key!r} must be a positive integer ({what}); a decoder "
                         "config names hidden_size, num_attention_heads, "
                         "num_hidden_layers, vocab_size and intermediate_size")
    if value > SIZE_BOUNDS[key]:
        raise _too_big(file, key, value, SIZE_BOUNDS[key])
    return value


def _optional_int(text: dict, key: str, file, low: int, high: int | None, meaning: str):
    """``text[key]``, an integer in ``low..high`` (no upper end for None);
    None where it is absent or null."""
    value = text.get(key)
    if value is None:
        return None
    if type(value) is not int or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f"{low} or more"
        raise ValueError(f"{file}: {key!r} must be an integer in {span} ({meaning}) "
                         f"(got {_given(value)})")
    return value


def _expert_count(text: dict, file) -> int:
    """The routed experts ``text`` names (the first of ``EXPERT_KEYS`` that is
    not 0), every one of those keys checked; 0 for a dense model."""
    counts = [_optional_int(text, key, file, 0, MAX_EXPERTS, "routed experts")
              for key in EXPERT_KEYS]
    return next((count for count in counts if count), 0)


def _mlp_only_layers(text: dict, file, layers: int) -> set[int]:
    """Qwen MoE's ``mlp_only_layers``: indices of layers in ``0..layers-1``."""
    value = text.get("mlp_only_layers")
    if value is None:
        return set()
    if not isinstance(value, list) or not all(
            type(i) is int and 0 <= i < layers for i in value):
        raise ValueError(f"{file}: 'mlp_only_layers' must be a list of layer indices in "
                         f"0..{layers - 1} (got {_given(value)})")
    return set(value)


def _dense_layers(text: dict, file, layers: int) -> tuple[int, str]:
    """How many of a mixture of experts' ``layers`` have a dense MLP, and the
    key of that MLP's width. Counted by arithmetic, not by a loop over the
    layers, so the work does not grow with the layer count."""
    first = _optional_int(text, "first_k_dense_replace", file, 0, layers,
                          f"the leading dense layers of {layers}")
    if first is not None:
        return first, "intermediate_size"
    if "decoder_sparse_step" in text or "mlp_only_layers" in text:
        step = _optional_int(text, "decoder_sparse_step", file, 1, None,
                             "every step-th layer is routed") or 1
        only = _mlp_only_layers(text, file, layers)
        # layer i is routed where (i + 1) % step == 0, unless mlp_only_layers lists it
        routed = layers // step - sum(1 for i in only if (i + 1) % step == 0)
        return layers - routed, "intermediate_size"
    step = _optional_int(text, "interleave_moe_layer_step", file, 1, None,
                         "every step-th layer is routed") or 1
    if step > 1:
        return layers - layers // step, "intermediate_size_mlp"
    return 0, "intermediate_size"


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


def _attention(text, file, get, hidden, heads) -> dict:
    """The attention fields of ``hf_config``'s entry: multi-head latent where
    ``kv_lora_rank`` is set, else grouped-query."""
    if text.get("kv_lora_rank") is not None:
        if text.get("q_lora_rank") is None:
            raise ValueError(f"{file}: multi-head latent attention without a query LoRA rank "
                             "(q_lora_rank null: one q projection) is not modelled")
        return dict(attention="mla", **{key: get(key) for key in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")})
    if get("head_dim", required=False) is None and hidden % heads:
        raise ValueError(f"{file}: no 'head_dim', and hidden_size {hidden} is not a multiple "
                         f"of num_attention_heads {heads}")
    kv_heads = get("num_key_value_heads", heads, required=False)
    if kv_heads > heads or heads % kv_heads:
        # grouped-query attention: each key/value head serves a whole group of query heads
        raise ValueError(f"{file}: 'num_key_value_heads' must be at most "
                         f"num_attention_heads {heads} and divide it (got {kv_heads})")
    return dict(attention="gqa", kv_heads=kv_heads,
                head_dim=get("head_dim", hidden // heads, required=False))


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
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    data = read_json(file, "Hugging Face config.json")
    if not isinstance(data, dict):
        raise ValueError(f"{file}: a config.json holds a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("text_config"), (dict, type(None))):
        raise ValueError(f"{file}: 'text_config' must be an object (the decoder's config) "
                         f"(got {_given(data['text_config'])})")
    _refuse_absurd_sizes(data, file)
    data = _with_class_defaults(data)
    text = data["text_config"] if isinstance(data.get("text_config"), dict) else data

    def get(key, default=None, required=True):
        value = text.get(key, data.get(key))
        if value is None and not required:
            return default
        return _size(file, key, value)

    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    if name is None:
        name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    entry = {"name": name, "source": str(file), "hidden": hidden, "heads": heads,
             "layers": layers, "vocab": get("vocab_size")}
    entry.update(_attention(text, file, get, hidden, heads))
    dense, key = layers, "intermediate_size"
    if _expert_count(text, file):
        dense, key = _dense_layers(text, file, layers)
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
    if _shape_table_model(name):
        return _shape_table_projections(_shape_table_model(name), tp)
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


def _shape_table_projections(model: str, tp: int) -> list[dict]:
    """The shape table's rows of ``model``, in ``projections``' form (neither
    how they shard nor how many layers run them is known: None)."""
    if tp != 1:
        raise ValueError(f"{model}: the built-in shape table lists its shapes as they are "
                         f"(full weights and marked TP shards); no --tp for it (got tp {tp})")
    return [{"n": n, "k": k, "model": model, "projection": projection, "parallel": None,
             "per_step": None} for n, k, projection in _shape_table_rows()[model]]


def layer_chain(name: str, tp: int = 1) -> list[dict]:
    """One layer's projections in the order a decode step runs them
    (``LAYER_ORDER``; the LM head is not part of a layer)."""
    if _shape_table_model(name):
        raise ValueError(f"{_shape_table_model(name)}: the built-in shape table lists its "
                         f"projections but not a layer of them (no config to chain)")
    shapes = {p["projection"]: p for p in projections(name, tp, lm_head=False)}
    return [shapes[p] for p in LAYER_ORDER if p in shapes]
