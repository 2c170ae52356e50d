"""``data.packing = 'documents'``: windows of documents packed back to back, with the
per-token document ids that keep attention, positions and targets inside a document.

The sampler cuts a split's concatenated tokens on a grid (window k reads tokens
``k*T .. k*T + T``, T = model.seq_len): every token is an input once per pass, and a
document longer than what is left of a window continues in the next one. For each
window this module gives (numpy, then int64 tensors):

- ``segments`` [B, T]: document ids numbered from 0 at the window's first token (the
  part of a document the window holds is one run; a continued document restarts there);
- ``targets`` [B, T]: the next token, or ``IGNORE_INDEX`` where the next token belongs
  to another document, so no target crosses a boundary. A prepared dataset's documents
  end with EOS (inside the document), so a document's last real token predicts its EOS
  and the EOS predicts nothing; raw text sources have no EOS id (the byte vocabulary
  has none), so there a document's last token predicts nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
"""A target that does not count (``F.cross_entropy``'s default ignore_index)."""


def window_documents(bounds: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Absolute document index of every token of windows starting at ``offsets`` [B]
    (``seq_len + 1`` tokens each), int64 [B, seq_len + 1]. ``bounds``: document starts
    of the split plus its size (``Corpus.bounds``)."""
    idx = offsets[:, None] + np.arange(seq_len + 1)
    return np.searchsorted(bounds, idx, side="right") - 1


def pack_window(chunk: np.ndarray, docs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``chunk`` and their documents ``docs``, both [B, T + 1] -> (input_ids,
    targets, segments), int64 [B, T] each: targets across a boundary are IGNORE_INDEX,
    segments count documents from 0 at each window's start. Pure."""
    x, y = chunk[:, :-1].astype(np.int64), chunk[:, 1:].astype(np.int64)
    y = np.where(docs[:, 1:] == docs[:, :-1], y, IGNORE_INDEX)
    seg = docs[:, :-1] - docs[:, :1]
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(np.ascontiguousarray(seg))


def window_stats(bounds: np.ndarray, offsets: np.ndarray, seq_len: int) -> dict[str, Any]:
    """What windows at ``offsets`` (any shape) hold: ``real_tokens`` (input tokens that
    are data: all of them, packing pads nothing), ``padding_tokens`` (0), ``target_tokens``
    (targets that count: not across a boundary) and ``docs_per_window`` (mean documents,
    or parts of documents, a window holds)."""
    flat = np.asarray(offsets).reshape(-1)
    docs = window_documents(bounds, flat, seq_len)
    crossing = int((docs[:, 1:] != docs[:, :-1]).sum())
    return {"real_tokens": int(flat.size * seq_len), "padding_tokens": 0,
            "target_tokens": int(flat.size * seq_len - crossing),
            "docs_per_window": float((docs[:, -2] - docs[:, 0] + 1).mean())}
