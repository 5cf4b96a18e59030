"""How models and this process run: ONNX Runtime sessions (:mod:`optkit.runtime.onnxrt`), OpenVINO
(:mod:`optkit.runtime.openvino`), and this process's place in a distributed launch (``torchrun``)."""
