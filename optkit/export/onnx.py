"""ONNX export that is always verified against PyTorch before the file appears.

:func:`export_onnx` prepares a copy of the model (eval mode, pruning
reparametrizations and optkit wrappers removed), exports it with one of
torch's two ONNX exporters (falling back to the other one when the first fails
to export or to verify), optionally simplifies the graph and then stores the
weights in fp16 (in that order: the simplifier folds fp16 weights and their
Casts back into fp32 ones), records any metadata, then checks that the written
file stores what was asked, checks it with ``onnx.checker`` and compares ONNX
Runtime's outputs with PyTorch's at two batch sizes. Only a verified file is
moved into place; on any failure nothing is left behind.

BatchNorms fed by a conv or linear layer are folded into it first, by the
folding engine (:func:`optkit.model.batchnorm.fold_batchnorm`, the one the
``fold_batchnorm`` pass runs); the rest (a BN before a conv, as in densenet)
stay, and ONNX Runtime fuses what it can when it loads the graph. When the
engine cannot fold (no data flow found), the unfolded copy is exported and a
note says why. ``batchnorm_nodes`` in the result says how many are left in the file.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import shutil
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import ExportError, OptkitError, first_line
from optkit.core.progress import Progress, progress
from optkit.export.symbolics import exporter_symbolics

if TYPE_CHECKING:
    import onnx
    import torch
    from torch import nn

EXPORTERS = ("auto", "torchscript", "dynamo")
#: Tried in this order by ``exporter="auto"``; measured on torchvision models here,
#: the TorchScript exporter takes well under a second where the dynamo one takes 3-9 s.
AUTO_ORDER = ("torchscript", "dynamo")
DEFAULT_OPSET = 18
#: Default verification tolerance relative to the largest output magnitude: fp32 weights,
#: and fp16 weights (about 3 significant digits each, accumulated over many layers).
DEFAULT_RTOL = 1e-3
DEFAULT_RTOL_FP16 = 2e-2
#: Protobuf cannot hold a message over 2 GiB; larger models keep weights in a side file.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26
SPARSITY_NOTE = (
    "{pct:.1%} of conv/linear weights are exactly zero. Dense ONNX Runtime kernels "
    "run no faster on zeros and the file is no smaller uncompressed; only the compressed "
    "size shrinks (gzip of the file: {gz:,} of {raw:,} bytes)."
)


@dataclass
class Verification:
    """ONNX Runtime vs PyTorch on the same random input at one batch size.

    Attributes:
        batch_size: batch size of the input.
        max_abs_diff: largest absolute difference over all outputs.
        max_abs_ref: largest absolute PyTorch output value (the scale).
        tolerance: ``rtol * max_abs_ref + atol``, the largest difference allowed.
        passed: whether ``max_abs_diff <= tolerance``.
    """

    batch_size: int
    max_abs_diff: float
    max_abs_ref: float
    tolerance: float
    passed: bool


@dataclass
class ExportResult:
    """What :func:`export_onnx` wrote and how it was checked.

    Attributes:
        path: the ONNX file.
        exporter: ``"torchscript"`` or ``"dynamo"``, the exporter whose file was kept.
        attempts: ``{exporter: why it was not kept}`` for exporters tried before it.
        opset: ONNX opset of the graph.
        dynamic_batch: whether the batch dimension is dynamic.
        fp16: whether weights are stored as fp16 (computed in fp32).
        simplified: whether onnxslim simplified the graph.
        external_data: whether weights live in ``<path>.data`` beside the file.
        verification: one entry per batch size checked.
        file_size: bytes of the ONNX file (plus its external data).
        compressed_size: bytes of the same after gzip (default level), which
            is what zeroed weights shrink.
        weight_sparsity: fraction of conv/linear weights that are exactly zero.
        batchnorm_nodes: BatchNormalization nodes left in the graph (ONNX
            Runtime fuses those that follow a Conv when it loads the file).
        seconds: wall time of export plus verification.
        notes: plain-language remarks for the report.
        metadata: the ``metadata_props`` written into the file.
    """

    path: str
    exporter: str
    attempts: dict[str, str]
    opset: int
    dynamic_batch: bool
    fp16: bool
    simplified: bool
    external_data: bool
    verification: list[Verification]
    file_size: int
    compressed_size: int
    weight_sparsity: float
    batchnorm_nodes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_onnx(model: nn.Module, path: str | os.PathLike, input_shape: Sequence[int], *,
                opset: int | None = None, dynamic_batch: bool = True, fp16: bool = False,
                exporter: str = "auto", simplify: bool = False, rtol: float | None = None,
                atol: float = 0.0, external_data: bool | None = None, seed: int = 0,
                metadata: dict[str, str] | None = None) -> ExportResult:
    """Export ``model`` to ONNX at ``path``, verified against PyTorch.

    The model itself is not changed: a deep copy is prepared (see
    :func:`prepare_for_export`), its BatchNorms are folded into the conv/linear
    layers that feed them where possible, and that copy is exported; ONNX
    Runtime's outputs are compared with the unfolded copy's.

    Args:
        model: the model (possibly pruned, wrapped or on a GPU).
        path: destination ``.onnx`` file; replaced only by a verified file.
        input_shape: example input shape, e.g. ``(1, 3, 224, 224)``.
        opset: ONNX opset (default 18).
        dynamic_batch: make the batch dimension dynamic (verified at two
            batch sizes), with the other axes the model's kind makes dynamic
            (:meth:`~optkit.kinds.ModelKind.dynamic_axes`: a token model's
            sequence); otherwise every axis is fixed to ``input_shape``.
        fp16: store weights as fp16 (half the file) while inputs, outputs and
            compute stay fp32.
        exporter: ``"auto"`` (TorchScript first, then dynamo), ``"torchscript"``
            or ``"dynamo"``.
        simplify: simplify the graph with onnxslim (verified the same way).
        rtol: allowed difference relative to the largest output magnitude
            (default :data:`DEFAULT_RTOL`, 1e-3, or :data:`DEFAULT_RTOL_FP16`,
            2e-2, with ``fp16``).
        atol: allowed absolute difference on top of ``rtol`` (default 0: the
            check is purely relative, so tiny random-init outputs are still compared).
        external_data: keep weights in ``<path>.data``; by default only when
            the model is too big for one protobuf (2 GB).
        seed: seed of the random verification inputs.
        metadata: string key/value pairs stored as the file's ONNX
            ``metadata_props`` (e.g. the input normalization), readable with
            ``onnxruntime.InferenceSession(path).get_modelmeta().custom_metadata_map``.

    Returns:
        the :class:`ExportResult`.

    Raises:
        ValueError: for an unknown ``exporter``, a bad ``input_shape``/tolerance
            or metadata that is not string keys and values.
        ExportError: when no exporter produces a file that stores what was
            asked (fp16 weights), passes ``onnx.checker`` and matches PyTorch
            within tolerance.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    shape = tuple(int(v) for v in input_shape)
    if len(shape) < 2 or any(v < 1 for v in shape):
        raise ValueError(f"input_shape must hold at least 2 positive sizes like (1, 3, 224, 224), got {tuple(input_shape)}")
    rtol = (DEFAULT_RTOL_FP16 if fp16 else DEFAULT_RTOL) if rtol is None else rtol
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"metadata must map strings to strings, got {metadata!r}")
    opset = DEFAULT_OPSET if opset is None else int(opset)

    from optkit.kinds import kind_of

    dynamic_batch = dynamic_batch and kind_of(model).dynamic_batch
    start = time.perf_counter()
    reference = prepare_for_export(model)
    prepared, fold_note = _folded_copy(reference, shape)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    order = AUTO_ORDER if exporter == "auto" else (exporter,)
    attempts: dict[str, str] = {}
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".export", dir=target.parent))
    try:
        for name in order:
            out = scratch / name / target.name
            out.parent.mkdir()
            shown = progress("export", f"{target.name} steps ({name} exporter)", 3)
            try:
                checks, is_external = _export_once(prepared, reference, out, shape, name, opset=opset,
                                                   dynamic_batch=dynamic_batch, fp16=fp16, simplify=simplify,
                                                   rtol=rtol, atol=atol, external_data=external_data, seed=seed,
                                                   metadata=metadata, shown=shown)
            except ExportError as e:
                attempts[name] = str(e)
                continue
            file_size, compressed = _sizes(out, is_external)
            _publish(out, target, is_external)
            result = _result(target, name, attempts, opset, dynamic_batch, fp16, simplify, is_external, checks,
                             file_size, compressed, prepared, time.perf_counter() - start)
            result.notes += [fold_note] if fold_note else []
            if gzip_is_estimated(file_size):
                result.notes.append(f"{target.name}'s gzipped size is estimated from a sample of about "
                                    f"{GZIP_EXACT_MAX_BYTES // 2**20} MiB (it is {file_size / 2**30:.1f} GiB)")
            if (half := _half_dtype(model)) and not fp16:
                result.notes.append(f"{target.name} holds the {half} weights as float32 (ONNX Runtime's CPU kernels "
                                    "have no bf16); --fp16 stores them in half the bytes")
            result.metadata = metadata
            return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tried = "; ".join(f"{name}: {reason}" for name, reason in attempts.items())
    raise ExportError(f"ONNX export of {type(prepared).__name__} failed, nothing was written ({tried})")


def prepare_for_export(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` ready to export: wrappers and pruning reparametrizations removed, eval mode.

    A bf16 or fp16 model's copy is float32 (ONNX Runtime's CPU kernels have no bf16; ``fp16=True`` stores the
    exported weights as fp16 afterwards), made tensor by tensor, so no half-precision copy exists on the way.
    BatchNorm is not folded here; :func:`export_onnx` folds it on this copy.
    """
    import torch
    from torch import nn
    from torch.nn.utils import prune

    from optkit.io.checkpoint import unwrap

    model = unwrap(model)
    # A pruned weight is a computed (non-leaf) tensor, which deepcopy refuses: copy it detached.
    memo = {id(getattr(m, hook._tensor_name)): getattr(m, hook._tensor_name).detach().clone()
            for m in model.modules() for hook in m._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod)}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo and tensor.dtype in (torch.bfloat16, torch.float16):
            wide = tensor.detach().float()
            memo[id(tensor)] = nn.Parameter(wide, requires_grad=tensor.requires_grad) if isinstance(
                tensor, nn.Parameter) else wide
    prepared = copy.deepcopy(model, memo)
    for module in prepared.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(module, hook._tensor_name)
    _route_experts_exportably(prepared)
    return prepared.eval()


def _half_dtype(model: nn.Module) -> str | None:
    """``bfloat16`` or ``float16`` when most of the model's parameters are in one, else ``None``."""
    from optkit.io.checkpoint import unwrap

    sizes: dict[str, int] = {}
    for parameter in unwrap(model).parameters():
        if parameter.is_floating_point():
            name = str(parameter.dtype).removeprefix("torch.")
            sizes[name] = sizes.get(name, 0) + parameter.numel()
    largest = max(sizes, key=sizes.get, default=None)
    return largest if largest in ("bfloat16", "float16") else None


def _route_experts_exportably(model: nn.Module) -> None:
    """Mixture-of-experts layers of ``transformers`` models group tokens per expert by default with ``histc``,
    which ONNX lacks; their ``batched_mm`` implementation gathers each token's expert weights instead, with the
    same results (the verification below compares this copy with ONNX Runtime)."""
    get = getattr(model, "get_experts_implementation", None)
    if callable(get) and get().get("") not in (None, "eager", "batched_mm"):
        model.set_experts_implementation("batched_mm")


def _folded_copy(reference: nn.Module, shape: tuple[int, ...]) -> tuple[nn.Module, str | None]:
    """A copy of ``reference`` with BatchNorm folded where possible (verification still compares with ``reference``)."""
    from torch import nn

    from optkit.model.batchnorm import fold_batchnorm

    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in reference.modules()):
        return reference, None  # nothing to fold (a transformer): no second copy of the model
    prepared = copy.deepcopy(reference)
    try:
        details = fold_batchnorm(prepared, input_shape=shape)
    except Exception as e:
        # Folding is an optimization: the exporter and ONNX Runtime still fuse Conv+BN pairs.
        return copy.deepcopy(reference), f"BatchNorm was not folded before export ({first_line(e)})"
    return prepared, (f"{len(details['not_folded'])} BatchNorm(s) could not be folded into a conv/linear layer"
                      if details["not_folded"] else None)


#: Up to this many bytes a gzipped size is exact; above it, it is estimated from every n-th 4 MiB piece so that
#: about this many bytes are compressed (an exact gzip of a model of several GB takes minutes on one core, for a
#: figure that tells sparse weights from dense ones, which a sample tells as well).
GZIP_EXACT_MAX_BYTES = 256 * 2**20
_GZIP_PIECE = 1 << 22


def gzip_size(path: str | os.PathLike) -> int:
    """Bytes of ``path`` after gzip at its default level 6 (as ``gzip.compress(data)`` with no file name); estimated
    from a sample above :data:`GZIP_EXACT_MAX_BYTES` (see :func:`gzip_is_estimated`)."""
    def pieces():
        with open(path, "rb") as f:
            while chunk := f.read(_GZIP_PIECE):
                yield chunk

    return _gzipped(pieces(), os.path.getsize(path))


def gzip_is_estimated(size: int) -> bool:
    """Whether the gzipped size of ``size`` bytes is estimated from a sample rather than exact."""
    return size > GZIP_EXACT_MAX_BYTES


def _gzipped(pieces: Iterable[bytes], total: int) -> int:
    """gzip bytes of the concatenated ``pieces`` (``total`` bytes in all): one stream when exact, else every n-th
    piece compressed on its own and the sum scaled to ``total``."""
    stride = max(1, math.ceil(total / GZIP_EXACT_MAX_BYTES))
    if stride == 1:
        compressor = _gzip_compressor()
        return sum(len(compressor.compress(piece)) for piece in pieces) + len(compressor.flush())
    sampled = compressed = 0
    for index, piece in enumerate(_split(pieces)):
        if index % stride == 0:
            compressor = _gzip_compressor()
            compressed += len(compressor.compress(piece)) + len(compressor.flush())
            sampled += len(piece)
    return round(compressed * total / max(sampled, 1))


def _split(pieces: Iterable[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        for start in range(0, len(piece), _GZIP_PIECE):
            yield piece[start:start + _GZIP_PIECE]


def weights_sizes(model: nn.Module) -> dict[str, int]:
    """Raw and compressed bytes of a model's parameters and buffers (as fp32/their dtype, contiguous).

    Returns:
        ``{"weights": raw bytes, "weights_gzip": bytes after gzip at its default level}`` (estimated from a sample
        above :data:`GZIP_EXACT_MAX_BYTES`).
    """
    import torch

    from optkit.io.checkpoint import unwrap

    tensors = list(unwrap(model).state_dict().values())
    raw = sum(t.numel() * t.element_size() for t in tensors)
    # As raw bytes: numpy has no bfloat16, and one tensor at a time is all this holds.
    pieces = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    return {"weights": raw, "weights_gzip": _gzipped(pieces, raw)}


def _gzip_compressor():
    return zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: gzip container


def _export_once(model: nn.Module, reference: nn.Module, out: Path, shape: tuple[int, ...], exporter: str, *, opset: int,
                 dynamic_batch: bool, fp16: bool, simplify: bool, rtol: float, atol: float,
                 external_data: bool | None, seed: int, metadata: dict[str, str],
                 shown: Progress | None = None) -> tuple[list[Verification], bool]:
    """Export ``model`` with one exporter to ``out``, post-process it and verify it against ``reference``
    (``shown``: progress of its three steps)."""
    import onnx

    raw = out.parent / "raw" / out.name
    raw.parent.mkdir()
    try:
        _run_exporter(model, raw, shape, exporter, opset=opset, dynamic_batch=dynamic_batch)
        proto = onnx.load(str(raw))
    except Exception as e:
        raise ExportError(f"the {exporter} exporter failed: {first_line(e)}") from e
    shutil.rmtree(raw.parent)
    if shown is not None:
        shown.step(detail="traced")
    if simplify:
        proto = _simplify(proto)
    if fp16:
        _store_weights_fp16(proto)
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    is_external = _save(proto, out, external_data)
    del proto
    if shown is not None:
        shown.step(detail=f"written{', weights in ' + out.name + '.data' if is_external else ''}")
    if fp16:
        _check_weights_fp16(out)
    checks = verify_onnx(reference, out, shape, dynamic_batch=dynamic_batch, rtol=rtol, atol=atol, seed=seed)
    if shown is not None:
        shown.step(detail="verified in ONNX Runtime")
    return checks, is_external


def _run_exporter(model: nn.Module, path: Path, shape: tuple[int, ...], exporter: str, *, opset: int,
                  dynamic_batch: bool) -> None:
    import torch

    from optkit.kinds import kind_of

    kind = kind_of(model)
    # torch.export specializes a batch of 1 to a constant, so trace a dynamic batch with 2.
    batch = max(2, shape[0]) if dynamic_batch and exporter == "dynamo" else shape[0]
    inputs = kind.example_inputs(model, (batch, *shape[1:]))
    module = kind.export_module(model, inputs)
    args = tuple(inputs.args) if module is model else tuple(inputs.tensors())
    with torch.no_grad():
        outputs = kind.outputs(inputs.call(model))
    output_names = kind.output_names(len(outputs))
    input_names = list(inputs.names)
    axes = kind.dynamic_axes(inputs, outputs) if dynamic_batch else {}
    kwargs: dict[str, Any] = {"input_names": input_names, "output_names": output_names, "opset_version": opset}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            if dynamic_batch:
                kwargs["dynamic_shapes"] = _by_signature(module, tuple(
                    {dim: torch.export.Dim(name, min=1, max=1 << 16) for dim, name in axes[input_name].items()}
                    for input_name in input_names))
            torch.onnx.export(module, args, str(path), dynamo=True, external_data=True, **kwargs)
        else:
            if dynamic_batch:
                kwargs["dynamic_axes"] = axes
            with exporter_symbolics(opset):
                torch.onnx.export(module, args, str(path), dynamo=False, do_constant_folding=True, **kwargs)


def _by_signature(module: nn.Module, shapes: tuple[dict, ...]) -> tuple:
    """Per-input dynamic shapes as ``torch.export`` matches them to ``module.forward``: one entry per parameter,
    so inputs taken by ``*tensors`` (a kind's export view) are one tuple."""
    import inspect

    parameters = list(inspect.signature(module.forward).parameters.values())
    if parameters and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return (shapes,)
    return shapes


def _store_weights_fp16(proto: onnx.ModelProto) -> None:
    """Store float32 initializers as fp16, each followed by a Cast back to fp32 (folded by ONNX Runtime at load)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = proto.graph
    casts = []
    for init in graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        name = init.name
        half = numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), f"{name}__fp16")
        init.CopyFrom(half)
        casts.append(helper.make_node("Cast", [half.name], [name], to=onnx.TensorProto.FLOAT, name=f"{name}__to_fp32"))
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def _check_weights_fp16(path: Path) -> None:
    """Refuse a file asked to store fp16 weights that still holds float32 initializers."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    left = [init.name for init in graph.initializer if init.data_type == onnx.TensorProto.FLOAT]
    if left:
        raise ExportError(f"fp16 was asked but the written file stores {len(left)} float32 initializer(s) "
                          f"(e.g. {', '.join(left[:3])}); export without --simplify or report this as a bug")


def _simplify(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        import onnxslim
    except ImportError as e:
        raise ExportError("graph simplification needs onnxslim: pip install onnxslim") from e
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return onnxslim.slim(proto)
    except Exception as e:
        raise ExportError(f"onnxslim could not simplify the graph: {first_line(e)}") from e


def _save(proto: onnx.ModelProto, out: Path, external_data: bool | None) -> bool:
    import onnx

    if external_data is None:
        external_data = sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    if external_data:
        onnx.save_model(proto, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{out.name}.data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(out))
    return external_data


def verify_onnx(model: nn.Module, path: str | os.PathLike, input_shape: Sequence[int], *, dynamic_batch: bool = True,
                rtol: float = DEFAULT_RTOL, atol: float = 0.0, seed: int = 0) -> list[Verification]:
    """Check an ONNX file with ``onnx.checker`` and compare ONNX Runtime's outputs with ``model``'s.

    Inputs are random, the same for both; with ``dynamic_batch`` they are
    checked at batch sizes ``b`` and ``b + 2`` (``b = input_shape[0]``),
    otherwise twice at ``b`` with different inputs.

    Returns:
        one :class:`Verification` per input, all passed.

    Raises:
        ExportError: if the checker rejects the file, ONNX Runtime cannot run
            it, or any output differs by more than ``rtol * max|ref| + atol``.
    """
    import numpy as np
    import onnx
    import torch

    from optkit.kinds import kind_of
    from optkit.runtime.onnxrt import onnx_session

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:
        raise ExportError(f"onnx.checker rejected the exported file: {first_line(e)}") from e
    kind = kind_of(model)
    batch = int(input_shape[0])
    batches = (batch, batch + 2) if dynamic_batch and kind.dynamic_batch else (batch, batch)
    model = model.eval()
    results = []
    try:
        session = onnx_session(path)
    except OptkitError as e:
        reason = first_line(e.__cause__ or e)
        raise ExportError(f"ONNX Runtime cannot load the exported file: {reason}") from e
    for index, b in enumerate(batches):
        inputs = kind.example_inputs(model, (b, *input_shape[1:]), seed=seed + index)
        with torch.no_grad():
            expected = [t.detach().float().cpu().numpy() for t in kind.outputs(inputs.call(model))]
        given = dict(zip(inputs.names, inputs.tensors()))
        try:
            feed = {i.name: _as_feed(given[i.name] if i.name in given else inputs.first()) for i in session.get_inputs()}
            actual = [np.asarray(a, dtype=np.float32) for a in session.run(None, feed)]
        except Exception as e:
            raise ExportError(f"ONNX Runtime failed to run the exported file at batch size {b}: {first_line(e)}") from e
        try:
            diff, scale = kind.compare(expected, actual)
        except ValueError as e:
            raise ExportError(f"ONNX Runtime outputs differ from PyTorch's at batch size {b}: {e}") from e
        tolerance = rtol * scale + atol
        check = Verification(b, diff, scale, tolerance, bool(diff <= tolerance))
        if not check.passed:
            raise ExportError(f"ONNX Runtime outputs differ from PyTorch at batch size {b}: max |diff| {diff:.3g} "
                              f"> tolerance {tolerance:.3g} (rtol {rtol:g} x max |output| {scale:.3g} + atol {atol:g})")
        results.append(check)
    return results


def _as_feed(tensor: torch.Tensor) -> Any:
    """A numpy array for ONNX Runtime: floating inputs as float32, integer ones (token ids) as they are."""
    data = tensor.detach().cpu()
    return (data.float() if data.is_floating_point() else data).numpy()


def _sizes(out: Path, is_external: bool) -> tuple[int, int]:
    files = [out] + ([out.with_name(f"{out.name}.data")] if is_external else [])
    return sum(f.stat().st_size for f in files), sum(gzip_size(f) for f in files)


def _publish(out: Path, target: Path, is_external: bool) -> None:
    for source in [out] + ([out.with_name(f"{out.name}.data")] if is_external else []):
        with open(source, "rb") as f:
            os.fsync(f.fileno())
    if is_external:
        os.replace(out.with_name(f"{out.name}.data"), target.with_name(f"{target.name}.data"))
    os.replace(out, target)


def _result(target: Path, exporter: str, attempts: dict[str, str], opset: int, dynamic_batch: bool, fp16: bool,
            simplify: bool, is_external: bool, checks: list[Verification], file_size: int, compressed: int,
            model: nn.Module, seconds: float) -> ExportResult:
    import onnx

    from optkit.model.stats import weight_sparsity

    graph = onnx.load(str(target), load_external_data=False).graph
    batchnorms = sum(node.op_type == "BatchNormalization" for node in graph.node)
    sparsity = weight_sparsity(model)
    notes = []
    if attempts:
        notes.append(f"exported with {exporter} after " + "; ".join(f"{k} was not kept ({v})" for k, v in attempts.items()))
    if sparsity >= 0.01:
        notes.append(SPARSITY_NOTE.format(pct=sparsity, gz=compressed, raw=file_size))
    if all(check.max_abs_ref <= check.tolerance for check in checks):
        largest = max(check.max_abs_ref for check in checks)
        notes.append(f"PyTorch's outputs were all within the tolerance of zero (max |output| {largest:.3g}), so "
                     "the check could not tell a wrong export from a right one: verify again with trained weights "
                     "(torchvision zero-initializes some classifier heads, e.g. ViT's)")
    return ExportResult(str(target), exporter, attempts, opset, dynamic_batch, fp16, simplify, is_external, checks,
                        file_size, compressed, sparsity, batchnorms, round(seconds, 3), notes)
