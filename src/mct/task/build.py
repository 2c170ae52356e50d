"""How a run turns a Task into a model and a training loss: the one place ``mct
train`` and ``mct verify`` learn what they train (``task_for``), a seeded
construction (on the meta device when the engine materializes units itself), and the
per-micro-batch dropout seed around the Task's loss."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from mct.adapters import apply_adapters
from mct.config import AdapterConfig, EngineConfig
from mct.task.init_program import InitProgram, record_init
from mct.task.factory import load_workload
from mct.task.gpt import gpt_task
from mct.task.seeding import seed_everything
from mct.task.spec import Task


def task_for(cfg: EngineConfig) -> Task:
    """The Task ``cfg`` trains, by ``model.source``: 'gpt' (the built-in GPT of
    ``[model]``), 'hf:DIR' (``mct.task.hf``) or 'pkg.module:factory'
    (``mct.task.factory``). New model sources plug in here (the run loop never names a
    model). With ``[adapter]`` on, its ``model_fn`` builds the model with adapters
    (``with_adapters``), so train, verify, plan and the Python API see one model.
    Raises ValueError (one line) for a source that cannot be loaded."""
    source = cfg.model.source
    if source == "gpt":
        task = gpt_task(cfg)
    elif source.startswith("hf:"):
        from mct.task.hf import hf_task  # imports transformers, an optional dependency
        task = hf_task(cfg, source[3:])
    else:
        task = load_workload(source, cfg)
    return with_adapters(task, cfg.adapter)


def with_adapters(task: Task, adapter: AdapterConfig) -> Task:
    """``task`` whose ``model_fn`` applies ``adapter`` to each model it builds (after the base
    is built, so the base's values and the random stream up to them are the unadapted
    model's); ``task`` itself when ``adapter.kind = 'none'``. QLoRA builds the same model
    as LoRA: the engine stores its base as NF4 (``mct.adapters.qlora``)."""
    if not adapter.enabled:
        return task
    base_fn = task.model_fn

    def model_fn() -> nn.Module:
        model = base_fn()
        apply_adapters(model, adapter)
        return model
    return dataclasses.replace(task, model_fn=model_fn)


def check_tokens(task: Task, corpus: Any) -> None:
    """Raise ValueError (one line) when ``corpus`` (a ``mct.data.Corpus``) holds token
    ids the Task's model cannot embed (a byte corpus into a model with fewer than 256
    ids, or a dataset tokenized for another model). No-op when the vocabulary is unknown."""
    if task.vocab_size is not None and corpus.min_vocab_size > task.vocab_size:
        raise ValueError(f"corpus {corpus.source!r} has token ids up to {corpus.min_vocab_size - 1}, but the "
                         f"model ({task.label}) embeds {task.vocab_size}; train on data tokenized for this model "
                         f"(mct prepare --tokenizer MODEL_DIR) or use a model with a larger vocabulary")


def builds_on_meta(cfg: EngineConfig) -> bool:
    """Does a run of ``cfg`` build its model on the meta device and materialize it a unit
    at a time? Stage 3 and offload never hold the whole model (``mct train``, and the
    planner's prediction of its initialization, both ask here)."""
    return cfg.zero.stage == 3 or cfg.offload.enabled


def build_model(task: Task, cfg: EngineConfig, on_meta: bool) -> tuple[nn.Module, InitProgram | None]:
    """``task.model_fn()`` seeded from ``cfg.seed`` (identical on every rank). With
    ``on_meta`` it is built on the meta device with the program that gives each
    parameter exactly the values of a normal construction when the engine packs its
    unit (stage 3 and offload never hold the whole model)."""
    seed_everything(cfg.seed)
    if on_meta:
        return record_init(task.model_fn)
    return task.model_fn(), None
