"""The compiled kernel cache of the low-precision optimizer is checked before a library is
mapped: a truncated library, one without the kernel's symbols, or one whose record does not
match is rebuilt with one warning line, never a bus error or a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mct.optim.lowbit import native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: nothing is cached")

LOAD = ("import sys; from pathlib import Path; from mct.optim.lowbit import native; "
        "k = native.load(Path(sys.argv[1])); print('kernels' if k is not None else 'reference')")


def _load_in_a_new_process(cache: Path) -> subprocess.CompletedProcess:
    """A fresh process, as the next run on the machine: a library mapped unchecked would kill
    it (SIGBUS) rather than this test's process."""
    return subprocess.run([sys.executable, "-c", LOAD, str(cache)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def _replace(path: Path, data: bytes) -> None:
    """Swap the file (a new inode: the library this process mapped stays intact)."""
    tmp = path.with_name("swap.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.fixture
def built(tmp_path) -> Path:
    kernels = native.load(tmp_path)
    assert kernels is not None
    record = json.loads((kernels.path.parent / (kernels.path.name + ".json")).read_text())
    assert record["size"] == kernels.path.stat().st_size and len(record["sha256"]) == 64
    assert not list(tmp_path.glob("*.tmp"))  # built under a temporary name, then renamed
    return kernels.path


def test_a_truncated_cached_kernel_is_rebuilt_with_one_warning_line(built):
    good = built.read_bytes()
    _replace(built, good[: len(good) // 2])
    done = _load_in_a_new_process(built.parent)
    assert done.returncode == 0 and done.stdout.strip() == "kernels", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mct: warning: the compiled optimizer kernel"), done.stderr
    assert f"{len(good) // 2} bytes, {len(good)} when it was built; rebuilt it" in lines[0]
    assert native._damage(built) is None and built.stat().st_size == len(good)
    again = _load_in_a_new_process(built.parent)
    assert again.stdout.strip() == "kernels" and again.stderr == ""  # the rebuilt one is trusted


def test_a_library_without_the_kernel_symbol_is_never_loaded(built, tmp_path):
    """A valid shared library with a matching record but not kernel.c's functions: found
    before it is loaded (no AttributeError), rebuilt, one warning line."""
    src = tmp_path / "other.c"
    src.write_text("int other(void) { return 1; }\n")
    other = tmp_path / "other.so"
    subprocess.run([native.compiler(), "-shared", "-fPIC", "-o", str(other), str(src)], check=True, timeout=300)
    data = other.read_bytes()
    _replace(built, data)
    _replace(built.with_name(built.name + ".json"), json.dumps(native._digest(data)).encode())
    assert native._damage(built) == "it has no symbol adamw_int8"
    done = _load_in_a_new_process(built.parent)
    assert done.returncode == 0 and done.stdout.strip() == "kernels", done
    assert done.stderr.count("\n") == 1 and "it has no symbol adamw_int8; rebuilt it" in done.stderr


@pytest.mark.parametrize("damage", ["record", "bytes"])
def test_a_cached_kernel_that_does_not_match_its_record_is_rebuilt(built, damage, capfd):
    if damage == "record":
        built.with_name(built.name + ".json").write_text("{not json")
    else:
        data = bytearray(built.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, another sha256
        _replace(built, bytes(data))
    kernels = native.load(built.parent)
    assert kernels is not None and native._damage(built) is None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.endswith("rebuilt it\n"), err
    assert ("record" in err) if damage == "record" else ("sha256" in err)


def test_a_damaged_cache_and_a_failing_compiler_fall_back_to_the_reference(built, monkeypatch, capfd):
    _replace(built, b"")
    monkeypatch.setattr(native, "_build", lambda cc, flags, out: False)
    assert native.load(built.parent) is None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "could not be rebuilt, so the optimizer runs its torch reference" in err
