"""Reading and writing files mempath keeps outside the model directory (the disk KV tier, the weights-digest
cache), and JSON that anyone may have written.

Files are opened only if they are regular files of this user that only it can write (``open_regular``), never
waiting on a FIFO nor following a link; they are written whole under a new temporary name and renamed into place
(``write_new_file``), so nothing is written through a link planted under either name. ``loads_json`` turns
nesting deeper than Python's parser recurses, a RecursionError no caller expects, into the ValueError that other
bad JSON gives.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class NotOurFile(OSError):
    """Where mempath's file should be is something it never writes (a FIFO, a directory, a link, a file of
    another user, or one others can write): it is neither read nor deleted."""


def open_regular(path: str):
    """(file, stat) of a regular file of this user that only it can write, opened for reading.

    O_NONBLOCK: opening a FIFO returns at once (then refused) instead of waiting for a
    writer forever; O_NOFOLLOW: a link is refused, not followed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & OTHERS_WRITE:
            raise NotOurFile(errno.EPERM, "not a regular file that only this user can write", path)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def write_new_file(final: str, chunks) -> None:
    """Write chunks to a new temporary beside ``final`` (mode 0o600), then rename it over ``final``.

    A crash leaves the old file or the new one, never half of one; at worst a temporary
    (``final``.<8 hex>.tmp). Raises OSError, NotOurFile when something that is not a regular
    file is where ``final`` goes.
    """
    tmp = f"{final}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        if os.path.lexists(final) and not stat.S_ISREG(os.lstat(final).st_mode):
            raise NotOurFile(errno.EEXIST, "something mempath does not write is in the way", final)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def loads_json(text: str | bytes | bytearray):
    """json.loads, with nesting too deep to parse raised as a JSONDecodeError (a ValueError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to parse", "", 0) from None
