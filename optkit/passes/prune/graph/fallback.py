"""Verified structured pruning: prune a copy, check that it runs, hold what breaks it.

Every try prunes a deep copy of the caller's model, so the caller's model is
never left half-changed. A try succeeds when torch-pruning finishes within its
time limits and the pruned copy still runs: forward and backward, with the
same output shapes as before.

When the first try (everything prunable) fails, the dependency groups
responsible are found on fresh copies. A group whose index mapping raises
or does not finish within the per-group limit is held at once. Then the
groups touching the module the error was raised in (the innermost module
in its traceback: a forward, or torch-pruning working on a layer) are held,
with every group of the same structure elsewhere in the model (the same
block repeated), and the model is tried again, until a try passes; each
class held this way is then tried again on its own, since some only
touched the failing module. If an error points nowhere, the remaining
groups are halved, each half pruned alongside the groups already found
good, and a failing half split again until the single groups that break
the model are found. Held groups keep their width, with the error each
caused as the reason. The search has a time and a trial budget; groups it
could not test in time are held, and holding every group is the last resort.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optkit.kinds.base import call_with
from optkit.model.state import detach_caches
from optkit.passes.prune.graph import pruner as _engine
from optkit.passes.prune.graph import limits as _limits
from optkit.passes.prune.graph.tp_fixes import converging_groups

if TYPE_CHECKING:
    from torch import nn

OTHERS_REASON = "held while other groups were tested"
#: The name progress lines are shown under.
STAGE = "structured_prune"
UNTESTED_REASON = "held untested: the fallback search ran out of its budget ({})"


@dataclass
class Job:
    """One structured prune to run verified.

    Attributes:
        model: the caller's model; it is only ever copied, never changed.
        root_name: the sub-module being pruned ('' for the whole model).
        model_inputs: example inputs of the whole model (used to check it runs).
        root_inputs: the inputs the pruned sub-module receives.
        options: torch-pruning settings.
        held: root-relative module name -> why it keeps its width (the user's choices).
        overrides: root-relative module name -> per-layer ratio.
        submodule: name reported for the pruned sub-module, if any.
        before_step: called with the copy being pruned before each pruning step.
        attempt_limit_s: time limit for one try (tracing, pruning, checking).
        group_limit_s: time limit for building one dependency group.
        budget_s: time the whole search may take, the first try included (a try
            started within it runs to its end).
        max_trials: how many tries the fallback search may make.
    """

    model: Any
    root_name: str
    model_inputs: Any
    root_inputs: Any
    options: _engine.Options
    held: dict[str, str]
    overrides: dict[str, float]
    submodule: str | None = None
    before_step: Callable[[Any], None] | None = None
    attempt_limit_s: float | None = None
    group_limit_s: float | None = None
    budget_s: float = 45.0
    max_trials: int = 40


@dataclass
class Outcome:
    """What a verified prune produced.

    Attributes:
        model: the pruned, checked copy; ``None`` when nothing could be pruned.
        skipped: conv/linear layers of the root left untouched, name -> reason.
        held: group roots the fallback held, name -> the error pruning them caused.
        trials: how many pruned copies were tried.
        seconds: time spent, the first try included (0 when the first try worked).
        error: why nothing was pruned, when ``model`` is ``None``.
    """

    model: Any
    skipped: dict[str, str] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    trials: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class _Unit:
    """A dependency group, named by its root layer.

    ``shape`` is the same for groups repeated in a model's stages and blocks
    (member types and names with block indices blanked): once one of them
    breaks the model the others are held too, without a trial each.
    """

    root: str
    members: tuple[str, ...]
    shape: tuple
    touches: tuple[str, ...] = ()

    def inside(self, where: str) -> bool:
        return any(name == where or name.startswith(where + ".") for name in self.touches)


class _Search:
    """The fallback search's state: trials made, groups held (root -> reason), the best checked copy."""

    def __init__(self, job: Job, reference: list) -> None:
        from optkit.core.progress import progress

        self.job, self.reference = job, reference
        self.trials, self.started = 0, time.monotonic()
        self.shown = progress(STAGE, "fallback search trial prunes", job.max_trials)
        self.best: tuple[Any, dict[str, str]] | None = None
        self.held: dict[str, str] = {}
        self.errors: dict[tuple[str, ...], str] = {}
        self.bad_shapes: dict[tuple, str] = {}
        self.members: dict[str, tuple[str, ...]] = {}
        self.where: str | None = None
        self.classes: dict[tuple, list[_Unit]] = {}

    def out_of_budget(self) -> str | None:
        if self.trials >= self.job.max_trials:
            return f"{self.job.max_trials} trial prunes"
        if time.monotonic() - self.started > self.job.budget_s:
            return f"{self.job.budget_s:g} s"
        return None

    def test(self, part: list[_Unit], others: list[_Unit]) -> bool:
        """Prune everything but ``others`` and the groups already held; ``part`` is what is new."""
        extra = {member: reason for root, reason in self.held.items() for member in self.members.get(root, (root,))}
        extra.update({member: OTHERS_REASON for u in others for member in u.members or (u.root,)})
        work, skipped, error, self.where = attempt(self.job, extra, self.reference)
        self.trials += 1
        self.shown.step(detail=f"{len(self.held)} group(s) held")
        if error is None:
            self.best = (work, skipped)
            return True
        self.errors[tuple(u.root for u in part)] = error
        return False

    def localize(self, units: list[_Unit], known_failing: bool) -> list[_Unit]:
        """Hold the groups touching the module each failure was raised in, and their repeats.

        Stops when a try passes (returns nothing) or a failure points nowhere
        new (returns the groups not held, for :meth:`failing`).
        """
        classes: dict[tuple, list[_Unit]] = {}
        while known_failing or (self.out_of_budget() is None and not self.test([], [])):
            known_failing = False
            error, where = self.errors[()], self.where
            new = [u for u in units if u.root not in self.held and where is not None and u.inside(where)]
            if not new:
                break
            shapes = {u.shape for u in new}
            for unit in units:
                if unit.shape in shapes and unit.root not in self.held:
                    self.held[unit.root] = f"{error} (raised in {where})"
                    classes.setdefault(unit.shape, []).append(unit)
        self.classes = classes
        return [] if self.best is not None else [u for u in units if u.root not in self.held]

    def refine(self) -> None:
        """Try each class of groups held by :meth:`localize` again: some only touched the failing module."""
        for members in self.classes.values():
            if self.out_of_budget():
                return
            reasons = {u.root: self.held.pop(u.root) for u in members}
            if not self.test(members, []):
                error = self.errors[tuple(u.root for u in members)]
                self.held.update({root: error for root in reasons})

    def failing(self, units: list[_Unit], good: list[_Unit], rest: list[_Unit]) -> list[_Unit]:
        """Units of ``units`` that break the model when pruned together with ``good`` (known to fail)."""
        if len(units) == 1:
            unit = units[0]
            reason = self.errors.get((unit.root,), "")
            self.bad_shapes.setdefault(unit.shape, f"same structure as {unit.root}, which caused: {reason}")
            return units
        half = len(units) // 2
        bad: list[_Unit] = []
        parts = (units[:half], units[half:])
        for i, part in enumerate(parts):
            later = [u for p in parts[i + 1:] for u in p] + rest
            alike = [u for u in part if u.shape in self.bad_shapes]
            for unit in alike:
                self.held[unit.root] = self.bad_shapes[unit.shape]
            bad += alike
            part = [u for u in part if u not in alike]
            if not part:
                continue
            budget = self.out_of_budget()
            if budget:
                self.held.update({u.root: UNTESTED_REASON.format(budget) for u in part})
                bad += part
                continue
            if not self.test(part, later + bad):
                found = self.failing(part, good, later + bad)
                bad += found
                part = [u for u in part if u not in found]
            good = good + part
        return bad


def prune_verified(job: Job) -> Outcome:
    """Prune a copy of ``job.model``, holding the dependency groups that break it.

    Returns:
        the outcome; ``model`` is a checked pruned copy, or ``None`` when even
        the tracing failed (the reason is in ``error``).

    Raises:
        Exception: whatever the unpruned model raises when it does not run on
            the example inputs (nothing can be checked against it).
    """
    reference = output_shapes(job.model, job.model_inputs)
    search = _Search(job, reference)
    work, skipped, error, first_where = attempt(job, {}, reference)
    if error is None:
        return Outcome(work, skipped, trials=1)
    search.trials = 1
    units, screen_error = screen(job, search.held)
    search.members = {u.root: u.members for u in units}
    if screen_error is not None:
        return Outcome(None, trials=search.trials, seconds=_since(search.started), error=screen_error)
    bad: list[_Unit] = []
    search.where = first_where
    search.errors[()] = error
    rest = search.localize(units, known_failing=not search.held) if units else []
    if rest and search.best is None and search.out_of_budget() is None:
        bad = search.failing(rest, [], [])
    for unit in bad:
        search.held.setdefault(unit.root, search.errors.get((unit.root,), error))
    if search.best is not None:
        search.refine()
    if search.best is None:  # even over budget: holding every group is the last resort
        why = UNTESTED_REASON.format(search.out_of_budget() or "no try passed")
        search.held.update({u.root: why for u in units if u.root not in search.held})
        search.test([], [])
    seconds = _since(search.started)
    if search.best is None:
        return Outcome(None, trials=search.trials, seconds=seconds, error=error)
    work, skipped = search.best
    skipped = {name: search.held.get(name, reason) if reason == OTHERS_REASON else reason
               for name, reason in skipped.items()}
    return Outcome(work, skipped, dict(search.held), search.trials, seconds)


def attempt(job: Job, extra_held: dict[str, str],
            reference: list) -> tuple[Any, dict[str, str], str | None, str | None]:
    """Prune a fresh copy with ``extra_held`` also kept at full width, and check it runs.

    Returns:
        ``(pruned copy, skipped layers, None, None)``, or ``(None, {}, error, where)``
        on any failure; ``where`` names the innermost module of the copy the
        error was raised in (a forward, or torch-pruning working on it), if any.
    """
    work = copy.deepcopy(detach_caches(job.model))
    root = work.get_submodule(job.root_name) if job.root_name else work
    modules = dict(root.named_modules())
    held = {modules[name]: reason for name, reason in {**job.held, **extra_held}.items()}
    overrides = {modules[name]: value for name, value in job.overrides.items()}
    before = (lambda: job.before_step(work)) if job.before_step is not None else None
    try:
        with _limits.time_limit(job.attempt_limit_s), group_time_limit(job.group_limit_s):
            skipped = _engine.prune_tree(root, job.root_inputs, job.options, held, overrides,
                                         submodule=job.submodule, before_step=before)
            error = check_runs(work, job.model_inputs, reference)
    except Exception as e:  # noqa: BLE001 - any failure of a try is the fallback's signal
        return None, {}, describe(e), _raised_in(e, {id(m): n for n, m in modules.items() if n})
    return (None, {}, error, None) if error else (work, skipped, None, None)


def _raised_in(error: BaseException, names: dict[int, str]) -> str | None:
    where, tb = None, error.__traceback__
    while tb is not None:
        frame_locals = tb.tb_frame.f_locals
        for key in ("self", "module", "layer"):
            if id(frame_locals.get(key)) in names:
                where = names[id(frame_locals[key])]
        tb = tb.tb_next
    return where


def screen(job: Job, held: dict[str, str]) -> tuple[list[_Unit], str | None]:
    """Trace a copy and list its prunable groups; hold (in ``held``) those whose mapping fails.

    Returns:
        the groups left to test, and an error when the model cannot be traced at all.
    """
    from torch import nn

    work = copy.deepcopy(detach_caches(job.model))
    root = work.get_submodule(job.root_name) if job.root_name else work
    modules = dict(root.named_modules())
    names = {m: n for n, m in modules.items()}
    user_held = {modules[name]: reason for name, reason in job.held.items()}
    try:
        with _limits.time_limit(job.attempt_limit_s), group_time_limit(job.group_limit_s):
            graph, kept = _engine.trace_graph(root, job.root_inputs, user_held, job.submodule)
    except Exception as e:  # noqa: BLE001
        return [], f"torch-pruning could not trace the model: {describe(e)}"
    with contextlib.suppress(Exception), group_time_limit(job.group_limit_s):
        _engine.hold_unprunable_grouped_convs(graph, kept)
    from optkit.core.progress import progress

    ignored = {m for h in kept if isinstance(h, nn.Module) for m in h.modules()}
    roots = tuple(_engine.root_types())
    units: list[_Unit] = []
    visited: set = set()
    failed_roots: dict[tuple[str, str], str] = {}
    candidates = [m for m in graph.module2node if isinstance(m, roots)]
    shown = progress(STAGE, "fallback search: groups screened", len(candidates))
    for module in candidates:
        shown.step()
        if module in ignored or module in visited or module not in names:
            continue
        pruner = graph.get_pruner_of_module(module)
        if pruner is None or pruner.get_out_channels(module) is None:
            continue
        # A repeated block whose group failed is not retried in every repeat (a hang costs the full limit).
        root_shape = (type(module).__name__, re.sub(r"\d+", "#", names[module]))
        if root_shape in failed_roots:
            held[names[module]] = failed_roots[root_shape]
            continue
        try:
            # The same limit and tolerant index mapping as a trial prune, so a group is held for what a trial would hit.
            with group_time_limit(job.group_limit_s):
                group = graph.get_pruning_group(module, pruner.prune_out_channels,
                                                list(range(pruner.get_out_channels(module))))
        except Exception as e:  # noqa: BLE001
            held[names[module]] = f"torch-pruning failed on its dependency group: {describe(e)}"
            failed_roots[root_shape] = f"same structure as {names[module]}, whose group failed: {describe(e)}"
            continue
        members = [dep.target.module for dep, _ in group
                   if graph.is_out_channel_pruning_fn(dep.handler) and isinstance(dep.target.module, nn.Module)]
        touches = tuple(dict.fromkeys(names[dep.target.module] for dep, _ in group
                                      if isinstance(dep.target.module, nn.Module) and dep.target.module in names))
        visited.update(members)
        if any(m in ignored for m in members):
            continue
        member_names = tuple(names[m] for m in members if m in names)
        shape = tuple((type(m).__name__, re.sub(r"\d+", "#", names[m])) for m in members if m in names)
        units.append(_Unit(names[module], member_names, shape, touches))
    order = {name: i for i, name in enumerate(modules)}
    return sorted(units, key=lambda u: order[u.root]), None


def output_shapes(model: nn.Module, inputs: Any) -> list:
    """Shapes of every tensor ``model`` returns for ``inputs`` (eval mode, no gradient)."""
    import torch

    from optkit.model.state import eval_mode

    with eval_mode(model), torch.no_grad():
        return [tuple(t.shape) for t in _tensors(call_with(model, inputs))]


def check_runs(model: nn.Module, inputs: Any, reference: list) -> str | None:
    """``None`` if ``model`` runs forward and backward with the ``reference`` output shapes, else why not."""
    import torch

    from optkit.model.state import eval_mode

    with eval_mode(model), torch.enable_grad():
        outputs = _tensors(call_with(model, inputs))
        shapes = [tuple(t.shape) for t in outputs]
        if shapes != reference:
            return f"the pruned model's output shapes changed from {reference} to {shapes}"
        loss = sum(t.float().mean() for t in outputs if t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
    model.zero_grad(set_to_none=True)
    detach_caches(model)
    return None


@contextlib.contextmanager
def group_time_limit(seconds: float | None) -> Iterator[None]:
    """While active, torch-pruning is limited and tolerant where it can stall or crash on a graph.

    Building any one dependency group is limited to ``seconds``, and an index
    mapping torch-pruning cannot compute for a concat, split, reshape or slice
    (an input of unknown width) is left out instead of failing the whole
    trace; the pruned copy's check then finds the groups that went wrong.
    """
    import torch_pruning as tp
    from torch_pruning.dependency import index_mapping

    graph_class = tp.DependencyGraph
    original = graph_class.get_pruning_group
    updaters = {name: fn for name, fn in vars(index_mapping).items() if name.startswith("update_") and
                name.endswith("_index_mapping") and name != "update_index_mapping"}

    def limited(self, *args, **kwargs):
        with _limits.time_limit(seconds):
            return original(self, *args, **kwargs)

    def tolerant(update):
        def run(graph, node):
            with contextlib.suppress(TypeError, ValueError, IndexError, ZeroDivisionError):
                update(graph, node)
        return run

    graph_class.get_pruning_group = limited
    for name, update in updaters.items():
        setattr(index_mapping, name, tolerant(update))
    try:
        with converging_groups():
            yield
    finally:
        graph_class.get_pruning_group = original
        for name, update in updaters.items():
            setattr(index_mapping, name, update)


def describe(error: BaseException) -> str:
    """A one-line description of an error: its type and the start of its message."""
    text = " ".join(str(error).split())
    if isinstance(error, _limits.TimeLimitExceeded):
        return f"torch-pruning {text}"
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _tensors(out: Any) -> list:
    import torch
    import torch_pruning as tp

    return [t for t in tp.utils.flatten_as_list(out) if isinstance(t, torch.Tensor)]


def _since(start: float) -> float:
    return round(time.monotonic() - start, 2)
