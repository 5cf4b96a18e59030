"""Recipe versions: recipes say which version they are; older ones (in every existing model.pt) still load."""

from __future__ import annotations

import pytest
import torch

import recipe_v1
from optkit.core.errors import RecipeError
from optkit.core.pipeline import Pipeline
from optkit.core.recipe import dumps, parse
from optkit.core.recipe_versions import VERSION
from optkit.demo import FASHION_RESNET
from optkit.passes.export.passes import ExportOnnx
from optkit.passes.quantize.passes import Int8
from optkit.passes.prune.passes import StructuredPrune

MIGRATED = "is a version 1 recipe; it was migrated to version 2 (save it again to keep it)"


def test_every_recipe_written_starts_with_its_version():
    text = dumps([StructuredPrune(ratio=0.3)], input_shape=(1, 3, 32, 32))
    assert text.splitlines()[0] == f"version = {VERSION}"
    parsed = parse(text)
    assert parsed["notes"] == [] and parsed["passes"] == [StructuredPrune(ratio=0.3)]


def test_the_demo_checkpoints_unversioned_recipe_loads_and_says_it_was_migrated():
    recipe = torch.load(FASHION_RESNET, weights_only=True)["extra"]["recipe"]
    assert recipe == recipe_v1.DEMO
    pipeline = Pipeline.from_toml(recipe, source="fashion_resnet.pt")
    assert pipeline.passes == [] and pipeline.input_shape == (1, 1, 28, 28)
    assert pipeline.notes == [f"fashion_resnet.pt {MIGRATED}"]


def test_a_version_1_int8_table_becomes_export_and_int8_steps():
    pipeline = Pipeline.from_toml(recipe_v1.WITH_INT8, source="model.pt")
    assert [p.name for p in pipeline.passes] == ["structured_prune", "finetune", "export_onnx", "int8"]
    prune, finetune, export, int8 = pipeline.passes
    assert prune.ratio == 0.3 and prune.round_to == 8
    assert finetune.data == "fashion-mnist" and finetune.epochs == 1
    assert export == ExportOnnx()
    assert int8 == Int8(calib_data="fashion-mnist", min_agreement=0.98)
    assert pipeline.notes == [f"model.pt {MIGRATED}"]
    saved = pipeline.to_toml()
    assert "[int8]" not in saved and 'name = "export_onnx"' in saved and 'name = "int8"' in saved
    again = Pipeline.from_toml(saved)
    assert again.notes == [] and again.passes == pipeline.passes


def test_a_version_1_int8_that_is_not_a_table_is_refused():
    with pytest.raises(RecipeError, match="^r.toml: int8 must be an \\[int8\\] table$"):
        parse('int8 = "static"\n', source="r.toml")


def test_a_model_pt_holding_a_version_1_recipe_still_loads(tmp_path):
    from optkit.io import checkpoint
    from optkit.io.models import arch_spec, load

    model = load("torchvision:resnet18", num_classes=10).model
    checkpoint.save(model, tmp_path / "model.pt", arch_spec("torchvision:resnet18", 10),
                    extra={"recipe": recipe_v1.WITH_INT8})
    recipe = torch.load(tmp_path / "model.pt", weights_only=True)["extra"]["recipe"]
    assert Pipeline.from_toml(recipe).notes == [f"recipe {MIGRATED}"]
    assert load(str(tmp_path / "model.pt")).recorded_input_shape == (1, 1, 28, 28)


def test_a_newer_recipe_is_a_one_line_error_naming_the_version_read():
    with pytest.raises(RecipeError) as info:
        parse(f"version = {VERSION + 1}\ninput_shape = [1, 3, 32, 32]\n", source="r.toml")
    assert str(info.value) == (f"r.toml is a version {VERSION + 1} recipe, but this optkit reads recipe versions up "
                               f"to {VERSION}: upgrade optkit to run it")


@pytest.mark.parametrize("value", ["0", '"2"', "true", "1.5"])
def test_a_malformed_version_is_refused(value):
    with pytest.raises(RecipeError, match=f"version must be a whole number from 1 to {VERSION}"):
        parse(f"version = {value}\n")


def test_mappings_built_in_code_are_the_current_version():
    parsed = Pipeline.from_dict({"pass": [{"name": "structured_prune", "ratio": 0.3}]}, source="command-line flags")
    assert parsed.notes == []
