"""``mct sample RUN_DIR``: text generated from a run's final weights, so a person sees what the
model learned.

The model is the run's own (``model.source`` of its recorded config; an ``hf:`` run is
rebuilt from ``RUN_DIR/hf/config.json``, so it does not depend on the source directory
still being there), with ``RUN_DIR/model.safetensors`` (the run's final weights) or,
for a run that did not finish, its newest usable checkpoint. Text goes through the
tokenizer the model was trained with: the prepared dataset's ``tokenizer.json``, else
UTF-8 bytes (a text corpus). Generation is autoregressive over the last
``model.seq_len`` tokens, one process, CPU, fp32; temperature 0 is greedy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mct.config import EngineConfig
from mct.persistence.export import consolidated_state, pick_checkpoint
from mct.persistence.files import read_json
from mct.task import task_for


class _Text:
    """encode/decode of the run's tokenizer (bytes, or a tokenizers.Tokenizer)."""

    def __init__(self, data_path: str) -> None:
        path = Path(data_path) / "tokenizer.json" if data_path else None
        self.hf = None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer
            self.hf = Tokenizer.from_file(str(path))
        elif data_path.endswith(".bin"):
            raise ValueError(f"the run trained on token ids from {data_path!r}, which has no tokenizer; "
                             f"mct sample needs a text corpus or a prepared dataset (mct prepare)")

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids if self.hf is not None else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _run_config(run_dir: Path) -> EngineConfig:
    meta = run_dir / "metadata.json"
    if not meta.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no metadata.json); pass a directory made by "
                         f"mct train")
    d = read_json(meta)["config"]
    if (run_dir / "hf" / "config.json").is_file():  # the run keeps its own copy of the architecture
        d["model"]["source"] = f"hf:{run_dir / 'hf'}"
    return EngineConfig.from_dict(d)


def load_run_model(run_dir: str | Path) -> tuple[nn.Module, EngineConfig]:
    """The run's model in fp32 on the CPU with its final (or newest checkpointed)
    weights, in eval mode. Raises ValueError (one line) for a directory that is no
    run, or weights that do not match the model."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    model = task_for(cfg).model_fn()
    final = run_dir / "model.safetensors"
    if final.is_file():
        from safetensors.torch import load_file
        state = load_file(str(final))
    else:
        state = consolidated_state(pick_checkpoint(run_dir)[0])
    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise ValueError(f"{run_dir}: the weights do not match the run's model: "
                         f"{sorted(set(params) ^ set(state))[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    return model.eval(), cfg


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out: Any = model(input_ids=ids, use_cache=False) if hasattr(model, "config") else model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits)[0, -1].float()


@torch.no_grad()
def sample(run_dir: str | Path, prompt: str = "", tokens: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """``prompt`` followed by ``tokens`` generated tokens, as text. Raises ValueError
    for bad arguments or a directory that is no run."""
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    model, cfg = load_run_model(run_dir)
    text = _Text(cfg.data.path)
    ids = text.encode(prompt) or [text.encode("\n")[0]]  # an empty prompt starts from a newline
    generator = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        logits = _logits(model, torch.tensor([ids[-cfg.model.seq_len:]]))
        if temperature == 0:
            ids.append(int(logits.argmax()))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return text.decode(ids)
