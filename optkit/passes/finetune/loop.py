"""The training loop that recovers accuracy after pruning.

``fit`` is the whole loop and reads top to bottom: AdamW with decay / no-decay
parameter groups, a cosine schedule with linear warmup, gradient clipping,
autocast (with a ``GradScaler`` only for fp16), optional distillation from a
teacher, evaluation each epoch keeping the best weights, and atomic
checkpoints from which ``resume`` continues exactly where it stopped.

Under ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel
(gloo on CPU, nccl on CUDA); every rank must call it with the same model, data
and config, and only rank 0 writes checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Subset

from optkit.data.datasets import make_loader

from optkit.io.files import atomic_path
from optkit.core.errors import ModelLoadError, TrainingError, UntrustedPickleError
from optkit.analysis.metrics import PRUNABLE_WEIGHT_TYPES
from optkit.io.models import read_checkpoint

CHECKPOINT_FORMAT = "optkit.passes.finetune.loop-checkpoint"
# Settings a resumed run must share with the run that wrote the checkpoint, or it would not end in the same place.
_RESUME_KEYS = ("epochs", "batch_size", "lr", "weight_decay", "warmup", "seed", "amp", "alpha", "temperature")
_log = logging.getLogger(__name__)
_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one fine-tuning run.

    Attributes:
        epochs: passes over the training data.
        batch_size: samples per step on each process.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW decay on weights (never on biases or norm parameters).
        warmup: fraction of all steps spent warming the learning rate up linearly.
        grad_clip: clip the global gradient norm to this; 0 disables clipping.
        amp: ``auto`` (bf16 on CUDA that supports it, else fp16; off on CPU),
            ``off``, ``bf16`` or ``fp16``.
        alpha: weight of the distillation term when a teacher is given (0..1).
        temperature: softening temperature of the distillation logits.
        seed: seeds weights-independent randomness and the data order.
        checkpoint: file to write checkpoints to (``None``: no checkpoints).
        checkpoint_every: also checkpoint every this many steps (0: epoch ends only).
        resume: continue from ``checkpoint`` if it exists.
        progress: show a progress bar; ``None`` shows one when stderr is a terminal.
        device: ``cpu``, ``cuda``, ``cuda:1``...; ``None`` picks CUDA when available.
        num_workers: DataLoader worker processes, or ``auto`` to measure (see :func:`optkit.data.datasets.make_loader`).
            A resumed run repeats the uninterrupted one exactly when augmentation runs in the
            main process (0 workers, what in-memory datasets get); workers draw fresh augmentations.
        keep_sparsity: keep weights that are exactly zero at the start at zero
            (so unstructured pruning survives fine-tuning).
    """

    epochs: int = 2
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.05
    grad_clip: float = 1.0
    amp: str = "auto"
    alpha: float = 0.5
    temperature: float = 4.0
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    progress: bool | None = None
    device: str | None = None
    num_workers: int | str = "auto"
    keep_sparsity: bool = True


@dataclass
class TrainResult:
    """What :func:`fit` returns.

    Attributes:
        model: the model holding the best weights (by validation accuracy).
        history: per epoch: ``epoch``, ``train_loss``, ``train_accuracy``, ``val_loss``, ``val_accuracy``, ``lr``.
        best_epoch: 1-based epoch whose weights were kept (the last one without validation data).
        best_accuracy: validation accuracy of those weights, or ``None`` without validation data.
        skipped_steps: fp16 steps the gradient scaler skipped for overflow.
    """

    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = 0
    best_accuracy: float | None = None
    skipped_steps: int = 0


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: decay on conv/linear (and other) weights, none on biases and norm parameters.

    Returns:
        two groups, ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]``.
    """
    no_decay_ids = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or name == "bias" or param.ndim <= 1:
                no_decay_ids.add(id(param))
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in no_decay_ids], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0},
    ]


def cosine_with_warmup(total_steps: int, warmup_steps: int):
    """The learning-rate multiplier at each step: linear warmup to 1, then cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *,
                      temperature: float, alpha: float) -> torch.Tensor:
    """Label cross-entropy mixed with KL divergence to the teacher's softened logits.

    ``(1 - alpha) * CE(student, labels) + alpha * T² * KL(softmax(teacher/T) || softmax(student/T))``;
    the ``T²`` keeps the soft term's gradients on the scale of the hard one's.
    """
    hard = F.cross_entropy(student, labels)
    soft = F.kl_div(F.log_softmax(student.float() / temperature, dim=-1),
                    F.log_softmax(teacher.float() / temperature, dim=-1),
                    reduction="batchmean", log_target=True)
    return (1.0 - alpha) * hard + alpha * temperature**2 * soft


def init_distributed() -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment, if any.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` outside a distributed launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """Whether this process should write files (rank 0, or not distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def resolve_device(device: str | None) -> torch.device:
    """The training device: the given one, else this rank's GPU when CUDA is available, else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for an ``amp`` mode on ``device`` (``None``: full precision)."""
    if amp == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, *, batch_size: int = 256, device: str | torch.device | None = None,
             amp: str = "off", num_workers: int | str = 0) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of ``model`` on ``dataset``.

    Under DDP each rank evaluates its share and the sums are all-reduced, so
    every rank gets the same figures.

    Returns:
        ``{"loss": float, "accuracy": float, "samples": int}``.
    """
    device = resolve_device(str(device) if device is not None else None)
    rank, world = _rank_world()
    shard = Subset(dataset, range(rank, len(dataset), world)) if world > 1 else dataset
    loader = make_loader(shard, batch_size, num_workers=num_workers, device=device)
    dtype = resolve_amp(amp, device)
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for inputs, labels in loader:
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(inputs)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(-1) == labels).sum()
        totals[2] += labels.numel()
    model.train(was_training)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(totals)
    loss, correct, samples = totals.tolist()
    return {"loss": loss / max(samples, 1), "accuracy": correct / max(samples, 1), "samples": int(samples)}


def fit(model: nn.Module, train_set: Dataset, val_set: Dataset | None, config: TrainConfig, *,
        teacher: nn.Module | None = None) -> TrainResult:
    """Fine-tune ``model`` on ``train_set``, keeping the weights that score best on ``val_set``.

    Args:
        model: the model to train, changed in place (and moved to the training device).
        train_set: yields ``(input, label)`` pairs.
        val_set: evaluated after each epoch; ``None`` keeps the last weights.
        config: the run's settings.
        teacher: a model to distil from (its softened logits are mixed into the loss).

    Returns:
        the model with the best weights, the per-epoch history and what was kept.

    Raises:
        TrainingError: when the loss stops being finite (the last checkpoint is left intact),
            or the checkpoint to resume from does not match this run.
    """
    rank, world = init_distributed()
    device = resolve_device(config.device)
    dtype = resolve_amp(config.amp, device)
    model.to(device)
    if teacher is not None:
        teacher.to(device).eval()

    steps_per_epoch = _samples_per_rank(len(train_set), world) // config.batch_size
    if steps_per_epoch == 0:
        raise TrainingError(f"the training data has {len(train_set)} samples, fewer than one batch of "
                            f"{config.batch_size} per process; lower --batch-size")
    total_steps = config.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(total_steps, max(1, round(config.warmup * total_steps))))
    # bf16 has fp32's exponent range, so only fp16 needs loss scaling.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = _ResumableSampler(train_set, num_replicas=world, rank=rank, seed=config.seed)
    loader = make_loader(train_set, config.batch_size, sampler=sampler, drop_last=True, device=device,
                         num_workers=config.num_workers, seed=config.seed)
    # Seeded after the loader is measured (which draws a timing-dependent number of
    # augmentations) and before a checkpoint's RNG state is restored.
    torch.manual_seed(config.seed)
    state = _RunState()
    if config.resume and config.checkpoint and Path(config.checkpoint).exists():
        state = _load_checkpoint(config, model, optimizer, scheduler, scaler, world)
    masks = _zero_masks(model) if config.keep_sparsity else []
    net = _wrap_ddp(model, device) if world > 1 else model
    saver = _Saver(config, rank, model, optimizer, scheduler, scaler, world)

    with _Progress(config, rank, total_steps, state.step) as progress:
        for epoch in range(state.epoch, config.epochs):
            sampler.set_epoch(epoch)
            sampler.start = state.position
            net.train()
            started, seen = time.perf_counter(), 0
            for inputs, labels in loader:
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    logits = net(inputs)
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(inputs)
                        loss = distillation_loss(logits, teacher_logits, labels,
                                                 temperature=config.temperature, alpha=config.alpha)
                    else:
                        loss = F.cross_entropy(logits, labels)
                if not _all_finite(loss, world):
                    raise TrainingError(
                        f"the loss became {loss.item()} at epoch {epoch + 1}, step {state.step + 1} "
                        f"(lr {scheduler.get_last_lr()[0]:.3g}); lower --lr{' or turn off --amp' if dtype else ''}. "
                        + (f"The last checkpoint {config.checkpoint} is intact" if saver.saved
                           else "No checkpoint was written"))
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if config.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                scale_before = scaler.get_scale() if scaler.is_enabled() else None
                scaler.step(optimizer)
                scaler.update()
                if scale_before is not None and scaler.get_scale() < scale_before:
                    state.skipped += 1
                scheduler.step()
                for param, mask in masks:
                    param.data.mul_(mask)

                state.step += 1
                state.position += labels.numel()
                state.loss_sum += loss.item() * labels.numel()
                state.correct += int((logits.argmax(-1) == labels).sum())
                state.samples += labels.numel()
                seen += labels.numel() * world
                progress.update(loss=state.loss_sum / state.samples, accuracy=state.correct / state.samples,
                                images_per_s=seen / max(time.perf_counter() - started, 1e-9), epoch=epoch)
                if config.checkpoint_every and state.step % config.checkpoint_every == 0:
                    saver.save(state)

            train_stats = _all_reduced_train_stats(state, device, world)
            if world > 1:
                _broadcast_buffers(model)
            val = evaluate(model, val_set, batch_size=config.batch_size * 2, device=device,
                           amp=config.amp) if val_set is not None else None
            state.history.append({"epoch": epoch + 1, **train_stats, "lr": scheduler.get_last_lr()[0],
                                  **({"val_loss": val["loss"], "val_accuracy": val["accuracy"]} if val else {})})
            if val is None or state.best_accuracy is None or val["accuracy"] > state.best_accuracy:
                state.best_accuracy = val["accuracy"] if val else None
                state.best_epoch = epoch + 1
                state.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            progress.log_epoch(state.history[-1])
            state.next_epoch()
            saver.save(state)

    if state.best_weights is not None:
        model.load_state_dict(state.best_weights)
    return TrainResult(model, state.history, state.best_epoch, state.best_accuracy, state.skipped)


@dataclass
class _RunState:
    """Where a run stands; everything here goes into the checkpoint."""

    epoch: int = 0
    position: int = 0  # samples this rank has consumed in the current epoch
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
        self.epoch += 1
        self.position = 0
        self.loss_sum, self.correct, self.samples = 0.0, 0, 0


class _ResumableSampler(DistributedSampler):
    """DistributedSampler (a seeded permutation per epoch) that can start part-way through an epoch."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, start: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def _samples_per_rank(n: int, world: int) -> int:
    return math.ceil(n / world)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _all_finite(loss: torch.Tensor, world: int) -> bool:
    # Every rank must agree, or the ones that stop would leave the others waiting in all-reduce.
    finite = torch.isfinite(loss.detach()).float().reshape(1)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def _broadcast_buffers(model: nn.Module) -> None:
    # DDP syncs buffers at the start of each forward, so after the last step every rank
    # holds BatchNorm statistics of its own batch; take rank 0's, as DDP would next.
    import torch.distributed as dist

    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def _all_reduced_train_stats(state: _RunState, device: torch.device, world: int) -> dict[str, float]:
    totals = torch.tensor([state.loss_sum, state.correct, state.samples], dtype=torch.float64, device=device)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return {"train_loss": loss_sum / max(samples, 1), "train_accuracy": correct / max(samples, 1)}


def _zero_masks(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    masks = []
    for module in model.modules():
        if isinstance(module, PRUNABLE_WEIGHT_TYPES):
            mask = module.weight.detach() != 0
            if not bool(mask.all()):
                masks.append((module.weight, mask.to(module.weight.dtype)))
    return masks


class _Saver:
    """Writes atomic checkpoints from rank 0; ``saved`` says whether one exists for this run."""

    def __init__(self, config: TrainConfig, rank: int, model, optimizer, scheduler, scaler, world: int):
        self.config, self.rank, self.world = config, rank, world
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.saved = bool(config.checkpoint and config.resume and Path(config.checkpoint).exists())

    def save(self, state: _RunState) -> None:
        if not self.config.checkpoint or self.rank != 0:
            return
        payload = {
            "format": CHECKPOINT_FORMAT,
            "settings": {k: getattr(self.config, k) for k in _RESUME_KEYS} | {"world_size": self.world},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            "state": {f.name: getattr(state, f.name) for f in fields(state) if f.name != "best_weights"},
            "best_weights": state.best_weights,
        }
        with atomic_path(self.config.checkpoint) as tmp:
            torch.save(payload, tmp)
        self.saved = True


def _load_checkpoint(config: TrainConfig, model, optimizer, scheduler, scaler, world: int) -> _RunState:
    path = config.checkpoint
    try:
        payload = read_checkpoint(path)
    except UntrustedPickleError as e:
        raise TrainingError(f"cannot resume: {path} holds pickled Python objects, which an optkit training "
                            "checkpoint never does, so it is not loaded; remove it to start over") from e
    except ModelLoadError as e:
        raise TrainingError(f"cannot resume: {e}; or remove it to start over") from e
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise TrainingError(f"cannot resume: {path} is not an optkit training checkpoint")
    wanted = {k: getattr(config, k) for k in _RESUME_KEYS} | {"world_size": world}
    different = sorted(k for k, v in wanted.items() if payload["settings"].get(k) != v)
    if different:
        found = ", ".join(f"{k}={payload['settings'].get(k)!r}" for k in different)
        raise TrainingError(f"cannot resume from {path}: it was written with {found}; rerun with those settings or remove it")
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        raise TrainingError(f"cannot resume from {path}: its weights do not fit this model (was it pruned differently?)") from e
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    scaler.load_state_dict(payload["scaler"])
    torch.set_rng_state(payload["rng"]["torch"])
    if payload["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    state = _RunState(**payload["state"])
    state.best_weights = payload["best_weights"]
    return state


class _Progress:
    """A rich progress bar on stderr with loss, accuracy and images/s; without one, epoch summaries go to the log."""

    def __init__(self, config: TrainConfig, rank: int, total: int, completed: int):
        enabled = config.progress if config.progress is not None else sys.stderr.isatty()
        self.enabled = bool(enabled) and rank == 0
        self.rank = rank
        self.total, self.completed, self.epochs = total, completed, config.epochs

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[accuracy]:.2%}  "
                                            "{task.fields[images_per_s]:.0f} img/s"),
                                 TimeRemainingColumn(), console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task("fine-tune", total=self.total, completed=self.completed,
                                            loss=float("nan"), accuracy=0.0, images_per_s=0.0)
        return self

    def update(self, *, loss: float, accuracy: float, images_per_s: float, epoch: int) -> None:
        if self.enabled:
            self._bar.update(self._task, advance=1, description=f"epoch {epoch + 1}/{self.epochs}",
                             loss=loss, accuracy=accuracy, images_per_s=images_per_s)

    def log_epoch(self, record: dict[str, float]) -> None:
        text = f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.2%}"
        if "val_accuracy" in record:
            text += f", val loss {record['val_loss']:.4f} acc {record['val_accuracy']:.2%}"
        if self.enabled:
            self._bar.console.print(text)
        elif self.rank == 0:
            _log.info(text)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()

