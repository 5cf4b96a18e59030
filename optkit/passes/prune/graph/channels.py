"""Prune a model's channels to given widths: the one entry point every pruning target calls.

A :class:`PruneSpec` says how channels are chosen and removed (importance,
held layers, time limits, the fallback search); :class:`Widths` says how many
each dependency group keeps; :func:`prune_to` applies them, verified, in
place. Targets (:mod:`optkit.passes.prune.targets.configs`) differ only in the widths
they ask for: one ratio for every group, or per-group counts.

A Hugging Face transformer (repeated blocks under a config) is pruned by
:mod:`optkit.passes.prune.hf` instead: whole heads, MLP channels and
blocks, uniformly across blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optkit.passes.prune.spec import PruneSpec, Widths

if TYPE_CHECKING:
    from torch import nn


def prune_to(model: nn.Module, spec: PruneSpec, widths: Widths) -> dict[str, Any]:
    """Prune ``model`` in place to ``widths`` the way ``spec`` says, never leaving it half-changed.

    A deep copy is pruned and checked (forward, backward, same output shapes);
    dependency groups that break it, raise or do not finish in
    ``group_timeout_s`` are found by the fallback search and held at full
    width. The checked copy's state is then moved into ``model``. When
    nothing can be pruned, ``model`` is left exactly as it was.

    Args:
        model: the model, changed in place.
        spec: how channels are chosen and removed.
        widths: how many each group keeps.

    Returns:
        details for the report: ``ratio``, ``skipped_layers`` (name -> reason),
        ``pruned_layers`` (count), ``held_layers`` (group roots the fallback
        held -> the error they caused), ``fallback`` (its cost: ``trials``,
        ``seconds``), and ``shortfall`` (one line) when less than asked was
        reachable.

    Raises:
        ValueError: for a layer pattern or sub-module that matches nothing, or
            settings a transformer's pruning does not take.
    """
    from optkit.kinds import example_inputs
    from optkit.model.stats import count_macs
    from optkit.passes.prune.graph import pruner as _engine
    from optkit.passes.prune.graph import fallback as _fallback
    from optkit.passes.prune.graph import limits as _limits
    from optkit.passes.prune.hf import describes_transformer

    if spec.submodule is None and describes_transformer(model):
        from optkit.passes.prune.hf.entry import prune_transformer_to
        from optkit.passes.prune.hf.transformer import heads_with_stream

        return heads_with_stream(model, spec, widths, prune_transformer_to(model, spec, widths))
    if spec.drop_blocks:
        raise ValueError("drop_blocks removes blocks of a Hugging Face transformer (a model with a config and "
                         "repeated blocks); this model is not one")
    search_notes: list[str] = []
    if spec.submodule is None and widths.per_group is None and not widths.global_ and widths.steps == 1:
        described = _prune_to_config_widths(model, spec, widths, search_notes)
        if described is not None:
            return described
    ratio = widths.ratio
    root, inputs, submodule = spec.root_and_inputs(model)
    held, overrides = _engine.user_choices(root, spec.ignored_layers, widths.per_group)
    held.update(_kind_held(model, root, held))
    names = {module: name for name, module in root.named_modules()}
    job = _fallback.Job(
        model=model, root_name=submodule or "", model_inputs=example_inputs(model, spec.input_shape),
        root_inputs=inputs,
        options=_engine.Options(_importance(spec.importance), ratio, widths.global_, widths.steps, widths.round_to,
                                spec.bias_correction),
        held={names[m]: reason for m, reason in held.items()},
        overrides={names[m]: value for m, value in overrides.items()}, submodule=submodule,
        before_step=_taylor_gradients(spec) if spec.importance == "taylor" else None,
        attempt_limit_s=spec.timeout_s or None, group_limit_s=spec.group_timeout_s or None,
        budget_s=spec.fallback_budget_s, max_trials=spec.fallback_trials)
    outcome = _fallback.prune_verified(job)
    details: dict[str, Any] = {"ratio": ratio}
    if outcome.model is None:
        details.update(pruned_layers=0, skipped_layers={n: outcome.error for n in _conv_linear_names(root)},
                       shortfall=f"nothing pruned: {outcome.error}; the model is unchanged. Hold the blocks "
                                 "named in the error with ignored_layers, or raise timeout_s")
    else:
        macs_before = count_macs(model, spec.input_shape) if outcome.held else None
        _adopt(model, outcome.model)
        root = model.get_submodule(submodule) if submodule else model
        details.update(pruned_layers=sum(1 for n in _conv_linear_names(root) if n not in outcome.skipped),
                       skipped_layers=outcome.skipped)
        if outcome.held:
            achieved = count_macs(model, spec.input_shape) / macs_before
            details["held_layers"] = outcome.held
            count = f"{len(outcome.held)} layer{'s' if len(outcome.held) > 1 else ''}"
            details["shortfall"] = (f"asked {ratio:g} per group, achieved MACs {achieved:.2f}; "
                                    f"{count} held, see held_layers")
    details["fallback"] = {"trials": outcome.trials, "seconds": outcome.seconds}
    if "shortfall" in details:
        stopped = any(reason.startswith(_fallback.UNTESTED_REASON.split("(")[0]) for reason in outcome.held.values())
        bound = (f"; it stopped at its budget (fallback_budget_s {spec.fallback_budget_s:g} s, fallback_trials "
                 f"{spec.fallback_trials}) and kept the best prune found, holding the groups it had not tested"
                 if stopped else "")
        details["notes"] = [f"structured_prune {details['shortfall']} (fallback search: {outcome.trials} "
                            f"trial prune(s), {outcome.seconds:.1f} s{bound})"]
    if submodule:
        details["submodule"] = submodule
    if spec.timeout_s and not _limits.limit_available():
        details["time_limit"] = "not enforced (SIGALRM needs the main thread)"
    if search_notes:
        details["notes"] = [*details.get("notes", []), *search_notes]
    return details


def _prune_to_config_widths(model: nn.Module, spec: PruneSpec, widths: Widths,
                            notes: list[str] | None = None) -> dict[str, Any] | None:
    """Prune a ``transformers`` model to the widths its own config can state (:mod:`.config_widths`), so the stock
    class reloads it; ``None`` (and ``model`` unchanged) when its config states none or the result differs
    (a line on a search stopped at its budget then goes to ``notes``)."""
    import copy
    import dataclasses

    from optkit.model.state import detach_caches
    from optkit.passes.prune.hf import config_heads
    from optkit.passes.prune.hf import config_widths

    described = config_widths.describe(model, spec, widths, notes)
    if described is None:
        return None
    trial = copy.deepcopy(detach_caches(model))  # describe traced it with autograd on
    held = dataclasses.replace(spec, ignored_layers=(*spec.ignored_layers, *described.held))
    details = prune_to(trial, held, Widths(0.0, described.per_group, 1))
    config_heads.cut(trial, list(described.interiors), described.heads)
    if details.get("held_layers") or config_widths.adopt_config(trial, described) is not None:
        return None
    _adopt(model, trial)
    details["ratio"] = widths.ratio
    details["config_widths"] = described.edits
    details.setdefault("notes", []).append(
        f"structured_prune kept the widths the model's config states ({described.summary()}), so its stock "
        "class reloads it")
    details["notes"] += described.notes
    return details


def skipped_layers(model: nn.Module, spec: PruneSpec, widths: Widths) -> dict[str, str]:
    """Conv/linear layers a prune to ``widths`` would leave untouched, with the reason; the model is not changed.

    Returns:
        ``{layer name: reason}``, names relative to the pruned sub-module.
    """
    from optkit.passes.prune.graph import pruner as _engine

    root, inputs, submodule = spec.root_and_inputs(model)
    held, overrides = _engine.user_choices(root, spec.ignored_layers, widths.per_group)
    held.update(_kind_held(model, root, held))
    options = _engine.Options(_importance(spec.importance), widths.ratio, widths.global_, widths.steps,
                              widths.round_to)
    return _engine.prune_tree(root, inputs, options, held, overrides, submodule=submodule, dry_run=True)


def _taylor_gradients(spec: PruneSpec):
    batches = spec.calibration if spec.calibration is not None else _data_batches(spec)

    def accumulate(model: nn.Module) -> None:
        import torch
        import torch.nn.functional as F

        from optkit.kinds import model_device

        device = model_device(model)
        model.zero_grad(set_to_none=True)
        seen = 0
        with torch.enable_grad():
            for batch in batches:
                if seen >= spec.calibration_batches:
                    break
                if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                    raise ValueError("taylor importance needs (inputs, targets) batches")
                inputs, targets = batch[0].to(device), batch[1].to(device)
                F.cross_entropy(model(inputs), targets).backward()
                seen += 1
        if not seen:
            raise ValueError("taylor importance got no calibration batches")

    return accumulate


def _kind_held(model: nn.Module, root: nn.Module, held: dict[Any, str]) -> dict[Any, str]:
    """The layers of ``root`` that the model's kind keeps at full width (see :meth:`ModelKind.held_layers`)."""
    from optkit.kinds import kind_of

    inside = set(root.modules())
    modules = dict(model.named_modules())
    return {modules[name]: reason for name, reason in kind_of(model).held_layers(model).items()
            if modules[name] in inside and modules[name] not in held}


def _adopt(model: nn.Module, pruned: nn.Module) -> None:
    # The caller keeps its model object; it takes the pruned copy's modules and attributes.
    model.__dict__.clear()
    model.__dict__.update(pruned.__dict__)


def _conv_linear_names(root: nn.Module) -> list[str]:
    from optkit.model.stats import prunable_weights

    return [name for name, _ in prunable_weights(root)]


def _data_batches(spec: PruneSpec):
    from optkit.data import load_dataset, make_loader

    dataset = load_dataset(spec.data, "train", augment=False)
    return make_loader(dataset, spec.batch_size, shuffle=True, num_workers=0, seed=0)


def _importance(kind: str):
    import torch_pruning as tp

    if kind == "l1":
        return tp.importance.GroupMagnitudeImportance(p=1)
    if kind == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if kind == "taylor":
        return tp.importance.GroupTaylorImportance()
    if kind == "bn_scale":
        return tp.importance.BNScaleImportance()
    if kind == "activation":
        raise ValueError("importance 'activation' ranks a Hugging Face transformer's heads and MLP channels; for "
                         "channel pruning choose l1, l2, taylor, bn_scale or random")
    return tp.importance.RandomImportance()
