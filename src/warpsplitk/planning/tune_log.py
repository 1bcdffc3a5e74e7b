"""The tuning log: one JSON record a line for every measurement the tuner made.

A record is ``{"key", "n", "k", "m", "tactic", "ok", "us", "spread", ...,
"rev"}``, keyed by ``log_key`` (a confirmation's key has a ``confirm:``
prefix, ``confirm_key``); a timing of an FP8 (e4m3) weight has ``"fp8"``,
its scales' kind, and a key of its own (one log holds both dtypes); a
provenance line is ``{"meta": {...}}``. The
tuner resumes from the log (the last record of a key wins) and plans are
made from it without a GPU (``selection.plan_from_log``).

Each record is appended in one write under the log's lock and synced before
the next measurement (``append_record``), so a crash or a full disk costs at
most the record being written: a last line left unfinished is ignored by the
readers (``read_log_records``) and cut off before the next append.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings

from .. import jsonfile
from ..contract import FP8_SCALE_KINDS, MAX_M
from ..tactics import WarpSplitKTactic
from .decode_plan import CUBLAS, is_time


def log_key(n, k, m, tactic, fp8_scales=None):
    """A measurement's log key; ``tactic`` may be ``CUBLAS`` (torch.matmul).
    ``fp8_scales``: the timing of an e4m3 weight with scales of that kind
    (``fp8:<kind>:`` before the BF16 key of the same cell and tactic)."""
    key = f"{n},{k},{m},{tactic if tactic == CUBLAS else tactic.short()}"
    return key if fp8_scales is None else f"fp8:{fp8_scales}:{key}"


#: Log key prefix of a confirmation measurement (a second, later timing of
#: one of a cell's fastest candidates, in a freshly captured graph).
CONFIRM_PREFIX = "confirm:"


def confirm_key(n, k, m, tactic, round_=1, fp8_scales=None):
    """Log key of a candidate's ``round_``-th confirmation (1: ``confirm:``;
    later ones ``confirm2:``, ...)."""
    prefix = CONFIRM_PREFIX if round_ == 1 else f"confirm{round_}:"
    return prefix + log_key(n, k, m, tactic, fp8_scales)


#: Kernel revisions. A log record carries the revision its kernel had
#: (``rev``; none: 1). Each change below made the timings of some tactics
#: stale: the tuner measures them again on resume, and plans leave them out
#: unless asked (``stale=True``), or made at an earlier ``revision``.
#: 2: the cross-proxy fence before each stage release of an async
#: activation ring (TMA boxes or bulk copies), up to ~10% slower.
ASYNC_RING_REVISION = 2
#: 3: a K split's partial sums handed over by st.async into an mbarrier of
#: the first CTA instead of a cluster barrier every CTA waits on; faster.
SPLIT_MBARRIER_REVISION = 3
#: 4: an e4m3 weight's 128 x 128 block scales folded into its conversion
#: instead of rescaling each tile's partial sums; faster at M > 8.
FOLDED_BLOCK_REVISION = 4
#: 5: an uneven K split of an e4m3 weight (row copies of x, no L2 prefetch)
#: runs one K loop of the longest share instead of one per rank
#: (``layout.one_loop_split``); 1.09-1.71x faster.
ONE_LOOP_REVISION = 5
KERNEL_REVISION = ONE_LOOP_REVISION


def is_stale(rec, revision=KERNEL_REVISION) -> bool:
    """Whether a log record times a kernel that changed between its
    revision and ``revision`` (never a cuBLAS timing)."""
    if rec["tactic"] == CUBLAS:
        return False
    tactic = WarpSplitKTactic.parse(rec["tactic"])
    rev = rec.get("rev", 1)
    return ((tactic.async_activation_ring and rev < ASYNC_RING_REVISION <= revision)
            or (tactic.k_split > 1 and rev < SPLIT_MBARRIER_REVISION <= revision)
            or (rec.get("fp8") == "block128" and rev < FOLDED_BLOCK_REVISION <= revision)
            or (rec.get("fp8") is not None and tactic.k_split > 1
                and rev < ONE_LOOP_REVISION <= revision
                and tactic.one_loop_split(rec["k"], fp8=True)))


def new_record(**fields):
    """A new log record, stamped with the revision its kernel has."""
    return {**fields, "rev": KERNEL_REVISION}


def _current(rec) -> bool:
    """Whether a log record times a kernel this version builds: not one of
    a retired experimental build (``variant``) nor a tactic this version no
    longer parses (a retired field)."""
    if rec.get("variant"):
        return False
    if rec.get("tactic") == CUBLAS:
        return True
    try:
        WarpSplitKTactic.parse(rec["tactic"])
    except ValueError:
        return False
    return True


def check_log_record(rec, where="tuning log record"):
    """``ValueError`` naming ``where`` unless ``rec`` (a log line's object)
    is a provenance line (``{"meta": ...}``) or a measurement plans can use:
    a ``key`` and a ``tactic`` string, ``n`` and ``k`` positive integers,
    ``m`` in 1..32, ``rev`` (if any) a positive integer, ``fp8`` (if any)
    a scale kind, and, when ``ok``, ``us`` a positive finite number of
    microseconds."""
    if not isinstance(rec, dict) or ("key" not in rec and "meta" not in rec):
        raise ValueError(f"{where}: not a tuning record (a JSON object with a 'key')")
    if "key" not in rec:
        if not isinstance(rec["meta"], dict):
            raise ValueError(f"{where}: a provenance line's 'meta' must be an object, got "
                             f"{rec['meta']!r}")
        return
    for name in ("key", "tactic"):
        if not isinstance(rec.get(name), str):
            raise ValueError(f"{where}: {name!r} must be a string, got {rec.get(name)!r}")
    for name in ("n", "k", "m") + (("rev",) if "rev" in rec else ()):
        value = rec.get(name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{where}: {name!r} must be a positive integer, got {value!r}")
    if rec["m"] > MAX_M:
        raise ValueError(f"{where}: 'm' must be in 1..{MAX_M}, got {rec['m']}")
    if "fp8" in rec and rec["fp8"] not in FP8_SCALE_KINDS:
        raise ValueError(f"{where}: 'fp8' must be one of {FP8_SCALE_KINDS}, got {rec['fp8']!r}")
    us = rec.get("us")
    if rec.get("ok") and not is_time(us):
        raise ValueError(f"{where}: 'us' must be a positive number of microseconds, got {us!r}")


# ------------------------------------------------------------ reading

#: A log line ends with a newline (this writer's) or a carriage return (a
#: file edited elsewhere: the readers split lines as text mode does).
_LINE_ENDS = (b"\n", b"\r")


def _unfinished(raw: bytes, where: str) -> bool:
    """Whether ``raw``, a log's last line, is a write cut short (a full disk,
    a process killed mid-record): no line end, and not JSON. One without a
    line end that parses is a whole record."""
    if raw.endswith(_LINE_ENDS):
        return False
    try:
        jsonfile.loads(raw.decode("utf-8"), where)
    except ValueError:  # UnicodeDecodeError too: a character cut in two
        return True
    return False


def _log_lines(path, records=None, warn=True) -> list[tuple[int, bytes]]:
    """``[(line number, line)]`` of the log (its first ``records`` lines
    only, when given), less an unfinished last line (``_unfinished``), with a
    warning: the records before it stand, and a resume or ``plan="auto"``
    must not stop at the one record a crash cut short."""
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    if records is not None:
        lines = lines[:records]
    numbered = list(enumerate(lines, 1))
    if numbered and _unfinished(lines[-1], f"{path} line {len(lines)}"):
        numbered.pop()
        if warn:
            warnings.warn(f"{path} line {len(lines)}: ignoring the unfinished last line (no "
                          "newline, not JSON: a write cut short); the next tune appending to "
                          "the log removes it", RuntimeWarning, stacklevel=2)
    return numbered


def count_lines(path):
    """How many lines of the log count (``read_log_records``): an
    unfinished last line does not, and is cut off before the next append."""
    return len(_log_lines(path, warn=False))


def read_log_records(path, records=None) -> list[tuple[int, dict]]:
    """``[(line number, record)]`` of the tuning log ``path`` (its first
    ``records`` lines only, when given): each non-blank line one strict JSON
    object (``jsonfile.loads``: a key named twice is an error) that
    ``check_log_record`` accepts. An unfinished last line is left out with a
    warning (``_log_lines``); any other broken line is a ``ValueError``
    naming the file and the line. Reading the file may raise ``OSError``."""
    found = []
    for number, raw in _log_lines(path, records):
        where = f"{path} line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start}); "
                             "a tuning log holds one JSON record a line") from None
        if not text.strip():
            continue
        try:
            record = jsonfile.loads(text, where)
        except ValueError as error:
            raise ValueError(f"{error}; a tuning log holds one JSON record a line") from None
        check_log_record(record, where)
        found.append((number, record))
    return found


def read_log(path, records=None, stale=False, revision=KERNEL_REVISION):
    """``{key: record}`` of a tuning log (its first ``records`` lines only,
    when given: the log as it stood when a plan was made from it), the last
    record of each key winning; records stale at ``revision`` (``is_stale``)
    are left out unless ``stale``, and so are records of kernels this
    version does not build (``_current``)."""
    done = {}
    if path and os.path.exists(path):
        for _, rec in read_log_records(path, records):
            if "key" not in rec:
                continue  # a provenance line ({"meta": ...})
            if not _current(rec):
                continue
            if stale or not is_stale(rec, revision):
                done[rec["key"]] = rec
    return done


# ------------------------------------------------------------ appending

def _end_at_line(fd: int, path) -> None:
    """Make the log open as ``fd`` (read and append, its lock held) end at a
    line's end: a tail without a newline that parses is a whole record and
    gets its newline; one that does not is a write cut short, and is cut
    off with a warning naming it. A record appended after a half line would
    be glued to it, and the log broken at that line for good."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) in _LINE_ENDS:
        return
    data = os.pread(fd, size, 0)
    cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    number = len(data[:cut].splitlines()) + 1
    tail = data[cut:]
    if not _unfinished(tail, f"{path} line {number}"):
        os.write(fd, b"\n")
        return
    os.ftruncate(fd, cut)
    warnings.warn(f"{path} line {number}: removed the unfinished last line before appending "
                  f"({len(tail)} bytes, no newline, not JSON: a write cut short): "
                  f"{tail[:80]!r}{'...' if len(tail) > 80 else ''}", RuntimeWarning,
                  stacklevel=3)


def append_record(log, record, path) -> None:
    """Append ``record`` to the log open as ``log`` (``open(path, "ab+")``):
    under the log's lock (tunes in several processes share a GPU's log),
    after ``_end_at_line``, in one write, then synced: a crash or power loss
    keeps every record measured before it (each cost a compile and a
    timing), and can leave at most this one unfinished."""
    fd = log.fileno()
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        _end_at_line(fd, path)
        log.write((json.dumps(record) + "\n").encode())
        log.flush()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.fsync(fd)


# ------------------------------------------------------------ stale timings

def stale_split(path):
    """``(valid, stale)``: the log's ``{key: record}``, split by ``is_stale``
    (a key measured again since holds its newer, valid record)."""
    everything = read_log(path, stale=True)
    valid = {key: rec for key, rec in everything.items() if not is_stale(rec)}
    return valid, {key: rec for key, rec in everything.items() if key not in valid}


def stale_records(path) -> int:
    """How many keys of the log have only stale timings (to measure again)."""
    return len(stale_split(path)[1])


def _cell(rec) -> tuple:
    """A record's cell: its shape and M, and its weights' dtype (``fp8``)."""
    return rec["n"], rec["k"], rec["m"], rec.get("fp8")


def dominated_keys(valid, stale) -> set:
    """``dominated_stale_keys`` of a log already split (``stale_split``)."""
    best = {}
    for rec in valid.values():
        if rec.get("ok") and not rec.get("confirm"):
            cell = _cell(rec)
            best[cell] = min(best.get(cell, float("inf")), rec["us"])
    # only the release fence is known to slow kernels down: a stale K split
    # (faster since revision 3) is measured again whatever its old time
    return {key for key, rec in stale.items()
            if rec.get("ok") and not rec.get("confirm") and rec["tactic"] != CUBLAS
            and WarpSplitKTactic.parse(rec["tactic"]).k_split == 1
            and rec["us"] >= best.get(_cell(rec), float("inf"))}


def dominated_stale_keys(path) -> set:
    """Keys of stale timings not worth measuring again: the release fence
    only adds work to a kernel, so a timing it made stale that was already
    slower than the best valid one of its cell can only get slower (a K
    split, faster since, is always measured again; confirmations and
    failures are not judged: their cell's candidates decide)."""
    return dominated_keys(*stale_split(path))
