"""The built-in decode shape table (package data) and shape-list parsing."""

from __future__ import annotations

import json
from importlib import resources


def load(path=None) -> dict:
    """The shape table: ``{"shapes": [{"n", "k", "model", "projection"}, ...], "m_values": [...]}``."""
    if path is None:
        text = resources.files("warpsplitk").joinpath("data/decode-shapes.json").read_text()
    else:
        with open(path) as f:
            text = f.read()
    table = json.loads(text)
    if "shapes" not in table:
        raise ValueError(f"{path or 'built-in table'}: a shape table needs a 'shapes' list")
    return table


def shape_entries(items) -> list[dict]:
    """``["N,K", "table.json", ...]`` -> the table entries they name
    (``{"n", "k", ...}``; a pair has only those two, a table's keep its
    model and projection names)."""
    entries = []
    for item in items:
        if item.endswith(".json"):
            entries += load(item)["shapes"]
            continue
        try:
            n, k = (int(v) for v in item.split(","))
        except ValueError:
            raise ValueError(f"a shape is 'N,K' or a .json table, got {item!r}") from None
        entries.append({"n": n, "k": k})
    return entries


def parse_shapes(items) -> list[tuple[int, int]]:
    """``["N,K", "table.json", ...]`` -> ``[(N, K), ...]``; a path loads its table."""
    return [(s["n"], s["k"]) for s in shape_entries(items)]


def parse_ms(text: str) -> list[int]:
    """``"1-32"``, ``"1,4,8"`` or ``"1-8,16"`` -> sorted Ms."""
    ms = set()
    for part in text.split(","):
        if "-" in part:
            lo, hi = (int(v) for v in part.split("-"))
            ms.update(range(lo, hi + 1))
        elif part:
            ms.add(int(part))
    return sorted(ms)
