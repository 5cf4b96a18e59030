"""A latency target's value: a fraction of the original's latency, or a budget with its unit (``3ms``, ``40tok/s``).

``structured_prune``'s ``target_latency`` takes three forms:

* ``0.5``: a fraction of the original's latency. Alone, the model is pruned until its ONNX Runtime FP32
  latency is that fraction (:mod:`optkit.passes.prune.targets.latency`); in a run with ``deploy``, the
  budget is that fraction of the unpruned model's ONNX Runtime FP32 latency at the deployment's threads
  and batch, met in whichever deployment keeps the most accuracy.
* ``3ms``: milliseconds per call at the deployment's batch and threads (needs ``deploy``).
* ``40tok/s``: a language model's decode tokens per second at the deployment's batch and threads (needs
  ``deploy``).

A run with ``deploy`` hands the budget to it (:meth:`optkit.passes.deploy.passes.Deploy.meet_budget`), which
prunes each deployment candidate just enough. Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError

if TYPE_CHECKING:
    from optkit.core.context import RunContext

UNITS = ("ms", "tok/s")
_BUDGET = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|tok/s)\s*$", re.IGNORECASE)
FORMS = "a fraction of the original's latency below 1 (0.5), milliseconds per call (3ms) or decode tokens/s (40tok/s)"


def check_latency_target(value: Any) -> float | str:
    """Validate a latency target: a fraction in (0, 1), or a positive number with its unit (``3ms``, ``40tok/s``).

    Returns:
        the fraction as a float, or the budget as ``"<number><unit>"``.

    Raises:
        ValueError: naming the three forms, for a zero or negative budget, a fraction of 1 or more, or an
            unknown unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"target_latency must be {FORMS}; got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), None
    else:
        text = str(value).strip()
        match = _BUDGET.match(text)
        try:
            number, unit = (float(match[1]), match[2].lower()) if match else (float(text), None)
        except ValueError:
            raise ValueError(f"target_latency must be {FORMS}; got {value!r}") from None
    if math.isnan(number) or number <= 0 or math.isinf(number):
        raise ValueError(f"target_latency must be above 0: {FORMS}; got {value!r}")
    if unit is None:
        if number >= 1:
            raise ValueError(f"target_latency must be {FORMS}; got {value!r} (a budget in milliseconds is written "
                             f"with its unit: {number:g}ms)")
        return number
    return f"{number:g}{unit}"


def budget_unit(value: float | str) -> tuple[float, str]:
    """A checked latency target as ``(number, unit)``: unit ``fraction``, ``ms`` or ``tok/s``."""
    if isinstance(value, (int, float)):
        return float(value), "fraction"
    match = _BUDGET.match(value)
    return float(match[1]), match[2].lower()


def check_budget_run(target: float | str, steps: Sequence[Any]) -> None:
    """Refuse the runs a latency ``target`` cannot be met in, before anything runs.

    Raises:
        OptkitError: for a run with ``int8`` (it would change the measured latency afterwards), a budget with a
            unit and no ``deploy``, or a ``deploy`` with no data to score the candidates on.
    """
    _, unit = budget_unit(target)
    names = [getattr(step, "name", None) for step in steps]
    if "int8" in names:
        raise OptkitError("--target-latency is met in the deployment it measures, and --int8 would change that "
                          "afterwards: drop --int8 (--deploy tries INT8 within the budget)")
    if "deploy" not in names:
        if unit != "fraction":
            raise OptkitError(f"--target-latency {target} is met in a deployment: add --deploy (and --calib-data to "
                              "score the candidates on), or give a fraction of the original's latency (0.5)")
        return
    if steps[names.index("deploy")].calib_data is None:
        raise OptkitError(f"--target-latency {target} with --deploy keeps the most accurate deployment that meets "
                          "it, so it needs data to score them on: give --calib-data SPEC (labelled images such as "
                          "fashion-mnist, or text for a language model)")


def bind_budget(context: RunContext) -> Any:
    """The run's ``deploy`` step bound to ``context``, where a latency target is met; ``None`` without one (a
    fraction is then met in ONNX Runtime FP32)."""
    deploy = context.step("deploy")
    return None if deploy is None else deploy.bind(context)
