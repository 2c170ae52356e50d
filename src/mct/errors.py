"""One place that turns an OSError into a user's one-line error.

Every command meets the file system (configs, corpora, datasets, model directories, run
directories, exports). An `OSError` there is almost never a bug in mct: it is a missing path,
a permission, a full disk or a damaged device. `describe` names the path, says whether mct was
reading or writing it, and says what to do; `user_error` wraps that in the `ValueError` the CLI
prints as `mct: error: ...` (exit 2); `read_text` reads a user's text file through it. Nothing here imports the rest of mct.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

READ, WRITE = "read", "write"

_BY_ERRNO: dict[int, str] = {
    errno.ENOENT: "no such file or directory",
    errno.EACCES: "permission denied (check the path's permissions and owner)",
    errno.EPERM: "operation not permitted (check the path's permissions and owner)",
    errno.EISDIR: "is a directory, not a file",
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.ENOSPC: "no space left on the device (free space or choose another path)",
    errno.EDQUOT: "disk quota exceeded (free space or choose another path)",
    errno.EROFS: "the file system is read-only (choose a writable path)",
    errno.EIO: "I/O error (the device or the file is damaged)",
    errno.ELOOP: "too many levels of symbolic links (a link points at itself)",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.EMFILE: "too many open files (raise `ulimit -n`)",
    errno.ENFILE: "too many open files in the system",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "the directory is not empty",
    errno.EXDEV: "cannot rename across file systems",
}


def describe(e: OSError, path: str | os.PathLike | None = None, action: str = READ) -> str:
    """A one-line description of `e` met while `action` ("read" or "write") `path`.

    The path is `path` when given, else the error's own filename. A dangling symbolic link is
    named as one (the OS only says "no such file"), and a missing parent is told apart from a
    missing file when writing.
    """
    where = Path(path) if path is not None else (Path(e.filename) if e.filename else None)
    what = _BY_ERRNO.get(e.errno or -1, e.strerror or type(e).__name__)
    if where is not None and e.errno in (errno.ENOENT, errno.EEXIST) and _dangling(where):
        what = _dangling(where)
    elif where is not None and e.errno == errno.ENOENT:
        if action == WRITE and not where.parent.exists():
            what = f"its parent directory {str(where.parent)!r} does not exist (create it first)"
    verb = "cannot write" if action == WRITE else "cannot read"
    return f"{verb} {str(where)!r}: {what}" if where is not None else f"{verb}: {what}"


def _dangling(path: Path) -> str:
    """'a dangling symbolic link (...)' when ``path`` is a link to nothing, else ''."""
    if path.is_symlink() and not path.exists():
        return f"a dangling symbolic link (it points at {os.readlink(path)!r}, which does not exist)"
    return ""


def not_a_directory(path: str | os.PathLike) -> str:
    """Why ``path``, which mct would use as a directory (creating it if missing), cannot be
    one: a dangling symbolic link (mkdir would say "already exists"), a file, or a device,
    FIFO or socket; '' when it is a directory or nothing is there."""
    p = Path(path)
    if _dangling(p):
        return _dangling(p)
    if p.exists() and not p.is_dir():
        return "a file, not a directory" if p.is_file() else "not a directory (a device, FIFO or socket)"
    return ""


def user_error(e: OSError, path: str | os.PathLike | None = None, action: str = READ) -> ValueError:
    """`describe(e, path, action)` as the ValueError the CLI prints as one line (exit 2)."""
    err = ValueError(describe(e, path, action))
    err.__cause__ = e
    return err


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``. An OSError becomes ``user_error(e, path)``; a
    UnicodeDecodeError propagates, for the caller to say what the file should hold."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise user_error(e, path) from None
