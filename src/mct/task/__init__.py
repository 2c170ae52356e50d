"""What is trained: a ``Task`` (model factory, loss, example batch, optimizer, groups),
the built-in GPT recipe (``gpt``) and a user's ``pkg.module:factory`` (``factory``).

``task_for(cfg)`` is the one place a run, ``mct verify`` and ``mct plan`` learn what
model they train; a new model source plugs in here, never in the run loop.
"""

from mct.task.build import build_model, builds_on_meta, check_tokens, task_for
from mct.task.seeding import seeded
from mct.task.factory import load_workload
from mct.task.gpt import gpt_task
from mct.task.spec import LossFn, ModelFn, OptimizerFactory, ParamGroupsFn, Task, with_loss_chunk
from mct.task.chunked import linear_cross_entropy, output_head
from mct.task.tokens import chunked_token_loss, token_batch, token_loss

__all__ = ["build_model", "builds_on_meta", "check_tokens", "seeded", "task_for", "LossFn", "ModelFn", "OptimizerFactory", "ParamGroupsFn", "Task", "gpt_task", "load_workload",
           "token_batch", "token_loss", "chunked_token_loss", "linear_cross_entropy", "output_head", "with_loss_chunk"]
