"""Mixed precision: the autocast wrapper and the rule that picks its dtype."""

from optkit.passes.precision.passes import Autocast

__all__ = ["Autocast"]
