"""Building files: ONNX export (always verified against PyTorch in ONNX Runtime), decode-step graphs, OpenVINO IR."""

from optkit.export.onnx import ExportResult, Verification, export_onnx, verify_onnx

__all__ = ["ExportResult", "Verification", "export_onnx", "verify_onnx"]
