"""Refusals: each is a one-line optkit error that says what to do, and nothing is written."""

from __future__ import annotations

import pytest

from optkit.core.errors import DataError, ExportError
from optkit.passes.quantize import Int8Settings, quantize_onnx

SHAPE = (1, 3, 32, 32)


def _refused(error, model, out, settings, shape=SHAPE):
    with pytest.raises(error) as info:
        quantize_onnx(model, out, settings, input_shape=shape)
    message = str(info.value)
    assert "\n" not in message
    assert list(out.parent.iterdir()) == [], "a refused run must leave nothing behind"
    return message


def test_no_calibration_data_names_the_flag_and_why(models, out):
    message = _refused(DataError, models["plain"], out, Int8Settings(measure_ops=False))
    assert "--calib-data" in message and "--random-calibration" in message
    assert "random inputs set activation ranges unlike real images'" in message


def test_empty_calibration_set(models, out, tmp_path):
    folder = tmp_path / "images"
    for name in ("cat", "dog"):
        (folder / name).mkdir(parents=True)
    message = _refused(DataError, models["plain"], out, Int8Settings(calib_data=f"imagefolder:{folder}",
                                                                     measure_ops=False))
    assert "no readable images" in message


@pytest.mark.parametrize("spec", ["synthetic:16:2x32x32:10", "synthetic:16:4x32x32:10"])
def test_images_whose_channels_do_not_fit(models, out, spec):
    message = _refused(DataError, models["plain"], out, Int8Settings(calib_data=spec, measure_ops=False))
    assert "channel" in message and "--input-shape" in message


def test_input_shape_that_does_not_fit_the_file(models, out):
    message = _refused(DataError, models["plain"], out,
                       Int8Settings(calib_data="synthetic:16:3x32x32:10", measure_ops=False), shape=(1, 3, 64, 64))
    assert "--input-shape" in message


def test_threshold_missed_even_with_exclusions(models, out):
    settings = Int8Settings(calib_data="synthetic:64:3x32x32:10", measure_ops=False, min_agreement=0.95,
                            max_accuracy_drop=0.05, max_excluded=1)
    message = _refused(ExportError, models["two"], out, settings)
    assert "even with 1 layer(s) left in FP32 (/convs.1/Conv)" in message and "nothing was written" in message
    assert "--max-excluded" in message
