"""Plain text files read as a stream of document pieces, in bounded memory.

``--split file`` (the default) makes a whole file one document, ``line`` each non-empty
line (its ``\\n`` / ``\\r\\n`` dropped), ``paragraph`` each run of lines between blank
lines (lines holding only spaces, tabs or ``\\r``; the paragraph's last line ending
dropped). A document larger than a chunk is handed on in pieces of about ``chunk_bytes``,
cut where a pre-tokenizer cuts anyway (``safe_cut``), so the tokens are those of the
whole document and memory never holds more than two chunks of it:

1. after a ``\\n`` that sits between two non-space characters (``"a\\n" | "b"``);
2. else before a space between two non-space characters (``"a" | " b"``);
3. else (a megabyte without whitespace) at a UTF-8 character boundary: still lossless for
   a byte-level tokenizer, though the tokens there may differ from the whole document's.

Every byte read is checked to be UTF-8 as it streams (``Utf8Reader``), naming the byte
offset of the first bad sequence, however the read blocks split it.
"""

from __future__ import annotations

import codecs
from typing import Callable, Iterator

SPLITS = ("file", "paragraph", "line")
"""``--split`` values; ``file`` (one document per file) is the default."""


def _char_before(buf: bytes, j: int) -> str:
    """The character whose last byte is ``buf[j]``."""
    s = j
    while s > 0 and s > j - 3 and 0x80 <= buf[s] < 0xC0:
        s -= 1
    return buf[s:j + 1].decode("utf-8", "replace")


def _char_at(buf: bytes, k: int) -> str:
    """The character whose first byte is ``buf[k]``."""
    b = buf[k]
    return buf[k:k + 1 + (b >= 0xC0) + (b >= 0xE0) + (b >= 0xF0)].decode("utf-8", "replace")


def _solid(ch: str) -> bool:
    return bool(ch) and not ch.isspace()  # isspace is a superset of the regex engines' \s


def cut_ok(buf: bytes, i: int) -> int:
    """The rule (1 or 2, see the module docstring) that allows cutting ``buf`` before
    position ``i``, or 0 when neither does."""
    if 2 <= i < len(buf) and buf[i - 1] == 0x0A and _solid(_char_before(buf, i - 2)) and _solid(_char_at(buf, i)):
        return 1
    if 1 <= i < len(buf) - 1 and buf[i] == 0x20 and _solid(_char_before(buf, i - 1)) and \
            _solid(_char_at(buf, i + 1)):
        return 2
    return 0


def safe_cut(buf: bytes, lo: int) -> int:
    """The last position in ``(lo, len(buf))`` where ``buf`` may be cut (rule 1, else 2,
    else a character boundary at or before the last byte); ``lo`` >= 1."""
    for byte, shift in ((b"\n", 1), (b" ", 0)):
        end = len(buf)
        while (pos := buf.rfind(byte, lo, end)) > lo:
            if cut_ok(buf, pos + shift):
                return pos + shift
            end = pos
    i = len(buf) - 1
    while i > 1 and 0x80 <= buf[i] < 0xC0:  # never inside a multi-byte character
        i -= 1
    return i


class Utf8Reader:
    """``read`` / ``readline`` of a binary stream, each block checked to be UTF-8 as it
    passes (a sequence split across blocks is fine). Raises ValueError naming ``name``
    and the byte offset of the first invalid sequence."""

    def __init__(self, stream, name: str) -> None:
        self.stream, self.name, self.offset = stream, name, 0
        self.dec = codecs.getincrementaldecoder("utf-8")()

    def _check(self, data: bytes) -> bytes:
        held = len(self.dec.getstate()[0])
        try:
            self.dec.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.name}: not UTF-8 text (byte {self.offset - held + e.start}); convert it, or "
                             f"pass it as .jsonl") from None
        self.offset += len(data)
        return data

    def read(self, n: int) -> bytes:
        return self._check(self.stream.read(n))

    def readline(self, n: int) -> bytes:
        return self._check(self.stream.readline(n))


def _eol(line: bytes) -> bytes:
    """``line`` without its ``\n`` or ``\r\n``."""
    return line[:-2] if line.endswith(b"\r\n") else line[:-1] if line.endswith(b"\n") else line


Piece = tuple[bytes, bool, bool]
"""(text bytes, continues a document begun in an earlier piece, ends its document)."""


def _limit(pending: bytes, chunk_bytes: int, started: bool, may_cut: Callable[[], None]) -> tuple[list[Piece], bytes]:
    """Cut ``pending`` (one open document's unsent bytes) while it is over a chunk."""
    out: list[Piece] = []
    width = max(chunk_bytes, 8)
    while len(pending) > width:
        may_cut()
        cut = safe_cut(pending, len(pending) - width)
        out.append((pending[:cut], started or bool(out), False))
        pending = pending[cut:]
    return out, pending


def pieces(reader: Utf8Reader, split: str, chunk_bytes: int, may_cut: Callable[[], None]) -> Iterator[Piece]:
    """The document pieces of one text file (see the module docstring). ``may_cut`` is
    called before a document is cut (it raises when the tokenizer cannot take pieces)."""
    if split == "file":
        pending, started = b"", False
        while block := reader.read(chunk_bytes):
            out, pending = _limit(pending + block, chunk_bytes, started, may_cut)
            started = started or bool(out)
            yield from out
        reader.read(0)  # end of input: a truncated last character is an error
        yield pending, started, True
        return
    pending, started = b"", False
    while line := reader.readline(chunk_bytes):
        whole = line.endswith(b"\n")
        if whole and (not line.strip() if split == "paragraph" else True):
            body = _eol(pending + line) if split == "line" else _eol(pending)
            if started or body:
                yield body, started, True
            pending, started = b"", False
            continue
        out, pending = _limit(pending + line, chunk_bytes, started, may_cut)
        started = started or bool(out)
        yield from out
    reader.read(0)
    if started or pending:
        yield _eol(pending), started, True
