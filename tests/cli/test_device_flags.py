"""Tests for the --device, --amp, --channels-last and --workers flags of ``optkit optimize``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from optkit.cli import main
from optkit.cli.optimize import pass_entries_from_flags

BASE = {"ratio": None, "method": "structured", "round_to": 8, "importance": "l1", "global_": False}


def test_flags_become_entries_in_pipeline_order():
    flags = {**BASE, "ratio": 0.2, "device": "cpu", "channels_last": True, "amp": "bf16", "workers": 2}
    names = [e["name"] for e in pass_entries_from_flags(flags)]
    assert names == ["to_device", "structured_prune", "channels_last", "autocast"]


def test_amp_off_adds_nothing():
    assert pass_entries_from_flags({**BASE, "amp": "off"}) == []


def test_workers_go_to_passes_that_load_data(monkeypatch):
    from optkit.core import contract as base

    @dataclasses.dataclass(frozen=True)
    class Loads(base.Pass):
        name = "loads"
        num_workers: int | str = "auto"

    monkeypatch.setattr("optkit.passes.get_pass", lambda name: Loads if name == "to_device" else base.Pass)
    entries = pass_entries_from_flags({**BASE, "device": "cpu", "workers": 3})
    assert entries == [{"name": "to_device", "device": "cpu", "num_workers": 3}]


@pytest.mark.parametrize("args, message", [(["--device", "gpu"], "auto, cpu, cuda, cuda:N or mps"),
                                           (["--workers", "-1"], "'auto' or an integer >= 0"),
                                           (["--amp", "int8"], "auto")])
def test_bad_values_are_usage_errors(args, message):
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", *args])
    assert result.exit_code == 2 and message in result.output


def test_device_channels_last_and_amp_run(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", "torchvision:squeezenet1_1", "--num-classes", "10",
                                       "--input-shape", "1,3,32,32", "--device", "cpu", "--channels-last",
                                       "--amp", "bf16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    details = {p["name"]: p.get("details", {}) for p in report["passes"]}
    assert details["to_device"]["device"] == "cpu" and details["autocast"]["dtype"] == "bf16"
    assert 'name = "channels_last"' in (out / "recipe.toml").read_text()
