"""Reading the JSON files a user names (plans, shape tables, logs' neighbours)."""

from __future__ import annotations

import json


def read_json(path, what: str):
    """The parsed contents of ``path``; every problem (no such file, not
    readable, not JSON) is a ``ValueError`` naming the file and ``what`` it
    should have been."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what}") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read the {what} ({error.strerror or error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
