"""Fine-tuning after pruning: the pass and its training loop."""

from optkit.passes.finetune.passes import FineTune

__all__ = ["FineTune"]
