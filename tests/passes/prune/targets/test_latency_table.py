"""The per-layer latency table: plausible timings, a disk cache that makes a second build free."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from torch import nn  # noqa: E402

from optkit.passes.prune.targets.latency_table import build_table, layer_ms, predict  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_table_is_monotone_cached_and_costed(cache):
    model = _model()
    first = build_table(model, (1, 3, 32, 32), threads=1)
    assert set(first.layers) == {"0", "2", "4", "8"}
    # Layers 2 and 4 differ in input width only: distinct signatures, so all four were timed.
    assert first.cost["measurements"] > 0 and first.cost["cache_hits"] == 0 and first.cost["seconds"] > 0
    conv = first.layers["4"]
    full = layer_ms(conv, 64, 64)
    # More channels are never predicted much faster (20% plus 0.02 ms of timing noise).
    for low, high in ((16, 32), (32, 48), (48, 64)):
        assert layer_ms(conv, low, 64) <= layer_ms(conv, high, 64) * 1.2 + 0.02
        assert layer_ms(conv, 64, low) <= layer_ms(conv, 64, high) * 1.2 + 0.02
    # A quarter of the channels on both axes is a sixteenth of the MACs: clearly faster than full width.
    assert layer_ms(conv, 16, 16) < 0.7 * full
    assert predict(first, {"4": (32, 32)}) < predict(first)

    second = build_table(model, (1, 3, 32, 32), threads=1)
    assert second.cost["measurements"] == 0 and second.cost["cache_hits"] == 4
    assert {n: e.ms for n, e in second.layers.items()} == {n: e.ms for n, e in first.layers.items()}
    assert any((cache / "latency_table").iterdir())


def test_identical_layers_share_an_entry(cache):
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))
    table = build_table(model, (1, 8, 16, 16), threads=1)
    assert table.cost["cache_hits"] == 1
    assert table.layers["0"].ms == table.layers["1"].ms
