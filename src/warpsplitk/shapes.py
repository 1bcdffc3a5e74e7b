"""The built-in decode shape table (package data) and shape-list parsing.

Every parser here raises ``ValueError`` with a message naming what it was
given and what it takes (the command line prints it as its one error line).
"""

from __future__ import annotations

from importlib import resources

from .contract import MAX_M
from .jsonfile import loads, read_json

#: The M buckets of a decode plan (the Ms the tuner measures): the default
#: ``--m`` of ``warpsplitk plan``, ``bench`` and ``tune``.
DEFAULT_MS = (1, 4, 8, 16, 24, 32)
M_SYNTAX = "Ms in 1..32 as e.g. 8, 1,4,8, 1-32 or 1-8,16"


def load(path=None) -> dict:
    """The shape table: ``{"shapes": [{"n", "k", "model", "projection"}, ...], "m_values": [...]}``."""
    where = str(path) if path is not None else "built-in shape table"
    if path is None:
        table = loads(resources.files("warpsplitk").joinpath("data/decode-shapes.json")
                      .read_text(encoding="utf-8"), where)
    else:
        table = read_json(path, "shape table")
    if not isinstance(table, dict) or not isinstance(table.get("shapes"), list):
        raise ValueError(f"{where}: a shape table needs a 'shapes' list "
                         '(e.g. {"shapes": [{"n": 4224, "k": 7168}]})')
    for i, shape in enumerate(table["shapes"]):
        if not isinstance(shape, dict):
            raise ValueError(f"{where}: shapes[{i}] must be an object with 'n' and 'k', "
                             f"got {shape!r}")
        for dim in ("n", "k"):
            if dim not in shape:
                raise ValueError(f"{where}: shapes[{i}] has no {dim!r} "
                                 f"(each shape needs integer 'n' and 'k'), got {shape!r}")
            value = shape[dim]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: shapes[{i}] {dim!r} must be a positive integer, "
                                 f"got {value!r}")
    return table


def shape_entries(items) -> list[dict]:
    """``["N,K", "table.json", ...]`` -> the table entries they name
    (``{"n", "k", ...}``; a pair has only those two, a table's keep its
    model and projection names)."""
    entries = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"a shape is an 'N,K' string or a .json table's path, got {item!r}")
        if item.endswith(".json"):
            entries += load(item)["shapes"]
            continue
        try:
            n, k = (int(v) for v in item.split(","))
        except ValueError:
            raise ValueError(f"a shape is 'N,K' or a .json table, got {item!r}") from None
        if n < 1 or k < 1:
            raise ValueError(f"a shape's N and K are positive, got {item!r}")
        entries.append({"n": n, "k": k})
    if not entries:
        raise ValueError("no shape given (N,K pairs or .json tables)")
    return entries


def parse_shapes(items) -> list[tuple[int, int]]:
    """``["N,K", "table.json", ...]`` -> ``[(N, K), ...]``; a path loads its table."""
    return [(s["n"], s["k"]) for s in shape_entries(items)]


def _parse_m(text: str, whole: str) -> int:
    try:
        m = int(text)
    except ValueError:
        raise ValueError(f"{whole!r} is not a list of Ms: give {M_SYNTAX}") from None
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M must be in 1..{MAX_M}, got {m} in {whole!r}")
    return m


def parse_ms(text: str) -> list[int]:
    """``"1-32"``, ``"1,4,8"`` or ``"1-8,16"`` -> sorted Ms, each checked to be
    in 1..32 (the whole text is checked before anything is returned)."""
    if not isinstance(text, str):
        raise ValueError(f"Ms are given as text ({M_SYNTAX}), got {text!r}")
    if not text or not text.strip():
        raise ValueError(f"no M given: give {M_SYNTAX}")
    ms = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in {text!r}: give {M_SYNTAX}")
        if "-" in part[1:]:
            lo_text, _, hi_text = part.partition("-")
            lo, hi = _parse_m(lo_text, text), _parse_m(hi_text, text)
            if lo > hi:
                raise ValueError(f"range {part!r} is empty (its low end is above its high end); "
                                 f"give {M_SYNTAX}")
            ms.update(range(lo, hi + 1))
        else:
            ms.add(_parse_m(part, text))
    return sorted(ms)
