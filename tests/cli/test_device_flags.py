"""Tests for the --device, --amp, --channels-last and --workers flags of ``optkit optimize``."""

from __future__ import annotations

import json

import click

import pytest
from click.testing import CliRunner

from optkit.cli import main
from optkit.cli.optimize import pass_entries_from_flags

def test_flags_become_entries_in_pipeline_order():
    flags = {"prune": 0.2, "device": "cpu", "channels_last": True, "amp": "bf16"}
    names = [e["name"] for e in pass_entries_from_flags(flags)]
    assert names == ["to_device", "structured_prune", "channels_last", "autocast"]


def test_amp_off_adds_a_pass_that_leaves_the_model_unwrapped():
    assert pass_entries_from_flags({"amp": "off"}) == [{"name": "autocast", "dtype": "off"}]


def test_workers_go_to_every_running_pass_that_loads_data():
    entries = pass_entries_from_flags({"recalibrate_bn": 2, "calib_data": "synthetic:8", "finetune": "synthetic:8",
                                       "workers": 3, "prune": 0.2})
    assert {e["name"]: e.get("num_workers") for e in entries} == {
        "structured_prune": None, "recalibrate_batchnorm": 3, "finetune": 3}


def test_workers_without_a_pass_that_loads_data_is_a_usage_error():
    with pytest.raises(click.UsageError, match="--workers is a setting of .*recalibrate_batchnorm"):
        pass_entries_from_flags({"prune": 0.2, "workers": 3})


@pytest.mark.parametrize("args, message", [(["--device", "gpu"], "auto, cpu, cuda, cuda:N or mps"),
                                           (["--workers", "-1"], "an integer >= 0 or 'auto'"),
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
