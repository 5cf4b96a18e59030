import pytest

from optkit.core.errors import RecipeError
from optkit.passes.prune.passes import L1Unstructured, StructuredPrune
from optkit.core.pipeline import Pipeline
from optkit.core.recipe import dumps, parse


def test_recipe_round_trips_every_setting():
    passes = [
        StructuredPrune(ratio=0.25, round_to=4, importance="l2", allocation="global", iterative_steps=2,
                        ignored_layers=("features.0",), layer_ratios={"layer1.*": 0.1}),
        L1Unstructured(ratio=0.5, global_=True),
    ]
    text = dumps(passes, input_shape=(1, 3, 64, 64))
    parsed = parse(text)
    assert parsed["passes"] == passes
    assert parsed["input_shape"] == (1, 3, 64, 64)
    assert dumps(parsed["passes"], input_shape=parsed["input_shape"]) == text


def test_keyword_settings_are_written_without_trailing_underscore():
    text = dumps([L1Unstructured(ratio=0.1, global_=True)])
    assert "global = true" in text and "global_" not in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[pass]]\nname = "does_not_exist"\n', "unknown pass 'does_not_exist'; valid passes: .*structured_prune"),
        ('[[pass]]\nname = "structured_prune"\nratio = 0.3\nspeed = "fast"\n', "no recipe setting.*speed.*valid: .*ratio"),
        ('colour = "red"\n', "unknown key.*colour.*valid keys: version, input_shape, device, pass"),
        ('[[pass]]\nratio = 0.3\n', "has no name"),
        ('[[pass]]\nname = "structured_prune"\nratio = 1.5\n', r"ratio must be a number in \[0, 1\)"),
        ('[[pass]]\nname = "structured_prune"\nimportance = "magic"\n', "importance must be one of auto, l1, l2"),
        ("input_shape = [1, -3]\n", "input_shape must be"),
        ("[[pass]\nname=", "not valid TOML"),
    ],
)
def test_invalid_recipes_are_rejected_with_the_valid_choices(text, message):
    with pytest.raises(RecipeError, match=message):
        parse(text)


def test_pipeline_save_and_load(tmp_path):
    pipeline = Pipeline([StructuredPrune(ratio=0.3)], input_shape=(1, 3, 32, 32), device="cpu")
    path = tmp_path / "recipe.toml"
    pipeline.save(path)
    again = Pipeline.load(path)
    assert again.passes == pipeline.passes
    assert again.input_shape == (1, 3, 32, 32) and again.device == "cpu"


def test_missing_recipe_file_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="cannot read recipe"):
        Pipeline.load(tmp_path / "nope.toml")
