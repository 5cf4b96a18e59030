"""Agreement checking: a deliberately broken INT8 model is refused, and the measures are what they say."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from optkit.core.errors import ExportError
from optkit.passes.quantize import Int8Settings, quantize_onnx, static
from optkit.passes.quantize.verify import Agreement, agreement, decided, misses, within_noise

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


def test_a_class_the_fp32_model_ties_first_agrees_and_a_near_tie_does_not():
    fp32 = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.4999, 0.0], [0.0, 0.0, 0.0]])
    int8 = np.array([[0.5, 0.51, 0.0], [0.0, 0.0, 0.1], [0.49, 0.5, 0.0], [0.0, 0.0, 1e-6]])
    # rows: tied first and the other tied class picked (agrees); tied but a third class (no); near tie (no); all tied
    assert agreement(fp32, int8).agreement == 0.5


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


def _result(samples: int, differing: int, drop_images: int = 0) -> Agreement:
    """A check on ``samples`` images where ``differing`` change class and ``drop_images`` of those lose a right
    answer (accuracy 0.9 before)."""
    return Agreement(samples, 1 - differing / samples, 0.01, 0.9, 0.9 - drop_images / samples)


def test_a_miss_is_within_noise_up_to_two_standard_errors_of_the_threshold():
    # 99 % on 256 images: one standard error is sqrt(0.99 * 0.01 / 256) = 0.00622, so the line is 0.97756.
    assert within_noise(_result(256, 5), 0.99, 1.0)  # 0.98047
    assert not within_noise(_result(256, 6), 0.99, 1.0)  # 0.97656
    # A drop of 2 / 64 with 2 images differing: paired SE sqrt((2 / 64) / 64) = 0.0221, line 0.01 + 0.0442.
    assert within_noise(_result(64, 2, 2), 0.9, 0.01)
    assert within_noise(_result(64, 5, 5), 0.9, 0.01)  # drop 0.0781 <= 0.01 + 2 * sqrt((5 / 64) / 64) = 0.0799
    assert not within_noise(_result(64, 6, 6), 0.9, 0.01)  # drop 0.0938 > 0.01 + 2 * 0.0383 = 0.0865
    assert within_noise(_result(64, 6, 0), 0.9, 0.01)  # agreement 0.906 passes; no drop


def test_a_near_miss_is_decided_by_the_wider_check_alone_and_a_clear_one_never_looks_again():
    looked = []

    def wider(result):
        return lambda: looked.append(result.samples) or result

    near, clear = _result(64, 2), _result(64, 6)
    passing, failing = _result(256, 2), _result(256, 7)
    assert decided(near, 0.98, 1.0, wider(passing)) == (passing, [])
    result, missed = decided(near, 0.98, 1.0, wider(failing))
    assert result is failing and missed == ["top-1 agreement 97.27% < 98.00%"]
    assert decided(clear, 0.98, 1.0, wider(passing))[0] is clear and looked == [256, 256]
    assert decided(near, 0.98, 1.0, wider(_result(64, 0)))[0] is near  # no more images than the first check
    assert decided(near, 0.98, 1.0, None)[1] == ["top-1 agreement 96.88% < 98.00%"]
    assert decided(passing, 0.98, 1.0, wider(failing)) == (passing, []) and looked == [256, 256, 64]


@pytest.mark.parametrize("later_flips", [0, 3])
def test_an_int8_model_that_misses_within_noise_is_decided_on_four_times_the_images(models, out, monkeypatch,
                                                                                     later_flips):
    from optkit.passes.quantize import verify
    from optkit.passes.quantize.calibration import load_batches

    settings = Int8Settings(calib_data="synthetic:64:3x32x32:10", measure_ops=False, auto_exclude=False,
                            eval_samples=16, min_agreement=0.95, max_accuracy_drop=0.1)
    first, wider = (np.concatenate(load_batches(settings.calib_data, "val", SHAPE, batch_size=16, samples=n,
                                                seed=settings.seed + 1).inputs) for n in (16, 64))
    seen = {image.tobytes() for image in first}
    flipped = {first[0].tobytes()} | set([image.tobytes() for image in wider if image.tobytes() not in seen]
                                         [:later_flips])
    real = verify.outputs
    fp32 = []

    def decisions_changed(path, batches, *, threads=1):
        """The INT8 file computes what the FP32 one does, but for the decisions on the images in ``flipped``."""
        if not path.name.startswith("int8-"):
            fp32.append(path)
            return real(path, batches, threads=threads)
        outputs = real(fp32[0], batches, threads=threads)
        for row, image in zip(outputs, np.concatenate(batches.inputs)):
            if image.tobytes() in flipped:
                row[row.argmax()] = row.min() - 1
        return outputs

    monkeypatch.setattr(verify, "outputs", decisions_changed)
    # 15 of 16 (93.75 %) misses 95 % within two standard errors (line 84.1 %); then 63 of 64 passes, 60 of 64 not.
    if not later_flips:
        result = quantize_onnx(models["plain"], out, settings, input_shape=SHAPE)
        assert (result.samples, result.agreement) == (64, 63 / 64) and out.is_file()
        return
    with pytest.raises(ExportError, match=r"missed the threshold on synthetic:64:3x32x32:10 \(val\), 64 images after "
                                          r"a near miss on 16: top-1 agreement 93\.75% < 95\.00%"):
        quantize_onnx(models["plain"], out, settings, input_shape=SHAPE)
    assert list(out.parent.iterdir()) == []
