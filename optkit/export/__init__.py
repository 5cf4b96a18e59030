"""ONNX export, always verified against PyTorch in ONNX Runtime."""

from optkit.export.onnx import ExportResult, Verification, export_onnx, verify_onnx

__all__ = ["ExportResult", "Verification", "export_onnx", "verify_onnx"]
