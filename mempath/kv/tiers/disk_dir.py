"""What the disk KV tier owns on the filesystem, and how it opens files there.

``--disk-kv-path`` is the tier's *root*: ``mempath-kv.json`` (format, version, the
layouts present) and one *namespace* directory per layout, named by a digest of the
layout string (``layout_namespace``), holding shard directories of block files
(``DiskBlockStore``) and the lock file ``LOCK_NAME``. A non-empty directory without the manifest was not made by
mempath and is refused; so is one another user owns or can write, because whoever
can write the tier can change the engine's answers (the checksum only catches
accidents). Directories are created with mode 0o700 and files with 0o600.

Files are opened only if they are regular files of this user (``open_regular``),
never waiting on a FIFO nor following a link; files are written whole under a
temporary name and renamed into place (``write_new_file``).

One engine per namespace (``lock_namespace``): each engine deletes, at start-up and when it
evicts, the files of its namespace it does not index, so a second engine of the same layout
on the same directory would delete the first one's blocks and half-written temporaries.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat

from mempath.safe_io import OTHERS_WRITE, NotOurFile, loads_json, open_regular, write_new_file

MANIFEST_NAME = "mempath-kv.json"
_MANIFEST_FORMAT, _MANIFEST_VERSION = "mempath-kv", 1
# The only names the tier writes: a namespace holds shard directories of two hex digits,
# each holding block files named by their hash and their temporaries. Nothing else is touched.
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
BLOCK_NAME = re.compile(r"(?:[0-9a-f]{2})+\.kv")
TMP_NAME = re.compile(r"(?:[0-9a-f]{2})+\.kv\.[0-9a-f]{8}\.tmp")
# In each namespace: flock-ed by the engine using it, holding its pid (never deleted: a lock file
# unlinked while another engine opens it would let two engines hold "the" lock).
LOCK_NAME = "mempath-kv.lock"
_LOCK_PREFIX = b"mempath disk KV tier in use by "
_MANIFEST_TMP_NAME = re.compile(re.escape(MANIFEST_NAME) + r"\.[0-9a-f]{8}\.tmp")
# stats()["tiers"]["disk_failures"] keys: every kind, zero until it happens.
FAILURE_KINDS = ("write_no_space", "write_permission", "write_error", "read_corrupt", "read_foreign_file",
                 "read_permission", "read_error", "read_timeout", "cleanup_error")


class DiskTierPathError(ValueError):
    """``--disk-kv-path`` cannot hold the disk tier; the message says why and what to do."""



def _path_error(root: str, problem: str, fix: str) -> DiskTierPathError:
    return DiskTierPathError(f"--disk-kv-path {root} {problem}; {fix}")


def layout_namespace(layout: str) -> str:
    """The subdirectory of ``--disk-kv-path`` that holds the blocks of one layout."""
    return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


def check_disk_kv_path(path) -> str:
    """Refuse a ``--disk-kv-path`` that cannot be this engine's disk tier, changing nothing; return it absolute.

    Called when the config is validated (before the weights load) and again when the tier opens.
    """
    root = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if "\0" in root:
        raise _path_error(repr(root), "contains a NUL byte, which no file name can", "name the directory again")
    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(root):
            raise _path_error(root, f"is a link to {os.readlink(root)}, which does not exist",
                              "create the directory it points to, or point --disk-kv-path at a directory") from None
        _check_creatable(root)
        return root
    except OSError as error:
        raise _path_error(root, f"cannot be examined ({error.strerror})", "point it at a directory of your own") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _path_error(root, "is not a directory", "point it at an empty or new directory")
    _check_private(root, st)
    if os.path.lexists(os.path.join(root, MANIFEST_NAME)):
        _read_manifest(root)
    elif any(not _MANIFEST_TMP_NAME.fullmatch(name) for name in os.listdir(root)):
        raise _path_error(root, f"is not empty and holds no {MANIFEST_NAME}, so mempath did not create it (the disk "
                          "tier deletes and overwrites only files it wrote)", "point it at an empty or new directory")
    return root


def check_disk_room(path, nbytes: int, flag_gb: float) -> None:
    """Refuse a tier larger than its disk can hold: the space free on the file system of ``path`` (its nearest
    existing ancestor when it is still to be made) plus what the files already under it take: the tier's own,
    which it may keep or evict, and other layouts' (so a folder several layouts share can pass with less room
    than asked; the check catches sizes no disk there could hold). A full disk would only fail writes (blocks
    stay off disk); the size asked for is refused here instead, in one line, before the weights load."""
    root = os.path.abspath(os.path.expanduser(os.fspath(path)))
    existing = root
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # the path's own checks name what is wrong with it
    if nbytes <= free:
        return
    held = _bytes_under(root) if os.path.isdir(root) else 0
    if nbytes > free + held:
        gib = 1 << 30
        raise _path_error(root, f"is on a disk with {free / gib:.3g} GiB free ({held / gib:.3g} GiB more in the "
                          f"files there now), less than --disk-kv-gb {flag_gb:g}",
                          "lower --disk-kv-gb, or point --disk-kv-path at a larger disk")


def _bytes_under(root: str) -> int:
    total = 0
    for directory, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def open_disk_root(path, layout: str | None = None) -> str:
    """Make ``path`` a disk tier directory and return it absolute; raise DiskTierPathError if it cannot be one.

    Creates it (mode 0o700) when missing and writes its manifest when new; with a
    ``layout``, records it in the manifest and creates its namespace (0o700).
    """
    root = check_disk_kv_path(path)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise _path_error(root, f"cannot be created ({error.strerror})", "point it at a directory you can write") from None
    try:
        # Engines starting together on one directory update the manifest in turn.
        fcntl.flock(root_fd, fcntl.LOCK_EX)
        check_disk_kv_path(root)  # again, now that it exists and under the lock
        _record_layout(root, layout)
        if layout is not None:
            make_private_dir(os.path.join(root, layout_namespace(layout)))
    except OSError as error:
        raise _path_error(root, f"cannot hold the disk tier ({error.strerror}: {error.filename})",
                          "point it at an empty or new directory") from None
    finally:
        os.close(root_fd)  # and the lock with it
    return root


def lock_namespace(root: str, namespace_path: str) -> int | None:
    """Take the namespace's lock (exclusive, not waiting) and return its file descriptor, held
    until ``unlock_namespace``; raise DiskTierPathError naming the holder if another engine has it.

    None on a read-only filesystem without a lock file: there no engine can delete anything.
    """
    lock_path = os.path.join(namespace_path, LOCK_NAME)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    writable = True
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | flags, 0o600)
    except OSError as error:
        if error.errno != errno.EROFS:
            raise _path_error(root, f"cannot hold the lock file {lock_path} ({error.strerror})",
                              "point it at an empty or new directory") from None
        writable = False
        try:
            fd = os.open(lock_path, os.O_RDONLY | flags)  # flock needs no write access
        except FileNotFoundError:
            return None
    try:
        st = os.fstat(fd)
        content = os.pread(fd, 4096, 0) if stat.S_ISREG(st.st_mode) else b""
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & OTHERS_WRITE
                or (content and not content.startswith(_LOCK_PREFIX))):
            raise _path_error(root, f"holds a {lock_path} mempath did not write",
                              "point it at an empty or new directory")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = content[len(_LOCK_PREFIX):].decode(errors="replace").strip()
            holder = f" ({holder})" if holder else ""
            raise _path_error(root, f"is in use by another engine{holder} with this model and KV layout, and two "
                              "engines on one directory delete each other's blocks",
                              "give each engine its own --disk-kv-path") from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _LOCK_PREFIX + f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def unlock_namespace(fd: int | None) -> None:
    """Release ``lock_namespace``'s lock; explicitly, as a forked child may still hold the descriptor."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _record_layout(root: str, layout: str | None) -> None:
    """Write the manifest if there is none, and add ``layout`` to it if it is not listed."""
    manifest_path = os.path.join(root, MANIFEST_NAME)
    exists = os.path.lexists(manifest_path)
    manifest = _read_manifest(root) if exists else {
        "format": _MANIFEST_FORMAT, "version": _MANIFEST_VERSION, "created_by": "mempath", "layouts": {}}
    new_layout = layout is not None and manifest["layouts"].get(layout_namespace(layout)) != layout
    if new_layout:
        manifest["layouts"][layout_namespace(layout)] = layout
    if new_layout or not exists:
        write_new_file(manifest_path, [json.dumps(manifest, indent=1, sort_keys=True).encode()])


def _check_creatable(root: str) -> None:
    parent = os.path.dirname(root)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _path_error(root, f"cannot be created: {parent} is not a directory", "point it at an empty or new directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _path_error(root, f"cannot be created: {parent} is not writable by this user",
                          "point it at a directory you can write")


def _check_private(root: str, st: os.stat_result) -> None:
    """As ssh treats its keys: whoever can write the tier can change the engine's answers."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise _path_error(root, f"is owned by uid {st.st_uid}, not by this user (uid {uid}), and whoever can write "
                          "the disk tier can change the engine's answers", "point it at a directory of your own")
    if st.st_mode & OTHERS_WRITE:
        raise _path_error(root, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), and whoever can "
                          "write the disk tier can change the engine's answers", f"chmod 700 {root}")
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            raise _path_error(root, "is on a read-only file system",
                              "point --disk-kv-path at a directory on a writable one")
        raise _path_error(root, "is not readable and writable by this user", f"chmod 700 {root}")


def _read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST_NAME)
    fix = "point --disk-kv-path at an empty or new directory"
    try:
        f, _ = open_regular(path)
        with f:
            manifest = loads_json(f.read())
    except (OSError, ValueError) as error:
        raise _path_error(root, f"holds a {MANIFEST_NAME} mempath cannot use ({error})", fix) from None
    if not (isinstance(manifest, dict) and manifest.get("format") == _MANIFEST_FORMAT
            and isinstance(manifest.get("layouts"), dict)):
        raise _path_error(root, f"holds a {MANIFEST_NAME} that is not a mempath disk KV manifest", fix)
    if manifest.get("version") != _MANIFEST_VERSION:
        raise _path_error(root, f"holds a disk tier of format version {manifest.get('version')!r}; this mempath "
                          f"reads version {_MANIFEST_VERSION}", fix)
    return manifest


def make_private_dir(path: str) -> None:
    """A directory of this tier (mode 0o700); something else of that name is an error, not followed."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & OTHERS_WRITE:
        raise NotOurFile(errno.ENOTDIR, "not a directory that only this user can write", path)


def read_failure_kind(error: OSError) -> str:
    if isinstance(error, NotOurFile) or error.errno == errno.ELOOP:
        return "read_foreign_file"
    return "read_permission" if isinstance(error, PermissionError) else "read_error"


def write_failure_kind(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "write_no_space"
    return "write_permission" if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "write_error"
