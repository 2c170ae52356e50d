"""Durable small-file writes and checked reads (no collectives, no torch).

A file is written to a temporary name in its directory, flushed and fsynced, renamed
over the final name, and the directory is fsynced: after a crash at any point the
final name holds either the old content or the new, never a torn mix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mct.errors import user_error
from mct.outputs import fsync_dir  # noqa: F401 (one implementation, also imported from here)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` durably (temp file, fsync, rename, directory fsync).
    On failure (OSError, e.g. a full disk) the temporary is removed and ``path`` is as
    it was; the OSError propagates."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_failure(path: str | os.PathLike, nbytes: int, e: OSError) -> ValueError:
    """The one-line error for a write of about ``nbytes`` to ``path`` that failed with ``e``."""
    why = e.strerror or str(e)
    hint = ("free space there or choose another place" if e.errno in (errno.ENOSPC, errno.EDQUOT)
            else "choose a place you can write to")
    return ValueError(f"cannot write {path} ({nbytes:,} bytes needed): {why}; {hint}")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented JSON, written with ``write_atomic``."""
    write_atomic(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    """Parsed JSON of ``path``. Raises ValueError naming the file for a missing,
    unreadable or malformed file (never a raw OSError or JSONDecodeError)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise user_error(e, path) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deeply to read)") from None


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def check_digest(path: Path, want: dict[str, Any]) -> None:
    """Raise ValueError naming ``path`` if it is missing, of another size, or hashes
    to something else than ``want`` (a ``file_digest`` record)."""
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    size = path.stat().st_size
    if size != want.get("bytes"):
        raise ValueError(f"{path}: {size} bytes, the manifest says {want.get('bytes')} (truncated or replaced)")
    if file_digest(path)["sha256"] != want.get("sha256"):
        raise ValueError(f"{path}: content does not match the manifest's sha256 (corrupted or from another save)")
