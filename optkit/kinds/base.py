"""The model-kind contract: what a kind of model takes, returns and keeps (the registry is :mod:`optkit.kinds.registry`).

A **model kind** describes a family of models: what they take (an image batch,
token ids and an attention mask, a list of images), what of their output is
compared and exported, which sub-module structured pruning works on, and which
layers keep their width. Passes, metrics, export and reports ask the kind of a
model (:func:`kind_of`) instead of assuming an image tensor.

A model's kind is the one named for it (``set_kind``, ``--kind``) or else the
first registered kind, by ``priority``, whose :meth:`ModelKind.matches` accepts it.

A kind also says how its models are **scored on data** (``--eval SPEC``):
:meth:`ModelKind.eval_set` reads the scoring samples once, through the data
layer's readers (:class:`EvalData`; kinds sit below ``optkit.data``, so they are
handed the readers rather than importing them); :meth:`ModelKind.eval_outputs`
runs a PyTorch model or an ONNX file on them; :meth:`ModelKind.score` turns the
outputs into the kind's figures (:attr:`ModelKind.score_columns`), and compares
them with the original model's outputs when given.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from optkit.core.errors import OptkitError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from torch import nn

__all__ = ["KIND_ATTRIBUTE", "EvalData", "EvalSet", "ModelInputs", "ModelKind", "ScoreColumn", "Throughput", "call_with",
           "eval_progress", "export_view", "flatten_tensors", "is_hf_pretrained", "model_device"]

#: The attribute a named kind is stored under on a model (it survives ``copy.deepcopy`` and in-place pruning).
KIND_ATTRIBUTE = "_optkit_kind"


@dataclass
class ModelInputs:
    """Example inputs for one forward call: ``model(*args, **kwargs)``.

    Attributes:
        args: positional arguments (tensors, or a list of tensors for detection).
        kwargs: keyword arguments (tensors, or plain flags such as ``use_cache=False``).
        names: ONNX input names of the tensors, in the order :meth:`tensors` gives them.
    """

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ("input",)

    def call(self, model: nn.Module) -> Any:
        """Run ``model`` on these inputs."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor, flattened in call order (what an exported graph takes)."""
        import torch

        values = [*self.args, *self.kwargs.values()]
        flat: list = []
        for value in values:
            flat.extend(value if isinstance(value, (list, tuple)) else [value])
        return [t for t in flat if isinstance(t, torch.Tensor)]

    def with_tensors(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> ModelInputs:
        """The same call with its tensors replaced, in :meth:`tensors` order (what an exported graph is given)."""
        import torch

        supply = iter(tensors)

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return next(supply)
            if isinstance(value, (list, tuple)):
                return type(value)(swap(v) for v in value)
            return value

        return ModelInputs(tuple(swap(v) for v in self.args), {k: swap(v) for k, v in self.kwargs.items()}, self.names)

    def first(self) -> Any:
        """The first argument alone (an image batch, token ids, a list of images): ``model(first)`` runs the model."""
        return self.args[0] if self.args else next(iter(self.kwargs.values()))

    def packed(self) -> Any:
        """The form torch-pruning's tracer and op counter unpack into this call: a tuple of arguments or a dict."""
        if self.kwargs and self.args:
            raise ValueError("inputs with both positional and keyword arguments have no packed form; call them")
        return dict(self.kwargs) if self.kwargs else tuple(self.args)

    @property
    def batch_size(self) -> int:
        """The number of samples: the first tensor's first dimension, or a list's length (detection)."""
        first = self.first()
        return len(first) if isinstance(first, (list, tuple)) else int(first.shape[0])


@dataclass(frozen=True)
class ScoreColumn:
    """One figure a kind's :meth:`ModelKind.score` gives, as reports show it.

    Attributes:
        key: the key in the scores dict (``accuracy``, ``perplexity``...).
        label: the column heading.
        format: a format spec for the value (``.2%``, ``.3f``).
    """

    key: str
    label: str
    format: str


@dataclass(frozen=True)
class Throughput:
    """What one call of a model processes, for the throughput reports give (``unit/s``).

    Attributes:
        count: how many :attr:`unit` one call processes.
        unit: what they are, plural (``images``, ``tokens``, ``samples``).
        call: the call in words, for reports (``batch of 1``, ``prefill of 128 tokens``).
    """

    count: int
    unit: str
    call: str


@dataclass
class EvalSet:
    """Scoring samples, read once and shaped as the model takes them, so every stage (PyTorch or
    ONNX Runtime) is scored on the same tensors.

    Attributes:
        spec: the dataset spec they were read from.
        inputs: every sample, batch dimension first: one tensor (an image batch ``N×C×H×W``)
            or :class:`ModelInputs` (token ids and their attention mask).
        targets: what the outputs are scored against: ``N`` class labels, or for a language
            model the next token at each position (``N×(L-1)``, a negative id where there is none),
            class masks ``N×H×W`` for segmentation, per-image boxes and labels for detection.
        num_classes: the classes (a language model's vocabulary size), or ``None``.
        kind: the name of the model kind that read them and scores on them.
        split: the dataset split.
        unit: what one sample is, for reports (``images``, ``sequences of 128 tokens``).
    """

    spec: str
    inputs: Any
    targets: Any
    num_classes: int | None = None
    kind: str = "image_classifier"
    split: str = "test"
    unit: str = "images"

    def model_inputs(self) -> ModelInputs:
        """:attr:`inputs` as :class:`ModelInputs` (one tensor becomes the single positional argument)."""
        return self.inputs if isinstance(self.inputs, ModelInputs) else ModelInputs((self.inputs,))

    def __len__(self) -> int:
        return self.model_inputs().batch_size

    def batches(self, batch_size: int) -> Iterator[tuple[int, ModelInputs]]:
        """``(first sample's index, inputs)`` for consecutive batches of at most ``batch_size`` samples."""
        inputs = self.model_inputs()
        tensors = inputs.tensors()
        for start in range(0, len(self), batch_size):
            yield start, inputs.with_tensors([t[start:start + batch_size] for t in tensors])


class EvalData(Protocol):
    """The data layer's readers, handed to :meth:`ModelKind.eval_set` by :mod:`optkit.analysis.evaluation`.

    Kinds sit below ``optkit.data`` in the import floors, so a kind is given the
    readers instead of importing them. Each reader raises ``DataError`` (one line)
    for data that is missing or does not fit the model.
    """

    def labelled_images(self, spec: str, split: str, shape: tuple[int, ...],
                        samples: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The first ``samples`` images of ``split`` adapted to input ``shape``, their labels and the class
        count, after checking that the model runs on them and has an output per class."""
        ...

    def token_blocks(self, spec: str, split: str, seq_len: int, samples: int, *, vocab_size: int | None,
                     max_positions: int | None, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``samples`` blocks of ``seq_len`` token ids of a text spec's ``split`` (with ``spread``:
        ``samples`` blocks evenly spaced across it), tokenized by the model's own tokenizer, and their attention
        mask (0 on the last block's padding)."""
        ...

    def segmentation_masks(self, spec: str, split: str, shape: tuple[int, ...],
                           samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``samples`` images of a segmentation spec's ``split``, resized to input ``shape`` and
        normalized (``N×C×H×W``), and their class masks resized with nearest neighbour (uint8 ``N×H×W``, 255
        where a pixel is not scored)."""
        ...

    def detection_images(self, spec: str, split: str, shape: tuple[int, ...],
                         samples: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """The first ``samples`` images of a detection spec's ``split``, fitted into input ``shape`` with their aspect
        ratio (``N×C×H×W`` in [0, 1], zero-padded), and per image ``{"boxes": G×4 (x1, y1, x2, y2 in those
        pixels), "labels": G}``."""
        ...


class ModelKind:
    """Base class of every model kind; subclasses override what differs from an image classifier.

    Class attributes:
        name: the unique registry name (``image_classifier``, ``tokens``...).
        description: one line for ``optkit kinds`` and error messages.
        priority: kinds are tried for inference from low to high; the generic image
            classifier comes last.
        shape_help: what an input shape means for this kind (for messages).
        dynamic_batch: whether an exported graph can take any batch size (its other
            dynamic axes: :meth:`dynamic_axes`).
        score_columns: the figures :meth:`score` gives, in report order (none: the kind
            is not scored on data).
        throughput_unit: what reports count throughput in (``images``, ``tokens``...; see :meth:`throughput`).
        language_model: whether its models read and predict text tokens: scored by perplexity on
            text, quantized to INT8 dynamically and checked on text, and timed generating text
            (a prefill and decode steps) when they can.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    priority: ClassVar[int] = 50
    shape_help: ClassVar[str] = "N,C,H,W"
    dynamic_batch: ClassVar[bool] = True
    score_columns: ClassVar[tuple[ScoreColumn, ...]] = ()
    throughput_unit: ClassVar[str] = "samples"
    language_model: ClassVar[bool] = False

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is of this kind, judged from its structure (never from its class name alone)."""
        return False

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        """The example input shape used when none is given."""
        raise NotImplementedError

    def check_shape(self, model: nn.Module, shape: tuple[int, ...]) -> None:
        """Raise :class:`OptkitError` (one line, naming the option to change) for a shape this model cannot take."""

    def shape_hint(self, model: nn.Module) -> str:
        """What to change when ``model`` does not run on this kind's example inputs (the end of a one-line error)."""
        from torch import nn

        if any(isinstance(m, nn.Embedding) for m in model.modules()):
            return ("if it takes token ids, give --kind tokens and --seq-len L; otherwise set --input-shape to what it "
                    "expects")
        return "set --input-shape to what it expects (or --kind)"

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        """Reproducible example inputs of ``shape`` on the model's device."""
        raise NotImplementedError

    def throughput(self, shape: tuple[int, ...]) -> Throughput:
        """What one call at input ``shape`` processes: by default its ``shape[0]`` samples, counted in
        :attr:`throughput_unit`."""
        return Throughput(int(shape[0]), self.throughput_unit, f"batch of {int(shape[0])}")

    def outputs(self, output: Any) -> list[torch.Tensor]:
        """The output tensors that are compared (export parity) and exported, in a fixed order."""
        return flatten_tensors(output)

    def output_names(self, count: int) -> list[str]:
        """ONNX output names for ``count`` output tensors."""
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]

    def compare(self, expected: list[Any], actual: list[Any]) -> tuple[float, float]:
        """Largest difference between two models' outputs (numpy arrays) and the scale it is judged against.

        Returns:
            ``(max |expected - actual|, max |expected|)``.

        Raises:
            ValueError: when the outputs' count or shapes differ.
        """
        import numpy as np

        if len(actual) != len(expected) or any(a.shape != e.shape for a, e in zip(actual, expected)):
            raise ValueError(f"output shapes {[a.shape for a in actual]} differ from {[e.shape for e in expected]}")
        diff = max((float(np.max(np.abs(a.astype(np.float64) - e))) for a, e in zip(actual, expected) if e.size),
                   default=0.0)
        scale = max((float(np.max(np.abs(e))) for e in expected if e.size), default=0.0)
        return diff, scale

    def dynamic_axes(self, inputs: ModelInputs, outputs: list[torch.Tensor]) -> dict[str, dict[int, str]]:
        """The axes of an exported graph that take any size, by input name (:attr:`ModelInputs.names`) and output
        name (:meth:`output_names`), each axis named: by default the batch axis of every input and output.

        Asked only when the graph is exported with a dynamic batch (:attr:`dynamic_batch`).

        Args:
            inputs: the example inputs the graph is traced with.
            outputs: the output tensors (:meth:`outputs`) on those inputs.
        """
        return {name: {0: "batch"} for name in (*inputs.names, *self.output_names(len(outputs)))}

    def export_module(self, model: nn.Module, inputs: ModelInputs) -> nn.Module:
        """The module handed to the ONNX exporter: the model itself, or a view taking :meth:`ModelInputs.tensors`
        and returning :meth:`outputs` when the model's call or output is not plain tensors."""
        return model

    def prune_root(self, model: nn.Module) -> str | None:
        """The sub-module structured pruning works on (its outputs keep their width), or ``None`` for the whole model."""
        return None

    def held_layers(self, model: nn.Module) -> dict[str, str]:
        """Modules (by qualified name) that keep their output width, with the reason, beyond the output layers."""
        return {}

    def eval_set(self, model: nn.Module, shape: tuple[int, ...], spec: str, *, split: str, samples: int,
                 data: EvalData) -> EvalSet:
        """Read the first ``samples`` scoring samples of ``spec``'s ``split`` for ``model`` at input ``shape``.

        Args:
            model: the model before any pass (it may be run once to check that it takes the data).
            shape: the pipeline's input shape.
            spec: a dataset spec (see :mod:`optkit.data.specs`).
            split: ``test`` for reports; other callers may score on ``val``.
            samples: how many samples at most.
            data: the data layer's readers.

        Returns:
            the :class:`EvalSet`.

        Raises:
            OptkitError: (``DataError`` for data) for data this model cannot be scored on; by
                default, because the kind has no scoring.
        """
        raise OptkitError(f"optkit cannot score {self.name} models on data yet; leave out --eval")

    def eval_outputs(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int) -> Any:
        """What :meth:`score` reads: the outputs of a PyTorch model (eval mode, no gradients, on its device) or of
        an ONNX file (a path; ONNX Runtime on the CPU) on every sample of ``eval_set``.

        By default the first output tensor of each batch of ``batch_size`` samples, concatenated on the CPU in
        float32. A file with a static batch size gets whole batches only (the last partial one is left out).
        """
        import torch

        return torch.cat(list(output_batches(self, model, eval_set, batch_size)))

    def score(self, outputs: Any, eval_set: EvalSet, reference: Any = None) -> dict[str, Any]:
        """The kind's figures (:attr:`score_columns`) for ``outputs`` of :meth:`eval_outputs` on ``eval_set``.

        Args:
            outputs: the outputs of the model or file being scored.
            eval_set: the samples they came from (outputs may cover only its first samples).
            reference: the original model's outputs on the same samples; the figures comparing
                with it are ``None`` without it.

        Returns:
            ``{"samples": scored samples, KEY: value for each score column}``.
        """
        raise NotImplementedError(f"the {self.name} kind has no scoring")

    def reference(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int) -> Any:
        """What later stages are compared with (:meth:`score`'s ``reference``, and :meth:`score` of it gives the
        original's own figures): computed now, so passes that change ``model`` in place afterwards do not
        change it, and kept only as large as scoring needs. By default :meth:`eval_outputs`."""
        return self.eval_outputs(model, eval_set, batch_size)

    def score_model(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int,
                    reference: Any = None) -> dict[str, Any]:
        """:meth:`score` of a model or file's outputs, computed now (nothing is kept for a later read)."""
        return self.score(self.eval_outputs(model, eval_set, batch_size), eval_set, reference)


#: The stage whose scoring batches :func:`output_batches` counts as progress (see :func:`eval_progress`).
_EVAL_STAGE: ContextVar[str | None] = ContextVar("optkit_eval_stage", default=None)


@contextmanager
def eval_progress(stage: str) -> Iterator[None]:
    """Within the block, the batches scored on an eval set are shown as progress of ``stage``
    (:func:`optkit.core.progress.progress`); elsewhere (searches scoring many candidates) they are not."""
    token = _EVAL_STAGE.set(stage)
    try:
        yield
    finally:
        _EVAL_STAGE.reset(token)


def output_batches(kind: ModelKind, model: nn.Module | str | os.PathLike, eval_set: EvalSet,
                   batch_size: int) -> Iterator[torch.Tensor]:
    """The first output tensor (float32, CPU) of a PyTorch model, an ONNX file or an OpenVINO IR (``.xml``) on
    each batch of ``eval_set``.

    Raises:
        OptkitError: for an ONNX file whose inputs are not the eval set's.
    """
    stage = _EVAL_STAGE.get()
    if stage is None:
        yield from _output_batches(kind, model, eval_set, batch_size)
        return
    from optkit.core.progress import progress

    count = progress(stage, "batches scored", -(-len(eval_set) // batch_size))
    for output in _output_batches(kind, model, eval_set, batch_size):
        yield output
        count.step()


def _output_batches(kind: ModelKind, model: nn.Module | str | os.PathLike, eval_set: EvalSet,
                    batch_size: int) -> Iterator[torch.Tensor]:
    if isinstance(model, (str, os.PathLike)):
        yield from _onnx_batches(model, eval_set, batch_size)
        return
    import torch

    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        for _, batch in eval_set.batches(batch_size):
            batch = batch.with_tensors([t.to(device) for t in batch.tensors()])
            # Gradients go off per batch, never across a yield: a consumer that stops early would
            # otherwise leave them off for the rest of its thread.
            with torch.no_grad():
                output = kind.outputs(batch.call(model))[0].float().cpu()
            yield output
    finally:
        model.train(was_training)


def _onnx_batches(path: str | os.PathLike, eval_set: EvalSet, batch_size: int) -> Iterator[torch.Tensor]:
    import torch

    from optkit.runtime import openvino as ov
    from optkit.runtime.onnxrt import onnx_session

    # An OpenVINO IR (a deployment of the ONNX file) is scored the same way, at the precision it records.
    session = ov.session(path) if os.fspath(path).endswith(".xml") else onnx_session(path)
    names = [value.name for value in session.get_inputs()]
    count = len(eval_set.model_inputs().tensors())
    if len(names) != count:
        raise OptkitError(f"{os.fspath(path)} takes {len(names)} inputs ({', '.join(names)}) but the scoring data "
                          f"gives {count}; export the model that was scored")
    static_batch = session.get_inputs()[0].shape[0]
    step = static_batch if isinstance(static_batch, int) else batch_size
    for _, batch in eval_set.batches(step):
        tensors = batch.tensors()
        if isinstance(static_batch, int) and len(tensors[0]) < static_batch:
            break
        yield torch.from_numpy(session.run(None, {n: t.numpy() for n, t in zip(names, tensors)})[0]).float()


def call_with(model: nn.Module, inputs: Any) -> Any:
    """Run ``model`` on example inputs: :class:`ModelInputs`, a list of positional arguments, or one tensor."""
    if isinstance(inputs, ModelInputs):
        return inputs.call(model)
    return model(*inputs) if isinstance(inputs, list) else model(inputs)


def export_view(model: nn.Module, inputs: ModelInputs, kind: ModelKind) -> nn.Module:
    """A module whose forward takes ``inputs``' tensors as flat arguments and returns the kind's output tensors."""
    from torch import nn

    class ExportView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return tuple(kind.outputs(inputs.with_tensors(tensors).call(self.model)))

    return ExportView().eval()


def is_hf_pretrained(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face ``transformers`` model: its ``config`` is a ``transformers``
    ``PretrainedConfig`` and it has ``save_pretrained``.

    ``transformers`` is never imported here: a model of its classes exists only once it is.
    """
    import sys

    config_class = getattr(sys.modules.get("transformers"), "PretrainedConfig", None)
    return (isinstance(config_class, type) and isinstance(getattr(model, "config", None), config_class)
            and callable(getattr(model, "save_pretrained", None)))


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for stateless models."""
    import torch

    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def flatten_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple, list or dict output, in order; other values are left out.

    Raises:
        OptkitError: when the output holds no tensor at all.
    """
    import torch

    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            stack[:0] = list(value.values())
        elif isinstance(value, (list, tuple)):
            stack[:0] = list(value)
    if not found:
        raise OptkitError(f"the model returns {type(output).__name__} with no tensor in it; "
                          "optkit compares and exports tensors (or tuples/lists/dicts of them)")
    return found
