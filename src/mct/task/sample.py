"""``mct sample RUN_DIR``: text generated from a run's final weights, so a person sees what
the model learned.

The model is the run's own (``model.source`` of its recorded config; an ``hf:`` run is
rebuilt from ``RUN_DIR/hf/config.json``, so it does not depend on the source directory
still being there), with ``RUN_DIR/model.safetensors`` (the run's final weights) or,
for a run that did not finish, its newest usable checkpoint. Text goes through the
tokenizer the model was trained with, the run's own ``RUN_DIR/tokenizer.json`` (written
when the run started: a prepared dataset's tokenizer, or the byte tokenizer of a text
corpus), never ``data.path``'s, which may have moved or changed; a run without one is a
one-line error, never a silent fall-back to bytes. One process, CPU, fp32; temperature 0
is greedy. Ctrl-C stops it and keeps what was generated.

A Hugging Face model (``hf:``) generates with transformers' own ``generate`` and KV cache
(each new token is one position's forward, not the whole window's): the prompt gets the
special tokens its tokenizer puts before a text (the model's BOS, ``RUN_DIR/hf``'s
tokenizer), generation stops at that tokenizer's EOS, sampling is plain temperature
sampling (no top-k / top-p) from ``--seed``. The context grows to the model's positions
(``max_position_embeddings``; else ``model.seq_len``); past them, generation goes on
from the last half of them (the cache is rebuilt once per half). Any other model is run
on the last ``model.seq_len`` tokens for every new token (no cache: the built-in GPT
learns absolute positions, so a window that slides each token would void a cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mct.config import EngineConfig
from mct.errors import read_text, user_error
from mct.persistence.export import consolidated_state, pick_checkpoint
from mct.persistence.init_from import rebuilt_frozen
from mct.persistence.files import read_json
from mct.task import task_for
from mct.task.hf import positions_of
from mct.task.tokens import forward_tokens

MAX_TOKENS = 100_000
"""The most tokens one ``mct sample`` generates (each one is a forward of the model)."""

MIN_TEMPERATURE = 1e-4
"""The smallest temperature above 0 (0 is greedy; below this the scaled logits overflow)."""


class _Text:
    """encode/decode of the run's own ``tokenizer.json`` (UTF-8 bytes when it is the byte
    tokenizer, else a ``tokenizers.Tokenizer``); ``prefix`` (ids put before each document,
    a model's BOS) and ``eos_id`` as its dataset recorded them (none for a text corpus)."""

    def __init__(self, run_dir: Path, cfg: EngineConfig, dataset: dict[str, Any] | None = None) -> None:
        from mct.data.tokenizer import bytes_tokenizer_json
        dataset = dataset or {}  # how the run's dataset placed special tokens (metadata.json, mct prepare)
        self.prefix: tuple[int, ...] = tuple(dataset.get("template", {}).get("prefix", ()))
        self.eos_id: int | None = dataset.get("eos_id")
        path = run_dir / "tokenizer.json"
        if not path.is_file():
            where = (f"it trained on token ids from {cfg.data.path!r}, which have no known tokenizer"
                     if cfg.data.path.endswith(".bin") else "the file is missing")
            raise ValueError(f"{str(run_dir)!r} has no tokenizer.json ({where}); mct sample encodes with the "
                             f"run's own tokenizer: copy the tokenizer the run was trained with to {str(path)!r}")
        try:
            text = read_text(path)
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(path)!r} is not a readable tokenizer (not UTF-8 text: {e})") from None
        self.hf = None
        if text not in (bytes_tokenizer_json(eos=False), bytes_tokenizer_json(eos=True)):
            from tokenizers import Tokenizer
            try:
                self.hf = Tokenizer.from_str(text)
            except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
                raise ValueError(f"{str(path)!r} is not a readable tokenizer ({e})") from None
            self.hf.encode_special_tokens = True  # a prompt that spells a special token stays text

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            try:
                return self.hf.encode(text, add_special_tokens=False).ids
            except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
                raise ValueError(f"--prompt {text[:40]!r} cannot be encoded by the run's tokenizer ({e})") from None
        try:
            return list(text.encode("utf-8", errors="surrogateescape"))  # bytes argv could not decode come back
        except UnicodeEncodeError as e:
            raise ValueError(f"--prompt {text[:40]!r} holds a lone surrogate {text[e.start]!r}, which is no "
                             f"UTF-8 text; leave it out") from None

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=False)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _dataset_of(run_dir: Path) -> dict[str, Any]:
    """The run's prepared dataset as metadata.json recorded it ({} for other corpora)."""
    recorded = read_json(run_dir / "metadata.json")
    corpus = recorded.get("corpus") if isinstance(recorded, dict) else None
    dataset = corpus.get("dataset") if isinstance(corpus, dict) else None
    return dataset if isinstance(dataset, dict) else {}


def _run_config(run_dir: Path) -> EngineConfig:
    meta = run_dir / "metadata.json"
    if not meta.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no metadata.json); pass a directory made by "
                         f"mct train")
    recorded = read_json(meta)
    d = recorded.get("config") if isinstance(recorded, dict) else None
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        raise ValueError(f"{meta}: holds no run config (it was damaged); restore it from a backup to sample")
    if (run_dir / "hf" / "config.json").is_file():  # the run keeps its own copy of the architecture
        d["model"]["source"] = f"hf:{run_dir / 'hf'}"
    return EngineConfig.from_dict(d)


def _final_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except OSError as e:
        raise user_error(e, path) from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own exception types
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({' '.join(str(e).split())}); "
                         f"delete it and run `mct train --resume {path.parent}` to write it again from the run's "
                         f"last checkpoint") from None


def load_run_model(run_dir: str | Path) -> tuple[nn.Module, EngineConfig]:
    """The run's model in fp32 on the CPU with its final (or newest checkpointed)
    weights, in eval mode. Raises ValueError (one line) for a directory that is no
    run, or weights that cannot be read or do not match the model (the first few
    names, or the first wrong shape, named as the model names them)."""
    model, cfg, _ = _load(Path(run_dir))
    return model, cfg


def _load(run_dir: Path) -> tuple[nn.Module, EngineConfig, int]:
    """``load_run_model``, and the vocabulary the model was trained on."""
    cfg = _run_config(run_dir)
    task = task_for(cfg)
    model = task.model_fn()
    final = run_dir / "model.safetensors"
    if final.is_file():
        state, source = _final_weights(final), final
    else:
        state, source = consolidated_state(pick_checkpoint(run_dir)[0], rebuilt_frozen), run_dir / "checkpoints"
    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise ValueError(f"{str(source)!r}: the weights do not match the run's model: "
                         f"{sorted(set(params) ^ set(state))[:3]}")
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise ValueError(f"{str(source)!r}: {name} has shape {list(state[name].shape)}, the run's model "
                             f"{list(p.shape)}; the file is not this run's weights")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    return model.eval(), cfg, task.vocab_size or cfg.model.vocab_size


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out: Any = forward_tokens(model, ids)  # as training called it: a user's model with a .config too
    return (out if isinstance(out, torch.Tensor) else out.logits)[0, -1].float()


def check_arguments(tokens: int, temperature: float) -> None:
    """Raise ValueError (one line) for a token count or temperature mct sample refuses."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"--tokens must be between 1 and {MAX_TOKENS:,}, got {tokens}")
    if temperature != temperature or temperature < 0 or temperature == float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"--temperature {temperature} is below {MIN_TEMPERATURE}: the scaled logits would "
                         f"overflow; pass 0 for greedy decoding, or a temperature >= {MIN_TEMPERATURE}")


def _check_prompt(prompt: str, ids: list[int], vocab: int, text: _Text) -> None:
    bad = next((i for i in ids if i >= vocab), None)
    if bad is not None:
        piece = text.decode([bad]) if bad < 256 or text.hf is not None else "?"
        raise ValueError(f"--prompt {prompt[:40]!r}: {piece!r} encodes to token id {bad}, beyond the model's "
                         f"vocabulary of {vocab} ids (the ids it was trained on); leave it out of the prompt")


@torch.no_grad()
def sample_text(run_dir: str | Path, prompt: str = "", tokens: int = 200, temperature: float = 0.8,
                seed: int = 0) -> tuple[str, int, bool]:
    """(``prompt`` followed by the generated tokens as text, tokens generated, whether
    Ctrl-C stopped it early: then the text holds what was generated until then). Raises
    ValueError (one line) for bad arguments, a prompt beyond the model's vocabulary, or
    a directory that is no run."""
    check_arguments(tokens, temperature)
    model, cfg, vocab = _load(Path(run_dir))
    text = _Text(Path(run_dir), cfg, _dataset_of(Path(run_dir)))
    ids = text.encode(prompt) or ([] if text.prefix else [text.encode("\n")[0]])  # else: from a newline
    ids = [*text.prefix, *ids]
    _check_prompt(prompt, ids, vocab, text)
    if cfg.model.source.startswith("hf:") and hasattr(model, "generate"):
        return _hf_sample(model, text, ids, tokens, temperature, seed, cfg)
    generator = torch.Generator().manual_seed(seed)
    start = len(ids)
    try:
        for _ in range(tokens):
            logits = _logits(model, torch.tensor([ids[-cfg.model.seq_len:]])).double()
            if temperature == 0:
                ids.append(int(logits.argmax()))
            else:
                probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
                ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    except KeyboardInterrupt:
        return text.decode(ids[len(text.prefix):]), len(ids) - start, True
    return text.decode(ids[len(text.prefix):]), len(ids) - start, False


def sample(run_dir: str | Path, prompt: str = "", tokens: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """``prompt`` followed by ``tokens`` generated tokens, as text (see ``sample_text``)."""
    return sample_text(run_dir, prompt, tokens, temperature, seed)[0]


class _Collect:
    """A ``generate`` streamer (transformers' ``BaseStreamer`` protocol): what it produces,
    token by token (its first ``put`` is the prompt), kept when Ctrl-C stops it mid-way."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.ids += [int(i) for i in value.reshape(-1)]
        self.prompt_seen = True

    def end(self) -> None:
        pass


def _hf_sample(model: nn.Module, text: "_Text", ids: list[int], tokens: int, temperature: float,
               seed: int, cfg: EngineConfig) -> tuple[str, int, bool]:
    """``sample_text`` of a transformers model: ``generate`` with its KV cache, in segments
    of the model's positions (see the module docstring)."""
    from transformers import GenerationConfig
    limit = positions_of(model.config) or cfg.model.seq_len
    eos = text.eos_id
    start, collect = len(ids), _Collect()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            while len(ids) - start < tokens and (eos is None or len(ids) == start or ids[-1] != eos):
                context = ids[-limit:] if len(ids) < limit else ids[-(limit // 2):]
                new = min(tokens - (len(ids) - start), limit - len(context))
                gen = GenerationConfig(max_new_tokens=new, do_sample=temperature > 0, use_cache=True,
                                       temperature=temperature if temperature > 0 else None,
                                       top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
                                       eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
                collect.ids = []
                model.generate(torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
                               generation_config=gen, streamer=collect)
                ids += collect.ids
        except KeyboardInterrupt:
            ids += collect.ids
            return text.decode(ids[len(text.prefix):]), len(ids) - start, True
    return text.decode(ids[len(text.prefix):]), len(ids) - start, False
