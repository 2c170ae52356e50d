"""What the engine learns of a model's parameters before it shards them: the
optimizer's groups (the factory is called once over the task's groups, a probe, to
learn each group's parameters and hyperparameters before the flat master shards
exist; optimizers that are not elementwise and groups that do not cover the
trainable parameters are refused), and what every rank must agree on."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from mct.config import EngineConfig
from mct.task.init_program import probe_stand_ins
from mct.task.spec import OptimizerFactory

# Optimizers whose update of an element depends on other elements of the same
# tensor: on flat shards they would compute something else than on the parameters.
NON_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon", "Shampoo", "Lamb", "LAMB", "LARS", "Lion8bit")


def discover_groups(model: nn.Module, optimizer: OptimizerFactory, param_groups: list[dict[str, Any]] | None
                    ) -> tuple[list[list[torch.nn.Parameter]], list[dict[str, Any]]]:
    """(parameters of each group, hyperparameters of each group) of the optimizer
    ``optimizer`` builds over ``param_groups`` (default: one group of all trainable
    parameters). Raises ValueError naming the fault and the fix."""
    user_groups = param_groups or [{"params": [p for p in model.parameters() if p.requires_grad]}]
    user_groups, real_of = probe_stand_ins(user_groups)
    probe = optimizer(user_groups)
    name = type(probe).__name__
    if name in NON_ELEMENTWISE:
        raise ValueError(f"optimizer {name} is not elementwise: its update of one element depends on others, "
                         f"so it cannot run on flat ZeRO shards. Use SGD, Adam, AdamW, Adagrad, RMSprop, ...")
    groups = [[real_of.get(id(p), p) for p in g["params"]] for g in probe.param_groups]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
    seen = {id(p) for g in groups for p in g}
    names = {id(p): n for n, p in model.named_parameters()}
    for p in seen:
        if p not in names:
            raise ValueError("the optimizer factory returned an optimizer over tensors that are not "
                             "parameters of the model: build it from the `groups` argument it is given")
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            raise ValueError(f"parameter {n!r} requires grad but is in no optimizer param group: "
                             f"add it to a group or set requires_grad=False")
    del probe
    return groups, hyper


def agreement_items(model: nn.Module, config: EngineConfig) -> list[tuple[str, str]]:
    """(name, description) of every parameter (shape, dtype, requires_grad) and of the
    engine config but ``train``/``data``: what every rank's engine must hold alike."""
    items = [(n, f"{tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}") for n, p in model.named_parameters()]
    items.append(("config", repr(sorted((k, repr(v)) for k, v in config.to_dict().items()
                                        if k not in ("train", "data")))))
    return items
