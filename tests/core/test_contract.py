"""Every registered pass keeps the contract: declared settings, a recipe form, a CLI form, a docs entry."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import click
import pytest

from optkit.cli import main
from optkit.core.contract import Pass, recipe_fields
from optkit.core.forms import TORCH
from optkit.core.pipeline import Pipeline
from optkit.core.registry import builtin_passes, get_pass, list_passes
from optkit.core.settings import SHARED_SETTINGS, declared

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _required_examples(cls: type) -> dict:
    """Values for the settings that need one (required ones, or those whose default a rule refuses)."""
    values = {}
    for f in dataclasses.fields(cls):
        spec = declared(f)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            assert spec is not None and spec.example is not None, f"{cls.name}.{f.name} is required but has no example"
        if spec is not None and spec.example is not None:
            values[f.name] = spec.example
    return values


def _steps_before(cls: type) -> list:
    """A pass that turns a PyTorch model into the form ``cls`` takes (none for a pass that takes PyTorch)."""
    if cls.accepts == TORCH:
        return []
    makers = [get_pass(n) for n in list_passes() if get_pass(n).accepts == TORCH and get_pass(n).produces == cls.accepts]
    assert makers, f"{cls.name} takes the {cls.accepts} form, which no registered pass makes"
    return [makers[0]()]


@pytest.mark.parametrize("name", list_passes())
def test_defaults_round_trip_through_a_recipe(name):
    cls = get_pass(name)
    assert issubclass(cls, Pass) and cls.name == name and cls.__dataclass_params__.frozen
    instance = cls(**_required_examples(cls))
    steps = [*_steps_before(cls), instance]
    pipeline = Pipeline(steps, input_shape=(1, 3, 16, 16))
    again = Pipeline.from_toml(pipeline.to_toml())
    assert again.passes == steps
    assert again.to_toml() == pipeline.to_toml()


@pytest.mark.parametrize("name", list_passes())
def test_every_setting_is_declared_with_help(name):
    for f in dataclasses.fields(get_pass(name)):
        spec = declared(f)
        assert spec is not None, f"{name}.{f.name} has no setting() declaration"
        assert spec.help.strip().endswith((".", ")")), f"{name}.{f.name} help should be a sentence: {spec.help!r}"


@pytest.mark.parametrize("name", builtin_passes())
def test_the_cli_exposes_every_flagged_setting_and_the_pass(name):
    cls = get_pass(name)
    ctx = click.Context(main)
    options = {opt for p in main.get_command(ctx, "optimize").params for opt in p.opts}
    assert "--pass" in options
    for f in dataclasses.fields(cls):
        spec = declared(f)
        if spec.flag and (f.name not in SHARED_SETTINGS or spec.enables):
            assert f"--{spec.flag}" in options, f"{name}.{f.name} declares --{spec.flag}, which optimize lacks"
    enabling = [spec.flag for f in dataclasses.fields(cls) if (spec := declared(f)).enables] + [cls.flag]
    assert any(flag and f"--{flag}" in options for flag in enabling), f"{name} has no flag that adds it"


@pytest.mark.parametrize("name", builtin_passes())
def test_the_pass_reference_lists_the_pass_and_its_settings(name):
    page = (DOCS / "passes.md").read_text(encoding="utf-8")
    section = page.split(f"\n## {name}\n", 1)
    assert len(section) == 2, f"docs/passes.md has no section for {name}"
    body = section[1].split("\n## ", 1)[0]
    for key in recipe_fields(get_pass(name)):
        assert f"| `{key}` |" in body


def test_the_pass_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_passes", DOCS / "gen_passes.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "passes.md").read_text(encoding="utf-8") == gen.generate(), \
        "docs/passes.md is out of date: run `python docs/gen_passes.py`"
