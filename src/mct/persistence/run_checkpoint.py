"""Run checkpoints: the engine's sharded state, and beside it ``trainer.json`` holding
``{key: component.state_dict()}`` for the run's Stateful components (saved by key, as
torchtitan's CheckpointManager), each rank's RNG streams, the newest
``train.keep_checkpoints`` kept.

Trust: a checkpoint is written as soon as its step is done (a kill right after loses
nothing), marked ``"trust": "pending"``; once a step that starts from its state applies
an update and passes the divergence checks, the file ``trusted`` is added beside it.
A checkpoint written on SIGTERM/SIGINT, or after the run's last step, is trusted at once
when the step that made its state passed and applied an update (no later step will run).
Resume never picks an untrusted checkpoint over a trusted one (``run_dir.newest_usable``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from mct.config import TrainConfig
from mct.dist import broadcast_from_main
from mct.persistence.checkpoint import MANIFEST, Checkpointable, load_engine_state, rng_state, save_checkpoint
from mct.persistence.run_dir import mark_trusted, prune, step_dir


class Stateful(Protocol):
    """torch's ``Stateful``: what a run checkpoint saves by key."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class RunCheckpointer:
    """Decides when to save (``should_save``) and saves the engine with the run's
    Stateful components by key. ``states``: name -> component; ``header``: the run's
    fixed facts (config, world size, global batch), stored beside them."""

    def __init__(self, run_dir: Path, tcfg: TrainConfig, states: dict[str, Stateful], *, is_main: bool) -> None:
        self.run_dir, self.tcfg, self.states, self.is_main = Path(run_dir), tcfg, states, is_main
        self.unconfirmed: Path | None = None
        """The newest checkpoint, until a step from its state applied an update and passed."""

    def should_save(self, steps_done: int, last: bool) -> bool:
        """After the last step, and every ``train.checkpoint_every`` steps."""
        every = self.tcfg.checkpoint_every
        return last or bool(every and steps_done % every == 0)

    def save(self, engine: Checkpointable, steps_done: int, header: dict[str, Any], *, trusted: bool = False) -> None:
        """Checkpoint the state after ``steps_done`` steps, then keep the newest
        ``train.keep_checkpoints`` (never the newest trusted one). Collective; a complete
        one already there (the run resumed at its last step) is kept as it is.
        ``trusted``: mark it at once (the run's last step applied an update and passed)."""
        path = step_dir(self.run_dir, steps_done)
        if not broadcast_from_main((path / MANIFEST).exists()):
            trainer = {**header, **{k: s.state_dict() for k, s in self.states.items()}, "trust": "pending"}
            # the frozen base by hash: the run's config rebuilds it (a LoRA checkpoint holds the adapters only)
            save_checkpoint(path, engine, step=steps_done, trainer=trainer, rank_state={"rng": rng_state()},
                            embed_base=False)
        self.unconfirmed = path
        if trusted:
            self.confirm()
        if self.is_main:
            prune(self.run_dir, self.tcfg.keep_checkpoints)

    def confirm(self) -> None:
        """A step from the newest checkpoint's state applied an update and passed: mark it
        trusted (rank 0 writes the mark, then prunes: set-aside ``.untrusted`` checkpoints
        it supersedes go; every rank forgets it)."""
        if self.unconfirmed is not None and self.is_main and self.unconfirmed.is_dir():
            mark_trusted(self.unconfirmed)
            prune(self.run_dir, self.tcfg.keep_checkpoints)
        self.unconfirmed = None

    def load(self, engine: Checkpointable, path: Path, trainer: dict[str, Any]) -> dict[str, Any]:
        """Load the engine from checkpoint ``path`` (collective; already verified) and each
        component from ``trainer`` (its trainer.json) by key; keys a component does not
        find are left at their initial state (a checkpoint of an older mct). Returns the
        manifest."""
        meta = load_engine_state(engine, path, verified=True)
        for key, component in self.states.items():
            if key in trainer:
                component.load_state_dict(trainer[key])
        return meta


def upgrade_trainer_state(trainer: dict[str, Any]) -> dict[str, Any]:
    """trainer.json of any mct version -> by-key form. Before components were saved by
    key, the loop's counters sat at the top level and the rollback state held the data
    offset and the LR scale."""
    if "loop" in trainer:
        return trainer
    out = dict(trainer)
    out["loop"] = {k: trainer[k] for k in ("step", "opt_step", "skipped", "first_val", "last_val") if k in trainer}
    rb = trainer.get("rollback") or {}
    if rb:
        out["data"] = {"offset": rb.get("data_offset", 0), "skipped": []}
        out["schedule"] = {"lr_scale": rb.get("lr_scale", 1.0)}
    return out
