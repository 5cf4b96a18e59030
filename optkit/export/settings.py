"""The ONNX export options, declared once: ``optkit export`` generates its flags from them.

Importing this module needs no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from optkit.core.settings import Settings, setting

EXPORTERS = ("auto", "torchscript", "dynamo")


@dataclass(frozen=True)
class ExportSettings(Settings):
    """How a model is written to ONNX (see :func:`optkit.export.onnx.export_onnx`)."""

    opset: int | None = setting(None, help="ONNX opset (default 18).", low=7, flag="opset")
    fp16: bool = setting(False, help="Store weights as fp16 (half the file); compute stays fp32.", flag="fp16")
    static_batch: bool = setting(False, help="Fix the batch dimension instead of making it dynamic.",
                                 flag="static-batch")
    exporter: str = setting("auto", help="torch ONNX exporter; auto tries TorchScript, then dynamo.",
                            choices=EXPORTERS, flag="exporter")
    simplify: bool = setting(False, help="Simplify the graph with onnxslim (verified the same way).", flag="simplify")
    rtol: float | None = setting(None, help="Allowed difference relative to the largest output (default 1e-3; "
                                 "2e-2 with --fp16).", low=0, flag="rtol")
    decode_graph: bool = setting(True, help="For a causal language model, also write NAME.decode.onnx: one step "
                                 "with a KV cache (a prefill or a decode step), verified against PyTorch, to "
                                 "generate text in ONNX Runtime (recipe setting).")

    def export_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`optkit.export.onnx.export_onnx` (from these settings' own fields)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(ExportSettings) if f.name != "decode_graph"}
        values["dynamic_batch"] = not values.pop("static_batch")
        return values
