"""The data's normalization is recorded in the report and the ONNX metadata, and a chance-level start is said."""

from __future__ import annotations

import json

import onnx

from optkit.cli import main

SPEC = "synthetic:64:3x32x32:10?mean=0&std=1"


def test_normalization_in_report_and_onnx_metadata_and_a_chance_warning(runner, tmp_path):
    out = tmp_path / "o"
    result = runner.invoke(main, ["optimize", "torchvision:squeezenet1_1", "--num-classes", "10", "--input-shape",
                                  "1,3,32,32", "--finetune", SPEC, "--epochs", "1", "--batch-size", "16",
                                  "--workers", "0", "--export", "onnx", "--no-latency", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["data"] == {SPEC: {"mean": "0,0,0", "std": "1,1,1"}}
    metadata = {p.key: p.value for p in onnx.load(str(out / "model.onnx")).metadata_props}
    assert metadata["optkit.data"] == SPEC
    assert metadata["optkit.input_mean"] == "0,0,0" and metadata["optkit.input_std"] == "1,1,1"
    # Random weights score at chance: the fine-tune pass says so before it trains, as expected of a random model
    # rather than as a normalization problem.
    assert any("chance level" in note and "random weights" in note for note in report["notes"])
    assert not any("check the data's normalization" in note for note in report["notes"])
