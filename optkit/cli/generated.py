"""Click options generated from settings declarations, and pipelines built from the flags given.

Every option here comes from a field declared with :func:`optkit.core.settings.setting`
(its ``flag``, help, type, choices and range) or from a pass's ``flag`` switch;
nothing about a particular pass is written in the CLI. Several passes may
declare the same flag (``--calib-data``, ``--workers``): one option sets the
field in every pass that runs. A pass runs when one of its *enabling* flags is
given (``--prune``, ``--finetune SPEC``, ``--fold-bn``); passes that share
enabling flags are told apart by their ``variant`` option (``--method``). The
pipeline order is each pass's declared ``stage``.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import click

from optkit.core.settings import SHARED_SETTINGS, Setting, declared, validate_value

PASS_OPTION = "pass"


@dataclass(frozen=True)
class FieldUse:
    """One pass field that a flag sets (``field`` is ``None`` for a pass's own on/off switch)."""

    pass_name: str
    field: str | None
    enables: bool


@dataclass
class Flag:
    """A CLI option and the pass fields it sets."""

    name: str
    uses: list[FieldUse] = field(default_factory=list)
    spec: Setting | None = None
    annotation: Any = None
    default: Any = None

    @property
    def param(self) -> str:
        return self.name.replace("-", "_")


def pass_flags(classes: Iterable[type]) -> dict[str, Flag]:
    """The flags declared by ``classes``, by option name.

    Raises:
        RuntimeError: if two passes declare one flag with different types or choices.
    """
    flags: dict[str, Flag] = {}
    for cls in sorted(classes, key=lambda c: (c.stage, c.name)):
        if cls.flag:
            flags.setdefault(cls.flag, Flag(cls.flag)).uses.append(FieldUse(cls.name, None, True))
        for f in dataclasses.fields(cls):
            spec = declared(f)
            if spec is None or spec.flag is None or (f.name in SHARED_SETTINGS and not spec.enables):
                continue
            flag = flags.setdefault(spec.flag, Flag(spec.flag, spec=spec, annotation=f.type, default=f.default))
            if flag.spec is not None and (flag.annotation != f.type or flag.spec.choices != spec.choices):
                raise RuntimeError(f"--{spec.flag} is declared differently by {flag.uses[0].pass_name} and {cls.name}")
            flag.uses.append(FieldUse(cls.name, f.name, spec.enables))
    return flags


def settings_flags(cls: type, *, skip: Iterable[str] = ()) -> dict[str, Flag]:
    """The flags of a settings dataclass that is not a pass (export options, INT8 options), by option name."""
    flags = {}
    for f in dataclasses.fields(cls):
        spec = declared(f)
        if spec is not None and spec.flag is not None and f.name not in skip:
            flags[spec.flag] = Flag(spec.flag, [FieldUse(cls.__name__, f.name, False)], spec, f.type, f.default)
    return flags


def settings_from_flags(cls: type, flags: dict[str, Flag], given: dict[str, Any]) -> Any:
    """An instance of the settings dataclass ``cls`` from the flags given (the rest keep their defaults).

    Raises:
        click.UsageError: with the setting named by its flag.
    """
    values = {flag.uses[0].field: given[flag.param] for flag in flags.values() if given.get(flag.param) is not None}
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        fields = {flag.uses[0].field: flag.name for flag in flags.values()}
        raise click.UsageError(_in_flag_terms(str(e), fields)) from e


def variants(classes: Iterable[type]) -> dict[str, list[tuple[str, str]]]:
    """The variant options (``method``) and their ``(value, pass name)`` choices, the default first."""
    found: dict[str, list[tuple[str, str, bool]]] = {}
    for cls in classes:
        if cls.variant:
            option, value = cls.variant
            found.setdefault(option, []).append((value, cls.name, cls.variant_default))
    return {option: [(v, n) for v, n, _ in sorted(items, key=lambda item: not item[2])] for option, items in found.items()}


def setting_option(flag: Flag, *, help_prefix: str = "", required: bool = False) -> Callable:
    """A click option for a declared setting, validated by its declaration; its value is ``None`` unless given."""
    spec, annotation = flag.spec, flag.annotation
    assert spec is not None
    name = flag.uses[0].field if flag.uses else flag.param
    kwargs: dict[str, Any] = {"default": None, "required": required, "metavar": spec.metavar}
    parts = {p.strip() for p in str(annotation).split("|")}
    if "bool" in parts:
        kwargs.update(is_flag=True, default=None)
    elif spec.choices:
        kwargs["type"] = click.Choice(spec.choices)
    elif not spec.also and parts <= {"int", "None"}:
        kwargs["type"] = click.INT
    elif not spec.also and parts <= {"float", "None"}:
        kwargs["type"] = click.FLOAT

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return validate_value(name, _typed(value, parts), spec, annotation)
        except ValueError as e:
            raise click.BadParameter(str(e)) from e

    kwargs["callback"] = callback
    hidden = flag.default in (None, dataclasses.MISSING, ()) or "bool" in parts or any(use.enables for use in flag.uses)
    shown_default = "" if hidden else f" [default: {_show(flag.default)}]"
    kwargs["help"] = f"{help_prefix}{spec.help}{shown_default}"
    return click.option(f"--{flag.name}", flag.param, **kwargs)


def switch_option(flag: Flag, classes: dict[str, type]) -> Callable:
    """A click ``is_flag`` option that adds a pass with its defaults."""
    cls = classes[flag.uses[0].pass_name]
    doc = (cls.__doc__ or cls.name).strip().splitlines()[0]
    return click.option(f"--{flag.name}", flag.param, is_flag=True, default=None, help=f"Add {cls.name}: {doc}")


def variant_option(option: str, choices: list[tuple[str, str]]) -> Callable:
    """A click choice option that picks among passes sharing their enabling flags."""
    values = [value for value, _ in choices]
    described = "; ".join(f"{value}: {name}" for value, name in choices)
    return click.option(f"--{option}", option.replace("-", "_"), type=click.Choice(values), default=None,
                        help=f"Which pass the shared flags run ({described}) [default: {values[0]}]")


def pass_option() -> Callable:
    """The generic ``--pass NAME:key=value,...`` option for any registered pass."""
    return click.option(f"--{PASS_OPTION}", "generic_passes", multiple=True, metavar="NAME[:KEY=VALUE,...]",
                        help="Add any registered pass (see `optkit passes`), with recipe settings as TOML values, "
                             "e.g. --pass structured_prune:ratio=0.3,round_to=16. Repeatable.")


def with_options(options: list[Callable]) -> Callable[[Callable], Callable]:
    """A decorator adding ``options`` to a command, the first one shown first in ``--help``."""

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def entries_from_flags(given: dict[str, Any], classes: dict[str, type], *,
                       generic: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Recipe ``[[pass]]`` entries for the flags given, in stage order.

    Run options (``recipe=False``) go to the passes at run time, never into the entries.

    Args:
        given: option values by click parameter name; ``None`` means not given.
        classes: the pass classes the flags were generated from, by name.
        generic: ``--pass`` values.

    Returns:
        one entry per pass that runs, each ``{"name": ..., setting: value}``.

    Raises:
        click.UsageError: naming the flag that does not apply or the setting that is wrong.
    """
    flags = pass_flags(classes.values())
    selected = _selected_variants(given, classes)
    enabled = [cls for cls in classes.values() if cls.name in selected and _is_enabled(cls, flags, given)]
    enabled_names = {cls.name for cls in enabled}
    settings: dict[str, dict[str, Any]] = {cls.name: {} for cls in enabled}
    for flag in flags.values():
        value = given.get(flag.param)
        if value is None:
            continue
        uses = [use for use in flag.uses if use.pass_name in enabled_names]
        if not uses:
            raise click.UsageError(f"--{flag.name} {_applies_to(flag, flags, classes)}")
        for use in uses:
            if use.field is not None and flag.spec is not None and flag.spec.recipe:
                settings[use.pass_name][use.field] = value
    entries = [_entry(cls, settings[cls.name], flags) for cls in enabled]
    entries += [parse_generic(text) for text in generic]
    order = {name: cls.stage for name, cls in classes.items()}
    return sorted(entries, key=lambda e: order.get(e["name"], _stage_of(e["name"])))


def recipe_overrides(given: dict[str, Any], classes: dict[str, type],
                     present: Iterable[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Split the flags given with a recipe: settings of passes the recipe already runs, and the rest.

    A flag that sets (without enabling) a recipe setting of a pass in ``present``,
    such as ``--max-steps`` for a recipe's ``finetune``, overrides that setting.

    Returns:
        ``({pass name: {field: value}}, the given values less those flags)``.
    """
    present = set(present)
    overrides: dict[str, dict[str, Any]] = {}
    remaining = dict(given)
    for flag in pass_flags(classes.values()).values():
        value = given.get(flag.param)
        uses = [use for use in flag.uses if use.pass_name in present and use.field is not None and not use.enables]
        if value is None or not uses or flag.spec is None or not flag.spec.recipe:
            continue
        for use in uses:
            overrides.setdefault(use.pass_name, {})[use.field] = value
        remaining[flag.param] = None
    return overrides, remaining


def _selected_variants(given: dict[str, Any], classes: dict[str, type]) -> set[str]:
    chosen = {option: given.get(option.replace("-", "_")) or choices[0][0]
              for option, choices in variants(classes.values()).items()}
    return {cls.name for cls in classes.values() if cls.variant is None or chosen[cls.variant[0]] == cls.variant[1]}


def _is_enabled(cls: type, flags: dict[str, Flag], given: dict[str, Any]) -> bool:
    return any(given.get(flag.param) not in (None, False) for flag in flags.values()
               for use in flag.uses if use.pass_name == cls.name and use.enables)


def _applies_to(flag: Flag, flags: dict[str, Flag], classes: dict[str, type]) -> str:
    needs = []
    for use in flag.uses:
        cls = classes[use.pass_name]
        enabling = [f"--{f.name}" for f in flags.values() if any(u.pass_name == cls.name and u.enables for u in f.uses)]
        variant = f" with --{cls.variant[0]} {cls.variant[1]}" if cls.variant else ""
        needs.append(f"{cls.name} ({' or '.join(enabling)}{variant})")
    return f"is a setting of {', '.join(needs)}, which this command line does not run"


def _entry(cls: type, values: dict[str, Any], flags: dict[str, Flag]) -> dict[str, Any]:
    for f in dataclasses.fields(cls):
        spec = declared(f)
        clash = [name for name in (spec.replaces if spec else ()) if f.name in values and name in values]
        if clash:
            raise click.UsageError(_in_flag_words(f"{f.name} replaces {clash[0]}: give one of them", cls, flags))
    try:
        cls(**values)
    except (ValueError, TypeError) as e:
        raise click.UsageError(_in_flag_words(str(e), cls, flags)) from e
    return {"name": cls.name, **{f.name.rstrip("_"): _plain(v) for f in dataclasses.fields(cls)
                                 if (v := values.get(f.name)) is not None}}


def _in_flag_words(message: str, cls: type, flags: dict[str, Flag]) -> str:
    fields = {use.field: flag.name for flag in flags.values() for use in flag.uses
              if use.pass_name == cls.name and use.field is not None}
    return f"{cls.name}: {_in_flag_terms(message, fields)}"


def _in_flag_terms(message: str, fields: dict[str, str]) -> str:
    """``message`` with each field name replaced by its ``--flag`` (``round_to`` -> ``--round-to``)."""
    for name, flag in fields.items():
        message = re.sub(rf"\b{re.escape(name)}\b", f"--{flag}", message)
    return message


def parse_generic(text: str) -> dict[str, Any]:
    """Parse ``NAME:key=value,...`` (values as TOML, bare words as strings) into a recipe entry.

    Raises:
        click.BadParameter: for a malformed item.
    """
    name, _, rest = text.partition(":")
    entry: dict[str, Any] = {"name": name.strip()}
    for item in _split_top_level(rest):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected NAME:key=value,... but got {text!r}", param_hint="--pass")
        entry[key.strip()] = _toml_value(value.strip())
    return entry


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item for item in [*items, current] if item.strip()]


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _stage_of(name: str) -> int:
    from optkit.core.registry import get_pass

    try:
        return get_pass(name).stage
    except KeyError as e:
        raise click.BadParameter(e.args[0], param_hint="--pass") from e


def _typed(value: Any, parts: set[str]) -> Any:
    if isinstance(value, str) and "int" in parts and value.lstrip("-").isdigit():
        return int(value)
    if isinstance(value, str) and "float" in parts:
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, str) and any(p.startswith("tuple[str") for p in parts):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, str) and any(p.startswith("tuple[float") for p in parts):
        return tuple(_typed(v.strip(), {"float"}) for v in value.split(","))
    if isinstance(value, str) and any(p.startswith("tuple[int") for p in parts):
        return tuple(int(v) if v.strip().lstrip("-").isdigit() else v for v in value.replace("x", ",").split(","))
    return value


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

