"""Two model forms, one pipeline: export turns the PyTorch model into an ONNX file that INT8 then takes;
what passes need from the run comes in one RunContext."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from optkit.core.context import RunContext
from optkit.core.contract import Pass, PassResult
from optkit.core.errors import FormError
from optkit.core.forms import ONNX, TORCH, OnnxModel
from optkit.core.pipeline import Pipeline
from optkit.core.settings import setting
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.finetune.passes import FineTune
from optkit.passes.prune.passes import L1Unstructured, StructuredPrune
from optkit.passes.quantize.passes import Int8

SHAPE = (1, 3, 16, 16)


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


@dataclass(frozen=True)
class Seen(Pass):
    """Records the model it gets and the teacher, checkpoint and resume the run gave it (test double)."""

    name = "seen"
    checkpoint: str | None = setting(None, help="Checkpoint file.", recipe=False)
    resume: bool = setting(False, help="Resume.", recipe=False)
    teacher: Any = setting(None, help="Teacher.", recipe=False, compare=False)

    def apply(self, model):
        return PassResult(model, {"checkpoint": self.checkpoint, "resume": self.resume, "teacher": self.teacher})


@pytest.mark.parametrize("steps, message", [
    ([ExportOnnx(), StructuredPrune(ratio=0.3)],
     "step 2 (structured_prune) takes a PyTorch model, but export_onnx before it returns an ONNX model: "
     "put structured_prune before export_onnx"),
    ([Int8()], "step 1 (int8) takes an ONNX model, but the model is still a PyTorch model there: "
               "add export_onnx (--export onnx) before it"),
    ([ExportOnnx(), lambda m: m], "step 2 (<lambda>) takes a PyTorch model, but export_onnx before it returns "
                                  "an ONNX model: put <lambda> before export_onnx"),
])
def test_a_step_that_cannot_take_the_form_before_it_is_a_one_line_error(steps, message):
    with pytest.raises(FormError) as info:
        Pipeline(steps)
    assert str(info.value) == message


def test_a_recipe_with_a_torch_pass_after_export_names_its_source():
    text = 'version = 2\n\n[[pass]]\nname = "export_onnx"\n\n[[pass]]\nname = "l1_unstructured"\n'
    with pytest.raises(FormError, match=r"^r.toml: step 2 \(l1_unstructured\) takes a PyTorch model"):
        Pipeline.from_toml(text, source="r.toml")


def test_one_recipe_holds_prune_export_and_int8_in_that_order():
    pipeline = Pipeline([StructuredPrune(ratio=0.3), ExportOnnx(fp16=True), Int8(calib_data="fashion-mnist")],
                        input_shape=SHAPE)
    text = pipeline.to_toml()
    assert [line for line in text.splitlines() if line.startswith("name = ")] == [
        'name = "structured_prune"', 'name = "export_onnx"', 'name = "int8"']
    assert Pipeline.from_toml(text).passes == pipeline.passes
    assert pipeline.writes_files() and not Pipeline([L1Unstructured()]).writes_files()


def test_export_turns_the_model_into_a_verified_onnx_file_in_the_output_folder(tmp_path):
    model = small_cnn().eval()
    seen = []
    run = Pipeline([L1Unstructured(ratio=0.5), ExportOnnx()], input_shape=SHAPE).run(
        model, context=RunContext(out_dir=tmp_path), after_pass=lambda record, m: seen.append((record.form, m)))
    assert [form for form, _ in seen] == [TORCH, ONNX]
    form = run.model
    assert isinstance(form, OnnxModel) and form.path == tmp_path / "model.onnx" and form.source is model
    assert run.torch_model is model and run.records[-1].stats is None and run.after == run.records[0].stats
    assert run.torch_part().records == run.records[:1]
    x = torch.randn(2, *SHAPE[1:])
    session = ort.InferenceSession(str(form.path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = model(x).numpy()
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert run.records[-1].details["verification"][0]["passed"]


def test_export_records_the_normalization_of_the_runs_data_as_metadata(tmp_path):
    data = {"fashion-mnist": {"mean": "0.2860", "std": "0.3530"}}
    Pipeline([ExportOnnx()], input_shape=SHAPE).run(small_cnn(), measure_stats=False,
                                                     context=RunContext(files_dir=tmp_path, data=data))
    meta = ort.InferenceSession(str(tmp_path / "model.onnx"),
                                providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert meta == {"optkit.data": "fashion-mnist", "optkit.input_mean": "0.2860", "optkit.input_std": "0.3530"}


def test_other_ranks_stop_before_the_steps_that_write_files(tmp_path):
    run = Pipeline([L1Unstructured(ratio=0.5), ExportOnnx()], input_shape=SHAPE).run(
        small_cnn(), context=RunContext(out_dir=tmp_path, rank=1, world_size=2))
    assert [r.name for r in run.records] == ["l1_unstructured"]
    assert list(tmp_path.iterdir()) == []


def test_the_context_names_checkpoints_after_the_step_and_passes_resume(tmp_path):
    run = Pipeline([Seen(), L1Unstructured(), Seen(), Seen(checkpoint="mine.ckpt")], input_shape=SHAPE).run(
        small_cnn(), measure_stats=False, context=RunContext(out_dir=tmp_path, resume=True))
    details = [r.details for r in run.records if r.name == "seen"]
    assert [d["checkpoint"] for d in details] == [str(tmp_path / "seen-1.ckpt"), str(tmp_path / "seen-2.ckpt"),
                                                 "mine.ckpt"]
    assert all(d["resume"] for d in details)
    alone = Pipeline([Seen()]).run(small_cnn(), measure_stats=False, context=RunContext(out_dir=tmp_path))
    assert alone.records[0].details["checkpoint"] == str(tmp_path / "seen.ckpt")
    assert not alone.records[0].details["resume"]


def test_the_teacher_is_the_model_before_any_pass_changed_it():
    model = small_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = Pipeline([L1Unstructured(ratio=0.9), Seen()], input_shape=SHAPE).run(model, measure_stats=False)
    teacher = run.records[1].details["teacher"]
    assert teacher is not model and not teacher.training
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in before.items())
    assert (model[0].weight == 0).float().mean() > 0.85


def test_a_given_teacher_is_used_and_no_copy_is_made_for_a_pass_that_will_not_distil():
    given = small_cnn()
    run = Pipeline([Seen()]).run(small_cnn(), measure_stats=False, context=RunContext(teacher=given))
    assert run.records[0].details["teacher"] is given
    bound = RunContext().bind([FineTune(data="synthetic:8:3x16x16:4"), FineTune(data="synthetic:8:3x16x16:4",
                                                                                  distill=True)], small_cnn())
    assert bound[0].teacher is None and isinstance(bound[1].teacher, nn.Module)
