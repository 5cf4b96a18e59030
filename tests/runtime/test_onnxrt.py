"""optkit.runtime.onnxrt: the one ONNX Runtime session opener sets exactly what it is asked (threads, spinning,
profiling) and leaves ONNX Runtime's defaults otherwise; its feeds fit every input."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch
from torch import nn

from optkit.core.errors import OptkitError
from optkit.runtime.onnxrt import onnx_feed, onnx_session

SPINNING = "session.intra_op.allow_spinning"


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnxrt") / "tiny.onnx"
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()).eval()
    torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), path, dynamo=False, input_names=["x"],
                      dynamic_axes={"x": {0: "batch"}})
    return path


def test_without_settings_the_session_has_onnx_runtimes_defaults(onnx_file):
    options, defaults = onnx_session(onnx_file).get_session_options(), ort.SessionOptions()
    assert (options.intra_op_num_threads, options.inter_op_num_threads, options.execution_mode) == (
        defaults.intra_op_num_threads, defaults.inter_op_num_threads, defaults.execution_mode)
    with pytest.raises(RuntimeError, match="does not have configuration"):
        options.get_session_config_entry(SPINNING)  # not set: ONNX Runtime's default (spinning)
    assert not options.enable_profiling


def test_threads_run_one_operator_at_a_time_and_spinning_is_set_as_asked(onnx_file):
    for spinning, entry in ((False, "0"), (True, "1")):
        options = onnx_session(onnx_file, 2, spinning=spinning).get_session_options()
        assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 1)
        assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        assert options.get_session_config_entry(SPINNING) == entry


def test_a_profiled_session_writes_its_trace(onnx_file, tmp_path):
    session = onnx_session(onnx_file, 1, profile_prefix=tmp_path / "trace")
    session.run(None, onnx_feed(session, (2, 3, 8, 8)))
    assert session.end_profiling().startswith(str(tmp_path / "trace"))


def test_feeds_fit_every_input(onnx_file):
    session = onnx_session(onnx_file)
    feed = onnx_feed(session, (2, 3, 8, 8), seed=1)
    assert list(feed) == ["x"] and feed["x"].shape == (2, 3, 8, 8)
    assert session.run(None, feed)[0].shape == (2, 144)


def test_an_unreadable_file_is_a_one_line_error(tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"not onnx")
    with pytest.raises(OptkitError, match="broken.onnx: ONNX Runtime cannot load it"):
        onnx_session(tmp_path / "broken.onnx")
