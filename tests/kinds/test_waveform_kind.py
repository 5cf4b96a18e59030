"""A kind added in one module (tests/plugins/waveform_kind.py) and nothing else: optimize --kind waveform prunes a 1-D
conv model taking float waveforms N,T, exports a graph whose waveform length is dynamic, and reports throughput in
the kind's unit. Every decision below is the kind's: were one still made outside it (2-D inputs taken for token ids,
only the batch axis dynamic, the input named by optkit), this test would fail."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import torch

from optkit.cli import main
from optkit.io.models import load
from optkit.kinds import kind_of
from tests.plugins.waveform_kind import ConvWaveNet, Waveform

ARCH = "tests.plugins.waveform_kind:ConvWaveNet"
EXPORTED_LENGTH = 800


def test_a_waveform_model_is_pruned_exported_with_a_dynamic_length_and_reported_in_samples(runner, tmp_path):
    weights = tmp_path / "wave.pt"
    torch.save(ConvWaveNet(channels=32).state_dict(), weights)
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", str(weights), "--arch", ARCH, "--kind", "waveform", "--input-shape",
                                  f"1,{EXPORTED_LENGTH}", "--prune", "0.5", "--export", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output

    pruned = load(out / "model.pt").model.eval()
    assert isinstance(kind_of(pruned), Waveform)
    assert [m.out_channels for m in pruned.modules() if isinstance(m, torch.nn.Conv1d)] == [16, 16, 16]
    assert pruned.head.out_features == 4

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (graph_input,) = session.get_inputs()
    assert graph_input.name == "waveform"
    assert all(isinstance(dim, str) for dim in graph_input.shape), graph_input.shape
    waves = torch.randn(3, 2 * EXPORTED_LENGTH + 37, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = pruned(waves).numpy()
    (actual,) = session.run(None, {"waveform": waves.numpy()})
    assert actual.shape == (3, 4)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())

    report = json.loads((out / "report.json").read_text())
    assert report["onnx_latency"]["throughput"] == {"count": EXPORTED_LENGTH, "unit": "samples",
                                                    "call": f"{EXPORTED_LENGTH} audio samples a call"}
    timing = report["onnx_latency"]
    rates = [EXPORTED_LENGTH / timing[side]["median_ms"] * 1e3 for side in ("before", "after")]
    line = f"; {EXPORTED_LENGTH} audio samples a call: {rates[0]:,.0f} -> {rates[1]:,.0f} samples/s;"
    markdown = (out / "report.md").read_text()
    assert line in markdown
    assert "tokens/s" not in markdown and "images/s" not in markdown
