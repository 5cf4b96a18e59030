"""Resumable training checkpoints: where a run stands, written atomically, checked before resuming.

A checkpoint holds the weights, the optimizer, schedule and gradient-scaler
states, the RNG states, the :class:`RunState` and the best weights so far, all
as tensors and plain values, so it loads with ``weights_only=True``. It also
records the settings that decide where a run ends (:data:`RESUME_KEYS`), the
world size and the sharding; resuming with different ones is refused. Under
FSDP the weights and optimizer state are gathered whole onto rank 0's CPU
before it writes them (:func:`~optkit.runtime.fsdp.gathered_states`): its
``model`` is a whole state dict whatever the sharding (the optimizer state is
keyed by parameter name there, by index under DDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optkit.core.errors import ModelLoadError, TrainingError, UntrustedPickleError
from optkit.core.files import atomic_path
from optkit.io.models import read_checkpoint
from optkit.runtime.fsdp import gathered_states, load_states

CHECKPOINT_FORMAT = "optkit.train-checkpoint"
#: Settings a resumed run must share with the run that wrote the checkpoint, or it would not end in the same place.
RESUME_KEYS = ("data", "input_shape", "epochs", "batch_size", "lr", "weight_decay", "warmup", "grad_clip", "seed",
               "amp", "distill", "alpha", "temperature", "max_train_samples", "max_steps")


@dataclass
class RunState:
    """Where a run stands; everything here goes into the checkpoint.

    Attributes:
        epoch: the 0-based epoch under way.
        position: samples this rank has consumed in the current epoch.
        step: optimizer steps taken in the whole run.
        skipped: fp16 steps the gradient scaler skipped for overflow.
        loss_sum, correct, samples: this rank's training figures in the current epoch.
        best_epoch, best_accuracy, best_weights: the epoch whose weights are kept so far.
        history: one record per finished epoch.
    """

    epoch: int = 0
    position: int = 0
    step: int = 0
    skipped: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0
    best_epoch: int = 0
    best_accuracy: float | None = None
    best_weights: dict[str, torch.Tensor] | None = None
    history: list[dict[str, float]] = field(default_factory=list)

    def next_epoch(self) -> None:
        """Start the next epoch's counts."""
        self.epoch += 1
        self.position = 0
        self.loss_sum, self.correct, self.samples = 0.0, 0, 0


def run_identity(settings: Any, world: int, sharding: str = "ddp") -> dict[str, Any]:
    """The settings a checkpoint records and a resumed run must match.

    Args:
        settings: the :class:`~optkit.passes.finetune.passes.FineTune` settings of the run.
        world: the number of processes.
        sharding: how the run trains, ``ddp`` or ``fsdp`` (``auto`` resolved).

    Returns:
        ``{key: value}`` for each of :data:`RESUME_KEYS` (``None`` for one ``settings`` lacks), ``world_size``
        and ``sharding``.
    """
    return {key: _plain(getattr(settings, key, None)) for key in RESUME_KEYS} | {"world_size": world,
                                                                                  "sharding": sharding}


def _plain(value: Any) -> Any:
    # Tuples come back from a checkpoint as lists; compare them as lists.
    return list(value) if isinstance(value, tuple) else value


class Checkpoints:
    """The checkpoint file of one run: written by rank 0, read by every rank to resume.

    Args:
        path: the checkpoint file; ``None`` writes none.
        identity: :func:`run_identity` of this run.
        rank: this process's rank (only rank 0 writes).
        model, optimizer, scheduler, scaler: the objects whose states are saved and restored.
        sharded: ``model`` is sharded with FSDP; every rank must then call :meth:`save`, which gathers.

    Attributes:
        saved: whether the file holds a checkpoint of this run (written or resumed from).
    """

    def __init__(self, path: str | None, identity: dict[str, Any], *, rank: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: torch.amp.GradScaler,
                 sharded: bool = False):
        self.path, self.identity, self.rank = path, identity, rank
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.sharded = sharded
        self.saved = False

    def save(self, state: RunState) -> None:
        """Write the checkpoint atomically (rank 0 only; nothing without a path)."""
        if not self.path or (self.rank != 0 and not self.sharded):
            return
        # Under FSDP every rank takes part in gathering the states whole; rank 0 alone writes them.
        model_state, optimizer_state = (gathered_states(self.model, self.optimizer) if self.sharded
                                        else (self.model.state_dict(), self.optimizer.state_dict()))
        if self.rank != 0:
            return
        payload = {
            "format": CHECKPOINT_FORMAT,
            "settings": self.identity,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            "state": {f.name: getattr(state, f.name) for f in fields(state) if f.name != "best_weights"},
            "best_weights": state.best_weights,
        }
        with atomic_path(self.path) as tmp:
            torch.save(payload, tmp)
        self.saved = True

    def resume(self) -> RunState:
        """Restore every state from the checkpoint, if there is one.

        Returns:
            where the checkpointed run stood; a fresh :class:`RunState` when there is no file.

        Raises:
            TrainingError: when the file is not an optkit training checkpoint, was written
                with other settings or another world size, or holds weights of another shape.
        """
        if not self.path or not Path(self.path).exists():
            return RunState()
        payload = self._read()
        try:
            if self.sharded:
                load_states(self.model, self.optimizer, payload["model"], payload["optimizer"])
            else:
                self.model.load_state_dict(payload["model"])
                self.optimizer.load_state_dict(payload["optimizer"])
        except RuntimeError as e:
            raise TrainingError(f"cannot resume from {self.path}: its weights do not fit this model "
                                "(was it pruned differently?); remove it to start over") from e
        self.scheduler.load_state_dict(payload["scheduler"])
        self.scaler.load_state_dict(payload["scaler"])
        torch.set_rng_state(payload["rng"]["torch"])
        if payload["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
        state = RunState(**payload["state"])
        state.best_weights = payload["best_weights"]
        self.saved = True
        return state

    def _read(self) -> dict[str, Any]:
        try:
            payload = read_checkpoint(self.path)
        except UntrustedPickleError as e:
            raise TrainingError(f"cannot resume: {self.path} holds pickled Python objects, which an optkit "
                                "training checkpoint never does, so it is not loaded; remove it to start over") from e
        except ModelLoadError as e:
            raise TrainingError(f"cannot resume: {e}; or remove it to start over") from e
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise TrainingError(f"cannot resume: {self.path} is not an optkit training checkpoint; "
                                "remove it or give another checkpoint file")
        # Checkpoints written before FSDP came record no sharding: they were DDP's.
        written = {"sharding": "ddp"} | payload.get("settings", {})
        different = [k for k, v in self.identity.items() if written.get(k) != v]
        if different:
            found = ", ".join(f"{k}={written[k]!r}" if k in written else f"no {k} recorded" for k in different)
            raise TrainingError(f"cannot resume from {self.path}: it was written with {found}; "
                                "rerun with those settings or remove it")
        return payload
