"""Parquet files and ``datasets`` ``save_to_disk`` directories (``.arrow``) as inputs of
``mct prepare``: one document per row, its text in the ``--text-field`` column.

Read with pyarrow (the optional ``parquet`` extra), streamed: a parquet file by row
groups, an Arrow file by record batches, only the text column, so memory holds about one
chunk of rows, never the table. A ``save_to_disk`` directory (``state.json`` naming its
``_data_files``) contributes those ``.arrow`` files in that order and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

EXTRA = "pip install 'mct[parquet]'"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(f"reading .parquet / .arrow inputs needs pyarrow, which is not installed; {EXTRA} "
                         f"(or convert the data to .jsonl)") from None
    return pyarrow


def arrow_dir_files(d: Path) -> list[Path] | None:
    """The ``.arrow`` files of a ``save_to_disk`` directory in its order, or None when
    ``d`` is not one. Raises ValueError for a state.json that names no readable file."""
    state = d / "state.json"
    if not state.is_file():
        return None
    try:
        files = [d / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a state.json of something else: the directory is read as files
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{str(state)!r} names {missing[0]!r}, which is missing; re-save the dataset "
                         f"(datasets' save_to_disk)")
    return files


def _batches(src: Any, text_field: str) -> Iterator:
    pa = _pyarrow()
    try:
        if src.kind == "parquet":
            pf = pa.parquet.ParquetFile(src.path)
            names = pf.schema_arrow.names
            _check_field(src, text_field, names)
            for i in range(pf.num_row_groups):
                yield from pf.read_row_group(i, columns=[text_field]).to_batches()
            return
        with pa.memory_map(str(src.path)) as f:
            try:
                reader = pa.ipc.open_stream(f)  # what datasets writes
            except pa.ArrowInvalid:
                f.seek(0)
                reader = pa.ipc.open_file(f)
            _check_field(src, text_field, reader.schema.names)
            it = reader if hasattr(reader, "__iter__") else (reader.get_batch(i) for i in range(reader.num_record_batches))
            for batch in it:
                yield batch.select([text_field])
    except (pa.lib.ArrowException, OSError) as e:  # not our own ValueErrors (a missing column)
        raise ValueError(f"{src.name}: not a readable {src.kind} file ({str(e).splitlines()[0][:160]}); re-create "
                         f"it or leave it out") from None


def _check_field(src: Any, text_field: str, names: list[str]) -> None:
    if text_field not in names:
        raise ValueError(f"{src.name}: no {text_field!r} column (columns: {', '.join(names[:8]) or 'none'}); "
                         f"pass --text-field NAME")


def column_chunks(src: Any, text_field: str, chunk_bytes: int) -> Iterator[tuple[list, int]]:
    """(rows, first) of about ``chunk_bytes`` of text of a Source's rows: each row's text
    (or None for a null), ``first`` the 1-based number of the first row."""
    rows: list = []
    size, first, row = 0, 1, 0
    for batch in _batches(src, text_field):
        col = batch.column(0)
        if not (str(col.type) in ("string", "large_string", "string_view")):
            raise ValueError(f"{src.name}: column {text_field!r} holds {col.type}, not strings; pass --text-field "
                             f"NAME of a string column")
        for text in col.to_pylist():
            rows.append(text)
            row += 1
            size += len(text) if text else 0
            if size >= chunk_bytes:
                yield rows, first
                rows, size, first = [], 0, row + 1
    if rows:
        yield rows, first
