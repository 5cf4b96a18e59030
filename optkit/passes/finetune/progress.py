"""What a training run shows while it runs: a rich progress bar, or one log line per epoch."""

from __future__ import annotations

import logging
import sys
from typing import Any


def epoch_summary(record: dict[str, float]) -> str:
    """One line about a finished epoch: train loss and accuracy, and the validation figures when there are any.

    Args:
        record: an entry of :attr:`~optkit.passes.finetune.loop.TrainResult.history`.

    Returns:
        the line, e.g. ``epoch 2: train loss 0.4121 acc 85.10%, val loss 0.3990 acc 86.02%``.
    """
    text = f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.2%}"
    if "val_accuracy" in record:
        text += f", val loss {record['val_loss']:.4f} acc {record['val_accuracy']:.2%}"
    return text


class TrainingProgress:
    """A progress bar on stderr with loss, accuracy and images/s, shown by rank 0.

    Without a bar, rank 0 sends each epoch's summary to ``log`` (the CLI prints
    that logger's lines when stderr is not a terminal).

    Args:
        show: show the bar; ``None`` shows one when stderr is a terminal.
        rank: this process's rank (only rank 0 shows anything).
        total: optimizer steps in the whole run.
        completed: steps already taken (a resumed run).
        epochs: epochs in the whole run.
        log: where epoch summaries go without a bar.
    """

    def __init__(self, show: bool | None, *, rank: int, total: int, completed: int, epochs: int,
                 log: logging.Logger):
        self.enabled = bool(sys.stderr.isatty() if show is None else show) and rank == 0
        self.rank, self.total, self.completed, self.epochs, self.log = rank, total, completed, epochs, log

    def __enter__(self) -> TrainingProgress:
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
        """Advance the bar by one step, showing the epoch's running figures."""
        if self.enabled:
            self._bar.update(self._task, advance=1, description=f"epoch {epoch + 1}/{self.epochs}",
                             loss=loss, accuracy=accuracy, images_per_s=images_per_s)

    def log_epoch(self, record: dict[str, float]) -> None:
        """Report a finished epoch above the bar, or in the log without one."""
        if self.enabled:
            self._bar.console.print(epoch_summary(record))
        elif self.rank == 0:
            self.log.info(epoch_summary(record))

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._bar.stop()
