"""Agreement checking: a deliberately broken INT8 model is refused, and the measures are what they say."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from optkit.core.errors import ExportError
from optkit.passes.quantize import Int8Settings, quantize_onnx, static
from optkit.passes.quantize.verify import agreement, misses

SHAPE = (1, 3, 32, 32)


def test_agreement_measures():
    fp32 = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5], [0.2, 0.1]])
    int8 = np.array([[2.0, 1.0], [0.0, 3.0], [0.5, 1.0], [0.2, 0.1]])
    result = agreement(fp32, int8, labels=np.array([0, 1, 0, 1]))
    assert result.agreement == 0.75 and result.samples == 4
    assert result.relative_error == pytest.approx(np.sqrt(0.5) / np.linalg.norm(fp32))
    assert (result.accuracy_fp32, result.accuracy_int8) == (0.75, 0.5)
    assert misses(result, 0.7, 0.3) == []
    assert len(misses(result, 0.8, 0.3)) == 1 and len(misses(result, 0.7, 0.2)) == 1


def test_labels_that_do_not_index_the_outputs_give_no_accuracy():
    result = agreement(np.eye(2), np.eye(2), labels=np.array([0, 5]))
    assert result.accuracy_fp32 is None and result.accuracy_drop is None


def _corrupt_first_conv_scale(path) -> None:
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name == "convs.0.weight_scale":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * -40.0, init.name))
            break
    else:
        raise AssertionError("no convs.0.weight_scale in the INT8 file")
    onnx.save(model, str(path))


def test_a_broken_int8_model_is_refused_and_not_written(models, out, monkeypatch):
    real = static.quantize_file

    def broken(pre_path, out_path, **kwargs):
        real(pre_path, out_path, **kwargs)
        _corrupt_first_conv_scale(out_path)

    monkeypatch.setattr(static, "quantize_file", broken)
    settings = Int8Settings(calib_data="synthetic:64:3x32x32:10", measure_ops=False, auto_exclude=False)
    with pytest.raises(ExportError) as info:
        quantize_onnx(models["plain"], out, settings, input_shape=SHAPE)
    assert "top-1 agreement" in str(info.value) and "nothing was written" in str(info.value)
    assert list(out.parent.iterdir()) == []
