"""optkit inspect: the per-layer table partitions params and MACs exactly, and its totals match report.json."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from optkit.model import stats

from optkit.io import models
from optkit.cli import main
from optkit.analysis.model_info import format_table, inspect_model, layer_channels, skipped_layers

SHAPE = (1, 3, 64, 64)


class TokenNet(nn.Module):
    """Holds parameters directly (a class token) and uses attention, like a small ViT."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 8, stride=8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        tokens = self.stem(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], dim=1)
        tokens, _ = self.attn(tokens, tokens, tokens)
        return self.head(tokens[:, 0])


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "squeezenet1_1", pytest.param("resnet50", marks=pytest.mark.slow),
                                  pytest.param("vit_b_32", marks=pytest.mark.slow)])
def test_totals_equal_metrics(arch):
    model = models.load_model(f"torchvision:{arch}", num_classes=10)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))]
    with torch.no_grad():
        layers[0].weight.view(-1)[::2] = 0
    zeros = sum(int((m.weight == 0).sum()) for m in layers)
    shape = (1, 3, 224, 224) if arch.startswith("vit") else SHAPE
    inspection = inspect_model(model, shape)
    assert inspection.params == stats.count_params(model)
    assert inspection.macs == stats.count_macs(model, shape)
    assert sum(layer.macs for layer in inspection.layers) == inspection.macs
    assert sum(layer.params for layer in inspection.layers) == inspection.params
    assert inspection.sparsity == pytest.approx(zeros / sum(m.weight.numel() for m in layers), abs=1e-12)
    assert inspection.sparsity > 0


def test_rows_cover_direct_parameters_and_attention():
    model = TokenNet()
    inspection = inspect_model(model, (2, 3, 32, 32))
    rows = {layer.name: layer for layer in inspection.layers}
    assert rows[""].params == 16  # the class token, held by the model itself
    assert rows["attn"].params == sum(p.numel() for p in model.attn.parameters())
    assert "attn.out_proj" not in rows  # counted inside the attention row
    assert (rows["stem"].in_channels, rows["stem"].out_channels) == (3, 16)
    assert inspection.params == stats.count_params(model)
    assert inspection.macs == stats.count_macs(model, (2, 3, 32, 32)) == stats.count_macs(model, (1, 3, 32, 32))
    assert sum(layer.macs for layer in inspection.layers) == inspection.macs


def test_per_layer_sparsity_and_channels():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    with torch.no_grad():
        model[0].weight[:2] = 0
    inspection = inspect_model(model, (1, 3, 8, 8))
    conv = inspection.layers[0]
    assert conv.sparsity == pytest.approx(0.5)
    assert inspection.layers[-1].sparsity == 0.0
    assert layer_channels(model) == {"0": 4, "3": 2}
    printed = format_table(inspection)
    assert [row[0] for row in printed] == ["0", "3"]  # ReLU and Flatten hidden by default
    assert len(format_table(inspection, all_layers=True)) == len(inspection.layers)


def test_skipped_layers_without_a_dry_run_names_classifier_and_attention():
    skipped = skipped_layers(TokenNet(), (1, 3, 32, 32))
    assert skipped.keys() == {"head", "attn"}
    assert "classifier" in skipped["head"]
    assert inspect_model(TokenNet(), (1, 3, 32, 32)).skipped_layers == skipped


def test_skipped_layers_come_from_the_prune_dry_run():
    calls = []

    def dry_run(model, input_shape):
        calls.append(input_shape)
        return {"features.0": "why it is kept"}

    model = models.load_model("torchvision:squeezenet1_1", num_classes=10)
    inspection = inspect_model(model, SHAPE, prune_dry_run=dry_run)
    assert calls == [SHAPE]
    assert inspection.skipped_layers == {"features.0": "why it is kept"} and inspection.prune_error is None


def test_a_model_the_pruner_cannot_trace_is_reported(monkeypatch, runner):
    from optkit.passes.prune import passes as prune

    def dry_run(model, input_shape):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(prune, "skipped_layers", dry_run)
    inspection = inspect_model(TokenNet(), (1, 3, 32, 32), prune_dry_run=dry_run)
    assert inspection.prune_error == "ZeroDivisionError: integer division or modulo by zero"
    assert inspection.to_dict()["prune_error"] == inspection.prune_error
    assert inspection.macs == stats.count_macs(TokenNet(), (1, 3, 32, 32))  # the table is still complete
    result = runner.invoke(main, ["inspect", "torchvision:squeezenet1_1", "--input-shape", "1,3,32,32"])
    assert result.exit_code == 0, result.output
    assert "cannot trace this model: ZeroDivisionError: integer division" in result.output


def test_inspect_leaves_the_model_as_it_was():
    model = models.load_model("torchvision:squeezenet1_1", num_classes=10).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inspect_model(model, SHAPE)
    assert model.training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_cli_totals_equal_report_json(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    # Random weights: the same seed makes the "before" model inspected here the one optimize started from.
    torch.manual_seed(0)
    result = runner.invoke(main, ["optimize", "torchvision:resnet18", "--num-classes", "10", "--input-shape", "1,3,32,32",
                                  "--prune", "0.3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    for spec, side, extra in (("torchvision:resnet18", "before", ["--num-classes", "10"]),
                              (str(out / "model.pt"), "after", [])):
        torch.manual_seed(0)
        result = runner.invoke(main, ["inspect", spec, "--input-shape", "1,3,32,32", "--json", *extra])
        assert result.exit_code == 0, result.output
        totals = json.loads(result.output)["totals"]
        assert totals["params"] == report[side]["params"]
        assert totals["macs"] == report[side]["macs"]
        assert totals["sparsity"] == report[side]["sparsity"]


def test_cli_table_lists_layers_totals_and_skips():
    result = CliRunner().invoke(main, ["inspect", "torchvision:squeezenet1_1", "--num-classes", "10",
                                       "--input-shape", "1,3,64,64"])
    assert result.exit_code == 0, result.output
    model = models.load_model("torchvision:squeezenet1_1", num_classes=10)
    assert f"{stats.count_macs(model, SHAPE):,}" in result.output
    assert "features.0" in result.output and "Conv2d" in result.output
    assert "A structured prune (optkit optimize --prune)" in result.output
    assert "--all-layers lists them" in result.output


def test_cli_reports_a_wrong_input_shape():
    result = CliRunner().invoke(main, ["inspect", "torchvision:resnet18", "--input-shape", "1,5,64,64"])
    assert result.exit_code == 1
    assert "Error: the model does not run on input shape 1,5,64,64" in result.output
