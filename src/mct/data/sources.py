"""Inputs of ``mct prepare``, read as a stream of chunks of raw documents.

An INPUT is a file or a directory. A file named ``*.jsonl`` or ``*.jsonl.gz`` holds one
document per line (a JSON object; its text under ``text_field``; blank lines are
skipped); ``*.parquet`` / ``*.arrow`` (and ``save_to_disk`` directories) one per row
(columnar.py); any other file is UTF-8 text, cut into documents by ``split``
(textstream.py: one per file by default). A directory contributes every
file under it (recursive, sorted by relative path; hidden names and ``__pycache__``
skipped) by the same rule, except that files which are not UTF-8 text are skipped and
counted instead of refused (a directory may hold images beside its text).

Reading streams: a chunk holds about ``chunk_bytes`` of raw records (or one larger
document), so memory is bounded by the chunks in flight, never by the corpus; a text
document larger than a chunk streams in pieces (textstream.py); one JSON line is held
whole. Parsing happens in ``parse_chunk`` (run by the workers), which names
``FILE:LINE`` in every error.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from mct.data.columnar import arrow_dir_files, column_chunks
from mct.data.dataset import is_dataset_dir
from mct.data.textstream import Utf8Reader, pieces
from mct.errors import user_error

CHUNK_BYTES = 1 << 20
"""Raw bytes of records per chunk: the unit of work a worker encodes."""


@dataclass(frozen=True)
class Source:
    """One input file: ``path``, ``name`` (as shown in errors and meta.json), ``kind``
    ("text" | "jsonl" | "jsonl.gz"), ``size`` in bytes, ``strict`` (False inside a
    directory: a non-UTF-8 text file is skipped, not an error)."""

    path: Path
    name: str
    kind: str
    size: int
    strict: bool


@dataclass
class Chunk:
    """Raw documents of one kind. jsonl: ``items`` are lines of ``names[0]`` starting at
    line ``first_line`` (1-based). text: ``items`` are documents or pieces of one
    (textstream.py), ``names`` their files; per item, ``cont``: it continues a document
    begun in an earlier item, ``ends``: its document ends with it."""

    kind: str
    names: list[str]
    items: list[bytes]
    first_line: int = 1
    strict: list[bool] = field(default_factory=list)
    cont: list[bool] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)


def _kind(path: Path) -> str:
    name = path.name.lower()
    for ext in ("jsonl.gz", "jsonl", "parquet", "arrow"):
        if name.endswith("." + ext):
            return ext
    return "text"


def _stat(p: Path, name: str) -> os.stat_result:
    """``p.stat()``; an OSError becomes one line naming ``name`` (missing told apart
    from a dangling link, permission denied and the rest: mct.errors)."""
    try:
        return p.stat()
    except FileNotFoundError:
        if p.is_symlink():
            raise user_error(FileNotFoundError(2, "No such file or directory", str(p)), name) from None
        raise ValueError(f"INPUT {name!r} does not exist; pass .txt, .jsonl, .jsonl.gz or .parquet files or "
                         f"directories of them") from None
    except OSError as e:
        raise user_error(e, name) from None


def _walk(p: Path, raw: str) -> list[Path]:
    """The files of INPUT directory ``p`` (see the module docstring). Raises ValueError
    for a subdirectory that cannot be listed or a dangling symbolic link, never skips them."""
    def fail(e: OSError) -> None:
        raise user_error(e, e.filename) from None
    files = []
    for dirpath, dirnames, filenames in os.walk(p, onerror=fail):
        d = Path(dirpath)
        if d != p and is_dataset_dir(d):
            dirnames[:] = []  # a prepared dataset is an output, not text: mct prepare never reads one
            continue
        dirnames[:] = [x for x in dirnames if not x.startswith(".") and x != "__pycache__"]
        for f in filenames:
            if f.startswith("."):
                continue
            if (d / f).is_symlink() and not (d / f).exists():
                raise ValueError(f"INPUT {raw!r}: {str(d / f)!r} is a dangling symbolic link (it points at "
                                 f"{os.readlink(d / f)!r}); remove the link or fix its target")
            if (d / f).is_file():
                files.append(d / f)
    return files


def expand_inputs(inputs: list[str]) -> list[Source]:
    """INPUT paths -> Sources in the order given (directories expanded in sorted order;
    a ``datasets`` ``save_to_disk`` directory gives its .arrow files in its order).
    Raises ValueError for no inputs, a missing or unreadable path, a path that is neither
    a file nor a directory, a directory without files, a prepared dataset given as an
    INPUT, or one file named twice."""
    if not inputs:
        raise ValueError("mct prepare needs at least one INPUT: .txt/.jsonl/.jsonl.gz/.parquet files or directories")
    out: list[Source] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        st = _stat(p, raw)
        if p.is_dir() and is_dataset_dir(p):
            raise ValueError(f"INPUT {raw!r} is a prepared dataset (tokens.bin, docs.idx), not text; train on it with "
                             f"--set data.path={raw}, or prepare its original inputs")
        if p.is_dir():
            arrow = arrow_dir_files(p)
            files = arrow if arrow is not None else _walk(p, raw)
            if not files:
                raise ValueError(f"INPUT {raw!r} is a directory without files; add text or .jsonl files to it")
            order = files if arrow is not None else sorted(files, key=lambda f: f.relative_to(p).as_posix())
            for f in order:
                out.append(Source(f, f"{raw.rstrip('/')}/{f.relative_to(p).as_posix()}", _kind(f),
                                  _stat(f, str(f)).st_size, False))
        elif p.is_file():
            out.append(Source(p, raw, _kind(p), st.st_size, True))
        else:
            raise ValueError(f"INPUT {raw!r} is not a regular file or directory (a device, FIFO or socket); pass "
                             f".txt, .jsonl, .jsonl.gz or .parquet files or directories of them")
    seen: dict[Path, str] = {}
    for s in out:
        key = s.path.resolve()
        if key in seen:
            raise ValueError(f"INPUT {s.name!r} is the same file as {seen[key]!r}; name each file once")
        seen[key] = s.name
    return out


class _HashingReader(io.RawIOBase):
    """A binary file that hashes (sha256) and counts every byte read through it."""

    def __init__(self, f: io.BufferedReader) -> None:
        self.f, self.sha, self.read_bytes = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[override]
        n = self.f.readinto(buf)
        if n:
            self.sha.update(memoryview(buf)[:n])
            self.read_bytes += n
        return n or 0

    def drain(self) -> None:
        """Hash what the reader above left unread (gzip stops at its trailer)."""
        while chunk := self.f.read(CHUNK_BYTES):
            self.sha.update(chunk)
            self.read_bytes += len(chunk)


def _open(path: Path) -> io.BufferedReader:
    try:
        return open(path, "rb")
    except OSError as e:
        raise user_error(e, path) from None


def never() -> None:
    """The ``may_cut`` that allows every cut."""


def _text_chunks(src: Source, stream: io.BufferedReader, split: str, chunk_bytes: int,
                 may_cut: Callable[[], None]) -> Iterator[Chunk]:
    """A text file streamed as chunks of document pieces (textstream.py). In a
    directory, a file whose first 64 KiB are not UTF-8 or hold a NUL byte is one
    skipped non-text file (a one-item chunk the parser counts)."""
    if not src.strict:
        head = stream.peek(1 << 16)[:1 << 16]
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head)
            binary = b"\x00" in head
        except UnicodeDecodeError:
            binary = True
        if binary:
            yield Chunk("text", [src.name], [b"\xff"], strict=[False], cont=[False], ends=[True])
            return
    chunk = Chunk("text", [], [])
    size = 0
    for piece, cont, end in pieces(Utf8Reader(stream, src.name), split, chunk_bytes, may_cut):
        for lst, v in ((chunk.names, src.name), (chunk.items, piece), (chunk.strict, True), (chunk.cont, cont),
                       (chunk.ends, end)):
            lst.append(v)
        size += len(piece)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = Chunk("text", [], []), 0
    if chunk.items:
        yield chunk


def read_source(src: Source, digest: dict, chunk_bytes: int = CHUNK_BYTES, split: str = "file",
                may_cut: Callable[[], None] = never, text_field: str = "text") -> Iterator[Chunk]:
    """Chunks of ``src``; when the file has been read to its end, ``digest`` gets its
    ``bytes`` and ``sha256`` (of the file as stored, compressed or not). A text file
    is split into documents by ``split`` (textstream.py); ``may_cut`` is called before
    a document is cut into pieces. Raises ValueError (FILE: ...) for an unreadable
    file, a corrupt .gz or (streamed) text that is not UTF-8."""
    with _open(src.path) as raw:
        hashing = _HashingReader(raw)
        if src.kind == "text" and split == "file" and src.size <= chunk_bytes:
            data = hashing.f.read()
            hashing.sha.update(data)
            hashing.read_bytes = len(data)
            yield Chunk("text", [src.name], [data], strict=[src.strict], cont=[False], ends=[True])
        elif src.kind in ("parquet", "arrow"):
            for rows, first in column_chunks(src, text_field, chunk_bytes):
                yield Chunk("rows", [src.name], rows, first)
            hashing.drain()
        elif src.kind == "text":
            buffered = io.BufferedReader(hashing, CHUNK_BYTES)
            yield from _text_chunks(src, buffered, split, chunk_bytes, may_cut)
            buffered.close()
            hashing.drain()
        else:
            buffered = io.BufferedReader(hashing, CHUNK_BYTES)
            stream = gzip.GzipFile(fileobj=buffered, mode="rb") if src.kind == "jsonl.gz" else buffered
            lines: list[bytes] = []
            size, first = 0, 1
            try:
                for no, line in enumerate(stream, 1):
                    lines.append(line)
                    size += len(line)
                    if size >= chunk_bytes:
                        yield Chunk("jsonl", [src.name], lines, first)
                        lines, size, first = [], 0, no + 1
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                raise ValueError(f"{src.name}: cannot read ({e}); re-create or leave out the file") from None
            if lines:
                yield Chunk("jsonl", [src.name], lines, first)
            buffered.close()
            hashing.drain()
    digest.update(bytes=hashing.read_bytes, sha256=hashing.sha.hexdigest())


def group_text(chunks: Iterator[Chunk], chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """Merge consecutive small text chunks (one file each) into chunks of about
    ``chunk_bytes``, so a directory of tiny files does not cost one task per file."""
    pending: Chunk | None = None
    for c in chunks:
        if c.kind == "text" and pending is not None and sum(map(len, pending.items)) < chunk_bytes:
            for k in ("names", "items", "strict", "cont", "ends"):
                getattr(pending, k).extend(getattr(c, k))
            continue
        if pending is not None:
            yield pending
            pending = None
        if c.kind == "text":
            pending = Chunk("text", list(c.names), list(c.items), strict=list(c.strict), cont=list(c.cont),
                            ends=list(c.ends))
        else:
            yield c
    if pending is not None:
        yield pending


@dataclass
class Parsed:
    """Texts of a chunk's non-empty documents; ``empty``: documents skipped as empty;
    ``binary``: files skipped inside directories as not UTF-8 text; ``ends``: per
    text, False for a piece whose document goes on in the next one; ``starts``: per
    text, False for a piece that goes on with a document begun in an earlier one."""

    texts: list[str]
    empty: int = 0
    binary: int = 0
    ends: list[bool] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)


def _json_type(v: object) -> str:
    """JSON's own name of a value's type (``null``, not NoneType)."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _json_text(line: bytes, where: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e}); each line must be one JSON object") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read; flatten the record (one object with a "
                         f"{text_field!r} string)") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {_json_type(record)}, not an object; each line must be one "
                         f"JSON object with a {text_field!r} field")
    if text_field not in record:
        keys = ", ".join(list(record)[:8]) or "none"
        raise ValueError(f"{where}: no {text_field!r} field (fields: {keys}); pass --text-field NAME")
    text = record[text_field]
    if not isinstance(text, str):
        shown = "" if text is None else " " + json.dumps(text)[:40]
        raise ValueError(f"{where}: field {text_field!r} holds {_json_type(text)}{shown}, "
                         f"not a string; fix the record or pass --text-field NAME")
    return _valid(text, where, text_field)


def _valid(text: str, where: str, text_field: str) -> str:
    """``text`` unless it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: field {text_field!r} holds a lone surrogate {text[e.start]!r} at character "
                         f"{e.start} (an escape like \\ud800 that is not valid Unicode); fix the record") from None
    return text


def parse_chunk(chunk: Chunk, text_field: str) -> Parsed:
    """Raw documents -> texts. Raises ValueError ``FILE:LINE: ...`` for a record that is
    not JSON, not an object, or lacks (or has a non-string) ``text_field``, and
    ``FILE: ...`` for a text file given by name that is not UTF-8."""
    out = Parsed([])
    if chunk.kind == "rows":
        for i, text in enumerate(chunk.items):
            if not isinstance(text, str):
                raise ValueError(f"{chunk.names[0]}: row {chunk.first_line + i}: column {text_field!r} is null; "
                                 f"fill or drop the row")
            if text:
                out.texts.append(_valid(text, f"{chunk.names[0]}: row {chunk.first_line + i}", text_field))
                out.ends.append(True)
                out.starts.append(True)
            else:
                out.empty += 1
        return out
    if chunk.kind == "jsonl":
        for i, line in enumerate(chunk.items):
            if not line.strip():
                continue  # blank lines (a trailing newline, a separator) are not records
            text = _json_text(line, f"{chunk.names[0]}:{chunk.first_line + i}", text_field)
            if text:
                out.texts.append(text)
                out.ends.append(True)
                out.starts.append(True)
            else:
                out.empty += 1
        return out
    for name, data, strict, cont, end in zip(chunk.names, chunk.items, chunk.strict, chunk.cont, chunk.ends):
        if cont or not end:  # a piece of a streamed document: checked UTF-8 as it was read
            out.texts.append(data.decode("utf-8"))
            out.ends.append(end)
            out.starts.append(not cont)
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise ValueError(f"{name}: not UTF-8 text (byte {e.start}); convert it, or pass it as "
                                 f".jsonl") from None
            out.binary += 1
            continue
        if "\x00" in text and not strict:
            out.binary += 1
        elif text:
            out.texts.append(text)
            out.ends.append(True)
            out.starts.append(True)
        else:
            out.empty += 1
    return out
