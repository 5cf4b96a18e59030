"""The training loop that recovers accuracy after pruning.

:func:`fit` reads top to bottom: AdamW with decay / no-decay parameter groups
(:mod:`~optkit.passes.finetune.objectives`), a cosine schedule with linear
warmup sized to the steps the run takes, gradient clipping, autocast (with a
``GradScaler`` only for fp16), optional distillation from a teacher,
evaluation each epoch keeping the best weights, and atomic checkpoints from
which ``resume`` continues exactly where it stopped
(:mod:`~optkit.passes.finetune.checkpoints`).

Its settings are a :class:`~optkit.passes.finetune.passes.FineTune` pass (the
one declaration of every training setting), or any object with the same
attributes.

Under ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel
(:mod:`~optkit.runtime.distributed`), or, for a model that does not fit one
device, a copy sharded with FSDP2 (:mod:`~optkit.runtime.fsdp`; the
``sharding`` setting chooses); every rank must call it with the same model,
data and settings, and only rank 0 writes checkpoints.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from optkit.core.errors import TrainingError
from optkit.data.loader import make_loader
from optkit.model.stats import PRUNABLE_WEIGHT_TYPES
from optkit.passes.device.passes import resolve_device
from optkit.passes.finetune.checkpoints import Checkpoints, RunState, run_identity
from optkit.runtime.distributed import (all_finite, all_reduce_sum, broadcast_buffers, init_distributed,
                                        rank_and_world, wrap_ddp)
from optkit.runtime.fsdp import full_state_dict, local_part, resolve_sharding, shard
from optkit.passes.finetune.objectives import (IGNORE_INDEX, cosine_with_warmup, distillation_loss, output_logits,
                                               param_groups, scored_positions)
from optkit.passes.finetune.progress import TrainingProgress
from optkit.passes.finetune.sampling import ResumableSampler, capped
from optkit.passes.precision.autocast import training_dtype

_log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What :func:`fit` returns.

    Attributes:
        model: the model holding the best weights (by validation accuracy).
        history: per epoch: ``epoch``, ``train_loss``, ``train_accuracy``, ``val_loss``, ``val_accuracy``, ``lr``.
        best_epoch: 1-based epoch whose weights were kept (the last one without validation data).
        best_accuracy: validation accuracy of those weights, or ``None`` without validation data.
        skipped_steps: fp16 steps the gradient scaler skipped for overflow.
        resumed: with ``resume``, one line on where the run resumed (or that it found no checkpoint).
    """

    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = 0
    best_accuracy: float | None = None
    skipped_steps: int = 0
    resumed: str | None = None


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, *, batch_size: int = 256, device: str | torch.device | None = None,
             amp: str = "off", num_workers: int | str = 0) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of ``model`` on ``dataset``.

    Under DDP or FSDP each rank evaluates its share and the sums are all-reduced,
    so every rank gets the same figures. The shares are padded to the same
    number of samples (repeats, not scored), since a sharded model's forward
    pass needs every rank.

    Args:
        model: the model (on ``device``); it is put back in the mode it was in.
        dataset: yields ``(input, label)`` pairs.
        batch_size: samples per forward pass.
        device: where the model is; ``None`` or ``auto`` picks one as
            :func:`~optkit.passes.device.passes.resolve_device` does.
        amp: autocast mode, as for training (``auto``, ``bf16``, ``fp16``, ``off``).
        num_workers: DataLoader worker processes, or ``auto``.

    Returns:
        ``{"loss": float, "accuracy": float, "samples": int}``.

    Raises:
        OptkitError: for a device this machine does not have.
    """
    device = resolve_device(None if device is None else str(device))
    rank, world = rank_and_world()
    count = len(dataset)
    scored_share = len(range(rank, count, world))
    share = (Subset(dataset, [i % count for i in range(rank, math.ceil(count / world) * world, world)])
             if world > 1 else dataset)
    loader = make_loader(share, batch_size, num_workers=num_workers, device=device)
    dtype = training_dtype(amp, device)
    was_training = model.training
    model.eval()
    totals = _sums([0, 0, 0], device)
    seen = 0
    for inputs, labels in loader:
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        labels[max(scored_share - seen, 0):] = IGNORE_INDEX  # the padding
        seen += len(labels)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits, scored = scored_positions(output_logits(model(inputs)), labels)
        totals[0] += F.cross_entropy(logits.float(), scored, reduction="sum")
        totals[1] += (logits.argmax(-1) == scored).sum()
        totals[2] += scored.numel()
    model.train(was_training)
    loss, correct, samples = all_reduce_sum(totals).tolist()
    return {"loss": loss / max(samples, 1), "accuracy": correct / max(samples, 1), "samples": int(samples)}


def fit(model: nn.Module, train_set: Dataset, val_set: Dataset | None, settings: Any, *,
        teacher: nn.Module | None = None, progress: bool | None = None, keep_sparsity: bool = True) -> TrainResult:
    """Fine-tune ``model`` on ``train_set``, keeping the weights that score best on ``val_set``.

    Args:
        model: the model to train, changed in place (and moved to the training device; under FSDP it
            stays where it is, whole, and gets the trained weights at the end).
        train_set: yields ``(input, label)`` pairs.
        val_set: evaluated after each epoch; ``None`` keeps the last weights.
        settings: the run's settings: a :class:`~optkit.passes.finetune.passes.FineTune`
            (its ``data`` is not read here) or any object with the same attributes.
        teacher: a model to distil from (its softened logits are mixed into the loss); under FSDP a
            sharded copy of it runs.
        progress: show a progress bar; ``None`` shows one when stderr is a terminal.
        keep_sparsity: keep weights that are exactly zero at the start at zero
            (so unstructured pruning survives fine-tuning).

    Returns:
        the model with the best weights, the per-epoch history and what was kept.

    Raises:
        TrainingError: when the training data is smaller than one batch per process, the loss
            stops being finite (the last checkpoint is left intact), or the checkpoint to resume
            from does not match this run, or FSDP is asked to train in fp16.
        OptkitError: for a device this machine does not have.
    """
    rank, world = init_distributed()
    device = resolve_device(settings.device)
    dtype = training_dtype(settings.amp, device)
    sharding = resolve_sharding(settings.sharding, model, teacher, device)
    if sharding == "fsdp":
        if dtype == torch.float16:
            raise TrainingError("FSDP trains in bf16 or fp32, not fp16 (--train-amp fp16, or auto on a GPU without "
                                "bf16): set --train-amp bf16 or off, or --sharding ddp")
        if rank == 0:
            _log.info("training a copy of the model sharded with FSDP over %d processes", world)
        # The model stays whole where it is; a sharded copy trains, and the best weights come back into it.
        trained = shard(model, device, dtype=dtype)
        teacher = shard(teacher, device, dtype=dtype, frozen=True) if teacher is not None else None
    else:
        trained = model.to(device)
        if teacher is not None:
            teacher.to(device).eval()
    train_set = capped(train_set, settings.max_train_samples, settings.seed)
    steps_per_epoch, total_steps = _count_steps(len(train_set), world, settings)

    optimizer = torch.optim.AdamW(param_groups(trained, settings.weight_decay), lr=settings.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(total_steps, max(1, round(settings.warmup * total_steps))))
    # bf16 has fp32's exponent range, so only fp16 needs loss scaling.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = ResumableSampler(train_set, num_replicas=world, rank=rank, seed=settings.seed)
    loader = make_loader(train_set, settings.batch_size, sampler=sampler, drop_last=True, device=device,
                         num_workers=settings.num_workers, seed=settings.seed)
    # Seeded after the loader is measured (which draws a timing-dependent number of
    # augmentations) and before a checkpoint's RNG state is restored.
    torch.manual_seed(settings.seed)
    checkpoints = Checkpoints(settings.checkpoint, run_identity(settings, world, sharding), rank=rank,
                              model=trained, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                              sharded=sharding == "fsdp")
    state = checkpoints.resume() if settings.resume else RunState()
    resumed = _resume_line(settings.checkpoint, checkpoints.saved, state, total_steps) if settings.resume else None
    if resumed and rank == 0:
        _log.info("%s", resumed)
    trainer = _Trainer(trained if sharding == "fsdp" else wrap_ddp(trained, device), teacher, optimizer,
                       scheduler, scaler, dtype, settings, _zero_masks(trained) if keep_sparsity else [])

    epochs = math.ceil(total_steps / steps_per_epoch)
    with TrainingProgress(progress, rank=rank, total=total_steps, completed=state.step, epochs=epochs,
                          log=_log) as bar:
        for epoch in range(state.epoch, epochs):
            sampler.set_epoch(epoch)
            sampler.start = state.position
            batches = itertools.islice(loader, total_steps - state.step)
            _train_epoch(trainer, batches, state, device=device, world=world, checkpoints=checkpoints, bar=bar)
            bar.log_epoch(_end_epoch(trained, val_set, state, settings, device, scheduler))
            checkpoints.save(state)

    if state.best_weights is not None:
        model.load_state_dict(state.best_weights)
    return TrainResult(model, state.history, state.best_epoch, state.best_accuracy, state.skipped, resumed)


def _resume_line(path: str | None, found: bool, state: RunState, total_steps: int) -> str:
    if found and state.step >= total_steps:
        return f"resumed from {path}: the run there had finished all {total_steps} steps, so its best weights are kept"
    if found:
        return f"resumed from {path} at step {state.step} of {total_steps} (epoch {state.epoch + 1})"
    return f"nothing to resume: no checkpoint at {path or '(no checkpoint file set)'}, so training started from the beginning"


def _count_steps(samples: int, world: int, settings: Any) -> tuple[int, int]:
    """Optimizer steps per epoch and in the whole run (``max_steps`` caps the latter)."""
    steps_per_epoch = math.ceil(samples / world) // settings.batch_size
    if steps_per_epoch == 0:
        raise TrainingError(f"the training data has {samples} samples, fewer than one batch of "
                            f"{settings.batch_size} per process; lower --batch-size")
    total_steps = settings.epochs * steps_per_epoch
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    return steps_per_epoch, total_steps


@dataclass
class _Trainer:
    """The parts of one optimizer step: forward (distilling when there is a teacher), backward, clip, step."""

    net: nn.Module
    teacher: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    dtype: torch.dtype | None
    settings: Any
    masks: list[tuple[nn.Parameter, torch.Tensor]]

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The loss, and the logits and labels of the scored positions (a language model's are per token)."""
        with torch.autocast(inputs.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            logits, scored = scored_positions(output_logits(self.net(inputs)), labels)
            if self.teacher is None:
                return F.cross_entropy(logits, scored), logits, scored
            with torch.no_grad():
                teacher_logits, _ = scored_positions(output_logits(self.teacher(inputs)), labels)
            return distillation_loss(logits, teacher_logits, scored, temperature=self.settings.temperature,
                                     alpha=self.settings.alpha), logits, scored

    def step(self, loss: torch.Tensor) -> bool:
        """Take one optimizer step; returns whether the fp16 scaler skipped it for overflow."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.settings.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.net.parameters(), self.settings.grad_clip)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        for param, mask in self.masks:
            local_part(param).mul_(mask)
        return scale_before is not None and self.scaler.get_scale() < scale_before


def _train_epoch(trainer: _Trainer, batches, state: RunState, *, device: torch.device, world: int,
                 checkpoints: Checkpoints, bar: TrainingProgress) -> None:
    trainer.net.train()
    started, seen = time.perf_counter(), 0
    for inputs, labels in batches:
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss, logits, scored = trainer.loss(inputs, labels)
        if not all_finite(loss):
            raise _diverged(loss, state, trainer, checkpoints)
        state.skipped += trainer.step(loss)
        state.step += 1
        state.position += len(labels)
        state.loss_sum += loss.item() * scored.numel()
        state.correct += int((logits.argmax(-1) == scored).sum())
        state.samples += scored.numel()
        seen += len(labels) * world
        bar.update(loss=state.loss_sum / state.samples, accuracy=state.correct / state.samples,
                   images_per_s=seen / max(time.perf_counter() - started, 1e-9), epoch=state.epoch)
        every = trainer.settings.checkpoint_every
        if every and state.step % every == 0:
            checkpoints.save(state)


def _diverged(loss: torch.Tensor, state: RunState, trainer: _Trainer, checkpoints: Checkpoints) -> TrainingError:
    lr = trainer.scheduler.get_last_lr()[0]
    fix = "lower --lr" + (" or set --train-amp off" if trainer.dtype is not None else "")
    kept = (f"The last checkpoint {checkpoints.path} is intact" if checkpoints.saved
            else "No checkpoint was written")
    return TrainingError(f"the loss became {loss.item()} at epoch {state.epoch + 1}, step {state.step + 1} "
                         f"(lr {lr:.3g}); {fix}. {kept}")


def _end_epoch(model: nn.Module, val_set: Dataset | None, state: RunState, settings: Any, device: torch.device,
               scheduler: Any) -> dict[str, float]:
    """Record the epoch (all-reduced figures), keep its weights if they score best, and start the next one.

    ``model`` is the module that trains (the sharded copy under FSDP); every rank keeps the best weights whole.
    """
    loss_sum, correct, samples = all_reduce_sum(_sums([state.loss_sum, state.correct, state.samples], device)).tolist()
    broadcast_buffers(model)
    record = {"epoch": state.epoch + 1, "train_loss": loss_sum / max(samples, 1),
              "train_accuracy": correct / max(samples, 1), "lr": scheduler.get_last_lr()[0]}
    val = None
    if val_set is not None:
        val = evaluate(model, val_set, batch_size=settings.batch_size * 2, device=device, amp=settings.amp)
        record |= {"val_loss": val["loss"], "val_accuracy": val["accuracy"]}
    state.history.append(record)
    if val is None or state.best_accuracy is None or val["accuracy"] > state.best_accuracy:
        state.best_accuracy = val["accuracy"] if val else None
        state.best_epoch = state.epoch + 1
        state.best_weights = full_state_dict(model)
    state.next_epoch()
    return record


def _sums(values: list[float], device: torch.device) -> torch.Tensor:
    # float64 so that large datasets count exactly; MPS has no float64.
    return torch.tensor(values, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)


def _zero_masks(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    masks = []
    for module in model.modules():
        if isinstance(module, PRUNABLE_WEIGHT_TYPES):
            # Under FSDP each rank masks its own shard.
            mask = local_part(module.weight) != 0
            if not bool(mask.all()):
                masks.append((module.weight, mask.to(module.weight.dtype)))
    return masks
