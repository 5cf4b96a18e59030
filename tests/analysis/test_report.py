"""Reports: report.json/report.md content, the channels plot, and what optimize writes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from optkit import workflow
from optkit.core.pipeline import Pipeline, PassRecord, PipelineRun
from optkit.io.models import ArchSpec, LoadedModel
from optkit.model.stats import ModelStats
from optkit.passes.prune.passes import UNSTRUCTURED_NOTE, L1Unstructured, StructuredPrune
from optkit.analysis.report import (
    NO_LATENCY_NOTE,
    build_report,
    plot_channels,
    print_report,
    skipped_layers,
    to_markdown,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(name: str = "structured_prune", details: dict | None = None) -> PipelineRun:
    before = ModelStats(params=1000, macs=10_000, sparsity=0.0)
    after = ModelStats(params=500, macs=4_000, sparsity=0.0)
    return PipelineRun(nn.Identity(), before, after, [PassRecord(name, 1.25, after, details or {})])


CHANNELS = {"before": {"conv": 64, "fc": 10}, "after": {"conv": 40, "fc": 10}}


def test_report_figures_and_ratios():
    report = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8), files={"model.pt": 2_000_000},
                          channels=CHANNELS, input_file_size=4_000_000)
    assert report["ratios"] == {"params": 0.5, "macs": 0.4}
    assert report["file_size"] == {"before": 4_000_000, "after": 2_000_000}
    assert report["layers"] == [{"name": "conv", "before": 64, "after": 40}, {"name": "fc", "before": 10, "after": 10}]
    assert NO_LATENCY_NOTE in report["notes"]
    assert "latency" not in report and "accuracy" not in report
    json.dumps(report)


def test_markdown_has_every_section():
    details = {"skipped_layers": {"fc": "final classifier"}}
    report = build_report(fake_run(details=details), model="m", input_shape=(1, 3, 8, 8),
                          files={"model.pt": 2_000_000}, channels=CHANNELS, input_file_size=4_000_000,
                          latency={"before": {"median_ms": 10.0, "p90_ms": 11.0, "spread": 1.1},
                                   "after": {"median_ms": 6.0, "p90_ms": 6.6, "spread": 1.1}},
                          accuracy={"before": 0.9, "after": 0.885, "dataset": "fashion-mnist test"})
    text = to_markdown(report, plot="channels.png")
    assert "| Parameters | 1,000 | 500 | 0.500× |" in text
    assert "| MACs | 10,000 | 4,000 | 0.400× |" in text
    assert "| File size (MB) | 4.00 | 2.00 | 0.500× |" in text
    assert "| PyTorch ms, median | 10.00 | 6.00 | 0.600× |" in text
    assert "| PyTorch ms, p90 | 11.00 | 6.60 | 0.600× |" in text
    assert "| Accuracy | 90.00% | 88.50% | -1.50 pts |" in text
    assert "Accuracy measured on fashion-mnist test." in text
    assert "| structured_prune | 1.25 |" in text
    assert "![output channels per layer, before and after](channels.png)" in text
    assert "| `conv` | 64 | 40 |" in text and "| `fc` |" not in text
    assert "- structured_prune: `fc`: final classifier" in text
    assert NO_LATENCY_NOTE not in text  # latency was measured
    assert "latency figures are noisy" not in text


def test_export_section():
    report = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8))
    assert "## Export" not in to_markdown(report)
    report["export"] = {"path": "model.onnx", "exporter": "torchscript", "opset": 18, "file_size": 2_000_000,
                        "compressed_size": 1_800_000,
                        "verification": [{"batch_size": 1, "max_abs_diff": 2e-7, "tolerance": 1e-4, "passed": True},
                                         {"batch_size": 3, "max_abs_diff": 3e-7, "tolerance": 1e-4, "passed": True}]}
    text = to_markdown(report)
    assert "`model.onnx`: torchscript exporter, opset 18, 2,000,000 bytes (1,800,000 gzipped)." in text
    assert "| 3 | 3e-07 | 0.0001 | yes |" in text


def test_accuracy_from_a_finetune_pass():
    report = build_report(fake_run("finetune", {"data": "fashion-mnist", "val_accuracy": 0.8512}), model="m",
                          input_shape=(1, 1, 28, 28))
    assert report["accuracy"] == {"before": None, "after": 0.8512, "dataset": "the val split of fashion-mnist"}
    text = to_markdown(report)
    assert "| Accuracy | - | 85.12% |  |" in text
    assert "Accuracy measured on the val split of fashion-mnist." in text


def test_noisy_latency_is_noted():
    latency = {"before": {"median_ms": 10.0, "p90_ms": 20.0, "spread": 2.0},
               "after": {"median_ms": 6.0, "p90_ms": 6.3, "spread": 1.05}}
    report = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8), latency=latency)
    assert any("latency figures are noisy (p90 / median up to 2.00)" in note for note in report["notes"])


def test_unstructured_note_and_unchanged_channels():
    channels = {"before": {"conv": 64}, "after": {"conv": 64}}
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.LazyLinear(4))
    model(torch.zeros(1, 3, 8, 8))
    run = Pipeline([L1Unstructured(ratio=0.5)], input_shape=(1, 3, 8, 8)).run(model)
    report = build_report(run, model="m", input_shape=(1, 3, 8, 8), channels=channels)
    assert report["notes"].count(UNSTRUCTURED_NOTE) == 1
    assert "No layer changed its output channels (1 conv/linear layers)." in to_markdown(report)


def test_ignored_layers_list_is_read_as_skipped():
    report = build_report(fake_run(details={"ignored_layers": ["fc"]}), model="m", input_shape=(1, 3, 8, 8))
    assert list(skipped_layers(report)["structured_prune"]) == ["fc"]


def test_plot_channels(tmp_path):
    report = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8), channels=CHANNELS)
    assert plot_channels(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    empty = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8))
    assert not plot_channels(empty, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_print_report(capsys):
    from rich.console import Console

    report = build_report(fake_run(), model="m", input_shape=(1, 3, 8, 8))
    print_report(report, Console(width=120))
    out = capsys.readouterr().out
    assert "0.400×" in out and "structured_prune: 1.25 s" in out


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


@pytest.mark.parametrize("pass_", [StructuredPrune(ratio=0.5, round_to=1), L1Unstructured(ratio=0.5)],
                         ids=["structured", "unstructured"])
def test_optimize_writes_markdown_and_plot(tmp_path, pass_):
    loaded = LoadedModel(small_cnn(), ArchSpec("torch.nn:Sequential"), "small-cnn")
    report = workflow.optimize(loaded, Pipeline([pass_], input_shape=(1, 3, 16, 16)), tmp_path, latency=True)
    assert (tmp_path / "channels.png").read_bytes()[:8] == PNG_MAGIC
    text = (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert "](channels.png)" in text and "## Passes" in text and "| PyTorch ms, median |" in text
    for side in ("before", "after"):
        assert report["latency"][side]["engine"] == "torch" and report["latency"][side]["repeats"] == 20
        assert 0 < report["latency"][side]["median_ms"] <= report["latency"][side]["p90_ms"]
    assert [row["name"] for row in report["layers"]] == ["0", "3", "7"]
    if pass_.name == "structured_prune":
        assert report["layers"][0] == {"name": "0", "before": 16, "after": 8}
        # The classifier keeps its outputs but loses input channels: pruned, not skipped.
        assert report["passes"][0]["details"]["skipped_layers"] == {}
        assert "## Skipped layers" not in text
    else:
        assert all(row["before"] == row["after"] for row in report["layers"])
        assert UNSTRUCTURED_NOTE in text


# The shipped Fashion model's channels after `--prune 0.3` (round_to 16): about half of each 32/64-channel layer went.
SHIPPED_AT_03 = {"before": {"stem.0": 32, "layer2.conv1": 64, "layer3.conv1": 128, "fc": 10},
                 "after": {"stem.0": 16, "layer2.conv1": 32, "layer3.conv1": 80, "fc": 10}}


def test_a_ratio_prune_that_rounding_moved_away_from_the_ratio_says_so():
    """#31: `--prune 0.3` removed 43% of the pruned layers' channels with no note."""
    report = build_report(fake_run(details={"ratio": 0.3}), model="m", input_shape=(1, 1, 28, 28),
                          channels=SHIPPED_AT_03)
    drift = [note for note in report["notes"] if "not the 30% asked" in note]
    assert drift == ["structured_prune removed 43% of the channels of the 3 layers it pruned, not the 30% asked "
                     "(e.g. stem.0: 32 -> 16): each layer keeps a multiple of round_to channels, and iterative "
                     "steps round at every step; --round-to 1 follows the ratio more closely, --target-macs aims "
                     "at a MACs fraction instead"]
    assert f"- {drift[0]}" in to_markdown(report)


@pytest.mark.parametrize("details, after", [
    ({"ratio": 0.3}, {"stem.0": 22, "layer2.conv1": 45, "layer3.conv1": 90, "fc": 10}),
    ({"ratio": None, "target": "macs", "target_fraction": 0.5}, SHIPPED_AT_03["after"]),
    ({"ratio": 0.3, "layer_ratios": {"stem.0": 0.5}}, SHIPPED_AT_03["after"]),
])
def test_no_ratio_note_when_the_ratio_was_met_or_a_target_was_asked(details, after):
    report = build_report(fake_run(details=details), model="m", input_shape=(1, 1, 28, 28),
                          channels={"before": SHIPPED_AT_03["before"], "after": after})
    assert not [note for note in report["notes"] if "asked (e.g." in note]


def test_iterative_steps_are_compared_with_the_ratio_they_compound_to():
    """#31: `--iterative-steps 3` toward 0.5 ran three prunes of 0.206 and removed far more than half, silently."""
    step = ModelStats(params=500, macs=4_000, sparsity=0.0)
    records = [PassRecord("structured_prune", 1.0, step, {"ratio": 1 - 0.5 ** (1 / 3)}) for _ in range(3)]
    run = PipelineRun(nn.Identity(), ModelStats(params=1000, macs=10_000, sparsity=0.0), step, records)
    channels = {"before": {"stem.0": 32, "layer2.conv1": 64}, "after": {"stem.0": 16, "layer2.conv1": 16}}
    report = build_report(run, model="m", input_shape=(1, 1, 28, 28), channels=channels)
    assert [note[:100] for note in report["notes"] if "asked" in note] == [
        "structured_prune removed 67% of the channels of the 2 layers it pruned in 3 steps, not the 50% asked"]


def _prune_then_finetune(prune_details: dict) -> PipelineRun:
    step = ModelStats(params=500, macs=5_000, sparsity=0.0)
    records = [PassRecord("structured_prune", 1.0, step, prune_details),
               PassRecord("finetune", 9.0, step, {"data": "fashion-mnist", "epochs": 2})]
    return PipelineRun(nn.Identity(), ModelStats(params=1000, macs=10_000, sparsity=0.0), step, records)


@pytest.mark.parametrize("prune_details, hinted", [
    ({"target": "macs", "target_fraction": 0.5}, True),
    ({"target": "macs", "target_fraction": 0.5, "allocation": "sensitivity"}, False),
    ({"ratio": 0.3}, False),
])
def test_a_uniform_target_prune_before_a_finetune_names_the_allocation_that_may_keep_more(prune_details, hinted):
    """#31: where a better-measured setting is not the default, the report says which flag and what it costs."""
    report = build_report(_prune_then_finetune(prune_details), model="m", input_shape=(1, 1, 28, 28))
    hints = [note for note in report["notes"] if "--allocation sensitivity" in note]
    assert hints == ([] if not hinted else [
        "structured_prune allocated the MACs uniformly: `--allocation sensitivity --calib-data fashion-mnist` may "
        "keep more accuracy, at about 1.5x this run's time (benchmarks/results/defaults.md)"])


@pytest.mark.parametrize("allocation, hinted", [
    ("uniform", True),
    ("uniform (split not measured: over its time budget)", False),
    ("mix", False),
])
def test_the_text_data_hint_is_given_only_where_text_would_have_changed_the_allocation(allocation, hinted):
    """Qwen2.5-0.5B with --calib-data text was told that text data would split the cut, beside the note that the
    split was over its time budget: the hint is for runs that had no text to measure on."""
    step = ModelStats(params=500, macs=5_000, sparsity=0.0)
    details = {"target": "params", "target_fraction": 0.8, "transformer": {}, "allocation": allocation}
    run = PipelineRun(nn.Identity(), ModelStats(params=1000, macs=10_000, sparsity=0.0), step,
                      [PassRecord("structured_prune", 1.0, step, details)])
    report = build_report(run, model="m", input_shape=(1, 16))
    hints = [note for note in report["notes"] if "given text data (--calib-data text)" in note]
    assert len(hints) == (1 if hinted else 0)


def test_the_latency_line_gives_throughput_in_the_unit_of_the_models_kind():
    import dataclasses

    from optkit.analysis.report import onnx_latency_note
    from optkit.kinds import get_kind

    def timing(kind: str, shape: tuple[int, ...]) -> dict:
        return {"threads": 2, "before": {"median_ms": 32.0, "input_shape": list(shape)},
                "after": {"median_ms": 25.6, "input_shape": list(shape)}, "speedup": 1.25, "ideal_speedup": 1.25,
                "efficiency": 1.0, "load_avg_1min": 0.1,
                "throughput": dataclasses.asdict(get_kind(kind).throughput(shape))}

    # 128 tokens in 32 ms is 4,000 tokens/s; in 25.6 ms, 5,000.
    assert "; prefill of 128 tokens: 4,000 -> 5,000 tokens/s;" in onnx_latency_note(timing("tokens", (1, 128)))
    images = onnx_latency_note(timing("image_classifier", (1, 3, 32, 32)))
    assert "; batch of 1: 31 -> 39 images/s;" in images and "tokens/s" not in images
    untold = timing("tokens", (1, 128))
    del untold["throughput"]
    assert "/s;" not in onnx_latency_note(untold)


def test_a_transformer_target_prune_with_an_even_split_names_the_mix_allocation():
    step = ModelStats(params=800, macs=8_000, sparsity=0.0)
    for details, hinted in (({"target": "params", "transformer": {}}, True),
                            ({"target": "params", "transformer": {}, "allocation": "mix"}, False)):
        run = PipelineRun(nn.Identity(), ModelStats(params=1000, macs=10_000, sparsity=0.0), step,
                          [PassRecord("structured_prune", 1.0, step, details)])
        notes = build_report(run, model="m", input_shape=(1, 128))["notes"]
        assert any("splits the cut between them by validation perplexity" in n for n in notes) == hinted


def test_counting_macs_shares_the_models_weights_and_leaves_no_hooks():
    """torch-pruning's counter deep-copies the model it counts: a 1.2 B model's load peaked at twice its size."""
    from optkit.model.stats import count_macs

    model = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10))
    copies = []

    def spying(real):
        def spy(tensor, memo):
            copies.append(tensor.numel())
            return real(tensor, memo)
        return spy

    with pytest.MonkeyPatch.context() as patch:
        for cls in (torch.Tensor, nn.Parameter):
            patch.setattr(cls, "__deepcopy__", spying(cls.__deepcopy__))
        assert count_macs(model, (1, 64)) == 64 * 4096 + 4096 + 4096 * 10 + 10 + 4096  # linear MACs + biases + ReLU
    assert sum(copies) < 1000  # nothing of the weights' 300 k values was copied
    assert not any(hasattr(m, "__flops__") for m in model.modules())
