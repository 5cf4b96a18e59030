"""``openvino`` and ``deploy``: deployments of the exported ONNX model, checked on the task, written beside it.

Both take the ONNX form (after ``export_onnx``) and write files beside
``NAME.onnx``; the pipeline's model stays the FP32 ONNX file (``openvino``) or
becomes the chosen ONNX Runtime file (``deploy``), so an ``int8`` step may still
follow ``openvino``. The work is :func:`optkit.passes.deploy.convert.openvino_ir`
and :func:`optkit.passes.deploy.choose.choose_deployment`; the settings are
declared once in :mod:`optkit.passes.deploy.settings`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.contract import Pass, PassResult, Stage
from optkit.core.errors import ExportError
from optkit.core.forms import ONNX, OnnxModel
from optkit.core.registry import register_pass
from optkit.core.settings import setting, shared_setting
from optkit.passes.deploy.settings import DeploySettings, OpenVinoSettings

if TYPE_CHECKING:
    from optkit.core.context import RunContext

#: The files an OpenVINO deployment of ``model.onnx`` adds to a run's output folder.
OPENVINO_FILES = ("model.xml", "model.bin")
#: The plot of a latency budget's frontier (accuracy against measured latency), written beside ``model.onnx``.
FRONTIER_PLOT = "frontier.png"


def openvino_path(onnx_path: str | os.PathLike) -> Path:
    """Where the OpenVINO IR of ``onnx_path`` goes: ``NAME.onnx`` -> ``NAME.xml`` (and ``NAME.bin``)."""
    return Path(onnx_path).with_suffix(".xml")


@register_pass
@dataclass(frozen=True)
class OpenVino(OpenVinoSettings, Pass):
    """OpenVINO IR of the exported ONNX model at fp32, bf16 or INT8 (NNCF), checked on the task, and timed.

    Takes the ONNX form (after ``export_onnx``) and writes ``NAME.xml`` and ``NAME.bin`` beside
    ``NAME.onnx`` only when the IR passes its checks; the IR (in OpenVINO) and the ONNX file (in ONNX
    Runtime) are then timed interleaved at batch 1 with every core, for the report. Returns the ONNX form
    it was given.
    """

    name = "openvino"
    stage = Stage.EXPORT + 2
    in_place = False
    accepts = ONNX
    produces = ONNX
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")

    def apply(self, model: OnnxModel) -> PassResult:
        """Write the IR of the ONNX file ``model`` at :attr:`precision` and time it against the file.

        Returns:
            ``model`` itself, with :class:`optkit.passes.deploy.convert.OpenVinoResult` as a dict in the details,
            plus ``path`` (the ``.xml`` name), ``files`` (both files' sizes), ``latency`` and ``latency_rows``.

        Raises:
            ExportError, DataError: as :func:`optkit.passes.deploy.convert.openvino_ir` does; nothing is written.
        """
        from optkit.analysis.latency import Deployment, interleaved_latency
        from optkit.export import openvino as ir
        from optkit.passes.deploy.convert import openvino_ir

        if model.precision not in ("fp32", "fp16"):
            raise ExportError(f"openvino converts the FP32 ONNX model, but it got the {model.precision} one: put it "
                              "before int8")
        shape = tuple(self.input_shape or model.input_shape)
        target = openvino_path(model.path)
        result = openvino_ir(model.path, target, self.precision, self, input_shape=shape).to_dict()
        threads = os.cpu_count() or 1
        onnx_time, ir_time = interleaved_latency([Deployment(model.path), Deployment(target, "openvino",
                                                                                     self.precision)],
                                                 (1, *shape[1:]), threads=threads, warmup=3, repeats=20)
        label = f"OpenVINO {self.precision}"
        check = f"agreement {result['agreement']:.1%} with the FP32 file on {result['checked_on']}"
        if result["accuracy"] is not None:
            check += f", accuracy {result['accuracy_fp32']:.2%} -> {result['accuracy']:.2%}"
        result.update(path=target.name, files={path.name: path.stat().st_size for path in ir.ir_files(target)},
                      latency={"threads": threads, "batch_size": 1, "onnxruntime": onnx_time.to_dict(),
                               "openvino": ir_time.to_dict()},
                      latency_rows=[{"label": f"{label} vs ONNX Runtime FP32 ms ({threads} thr, batch 1)",
                                     "before_ms": onnx_time.median_ms, "after_ms": ir_time.median_ms}])
        result["notes"] = [f"{target.name}: {label} (compile with INFERENCE_PRECISION_HINT {result['compute']}), "
                           f"{result['file_size']:,} bytes with its .bin, {check}; batch 1, {threads} thread(s): "
                           f"ONNX Runtime FP32 {onnx_time.median_ms:.2f} ms, {label} {ir_time.median_ms:.2f} ms",
                           *result["notes"]]
        return PassResult(model, result)


@register_pass
@dataclass(frozen=True)
class Deploy(DeploySettings, Pass):
    """The fastest verified deployment (ONNX Runtime FP32/INT8, OpenVINO fp32/bf16/INT8), timed on this machine.

    Every candidate is checked on the task and timed against the unpruned FP32 model. Takes the FP32 ONNX
    form (after ``export_onnx``), writes only the chosen deployment's files beside ``NAME.onnx``
    (``NAME.int8.onnx``, or ``NAME.xml`` + ``NAME.bin``), and lists every candidate with its figures or why
    it was not taken. Returns the chosen ONNX Runtime file, or the FP32 file when OpenVINO is chosen. A
    language model's candidates add weight-only INT8/INT4 (ONNX Runtime's MatMulNBits, NNCF's weight
    compression), each deployed with its decode graph (``NAME.decode.*``), checked by validation perplexity
    against its precision's limit and compared by the time of a decode step.

    With a latency budget in the run (``structured_prune``'s ``target_latency``, which prunes each candidate
    just enough through :meth:`meet_budget` and plans the most accurate), only the planned deployment is built,
    checked and timed again, and the details add the ``budget`` frontier and ``frontier.png`` beside the file.
    """

    name = "deploy"
    flag = "deploy"
    stage = Stage.QUANTIZE + 2
    in_place = False
    accepts = ONNX
    produces = ONNX
    input_shape: tuple[int, ...] | None = shared_setting("input_shape")
    reference: Any = setting(None, help="The model before the pipeline, exported to time the deployments against "
                             "(default: the run's model before its passes; none: the exported file itself).",
                             recipe=False, compare=False, repr=False)
    plan: Any = setting(None, help="The run's plan: the deployment a latency budget chose and its frontier (filled "
                        "in from the run's context).", recipe=False, compare=False, repr=False)

    def bind(self, context: RunContext) -> Deploy:
        """Time against the model as it was before the pipeline (a copy made before any pass changed it), and follow
        the run's plan (a latency budget's choice)."""
        reference = self.reference if self.reference is not None else context.original()
        return dataclasses.replace(self, reference=reference, plan=context.plan)

    def meet_budget(self, prune: Any, model: Any) -> PassResult:
        """Prune ``model`` just enough for the most accurate deployment to meet ``prune``'s latency budget, and plan
        that deployment (see :func:`optkit.passes.deploy.budget.meet_budget`)."""
        from optkit.passes.deploy.budget import meet_budget

        return meet_budget(self, prune, model)

    def apply(self, model: OnnxModel) -> PassResult:
        """Choose and write the fastest verified deployment of the ONNX file ``model``.

        Returns:
            the chosen ONNX Runtime file as an :class:`OnnxModel` (``model`` itself when OpenVINO is chosen), with
            :class:`optkit.passes.deploy.choose.DeployResult` as a dict in the details, plus ``latency_rows``.

        Raises:
            ExportError: for a model that is not the FP32 file, a file an earlier step wrote where the choice
                would write, or when no candidate passes its checks.
        """
        import tempfile

        from optkit.export import decode
        from optkit.export.onnx import export_onnx
        from optkit.passes.deploy.choose import choose_deployment
        from optkit.passes.deploy.tokens import deployed_paths
        from optkit.passes.quantize.passes import int8_path

        if model.precision != "fp32":
            raise ExportError(f"deploy starts from the FP32 ONNX model, but it got the {model.precision} one: drop "
                              "--int8 and --fp16 (deploy tries ONNX Runtime INT8 itself)")
        written = [int8_path(model.path), openvino_path(model.path),
                   *(deployed_paths(Path(model.path), "onnxruntime", p)[0] for p in ("w8", "w4"))]
        taken = [p.name for p in written if p.exists()]
        if taken:
            raise ExportError(f"{', '.join(taken)} was written by an earlier step; deploy writes the deployment it "
                              "chooses: drop --int8 and --openvino")
        shape = tuple(self.input_shape or model.input_shape)
        budget = (self.plan or {}).get("budget")
        settings = dataclasses.replace(self, candidates=(self.plan["deployment"],)) if budget else self
        with tempfile.TemporaryDirectory(prefix="optkit-deploy-") as scratch:
            baseline = None
            if self.reference is not None:
                baseline = Path(scratch) / "unpruned.onnx"
                export_onnx(self.reference, baseline, shape)
                if decode.decode_path(model.path).is_file() and decode.unsupported(self.reference) is None:
                    # A language model's candidates are compared by decode time: the unpruned decode graph too.
                    decode.export_decode(self.reference, decode.decode_path(baseline))
            result = choose_deployment(model.path, settings, input_shape=shape, baseline=baseline,
                                       model=model.source).to_dict()
        chosen = Path(model.path).with_name(result["path"])
        what = {"decode": " decode ms/step", "prefill": " prefill ms"}.get(result["timed_as"], " ms")
        result["latency_rows"] = [{
            "label": f"{result['label']}{what} vs {'unpruned ' if baseline is not None else ''}ONNX Runtime FP32 "
                     f"({result['threads']} thr, batch {result['batch_size']})",
            "before_ms": result["baseline"]["median_ms"],
            "after_ms": next(c["latency"]["median_ms"] for c in result["candidates"] if c["status"] == "chosen")}]
        if budget:
            self._report_budget(result, budget, Path(model.path).with_name(FRONTIER_PLOT))
        form = (OnnxModel(chosen, model.input_shape, model.source, result["precision"])
                if result["runtime"] == "onnxruntime" else model)
        return PassResult(form, result)

    @staticmethod
    def _report_budget(result: dict[str, Any], budget: dict[str, Any], plot: Path) -> None:
        """Add the budget's frontier, the chosen deployment timed again against it, and the frontier plot."""
        from optkit.passes.deploy.budget import plot_frontier, recheck

        result["budget"] = budget
        result["notes"].insert(1, recheck(budget, result))
        if plot_frontier(budget, plot):
            result["files"][plot.name] = plot.stat().st_size
            budget["plot"] = plot.name
