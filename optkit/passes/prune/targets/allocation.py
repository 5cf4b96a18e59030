"""Choosing how many channels each group keeps: greedy shrinking under a cost budget.

Both the latency target (cost: predicted milliseconds) and sensitivity
allocation (cost: MACs) start from the full model and repeatedly take
``round_to`` channels from the group whose next step loses the least per unit
of cost saved, until the model's cost is within the budget. The cost of a
layer depends on both its widths, so a step's saving is computed with the
current widths of every layer the group touches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from optkit.passes.prune.graph.groups import Group, layer_widths

#: A group keeps at least this fraction of its channels (and at least ``round_to``).
MIN_KEEP = 0.05
#: How many times a measured result is used to correct the aim before the closest try is kept.
MAX_CORRECTIONS = 3

LayerCost = Callable[[str, int, int], float]


def shrink(groups: Sequence[Group], full: Mapping[str, tuple[int, int]], cost: LayerCost, budget: float, *,
           round_to: int, loss: Callable[[int, int], float], max_removed: Sequence[float] | None = None,
           slack: float = 0.0) -> list[int]:
    """Kept channels per group once the summed layer cost is at most ``budget`` (or nothing more can go).

    Args:
        groups: the groups that may shrink.
        full: every costed layer's full (in, out) channels.
        cost: a layer's cost at (name, in channels, out channels).
        budget: the total cost to reach.
        round_to: channels go this many at a time (kept counts are multiples of it).
        loss: ``loss(i, kept)``, what group ``i`` loses when it keeps ``kept`` channels (non-decreasing
            as ``kept`` falls).
        max_removed: per group, the largest fraction of its channels that may go (default: all but
            :data:`MIN_KEEP`).
        slack: how far below ``budget`` the result may land. When the last greedy step overshoots by
            more (one large group's coarse step), it is undone and the rest of the way is covered by
            steps no larger than what is left, if they reach ``budget`` within the slack.

    Returns:
        the kept channel count of each group.
    """
    floors = [max(round_to, g.channels * (1 - max_removed[i]) if max_removed is not None else MIN_KEEP * g.channels)
              for i, g in enumerate(groups)]

    def options(kept: list[int], widths: dict[str, tuple[int, int]]) -> list[tuple]:
        found = []
        for i, g in enumerate(groups):
            step = (-(-kept[i] // round_to) - 1) * round_to
            if step < floors[i]:
                continue
            touched = [n for n in dict.fromkeys(g.outs + g.ins) if n in widths]
            after = layer_widths({n: full[n] for n in touched}, [g], [step])
            after = {n: (after[n][0] if n in g.ins else widths[n][0], after[n][1] if n in g.outs else widths[n][1])
                     for n in touched}
            saved = sum(cost(n, *widths[n]) - cost(n, *after[n]) for n in touched)
            found.append(((loss(i, step) - loss(i, kept[i])) / max(saved, 1e-9), i, step, after, saved))
        return found

    def run(kept: list[int], widths: dict[str, tuple[int, int]], total: float, largest: float | None = None):
        undo = None
        while total > budget:
            found = [o for o in options(kept, widths) if largest is None or o[4] <= total - budget + largest]
            if not found:
                break
            _, i, step, after, saved = min(found, key=lambda o: o[0])
            undo = (i, kept[i], {n: widths[n] for n in after}, saved)
            kept[i] = step
            widths.update(after)
            total -= saved
        return total, undo

    kept = [g.channels for g in groups]
    widths = layer_widths(full, groups, kept)
    total, undo = run(kept, widths, sum(cost(name, *w) for name, w in widths.items()))
    if undo is None or total >= budget - slack:
        return kept
    i, before, old, saved = undo
    retry_kept, retry_widths = list(kept), {**widths, **old}
    retry_kept[i] = before
    retry_total, _ = run(retry_kept, retry_widths, total + saved, largest=slack)
    return retry_kept if budget - slack <= retry_total <= budget else kept


def next_aim(points: Sequence[tuple[float, float]], target: float) -> float:
    """The next predicted fraction to aim at, from the (predicted, achieved) fractions of the tries so far.

    Between the closest tries achieved below and above the target, interpolate linearly; without
    such a pair, scale the last prediction by target/achieved.
    """
    below = max((p for p in points if p[1] < target), default=None, key=lambda p: p[1])
    above = min((p for p in points if p[1] > target), default=None, key=lambda p: p[1])
    if below and above and above[0] != below[0]:
        return below[0] + (above[0] - below[0]) * (target - below[1]) / (above[1] - below[1])
    predicted, achieved = points[-1]
    return min(1.0, predicted * target / achieved) if achieved > 0 else predicted
