"""One declaration per setting: a dataclass field carries its help, choices and range.

A pass (or any settings dataclass, such as the export options) declares each
setting once::

    ratio: float = setting(0.3, help="Fraction of channels to remove.", low=0, high=1, high_open=True,
                           flag="prune", enables=True)

and everything else is read from that declaration: validation
(:func:`validate_fields`, run when a :class:`Settings` is created), recipe keys, CLI
options (:mod:`optkit.cli.generated`), the ``Args`` section of the class
docstring and the generated settings reference (``docs/passes.md``).

The type comes from the field's annotation; ``int | str`` with ``also=("auto",)``
accepts an integer or the word ``auto``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from functools import lru_cache
from typing import Any

_KEY = "optkit"
INPUT_SHAPE_HELP = "Example input shape, e.g. 1,3,224,224 (batch first)."
DEVICE_HELP = "Device: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps."
_DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


@dataclass(frozen=True)
class Setting:
    """What a field declares about itself (see :func:`setting`)."""

    help: str
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[str, ...] = ()
    check: Callable[[Any], Any] | None = None
    recipe: bool = True
    flag: str | None = None
    enables: bool = False
    metavar: str | None = None
    example: Any = None
    accepts: str | None = None
    dataset: bool = False
    replaces: tuple[str, ...] = ()


def setting(default: Any = MISSING, *, help: str, choices: tuple[str, ...] | None = None,
            low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False,
            also: tuple[str, ...] = (), check: Callable[[Any], Any] | None = None, recipe: bool = True,
            flag: str | None = None, enables: bool = False, metavar: str | None = None, example: Any = None,
            dataset: bool = False, replaces: tuple[str, ...] = (), default_factory: Any = MISSING,
            compare: bool = True, repr: bool = True) -> Any:
    """Declare a dataclass field as a setting.

    Args:
        default: the default value (omit for a required setting, and give ``example``).
        help: one sentence for ``--help``, docs and error messages.
        choices: the valid strings, for a choice setting.
        low, high: the valid numeric range (``low_open``/``high_open`` exclude the ends).
        also: words accepted besides the annotated type (``"auto"`` for a worker count).
        check: a function that validates and normalizes the value, raising ``ValueError``;
            used instead of the type rules (input shapes, devices).
        recipe: ``False`` for run options and live objects that recipes never hold.
        flag: the CLI option name (``"round-to"`` gives ``--round-to``); several passes may share one.
        enables: giving the flag adds the pass to a pipeline built from flags.
        metavar: the option's metavar in ``--help``.
        example: a valid value for a required setting (used by docs and the contract tests).
        dataset: the value is a dataset spec, checked to be readable before any pass runs.
        replaces: fields this one overrides when set (``target_macs`` replaces ``ratio``): giving both
            on the command line is an error.
        default_factory, compare, repr: as for :func:`dataclasses.field`.

    Returns:
        a :func:`dataclasses.field` carrying a :class:`Setting` in its metadata.
    """
    declared = Setting(help=help, choices=tuple(choices) if choices else None, low=low, high=high,
                       low_open=low_open, high_open=high_open, also=tuple(also), check=check, recipe=recipe,
                       flag=flag, enables=enables, metavar=metavar, example=example, dataset=dataset,
                       replaces=tuple(replaces))
    kwargs: dict[str, Any] = {"metadata": {_KEY: declared}, "compare": compare, "repr": repr}
    if default_factory is not MISSING:
        kwargs["default_factory"] = default_factory
    elif default is not MISSING:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def declared(f: dataclasses.Field) -> Setting | None:
    """The :class:`Setting` a field declares, or ``None`` for a plain dataclass field."""
    return f.metadata.get(_KEY)


def check_input_shape(value: Any) -> tuple[int, ...] | None:
    """Validate an input shape such as ``(1, 3, 224, 224)``; ``None`` means "filled in later".

    Raises:
        ValueError: if it is not a sequence of 2 to 5 positive integers.
    """
    if value is None:
        return None
    try:
        shape = tuple(int(v) for v in value)
        valid = 2 <= len(shape) <= 5 and all(v > 0 for v in shape) and all(float(v) == int(v) for v in value)
    except (TypeError, ValueError):
        valid = False
    if not valid or isinstance(value, str):
        raise ValueError(f"input_shape must be 2 to 5 positive integers like (1, 3, 224, 224); got {value!r}")
    return shape


def check_device(value: Any) -> str | None:
    """Validate a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``); ``None`` passes through.

    Raises:
        ValueError: naming the valid choices.
    """
    if value is not None and not (isinstance(value, str) and _DEVICE_PATTERN.fullmatch(value)):
        raise ValueError(f"device must be one of {DEVICE_CHOICES}; got {value!r}")
    return value


#: The settings a pipeline (and a recipe's top level) holds and fills into every pass that has them.
SHARED_SETTINGS: dict[str, Setting] = {
    "input_shape": Setting(help=INPUT_SHAPE_HELP, check=check_input_shape, flag="input-shape",
                           accepts="2 to 5 positive integers"),
    "device": Setting(help=DEVICE_HELP, check=check_device, flag="device", metavar="auto|cpu|cuda|cuda:N|mps",
                      accepts=DEVICE_CHOICES),
}


DATA_HELP = ("Dataset spec (fashion-mnist, imagefolder:DIR, ...) whose batches feed data-driven steps "
             "(taylor importance, BatchNorm statistics, a latency target's choice among its tries by accuracy).")
WORKERS_HELP = "DataLoader worker processes, an integer >= 0, or auto (chosen by measurement)."


def calib_data_setting(**changes: Any) -> Any:
    """The ``data`` field of a pass that reads calibration batches (the ``--calib-data`` option)."""
    return setting(None, **{"help": DATA_HELP, "flag": "calib-data", "metavar": "SPEC", "dataset": True, **changes})


def workers_setting(default: int | str = 0) -> Any:
    """The ``num_workers`` field of a pass that loads data (the ``--workers`` option)."""
    return setting(default, help=WORKERS_HELP, low=0, also=("auto",), flag="workers", metavar="auto|N")


def shared_setting(name: str, **changes: Any) -> Any:
    """A field for one of the :data:`SHARED_SETTINGS` (unset by default, filled in by a pipeline)."""
    base = SHARED_SETTINGS[name]
    return dataclasses.field(default=None, metadata={_KEY: dataclasses.replace(base, **changes)})


@lru_cache(maxsize=None)
def _annotation_parts(annotation: str) -> frozenset[str]:
    return frozenset(part.strip() for part in str(annotation).split("|"))


def validate_fields(obj: Any) -> None:
    """Validate and normalize every declared field of a frozen settings dataclass in place.

    Raises:
        ValueError: naming the setting and what it accepts.
    """
    for f in dataclasses.fields(obj):
        spec = declared(f)
        if spec is None:
            continue
        value = getattr(obj, f.name)
        normalized = validate_value(f.name, value, spec, f.type)
        if normalized is not value:
            object.__setattr__(obj, f.name, normalized)


@dataclass(frozen=True)
class Settings:
    """Base of a frozen dataclass of declared settings (every pass, and the settings groups passes share).

    Creating one validates it: each declared field on its own (:func:`validate_fields`: type, range,
    choices), then :meth:`check` for the rules that involve several settings.
    """

    def __post_init__(self) -> None:
        validate_fields(self)
        self.check()

    def check(self) -> None:
        """Validate rules that involve several settings; raise ``ValueError`` naming the fix."""


def validate_value(name: str, value: Any, spec: Setting, annotation: Any) -> Any:
    """Check one value against its declaration and return it normalized (lists become tuples, ints floats).

    Raises:
        ValueError: ``"<name> must be <what it accepts>; got <value>"``.
    """
    parts = _annotation_parts(annotation)
    if value is None and ("None" in parts or "Any" in parts):
        return value
    if spec.check is not None:
        return spec.check(value)
    if "Any" in parts:
        return value
    if isinstance(value, str) and value in spec.also:
        return value
    for kind in ("bool", "int", "float", "str"):
        if kind in parts:
            ok, normalized = _as_kind(kind, value, spec)
            if ok:
                return normalized
    for part in parts:
        if part.startswith(("tuple[", "dict[")):
            ok, normalized = _as_container(part, value, spec)
            if ok:
                return normalized
    raise ValueError(f"{name} must be {describe(spec, annotation)}; got {value!r}")


def _as_kind(kind: str, value: Any, spec: Setting) -> tuple[bool, Any]:
    if kind == "bool":
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if kind == "str":
        # With ``also`` words, the string part of ``int | str`` means exactly those words.
        ok = isinstance(value, str) and bool(value.strip()) and not spec.also and (
            spec.choices is None or value in spec.choices)
        return ok, value
    if kind == "int" and not isinstance(value, int):
        return False, value
    if kind == "float" and not isinstance(value, (int, float)):
        return False, value
    number = float(value) if kind == "float" else value
    return _in_range(number, spec), number


def _in_range(number: float, spec: Setting) -> bool:
    if isinstance(number, float) and math.isnan(number):
        return False
    if spec.low is not None and (number < spec.low or (spec.low_open and number == spec.low)):
        return False
    if spec.high is not None and (number > spec.high or (spec.high_open and number == spec.high)):
        return False
    return True


def _as_container(part: str, value: Any, spec: Setting) -> tuple[bool, Any]:
    if part.startswith("tuple["):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False, value
        item = part[len("tuple["):].split(",")[0].strip()
        ok = all(_as_kind(item, v, spec)[0] for v in value) if item in ("int", "float", "str") else True
        return ok, tuple(_as_kind(item, v, spec)[1] for v in value) if ok and item == "float" else tuple(value)
    if not isinstance(value, dict):
        return False, value
    item = part[len("dict["):].rstrip("]").split(",")[1].strip()
    checked = {str(k): _as_kind(item, v, spec) for k, v in value.items()} if item in ("int", "float") else None
    if checked is None:
        return True, dict(value)
    return all(ok for ok, _ in checked.values()), {k: v for k, (_, v) in checked.items()}


def describe(spec: Setting, annotation: Any) -> str:
    """What a setting accepts, in words: ``a number in [0, 1)``, ``one of l1, l2``, ``an integer >= 1``..."""
    if spec.accepts:
        return spec.accepts
    parts = _annotation_parts(annotation)
    words = []
    if spec.choices:
        words.append(f"one of {', '.join(spec.choices)}")
    elif "bool" in parts:
        words.append("true or false")
    elif "int" in parts:
        words.append("an integer" + _range_words(spec))
    elif "float" in parts:
        words.append("a number" + _range_words(spec))
    elif "str" in parts:
        words.append("a non-empty string")
    for part in parts:
        if part.startswith("tuple["):
            words.append("a list" + (" of strings" if "str" in part else " of numbers" if "int" in part or "float" in part else ""))
        elif part.startswith("dict["):
            words.append("a table of names to numbers" + _range_words(spec))
    words += [repr(word) for word in spec.also]
    return " or ".join(words) or "a valid value"


def _range_words(spec: Setting) -> str:
    if spec.low is not None and spec.high is not None:
        left = "(" if spec.low_open else "["
        right = ")" if spec.high_open else "]"
        return f" in {left}{_number(spec.low)}, {_number(spec.high)}{right}"
    if spec.low is not None:
        return f" {'>' if spec.low_open else '>='} {_number(spec.low)}"
    if spec.high is not None:
        return f" {'<' if spec.high_open else '<='} {_number(spec.high)}"
    return ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def args_section(cls: type) -> str:
    """A Google-style ``Args:`` section written from the class's declared settings."""
    lines = ["Args:"]
    for f in dataclasses.fields(cls):
        spec = declared(f)
        if spec is None:
            continue
        lines.append(f"    {f.name}: {spec.help} ({describe(spec, f.type)}" + _default_words(f) + ")")
    return "\n".join(lines) if len(lines) > 1 else ""


def _default_words(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        return "" if f.default is None else f"; default {f.default!r}"
    if f.default_factory is not MISSING:
        return f"; default {f.default_factory()!r}"
    return "; required"
