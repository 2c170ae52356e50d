"""mct.errors: an OSError becomes one line that names the path, the direction and the fix."""

from __future__ import annotations

import errno
import os

from mct.errors import READ, WRITE, describe, user_error


def _catch(fn, *a):
    try:
        fn(*a)
    except OSError as e:
        return e
    raise AssertionError("no OSError")


def test_a_missing_file_is_named_with_the_direction(tmp_path):
    e = _catch(open, tmp_path / "nope.txt")
    assert describe(e, action=READ) == f"cannot read {str(tmp_path / 'nope.txt')!r}: no such file or directory"


def test_a_dangling_link_is_told_apart_from_a_missing_file(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    msg = describe(_catch(open, link), link)
    assert "dangling symbolic link" in msg and "gone" in msg


def test_a_missing_parent_is_named_when_writing(tmp_path):
    target = tmp_path / "no" / "such" / "out.bin"
    msg = describe(_catch(open, target, "wb"), target, WRITE)
    assert msg.startswith("cannot write") and "parent directory" in msg


def test_a_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    target = tmp_path / "f" / "out.bin"
    msg = describe(_catch(open, target, "wb"), target, WRITE)
    assert "is a file, not a directory" in msg


def test_permission_io_and_space_errors_say_what_to_do(tmp_path):
    for code, words in ((errno.EACCES, "permission denied"), (errno.EIO, "I/O error"),
                        (errno.ENOSPC, "no space left")):
        msg = describe(OSError(code, os.strerror(code), str(tmp_path / "x")), action=WRITE)
        assert words in msg and "cannot write" in msg


def test_user_error_is_a_value_error_with_its_cause(tmp_path):
    e = _catch(open, tmp_path / "nope")
    err = user_error(e)
    assert isinstance(err, ValueError) and err.__cause__ is e
