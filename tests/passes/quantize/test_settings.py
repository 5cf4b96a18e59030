"""Int8Settings: one declaration gives validation, cross-field rules and the CLI flags."""

from __future__ import annotations

import dataclasses

import pytest

from optkit.core.settings import declared
from optkit.passes.quantize import Int8Settings


def test_defaults_match_the_issue():
    s = Int8Settings()
    assert (s.mode, s.calibration_method, s.min_agreement, s.max_accuracy_drop) == ("static", "minmax", 0.99, 0.01)
    assert s.per_channel and s.auto_exclude and not s.random_calibration and s.exclude == ()


def test_flags_are_declared_once():
    flags = {f.name: declared(f).flag for f in dataclasses.fields(Int8Settings)}
    assert flags["mode"] == "int8-mode"
    assert flags["calibration_method"] == "calibration-method"
    assert flags["calib_data"] == "calib-data"
    assert flags["random_calibration"] == "random-calibration"
    assert flags["min_agreement"] == "min-agreement"
    assert flags["max_accuracy_drop"] == "max-accuracy-drop"
    assert all(declared(f).help for f in dataclasses.fields(Int8Settings))


@pytest.mark.parametrize("changes, words", [
    ({"mode": "int4"}, "mode must be one of static, dynamic"),
    ({"calibration_method": "mse"}, "calibration_method must be one of minmax, entropy, percentile"),
    ({"min_agreement": 1.5}, "min_agreement must be a number in [0, 1]"),
    ({"max_accuracy_drop": -0.1}, "max_accuracy_drop must be a number in [0, 1]"),
    ({"calibration_batches": 0}, "calibration_batches must be an integer >= 1"),
    ({"max_excluded": -1}, "max_excluded must be an integer >= 0"),
    ({"calib_data": "synthetic:8", "random_calibration": True}, "not both"),
    ({"mode": "dynamic", "calibration_method": "entropy"}, "static mode only"),
    ({"exclude": ["/conv/Conv", " "]}, "exclude must be a list of strings"),
])
def test_bad_values_name_the_fix(changes, words):
    with pytest.raises(ValueError) as info:
        Int8Settings(**changes)
    assert words in str(info.value)


def test_lists_become_tuples():
    assert Int8Settings(exclude=["/a/Conv"], op_types=["Conv", "Gemm"]).op_types == ("Conv", "Gemm")


def test_the_int8_pass_round_trips_through_a_recipe_after_export():
    from optkit.core.pipeline import Pipeline
    from optkit.passes.export.passes import ExportOnnx
    from optkit.passes.quantize.passes import Int8

    step = Int8(calib_data="fashion-mnist", exclude=("/head/Gemm",), min_agreement=0.98)
    values = step.settings()
    assert values["exclude"] == ["/head/Gemm"] and values["calib_data"] == "fashion-mnist"
    assert "calib_data" not in Int8(random_calibration=True).settings()
    again = Pipeline.from_toml(Pipeline([ExportOnnx(), step], input_shape=(1, 3, 32, 32)).to_toml())
    assert again.passes == [ExportOnnx(), step] and isinstance(again.passes[1], Int8Settings)
