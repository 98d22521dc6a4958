"""Files in a directory every user shares (/dev/shm) that only this user can create,
replace or have us read.

/dev/shm is world-writable: anyone can create a file under a name we will open, or a
symlink there pointing elsewhere. So files are created with O_EXCL | O_NOFOLLOW and mode
0600 under a fresh temporary name and renamed into place (atomic; the sticky bit stops
another user from replacing ours), and an existing file is used only when it is a regular
file owned by us that nobody else can read or write (`open_private`). Content is checked
separately by its callers (a size and hash recorded when the file was written).
"""
from __future__ import annotations

import hashlib
import os
import stat
import uuid
from pathlib import Path


class UntrustedFile(ValueError):
    """A file under a name we use that is not ours, not private, or not a regular file."""


def create_private(final: Path) -> tuple[int, Path]:
    """A new, empty 0600 file beside `final` (not yet at its name): (read-write fd, its path)."""
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return fd, tmp


def open_private(path: Path, flags: int = os.O_RDONLY, create: bool = False) -> int:
    """An fd of `path` if it is a regular file of ours, private to us; UntrustedFile if not,
    FileNotFoundError if it does not exist (and not `create`)."""
    if create:
        flags |= os.O_CREAT
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)   # a symlink raises OSError (ELOOP)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if problem is not None:
        os.close(fd)
        raise UntrustedFile(f"refusing to use {path}: it {problem}")
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: a private temporary file renamed into place."""
    fd, tmp = create_private(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_private(path: Path) -> bytes | None:
    """The bytes of `path` if it exists (None if not); UntrustedFile if it is not ours."""
    try:
        fd = open_private(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def sha256_hex(buffer) -> str:
    return hashlib.sha256(memoryview(buffer)).hexdigest()
