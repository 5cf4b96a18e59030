"""Export steps: a PyTorch model becomes a verified file form (ONNX) that later steps (INT8) work on."""
