"""``export_onnx``: the PyTorch model becomes a verified ONNX file, the form later steps (``int8``) take.

The export itself is :func:`optkit.export.onnx.export_onnx`: the file is checked
with ``onnx.checker`` and against PyTorch in ONNX Runtime before it appears. The
settings are :class:`optkit.export.settings.ExportSettings`'s, declared once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optkit.core.contract import DEFAULT_INPUT_SHAPE, Pass, PassResult, Stage
from optkit.core.forms import ONNX, OnnxModel
from optkit.core.registry import register_pass
from optkit.core.settings import setting, shared_setting
from optkit.export.settings import ExportSettings

if TYPE_CHECKING:
    from torch import nn

    from optkit.core.context import RunContext

FORMATS = ("onnx",)
FILE_NAME = "model.onnx"


@register_pass
@dataclass(frozen=True)
class ExportOnnx(ExportSettings, Pass):
    """Export to ONNX, verified against PyTorch in ONNX Runtime; later steps work on the file.

    Does not change the PyTorch model (a prepared copy is exported). In a run with an
    output folder the file is ``model.onnx`` there; its metadata records the input
    normalization when the run's passes read one dataset.
    """

    name = "export_onnx"
    stage = Stage.EXPORT
    in_place = False
    produces = ONNX
    format: str = setting("onnx", help="Also write model.onnx, verified against PyTorch in ONNX Runtime.",
                          choices=FORMATS, recipe=False, flag="export", enables=True)
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")
    path: str | None = setting(None, help="The ONNX file to write (default: model.onnx in the run's output "
                               "folder).", recipe=False)
    metadata: dict[str, str] | None = setting(None, help="String pairs stored as the file's ONNX metadata_props "
                                              "(default: the input normalization of the data the run read).",
                                              recipe=False)

    def bind(self, context: RunContext) -> ExportOnnx:
        """Write into the run's output folder, with the normalization of the run's data as metadata."""
        changes = {}
        if self.path is None:
            changes["path"] = str(context.output_path(FILE_NAME))
        if self.metadata is None and (metadata := onnx_metadata(context.data)):
            changes["metadata"] = metadata
        return dataclasses.replace(self, **changes) if changes else self

    def apply(self, model: nn.Module) -> PassResult:
        """Export ``model`` and return it as an :class:`OnnxModel`.

        Returns:
            the ONNX form, with :class:`optkit.export.onnx.ExportResult` as a dict in the details.

        Raises:
            ExportError: when no exporter writes a file that verifies (nothing is written then).
        """
        from optkit.export.onnx import export_onnx

        target = Path(self.path or FILE_NAME)
        shape = tuple(self.input_shape or DEFAULT_INPUT_SHAPE)
        result = export_onnx(model, target, shape, metadata=self.metadata or None, **self.export_kwargs())
        details = result.to_dict()
        if self.decode_graph:
            details.update(_decode_graph(model, target, details))
        return PassResult(OnnxModel(target, shape, model, "fp16" if self.fp16 else "fp32"), details)


def _decode_graph(model: nn.Module, target: Path, details: dict) -> dict:
    """A causal LM's decode-step graph beside ``target``, as report details: ``decode`` (what was written and
    checked) and ``files``; a model without one adds nothing, a graph that does not verify adds a note."""
    from optkit.core.errors import ExportError
    from optkit.export import decode

    if decode.unsupported(model) is not None:
        return {}
    path = decode.decode_path(target)
    try:
        written = decode.export_decode(model, path).to_dict()
    except ExportError as e:
        return {"notes": [*details["notes"], f"{path.name} was not written: {e}"]}
    written["path"] = path.name
    written["file_size"] = decode.graph_bytes(path)
    return {"decode": written, "files": {target.name: details["file_size"], path.name: written["file_size"]}}


def onnx_metadata(normalization: dict[str, dict[str, str]]) -> dict[str, str]:
    """ONNX ``metadata_props`` naming the input normalization the model was trained or calibrated with.

    Args:
        normalization: ``{dataset spec: {"mean": ..., "std": ...}}`` of the data the run's passes read.

    Returns:
        the metadata, recorded only when the passes read one dataset spec (so the values are unambiguous).
    """
    if len(normalization) != 1:
        return {}
    ((spec, values),) = normalization.items()
    return {"optkit.data": spec, "optkit.input_mean": values["mean"], "optkit.input_std": values["std"]}
