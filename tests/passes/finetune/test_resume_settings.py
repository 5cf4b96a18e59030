"""Resuming refuses every setting that changes where training ends, and says what it resumed (#31)."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from optkit.cli import main
from optkit.core.errors import TrainingError
from optkit.passes.finetune.loop import fit
from tinytrain import tiny_data, tiny_model, tiny_settings

SHIPPED = "optkit/demo/fashion_resnet.pt"


@pytest.mark.parametrize("first, changed, message", [
    ({"distill": True}, {"distill": False}, "distill=True"),
    ({}, {"grad_clip": 0.5}, "grad_clip=1.0"),
    ({}, {"data": "synthetic:96:1x6x6:4"}, "data='synthetic:96:1x6x6:3'"),
    ({}, {"input_shape": (1, 1, 8, 8)}, "input_shape=None"),
])
def test_a_resume_with_a_setting_that_changes_the_result_is_refused(tmp_path, first, changed, message):
    ckpt = str(tmp_path / "train.ckpt")
    teacher = tiny_model() if first.get("distill") else None
    fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, checkpoint=ckpt, **first), teacher=teacher,
        progress=False)
    with pytest.raises(TrainingError, match=f"it was written with {message}; rerun with those settings"):
        fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, checkpoint=ckpt, resume=True,
                                                           **{**first, **changed}), progress=False)


def test_a_resume_says_where_it_resumed_and_a_missing_checkpoint_says_so(tmp_path, caplog):
    ckpt = str(tmp_path / "train.ckpt")
    caplog.set_level(logging.INFO, logger="optkit.passes.finetune")
    fresh = fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, max_steps=4, checkpoint=ckpt, resume=True),
                progress=False)
    assert fresh.resumed == f"nothing to resume: no checkpoint at {ckpt}, so training started from the beginning"
    again = fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, max_steps=4, checkpoint=ckpt, resume=True),
                progress=False)
    assert again.resumed == f"resumed from {ckpt}: the run there had finished all 4 steps, so its best weights are kept"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(("resumed", "nothing"))] == [
        fresh.resumed, again.resumed]
    plain = fit(tiny_model(), tiny_data(), None, tiny_settings(epochs=1, max_steps=4), progress=False)
    assert plain.resumed is None


def test_the_readme_resume_without_distill_is_refused_and_with_it_resumes(tmp_path):
    """The README's --distill run, interrupted after its last checkpoint, then resumed as the README says."""
    runner = CliRunner()
    run = ["optimize", SHIPPED, "--prune", "0.5", "--finetune", "synthetic:64:1x28x28:10", "--epochs", "2",
           "--batch-size", "32", "--workers", "0", "--out", str(tmp_path / "ft")]
    first = runner.invoke(main, [*run, "--distill"], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    # What a crash after the last checkpoint leaves: the checkpoint, and none of the outputs written at the end.
    for name in ("model.pt", "recipe.toml", "report.json", "report.md", "channels.png"):
        (tmp_path / "ft" / name).unlink()

    without = runner.invoke(main, [*run, "--resume"])
    assert without.exit_code == 1
    assert without.output.strip().splitlines()[-1].endswith(
        "it was written with distill=True; rerun with those settings or remove it")
    assert not (tmp_path / "ft" / "model.pt").exists()

    resumed = runner.invoke(main, [*run, "--distill", "--resume"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    line = f"resumed from {tmp_path / 'ft' / 'finetune.ckpt'}: the run there had finished all 4 steps"
    assert line in " ".join(resumed.output.split())
    assert any(line in note for note in json.loads((tmp_path / "ft" / "report.json").read_text())["notes"])
