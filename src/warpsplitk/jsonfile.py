"""Reading JSON: the files a user names (plans, shape tables, model configs)
and the records the library keeps (tuning logs, cache records).

Every reader goes through :func:`loads`, which is stricter than ``json``:
an object that names a key twice is an error naming the key (``json``
silently keeps the last, so a plan with two entries for one M would run
whichever came second), and text nested too deeply for the parser is a
``ValueError`` instead of a ``RecursionError`` traceback.
"""

from __future__ import annotations

import json
import os


def _unique_keys(pairs):
    found = {}
    for name, value in pairs:
        if name in found:
            raise ValueError(f"duplicate key {name!r}")
        found[name] = value
    return found


def loads(text: str, where: str):
    """The parsed JSON ``text``; not JSON, a duplicate key in an object or
    nesting too deep is a ``ValueError`` that starts with ``where``."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as error:  # _unique_keys
        raise ValueError(f"{where}: not valid JSON ({error})") from None


def read_json(path, what: str):
    """The parsed contents of ``path``; every problem (no such file, not
    readable, not JSON, a duplicate key) is a ``ValueError`` naming the file
    and ``what`` it should have been."""
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
    return loads(text, str(path))
