"""Folders and files only this user can have written: the caches' trust rules.

The disk cache hands stored objects to the CuTe DSL's loader, which links
their host code into the process; the plan cache decides which kernels run.
A file another local user could have written is therefore never used. The
rules, one place for both caches:

* folders are created ``0700`` (whatever the umask);
* a folder or file is used only if it is owned by this process's user and
  not writable by group or others (POSIX; elsewhere no such check exists);
* files are opened with ``O_NOFOLLOW``: a symbolic link planted where a
  cache file belongs is refused, never followed (a lock file included);
* files are written under a fresh ``0600`` temporary name and renamed into
  place, so readers see a whole file or none.

A folder or file that breaks a rule raises :class:`UntrustedPath`; the
caches catch it, warn once naming the path and the reason, and keep what
they would have stored in the process only.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

#: ``O_NOFOLLOW`` and ``O_CLOEXEC`` where the platform has them.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_POSIX = hasattr(os, "geteuid")


class UntrustedPath(OSError):
    """A cache folder or file this process must not use (``reason`` says why)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def trust_problem(st: os.stat_result) -> str | None:
    """Why a folder or file with status ``st`` cannot be trusted, or None:
    it must belong to this process's user and be writable by no one else."""
    if not _POSIX:
        return None
    user = os.geteuid()
    if st.st_uid != user:
        return f"owned by uid {st.st_uid}, not by this user (uid {user})"
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
               if st.st_mode & bit]
    if writers:
        return (f"writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o}; "
                "the caches need this user's alone, e.g. 0700)")
    return None


def check_dir(path) -> Path:
    """``path`` if it is a folder this process may trust, else :class:`UntrustedPath`
    (a missing folder is ``FileNotFoundError``)."""
    path = Path(path)
    st = os.stat(path)  # a folder reached through a link is judged by the folder itself
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(path, "not a folder")
    problem = trust_problem(st)
    if problem:
        raise UntrustedPath(path, problem)
    return path


def private_dir(path) -> Path:
    """``path``, created ``0700`` with any missing parents (whatever the
    umask) and checked by :func:`check_dir`."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # another process made it first: judged below
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
    return check_dir(path)


def open_file(path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file ``path``, opened without following a
    link, after checking that this user owns it alone; else
    :class:`UntrustedPath` (``FileNotFoundError`` when it is absent and
    ``flags`` do not create it)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as error:
        if os.path.islink(path):  # ELOOP (Linux) or EMLINK (BSD): a planted link
            raise UntrustedPath(path, "a symbolic link (cache files are never followed "
                                      "through links)") from None
        raise error
    try:
        st = os.fstat(fd)
        problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else trust_problem(st)
        if problem:
            raise UntrustedPath(path, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path) -> bytes:
    """The bytes of ``path``, read through :func:`open_file`."""
    with os.fdopen(open_file(path), "rb") as f:
        return f.read()


def write_atomic(path, data: bytes, prefix: str = ".tmp-") -> Path:
    """Write ``data`` to ``path`` in a trusted folder: a new ``0600`` file
    under a temporary name in the same folder, synced, then renamed over
    ``path`` (readers see the old file or the new one, never a part)."""
    path = Path(path)
    fd, scratch = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        try:
            os.unlink(scratch)
        except OSError:
            pass
        raise
    return path


#: Temporary files and folders older than this are left over from a killed
#: process (a write takes milliseconds, an export seconds) and are removed.
STALE_SCRATCH_S = 3600.0


def remove_stale_scratch(folder, patterns, older_than_s: float = STALE_SCRATCH_S) -> int:
    """Remove what matches ``patterns`` (globs) in ``folder`` and was last
    modified more than ``older_than_s`` ago; returns how many went."""
    import shutil
    removed = 0
    cutoff = time.time() - older_than_s
    for pattern in patterns:
        for path in Path(folder).glob(pattern):
            try:
                st = os.lstat(path)
                if st.st_mtime > cutoff:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed += 1
            except OSError:  # gone already, or not ours to remove
                continue
    return removed


__all__ = ["UntrustedPath", "trust_problem", "check_dir", "private_dir", "open_file",
           "read_bytes", "write_atomic", "remove_stale_scratch", "STALE_SCRATCH_S"]
