"""Paths a user names for mct to write (``--plot``, ``--out``): one rule for every command.

A **file** output is a new name in an existing directory, or, with ``--force``, an existing
regular file. A **directory** output is a new name, an empty
directory, or, with ``--force``, a directory that holds only what the command itself writes (a
previous output of it: ``--force`` never deletes a user's other files). Never a symbolic link
(dangling or not), FIFO, socket or device, never the other kind (a directory where a file goes,
a file where a directory goes), and never one of a run's own files (the caller's ``owned``
check: ``mct.persistence.run_dir.check_outside_runs``). A refusal is a ValueError, one line
naming the flag, the path, what is there and the fix; it is raised before any work is done.

What is written goes to a temporary in the same directory and is renamed over the name once
complete (``replace_file``, ``install_dir``), so a failure or a kill leaves the old content or
nothing, never half a file. The rename replaces a directory entry, never writes through one: a
link or FIFO that appears between the check and the rename is refused again, not followed.

Imports nothing of mct but ``errors``: every room (data, reporting, persistence) may use it.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Callable, Iterable

Owned = Callable[[Path, str], None]
"""``owned(path, flag)`` raises ValueError (one line, naming ``flag``) when ``path`` is part
of a run's own tree (``mct.persistence.run_dir.check_outside_runs``)."""


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kind(path: str | os.PathLike) -> str | None:
    """What is at ``path`` itself, links not followed: None when nothing is (or a parent is a
    file), else 'a regular file', 'a directory', 'a symbolic link (to ...)' (dangling or not),
    'a FIFO', 'a socket', 'a device' or 'not a regular file'."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a parent may be a file)
        return None
    if stat.S_ISLNK(mode):
        dangling = "" if os.path.exists(path) else ", which does not exist"
        return f"a symbolic link (to {os.readlink(path)!r}{dangling})"
    return ("a regular file" if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _refuse_special(p: Path, flag: str, what: str, new: str) -> None:
    """Raise for a link, FIFO, socket or device at ``p``: --force never replaces one."""
    if what not in ("a regular file", "a directory"):
        raise ValueError(f"{flag} {str(p)!r} is {what}; mct never writes through or over one, not even with "
                         f"--force: pass {new}")


def check_parent(p: Path, flag: str, *, create: bool = False) -> None:
    """Raise ValueError (one line) unless ``p``'s parent is an existing, writable directory
    (``create``: the nearest existing ancestor, whose missing folders will be created)."""
    parent = p.parent if str(p.parent) else Path(".")
    found = next((q for q in [parent, *parent.parents] if os.path.lexists(q)), Path("."))
    if found.is_dir() and (create or found == parent):
        if not os.access(found, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {str(p)!r}: cannot write {str(found)!r} (permission denied); "
                             f"choose another place")
        return
    why = ("is a dangling symbolic link" if found.is_symlink() and not found.exists() else
           "is a file, not a directory" if os.path.lexists(found) and not found.is_dir() else "does not exist")
    shown = parent if why == "does not exist" else found
    raise ValueError(f"{flag} {str(p)!r}: {str(shown)!r} {why}; pass a path in an existing directory")


def check_file_output(path: str | os.PathLike, flag: str, *, force: bool, example: str,
                      owned: Owned | None = None) -> Path:
    """``path`` as a Path if a file may be written there (see the module docstring).
    ``example``: a file name the messages suggest. Raises ValueError (one line) otherwise;
    touches nothing."""
    p = Path(path)
    what = kind(p)
    if what == "a directory":
        raise ValueError(f"{flag} {str(p)!r} is a directory; pass a file name such as {str(p / example)!r}")
    if what is not None:
        _refuse_special(p, flag, what, "a new file name")
    if owned is not None:  # first: "part of a run" tells more than "its folder does not exist"
        owned(p, flag)
    check_parent(p, flag)
    if what is not None and not force:
        raise ValueError(f"{flag} {str(p)!r} already exists; pass --force to replace it, or a new file name")
    if what is not None and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {str(p)!r} cannot be replaced (permission denied); choose another place")
    return p


def check_dir_output(path: str | os.PathLike, flag: str, *, force: bool, writes: Iterable[str],
                     command: str, owned: Owned | None = None, parents: bool = False) -> Path:
    """``path`` as a Path if a directory may be written there (see the module docstring).
    ``writes``: glob patterns of the names the command puts in it (what ``--force`` may
    replace); ``command``: its name for the messages; ``parents``: missing parent folders
    are allowed (the caller creates them). Raises ValueError (one line) otherwise; touches
    nothing."""
    p = Path(path)
    what = kind(p)
    if what == "a regular file":
        raise ValueError(f"{flag} {str(p)!r} already exists and is not an empty directory (it is a regular file); "
                         f"{command} writes a directory: pass a new directory name")
    if what is not None and what != "a directory":
        _refuse_special(p, flag, what, "a new directory name")
    if owned is not None:
        owned(p, flag)
    check_parent(p, flag, create=parents)
    entries = sorted(os.scandir(p), key=lambda e: e.name) if what else []
    if entries and not force:
        raise ValueError(f"{flag} {str(p)!r} already exists and is not an empty directory; pass --force to "
                         f"replace an earlier output of {command}, or a new directory")
    patterns = tuple(writes)
    foreign = next((e for e in entries if not e.is_file(follow_symlinks=False)
                    or not any(fnmatch.fnmatchcase(e.name, pat) for pat in patterns)), None)
    if foreign is not None:
        raise ValueError(f"{flag} {str(p)!r} holds {foreign.name!r} ({kind(foreign.path)}), which {command} does "
                         f"not write; --force replaces only an earlier output of {command}: pass a new directory")
    return p


def temporary(path: Path, tag: str = "tmp") -> Path:
    """A hidden name beside ``path`` for what becomes it (same directory, so the rename is
    atomic; same suffix, for writers that choose the format by it)."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}{path.suffix}")


def replace_file(tmp: Path, path: Path) -> None:
    """Rename the complete file ``tmp`` over ``path`` and fsync the directory. Raises
    ValueError (one line; ``tmp`` removed) when ``path`` became something other than a
    regular file meanwhile; an OSError of the rename propagates (``tmp`` removed)."""
    try:
        what = kind(path)
        if what not in (None, "a regular file"):
            raise ValueError(f"{str(path)!r} became {what} while mct wrote it; nothing was replaced")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent if str(path.parent) else ".")


def write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a temporary beside ``path``, fsync it, ``replace_file`` it over
    ``path``. Returns ``path``. On any failure the temporary is removed, ``path`` is as it
    was, and the error propagates."""
    p = Path(path)
    tmp = temporary(p)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    replace_file(tmp, p)
    return p


def install_dir(tmp: Path, out: Path, *, force: bool = False) -> None:
    """Make the complete directory ``tmp`` (beside ``out``) be ``out``: a plain rename when
    ``out`` is absent or an empty directory, else (``force``: an earlier output
    ``check_dir_output`` allowed to replace) the old one is renamed aside, the new one in, the
    old one removed; if the second rename fails the old one is put back. fsyncs the parent.
    Raises ValueError when ``out`` became a link, file or FIFO meanwhile, or (without
    ``force``) a non-empty directory; an OSError propagates."""
    what = kind(out)
    if what not in (None, "a directory"):
        raise ValueError(f"{str(out)!r} became {what} while mct wrote it; nothing was replaced")
    full = what is not None and any(os.scandir(out))
    if full and not force:
        raise ValueError(f"{str(out)!r} was filled by another process while mct wrote it; nothing was replaced")
    if not full:
        os.replace(tmp, out)  # over an empty directory: atomic on POSIX
    else:
        old = temporary(out, "old")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent if str(out.parent) else ".")
