"""What a structured prune is asked: how channels are chosen and removed (:class:`PruneSpec`), and how many each
group keeps (:class:`Widths`). Every target, the graph engine and the Hugging Face engine read these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PruneSpec", "Widths"]


@dataclass(frozen=True)
class Widths:
    """How many channels each dependency group keeps, in torch-pruning's terms.

    Build them with :meth:`PruneSpec.uniform` or :meth:`PruneSpec.per_group`.

    Attributes:
        ratio: fraction removed from every group ``per_group`` does not name.
        per_group: layer pattern -> fraction removed from the group it roots (``None``: none).
        round_to: kept counts are multiples of this (1: no rounding).
        global_: rank channels across all groups to remove ``ratio`` of them, instead of in each group.
        steps: reach the widths in this many equal steps (each rounds).
        heads_ratio: a transformer's share of attention heads to remove, when it differs from
            ``ratio`` (which its MLP channels then lose); ``None``: ``ratio`` for both.
    """

    ratio: float
    per_group: Mapping[str, float] | None
    round_to: int
    global_: bool = False
    steps: int = 1
    heads_ratio: float | None = None


@dataclass(frozen=True)
class PruneSpec:
    """How a structured prune chooses and removes channels: everything but how many.

    :meth:`optkit.passes.prune.passes.StructuredPrune.spec` builds it from the
    pass's settings, which document each field.

    Attributes:
        input_shape: the model's example input shape.
        importance: how channels are ranked (``l1``, ``l2``, ``taylor``, ``bn_scale``, ``random``).
        global_: with one ratio for every group, rank channels across groups.
        steps: equal steps a prune is reached in (``iterative_steps``).
        layer_ratios: the user's per-layer ratio overrides, applied with one ratio for every group.
        ignored_layers: fnmatch patterns of modules that keep their output channels.
        submodule: prune only this sub-module (``None``: the model kind's choice).
        bias_correction: give removed BatchNorm channels' expected contribution back.
        drop_blocks: whole transformer blocks to remove.
        timeout_s, group_timeout_s, fallback_budget_s, fallback_trials: the verified prune's limits.
        data, calibration, calibration_batches, batch_size: batches for ``taylor`` importance.
        device: where a transformer's blocks are computed, one at a time (``None``: where the model is).
        block_inputs: whether a block's statistics are taken on the pruned (``pruned``) or the unpruned
            (``unpruned``) outputs of the blocks before it.
    """

    input_shape: tuple[int, ...]
    importance: str = "l1"
    global_: bool = False
    steps: int = 1
    layer_ratios: Mapping[str, float] | None = None
    ignored_layers: tuple[str, ...] = ()
    submodule: str | None = None
    bias_correction: bool = True
    drop_blocks: int = 0
    timeout_s: float = 0.0
    group_timeout_s: float = 0.0
    fallback_budget_s: float = 40.0
    fallback_trials: int = 40
    data: str | None = None
    calibration: Any = None
    calibration_batches: int = 4
    batch_size: int = 16
    device: str | None = None
    block_inputs: str = "unpruned"

    def uniform(self, ratio: float, round_to: int) -> Widths:
        """Every group loses ``ratio`` of its channels (the user's ``layer_ratios`` and ranking apply)."""
        return Widths(ratio, self.layer_ratios, round_to, self.global_, self.steps)

    def per_group(self, ratios: Mapping[str, float], round_to: int, *, steps: int | None = None) -> Widths:
        """The groups ``ratios`` names lose those fractions (see :func:`~optkit.passes.prune.graph.groups.ratios_for`),
        the others none; in ``steps`` steps (default: the spec's)."""
        return Widths(0.0, dict(ratios) or None, round_to, False, self.steps if steps is None else steps)

    def root_and_inputs(self, model: nn.Module) -> tuple[nn.Module, Any, str | None]:
        """The module to prune (the model, or its sub-module), the inputs it receives, and its name.

        Raises:
            ValueError: for a sub-module the model does not have or does not run.
        """
        import torch

        from optkit.kinds import call_with, example_inputs, kind_of
        from optkit.model.state import eval_mode

        inputs = example_inputs(model, self.input_shape)
        submodule = self.submodule if self.submodule is not None else kind_of(model).prune_root(model)
        if not submodule:
            return model, inputs, None
        try:
            root = model.get_submodule(submodule)
        except AttributeError as e:
            raise ValueError(f"submodule {submodule!r} is not a module of {type(model).__name__}") from e
        captured: list = []
        hook = root.register_forward_pre_hook(lambda module, args: captured.append(args))
        try:
            with eval_mode(model), torch.no_grad():
                call_with(model, inputs)
        finally:
            hook.remove()
        if not captured:
            raise ValueError(f"submodule {submodule!r} does not run in a forward pass at input_shape {self.input_shape}")
        args = captured[0]
        return root, args[0] if len(args) == 1 else list(args), submodule

    # groups.prunable_groups asks for the private name (the pass's, which it was written against).
    _root_and_inputs = root_and_inputs
