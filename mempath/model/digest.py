"""What identifies a checkpoint's content, for the disk KV tier's fingerprint (docs/tiers.md): each weights
file's identity at load (cheap: stat and header) and a cached sha256 of its bytes."""
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mempath.model.spec import CheckpointError
from mempath.safe_io import loads_json, open_regular, write_new_file

log = logging.getLogger(__name__)

# safetensors refuses headers above 100 MB; the identity reads no further.
_MAX_HEADER_BYTES = 100_000_000
# The cache of weights files' content digests (docs/tiers.md) and how many it keeps.
WEIGHT_DIGESTS_FILE = "weight-digests.json"
_MAX_CACHED_DIGESTS = 1024


def file_identity(path: str | Path) -> str:
    """What changes whenever a file's bytes may have: device, inode, size, mtime, ctime, header.

    ctime cannot be set from user space and moves on every write, so a copy over the
    file (cp -p included, which restores the mtime) changes the identity; the safetensors
    header hash also catches a re-export restored onto the same inode and times.
    """
    st = os.stat(path)  # follows symlinks: the bytes read are the target's
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(min(int.from_bytes(head, "little"), _MAX_HEADER_BYTES)) if len(head) == 8 else b""
    header_hash = hashlib.blake2b(head + header, digest_size=16).hexdigest()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{header_hash}"


def hash_file(path: str | Path) -> str:
    """sha256 of the file's bytes (OpenSSL's, with the CPU's SHA instructions where it has them)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_digests(cache_file: Path) -> dict[str, str]:
    """identity -> digest, or nothing when the cache is missing or damaged (it is only a cache)."""
    try:
        f, _ = open_regular(str(cache_file))
        with f:
            cached = loads_json(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict):
        return {}
    return {k: v for k, v in cached.items() if isinstance(k, str) and isinstance(v, str)}


def digest_cache_file() -> Path:
    """mempath's own cache, never the model directory: $XDG_CACHE_HOME/mempath (~/.cache/mempath)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mempath" / WEIGHT_DIGESTS_FILE


def _write_digests(cache_file: Path, digests: dict[str, str]) -> None:
    """Replace the cache whole; an engine writing at the same time may lose an entry (hashed again)."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_new_file(str(cache_file), [json.dumps(digests).encode()])
    except OSError as error:
        log.warning("could not cache the weights' digests in %s (%s); they are hashed again at the next "
                    "start-up", cache_file, error)


def weights_digest(identities: dict[str, str], cache_file: Path) -> str:
    """One digest of the weights' content; ``identities`` maps each file to file_identity() at load.

    A file whose identity is in ``cache_file`` is not read again; the others are hashed
    (in parallel, one thread per file) and added to the cache, which keeps the newest
    _MAX_CACHED_DIGESTS. Raises CheckpointError if a file changed after it was loaded.
    """
    cached = _read_digests(cache_file)
    misses = [path for path, identity in identities.items() if identity not in cached]
    if misses:
        log.info("hashing %d weights file(s) for the disk KV tier's fingerprint", len(misses))
        with ThreadPoolExecutor(max_workers=min(len(misses), os.cpu_count() or 1)) as pool:
            for path, digest in zip(misses, pool.map(hash_file, misses)):
                if file_identity(path) != identities[path]:
                    raise CheckpointError(f"{path}: changed on disk after mempath loaded it; restart mempath "
                                          f"once the new checkpoint is complete")
                cached[identities[path]] = digest
        newest = list(cached.items())[-_MAX_CACHED_DIGESTS:]  # JSON objects keep their order
        _write_digests(cache_file, dict(newest))
    return hashlib.blake2b("|".join(cached[identities[p]] for p in sorted(identities)).encode(),
                           digest_size=16).hexdigest()
