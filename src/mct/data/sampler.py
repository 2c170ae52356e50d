"""The per-rank window sampler: stateless and seeded, independent of the world size
for the same global batch (a resume on another number of ranks sees the same samples).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mct.config import check_int
from mct.data.corpus import Corpus, load_corpus
from mct.data.model_data import model_corpus
from mct.data.packing import pack_window, window_documents, window_stats

if TYPE_CHECKING:
    from mct.config import EngineConfig

_TRAIN_STREAM, _VAL_STREAM = 0, 1  # separate seed streams: eval never shifts training data


class BatchSampler:
    """Stateless, seeded windows: every call is a pure function of its arguments.

    A training step draws ``world_size * grad_accum * micro_batch_size`` distinct window
    offsets from a generator seeded by (seed, step); rank r, micro-batch m takes slice
    ``(r * grad_accum + m) * B ... + B``. So any process can rebuild any rank's batch, a
    run resumes at any step, and no two ranks or micro-batches share a window in a step.
    Validation batch i draws from ``corpus.val`` on its own seed stream (seed, i), the same
    on every world size.

    ``packing``: 'stream' windows start at any token; 'documents' windows start on a grid
    of ``seq_len`` tokens and their batches carry the document ids (``mct.data.packing``):
    (input_ids, targets, segments).
    """

    def __init__(self, corpus: Corpus, *, seq_len: int, micro_batch_size: int, grad_accum: int,
                 world_size: int, seed: int, packing: str = "stream") -> None:
        """Raises ValueError for non-positive sizes, an unknown packing or a train split
        too small for one step's distinct windows."""
        if packing not in ("stream", "documents"):
            raise ValueError(f"data.packing = {packing!r} is not allowed: must be 'stream' or 'documents'")
        self.packing = packing
        self.stride = seq_len if packing == "documents" else 1
        check_int("model.seq_len", seq_len, 1)
        check_int("data.micro_batch_size", micro_batch_size, 1)
        check_int("data.grad_accum", grad_accum, 1)
        check_int("world_size", world_size, 1)
        self.corpus, self.seq_len, self.seed = corpus, seq_len, seed
        self.micro_batch_size, self.grad_accum, self.world_size = micro_batch_size, grad_accum, world_size
        self._seed_key = seed % 2**64  # SeedSequence needs a non-negative entropy word
        self.windows_per_step = world_size * grad_accum * micro_batch_size
        n_train, n_val = self._positions(corpus.train), self._positions(corpus.val)
        if n_train < self.windows_per_step:
            grid = (f" (data.packing = 'documents' starts windows every {seq_len} tokens; 'stream' at every token)"
                    if packing == "documents" else "")
            raise ValueError(
                f"the train split has {corpus.train.size} tokens: {max(n_train, 0)} windows of "
                f"model.seq_len + 1 = {seq_len + 1}{grid}, but one step needs {self.windows_per_step} distinct "
                "windows (world_size x data.grad_accum x data.micro_batch_size); use a larger corpus "
                "or smaller batches")
        if n_val < 1:
            raise ValueError(f"the validation split has {corpus.val.size} tokens, fewer than "
                             f"model.seq_len + 1 = {seq_len + 1}; reduce model.seq_len or use more data")

    def _positions(self, tokens: np.ndarray) -> int:
        """Window starts: every ``stride``-th offset whose window (seq_len + 1 tokens) fits."""
        return (tokens.size - self.seq_len - 1) // self.stride + 1

    def step_offsets(self, step: int) -> np.ndarray:
        """All window offsets of ``step``, shape [world_size, grad_accum, micro_batch_size]."""
        check_int("step", step, 0)
        rng = np.random.default_rng([self._seed_key, _TRAIN_STREAM, step])
        flat = rng.choice(self._positions(self.corpus.train), size=self.windows_per_step,
                          replace=False) * self.stride
        return flat.reshape(self.world_size, self.grad_accum, self.micro_batch_size)

    def val_offsets(self, i: int) -> np.ndarray:
        """Window offsets of validation batch ``i``, shape [micro_batch_size]: the same on
        any world size (a resumed or resharded run validates on the same samples).
        Distinct when the split has enough windows, else drawn with replacement."""
        check_int("validation batch index", i, 0)
        rng = np.random.default_rng([self._seed_key, _VAL_STREAM, i])
        n, k = self._positions(self.corpus.val), self.micro_batch_size
        return rng.choice(n, size=k, replace=k > n) * self.stride

    def _windows(self, split: str, offsets: np.ndarray, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        tokens = self.corpus.train if split == "train" else self.corpus.val
        idx = offsets[:, None] + np.arange(self.seq_len + 1)
        if self.packing == "documents":
            docs = window_documents(self.corpus.bounds(split), offsets, self.seq_len)
            return tuple(t.to(device) for t in pack_window(tokens[idx], docs))
        chunk = torch.from_numpy(tokens[idx].astype(np.int64))
        x, y = chunk[:, :-1], chunk[:, 1:]
        return x.contiguous().to(device), y.contiguous().to(device)

    def step_stats(self, step: int) -> dict[str, Any]:
        """What the global batch of ``step`` holds (``mct.data.packing.window_stats``):
        real and padding tokens, counted targets, documents per window."""
        return window_stats(self.corpus.bounds("train"), self.step_offsets(step), self.seq_len)

    def batch(self, step: int, micro: int, rank: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """(input_ids, targets), int64 [B, T] each, targets = inputs shifted by one;
        packed documents: (input_ids, targets, segments) (``mct.data.packing``)."""
        check_int("micro", micro, 0, self.grad_accum)
        check_int("rank", rank, 0, self.world_size)
        return self._windows("train", self.step_offsets(step)[rank, micro], device)

    def micro_batches(self, step: int, rank: int,
                      device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, ...]]:
        """The ``grad_accum`` micro-batches of ``rank`` at ``step``, in order."""
        check_int("rank", rank, 0, self.world_size)
        offsets = self.step_offsets(step)[rank]
        return [self._windows("train", o, device) for o in offsets]

    def val_batch(self, i: int, rank: int = 0,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """Validation batch ``i``: fixed for a seed, from the val split only, the same on
        every rank and world size (``rank`` is checked, not used: the Validator spreads
        batches over ranks)."""
        check_int("rank", rank, 0, self.world_size)
        return self._windows("val", self.val_offsets(i), device)

def build_data(cfg: EngineConfig, world_size: int = 1) -> tuple[Corpus, BatchSampler]:
    """Corpus and sampler from a config (an ``hf:`` model's data in its own tokens:
    ``model_data.model_corpus``); checks token ids against model.vocab_size for
    the built-in GPT (another model's own vocabulary is the bound: task.build.check_tokens)."""
    if cfg.model.source.startswith("hf:"):  # the model's own tokens (model_data.py)
        corpus = model_corpus(cfg.data.path, cfg.model.source[3:], seed=cfg.seed,
                              val_fraction=cfg.data.val_fraction, seq_len=cfg.model.seq_len)
    else:
        corpus = load_corpus(cfg.data.path, seed=cfg.seed, val_fraction=cfg.data.val_fraction,
                             seq_len=cfg.model.seq_len)
    if cfg.model.source == "gpt":
        corpus.check_vocab(cfg.model.vocab_size)
    sampler = BatchSampler(corpus, seq_len=cfg.model.seq_len, micro_batch_size=cfg.data.micro_batch_size,
                           grad_accum=cfg.data.grad_accum, world_size=world_size, seed=cfg.seed,
                           packing=cfg.data.packing)
    return corpus, sampler


class DataPosition:
    """Where the run reads: step ``s`` takes the sampler's windows of position
    ``s + offset``. A rollback that skips a diverged window moves the offset past its
    batches (PaLM-style); the skipped windows are kept for the record. Stateful (saved
    in run checkpoints); persists across rollbacks."""

    def __init__(self) -> None:
        self.offset = 0
        self.skipped: list[tuple[int, int]] = []

    def position(self, step: int) -> int:
        """The sampler position of loop step ``step``."""
        return step + self.offset

    def skip(self, first: int, last: int) -> None:
        """Never read again the batches of loop steps ``first..last`` (inclusive)."""
        self.skipped.append((self.position(first), self.position(last)))
        self.offset += last - first + 1

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "skipped": [list(w) for w in self.skipped]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.offset = int(sd["offset"])
        self.skipped = [(int(a), int(b)) for a, b in sd.get("skipped", [])]
