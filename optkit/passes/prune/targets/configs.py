"""Pruning targets: what a structured prune aims at, as small typed configs, each with a registered handler.

:meth:`optkit.passes.prune.passes.StructuredPrune.target` turns the pass's
settings into one of these configs (the only place that reads them), and
:func:`reach` runs the handler registered for the config's type. Every
handler prunes through :func:`optkit.passes.prune.graph.channels.prune_to`, asking
for one ratio for every group or for per-group widths:

- :class:`RatioTarget`: one ratio (:mod:`optkit.passes.prune.targets.ratio`);
- :class:`MacsTarget`, :class:`ParamsTarget`: a fraction of the MACs or
  parameters, by bracketing search over the ratio and per-group fills
  (:mod:`optkit.passes.prune.targets.ratio`);
- :class:`LatencyTarget`: a measured ONNX Runtime latency fraction
  (:mod:`optkit.passes.prune.targets.latency`);
- :class:`MixTarget`: a transformer's parameter or MACs fraction, split between
  heads and MLP channels by measured perplexity (:mod:`optkit.passes.prune.targets.mix`);
- :class:`SensitivityTarget`: a MACs fraction with the least loss predicted
  by measured per-group curves (:mod:`optkit.passes.prune.targets.sensitivity`).

A new target is a frozen dataclass here (or in its own module) and a function
decorated with :func:`handles` taking ``(target, spec, model)`` and returning
a :class:`~optkit.core.contract.PassResult`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from optkit.core.contract import PassResult

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.prune.spec import PruneSpec
    from optkit.passes.prune.targets.curves import Sensitivity

Handler = Callable[[Any, "PruneSpec", "nn.Module"], PassResult]
_HANDLERS: dict[type, Handler] = {}


@dataclass(frozen=True)
class RatioTarget:
    """Remove ``ratio`` of every group's channels, counts rounded to multiples of ``round_to``."""

    ratio: float
    round_to: int


@dataclass(frozen=True)
class FractionTarget:
    """Keep ``fraction`` of what :attr:`measured` counts, within ``tolerance``, starting at ``round_to``."""

    measured: ClassVar[str] = ""
    fraction: float
    tolerance: float
    round_to: int


@dataclass(frozen=True)
class MacsTarget(FractionTarget):
    """Keep ``fraction`` of the original's MACs."""

    measured: ClassVar[str] = "macs"


@dataclass(frozen=True)
class ParamsTarget(FractionTarget):
    """Keep ``fraction`` of the original's parameters."""

    measured: ClassVar[str] = "params"


@dataclass(frozen=True)
class SensitivityTarget(FractionTarget):
    """Keep ``fraction`` of the MACs where ``sensitivity``'s curves predict the least loss."""

    measured: ClassVar[str] = "macs"
    sensitivity: Sensitivity


@dataclass(frozen=True)
class MixTarget:
    """Keep ``fraction`` of a transformer's parameters or MACs (``measured``) within ``tolerance``, MLP widths in
    multiples of ``round_to``, the cut split between attention heads and MLP channels by validation perplexity
    on the pass's text data (:mod:`optkit.passes.prune.targets.mix`). ``measured_by_default``: the split was not
    asked for (the default allocation chose it), so a model too large to measure within the time budget is cut
    uniformly instead."""

    fraction: float
    tolerance: float
    round_to: int
    measured: str = "params"
    measured_by_default: bool = False

    def __post_init__(self) -> None:
        if self.measured not in ("params", "macs"):
            raise ValueError(f"MixTarget measures params or macs, not {self.measured!r}")


@dataclass(frozen=True)
class LatencyTarget:
    """Reach ``fraction`` of the original's ONNX Runtime latency, measured on this machine.

    Attributes:
        fraction: the latency fraction.
        tolerance: the MACs search's tolerance for its proposal.
        threads: intra-op threads timed at (``None``: all cores).
        batch: the batch timed.
        round_to: channel multiple, or ``None`` to pick one by the latency table.
        data: a dataset spec, or ``None``: with one, the tries measured near the fraction (a little faster
            included, see :func:`optkit.passes.prune.targets.latency.search`) are scored on its
            validation split (BatchNorm re-estimated on its training split) and the most accurate is kept;
            without, the one keeping the most MACs per measured millisecond.
    """

    fraction: float
    tolerance: float
    threads: int | None
    batch: int
    round_to: int | None
    data: str | None = None


def handles(*target_types: type) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``target_types``.

    Raises:
        ValueError: if a type already has a handler.
    """

    def register(handler: Handler) -> Handler:
        for target_type in target_types:
            if target_type in _HANDLERS:
                raise ValueError(f"{target_type.__name__} already has a handler: {_HANDLERS[target_type].__qualname__}")
            _HANDLERS[target_type] = handler
        return handler

    return register


def reach(target: Any, spec: PruneSpec, model: nn.Module) -> PassResult:
    """Prune ``model`` to ``target`` with the handler registered for its type.

    Args:
        target: a target config.
        spec: how channels are chosen and removed.
        model: the model; handlers that search prune copies and return the one kept.

    Returns:
        the pruned model with the handler's details.

    Raises:
        TypeError: for a target type no handler is registered for.
    """
    handler = _HANDLERS.get(type(target))
    if handler is None:
        known = ", ".join(sorted(t.__name__ for t in _HANDLERS))
        raise TypeError(f"no handler for the pruning target {type(target).__name__}; registered: {known}")
    return handler(target, spec, model)
