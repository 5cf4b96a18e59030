"""Tests for optkit.passes.finetune.checkpoints: resume after SIGKILL, and resumes that are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optkit.core.errors import TrainingError
from optkit.passes.finetune.checkpoints import CHECKPOINT_FORMAT
from optkit.passes.finetune.loop import fit
from tinytrain import tiny_data, tiny_model, tiny_settings

ROOT = Path(__file__).resolve().parents[3]

_RESUME_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    sys.path.insert(0, {here!r})
    from tinytrain import tiny_data, tiny_model, resume_settings
    from optkit.passes.finetune.loop import fit

    torch.set_num_threads(1)
    data = tiny_data()
    kill_at = int(sys.argv[2])

    class Killing(torch.utils.data.Dataset):
        calls = 0
        def __len__(self):
            return len(data)
        def __getitem__(self, i):
            return data[i]
        def __getitems__(self, indices):
            Killing.calls += 1
            if Killing.calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return [data[i] for i in indices]

    result = fit(tiny_model(), Killing(), data, resume_settings(sys.argv[1], resume=kill_at == 0), progress=False)
    torch.save(result.model.state_dict(), sys.argv[1] + ".final")
""")


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RESUME_SCRIPT.format(here=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ckpt = str(tmp_path / "train.ckpt")
    # 6 batches an epoch: batch 10 is mid-way through epoch 2, two batches after the step-8 checkpoint.
    killed = subprocess.run([sys.executable, str(script), ckpt, "10"], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state"]["epoch"] == 1 and saved["state"]["step"] == 8 and saved["state"]["position"] == 32

    resumed = subprocess.run([sys.executable, str(script), ckpt, "0"], env=env, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    fresh = str(tmp_path / "fresh.ckpt")
    uninterrupted = subprocess.run([sys.executable, str(script), fresh, "-1"], env=env, capture_output=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr.decode()[-2000:]

    a = torch.load(ckpt + ".final", weights_only=True)
    b = torch.load(fresh + ".final", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=1e-6), key
    last_a, last_b = torch.load(ckpt, weights_only=True), torch.load(fresh, weights_only=True)
    assert last_a["state"]["history"] == last_b["state"]["history"]
    for key in last_a["model"]:
        assert torch.allclose(last_a["model"][key].float(), last_b["model"][key].float(), rtol=0, atol=1e-6), key


@pytest.mark.parametrize("changed, message", [
    ({"lr": 2e-3}, "lr=0.001"),
    ({"max_steps": 3}, "max_steps=None"),
    ({"max_train_samples": 64}, "max_train_samples=None"),
])
def test_resume_refuses_checkpoint_from_other_settings(tmp_path, changed, message):
    ckpt = str(tmp_path / "train.ckpt")
    fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, lr=1e-3, checkpoint=ckpt), progress=False)
    with pytest.raises(TrainingError, match=message):
        fit(tiny_model(), tiny_data(), None,
            tiny_settings(**{"epochs": 1, "lr": 1e-3, "checkpoint": ckpt, "resume": True, **changed}), progress=False)


def test_resume_refuses_a_file_that_is_not_a_training_checkpoint(tmp_path):
    ckpt = tmp_path / "train.ckpt"
    torch.save({"format": "something else", "model": {}}, ckpt)
    with pytest.raises(TrainingError, match="not an optkit training checkpoint; remove it"):
        fit(tiny_model(), tiny_data(), None, tiny_settings(checkpoint=str(ckpt), resume=True), progress=False)


def test_resume_refuses_weights_of_another_shape(tmp_path):
    ckpt = str(tmp_path / "train.ckpt")
    fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, checkpoint=ckpt), progress=False)
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3))
    with pytest.raises(TrainingError, match="do not fit this model"):
        fit(other, tiny_data(), None, tiny_settings(epochs=1, checkpoint=ckpt, resume=True), progress=False)


@pytest.mark.parametrize("max_steps", [None, 8])
def test_resume_of_finished_run_restores_best_weights(tmp_path, max_steps):
    ckpt = str(tmp_path / "train.ckpt")
    settings = dict(epochs=2, checkpoint=ckpt, max_steps=max_steps)
    first = fit(tiny_model(), tiny_data(), tiny_data(), tiny_settings(**settings), progress=False)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["format"] == CHECKPOINT_FORMAT and saved["state"]["step"] == (max_steps or 12)
    again = fit(tiny_model(), tiny_data(), tiny_data(), tiny_settings(**settings, resume=True), progress=False)
    assert again.history == first.history and again.best_epoch == first.best_epoch
    assert torch.load(ckpt, weights_only=True)["state"]["step"] == (max_steps or 12)
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key


class _Planted:
    """Unpickling this creates a file: a stand-in for code hidden in a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_never_unpickles_code_in_a_checkpoint(tmp_path):
    ckpt, marker = tmp_path / "train.ckpt", tmp_path / "marker"
    torch.save({"format": CHECKPOINT_FORMAT, "model": _Planted(marker)}, ckpt)
    with pytest.raises(TrainingError, match="holds pickled Python objects.*remove it to start over"):
        fit(tiny_model(), tiny_data(), None, tiny_settings(checkpoint=str(ckpt), resume=True), progress=False)
    assert not marker.exists()
