"""Reading the JSON files a user names (plans, shape tables, logs' neighbours)."""

from __future__ import annotations

import json
import os


def read_json(path, what: str):
    """The parsed contents of ``path``; every problem (no such file, not
    readable, not JSON) is a ``ValueError`` naming the file and ``what`` it
    should have been."""
    # open() also takes a file descriptor (True is 1: stdout), never meant here
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"the {what} must be a path, got {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what}") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read the {what} ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a {what}: not UTF-8 text ({error.reason} at byte "
                         f"{error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
