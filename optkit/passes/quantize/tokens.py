"""INT8 of a language (token) model's ONNX files: dynamic quantization, verified by perplexity on text.

A token model's time is in its linear layers and its activations change from
token to token, so it is quantized dynamically: weights INT8 per output
channel, activations quantized at run time (static QDQ is not applied). The
check is the task's: the FP32 and INT8 files are scored by the token kind
(:class:`optkit.kinds.tokens.TokenModel`) on the ``val`` split of the text in
``calib_data`` (perplexity, next-token top-1, top-1 agreement and mean KL with
FP32), and the INT8 perplexity may be at most ``1 + max_perplexity_increase``
times FP32's. When it is not, the exclusion search leaves the quantized
MatMuls that add the most error in FP32, one at a time, worst first
(:func:`optkit.passes.quantize.exclusion.node_scores`). Without text,
``random_calibration`` checks only the logits' top-1 agreement on random token
ids (``min_agreement``): the INT8 model is then fit for timing only.

The decode-step graph beside the FP32 file (``NAME.decode.onnx``, see
:mod:`optkit.export.decode`) is quantized the same way, the nodes that read the
same weights as those left in FP32 staying in FP32 too, and checked through its
KV cache: each prompt (the start of a text block) is prefilled and the text's
next tokens are fed one at a time; the INT8 graph's perplexity over those steps
must meet the same limit. On random ids the tokens fed are the FP32 graph's
greedy ones and the check is top-1 agreement. Greedy generation from the
prompts is compared and reported but not gated, since one near tie changes
every later token. A decode graph that misses its check is not written (a note
says why); the INT8 model, which passed, is.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError, ExportError
from optkit.core.settings import check_input_shape
from optkit.passes.quantize import exclusion, static
from optkit.passes.quantize.api import int8_nodes, prepare, publish
from optkit.passes.quantize.paths import decode_int8_path
from optkit.passes.quantize.settings import Int8Settings

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from optkit.kinds.base import ModelKind

#: Most tokens the text check scores (the first blocks of the val split): each check runs both files on them.
TEXT_TOKENS = 8192
#: Rows of random token ids the check without text runs.
RANDOM_ROWS = 4
#: The decode graph's check: prompts, tokens per prompt at most, and tokens fed (or generated) after each.
DECODE_PROMPTS = 8
DECODE_PROMPT_TOKENS = 32
DECODE_STEPS = 16
#: The decode speed-up INT8 should bring; under it, the summary says what the step's time goes to.
DECODE_SPEEDUP = 1.5

NO_TEXT = ("INT8 of a language model is verified by its perplexity on text: give --calib-data text (the Python "
           "documentation) or text:FILE|DIR; --random-calibration checks top-1 agreement on random token ids "
           "instead, for timing only")
RANDOM_NOTE = ("random calibration: the INT8 model was checked only by its logits' top-1 agreement with FP32 on "
               "random token ids, so it is fit for timing only; its perplexity is unknown (--calib-data text "
               "checks it)")


@dataclass
class TokenQuantizeResult:
    """What :func:`quantize_tokens` wrote and how it was checked.

    Attributes:
        path: the INT8 ONNX file.
        mode: ``dynamic`` (language models are always quantized dynamically).
        checked_on: the text spec and split, or ``random token ids``.
        fp32_size, int8_size: file sizes in bytes.
        samples: token blocks (rows) checked.
        tokens: positions checked (on text: those with a next token).
        agreement: next-token top-1 agreement with the FP32 file.
        perplexity_fp32, perplexity_int8: on the text (``None`` on random ids).
        accuracy_fp32, accuracy_int8: next-token top-1 accuracy on the text (``None`` on random ids).
        mean_kl: mean KL(FP32 || INT8) per token on the text (``None`` on random ids).
        relative_error: ``||int8 - fp32|| / ||fp32||`` of the logits on random ids (``None`` on text).
        excluded_nodes: MatMuls the exclusion search left in FP32, in the order it chose them.
        user_excluded: nodes left in FP32 because the settings said so.
        quantized_nodes: nodes quantized in the written model.
        search: the exclusion search's steps (node, score, check after it).
        decode: the decode graph's quantization and check when there was one beside the FP32 file
            (``file`` is ``None`` when it missed the check and was not written), else ``None``.
        files: the files written, by name, with their sizes.
        seconds: wall time.
        notes: plain-language remarks for the report.
    """

    path: str
    mode: str
    checked_on: str
    fp32_size: int
    int8_size: int
    samples: int
    tokens: int
    agreement: float
    perplexity_fp32: float | None
    perplexity_int8: float | None
    accuracy_fp32: float | None
    accuracy_int8: float | None
    mean_kl: float | None
    relative_error: float | None
    excluded_nodes: list[str]
    user_excluded: list[str]
    quantized_nodes: int
    search: list[dict[str, Any]]
    decode: dict[str, Any] | None
    files: dict[str, int]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TokenCheck:
    """How a language model's lower-precision files are checked against its FP32 file (see :func:`token_check`).

    Attributes:
        source: what the check runs on, in words.
        base: the FP32 file's own figures.
        run: a file's figures against FP32 and what it missed (empty: passed); on text, ``run(path, increase)``
            checks against a perplexity limit of ``1 + increase`` times FP32's (default: the settings').
        inputs: model inputs (token ids, attention mask) that rank nodes for the exclusion search.
        prompts: ``(prompt ids, text ids that follow, or None on random ids)`` for the decode graph.
        perplexity: whether the figures include perplexity (text) or only agreement (random ids).
    """

    source: str
    base: dict[str, Any]
    run: Callable[[Path], tuple[dict[str, Any], list[str]]]
    inputs: list[np.ndarray]
    prompts: list[tuple[list[int], list[int] | None]]
    perplexity: bool


def quantize_language_model(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, settings: Int8Settings,
                            input_shape: tuple[int, ...], model: nn.Module) -> dict[str, Any]:
    """Quantize a language model's exported file (and its decode graph), verified by perplexity, and time both.

    Args:
        fp32_path: the exported FP32 file (``NAME.decode.onnx`` beside it is quantized too).
        int8_path: where the INT8 file goes (the decode graph's INT8 file goes beside it).
        settings: the INT8 settings.
        input_shape: the token input shape ``N,L``.
        model: the PyTorch model the file was exported from (its tokenizer reads the text).

    Returns:
        :class:`TokenQuantizeResult` as a dict, with ``path`` (the file name), ``file_size``, ``latency``
        (:func:`optkit.passes.quantize.compare_latency` at ``input_shape``, batch 1, every core), the decode
        graphs' tokens/s and speed-up in ``decode`` when it was written, and ``notes`` led by a one-line summary.

    Raises:
        DataError, ExportError: as :func:`quantize_tokens` does; nothing is written then.
    """
    from optkit.export import decode
    from optkit.passes.quantize.latency import compare_latency

    result = quantize_tokens(fp32_path, int8_path, settings, model=model, input_shape=input_shape).to_dict()
    result["path"] = Path(int8_path).name
    result["file_size"] = result["int8_size"]
    threads = os.cpu_count() or 1
    result["latency"] = compare_latency(fp32_path, int8_path, input_shape, threads=(threads,))
    info = result["decode"]
    if info is not None and info["file"] is not None:
        fp32, int8 = decode.onnx_decode_speed([decode.decode_path(fp32_path), Path(int8_path).with_name(info["file"])],
                                              threads=threads)
        info.update(fp32_speed=fp32, int8_speed=int8, fp32_tokens_per_s=fp32["tokens_per_s"],
                    int8_tokens_per_s=int8["tokens_per_s"], speedup=round(fp32["median_ms"] / int8["median_ms"], 3))
    result["notes"] = [_summary(result, settings, input_shape), *result["notes"]]
    return result


def quantize_tokens(fp32_path: str | os.PathLike, int8_path: str | os.PathLike, settings: Int8Settings | None = None,
                    *, model: nn.Module, input_shape: tuple[int, ...],
                    check: TokenCheck | None = None) -> TokenQuantizeResult:
    """Dynamic INT8 of a language model's ONNX file and of its decode graph, verified before anything is written.

    Args:
        fp32_path: the FP32 model (from :func:`optkit.export.onnx.export_onnx`); a decode graph beside it
            (:func:`optkit.export.decode.decode_path`) is quantized too, to
            :func:`optkit.passes.quantize.paths.decode_int8_path`'s name beside ``int8_path``.
        int8_path: destination; written only when the INT8 model passes.
        settings: the :class:`Int8Settings` (defaults when ``None``); ``calib_data`` names the text.
        model: the PyTorch model the file was exported from (its kind scores the files, its tokenizer reads the text).
        input_shape: the token input shape ``N,L``; the text is scored in blocks of ``L`` tokens.
        check: the check of the FP32 file already made by :func:`token_check` (default: made from ``settings``).

    Returns:
        the :class:`TokenQuantizeResult`.

    Raises:
        DataError: without text (and without ``random_calibration``), for image data, or text the model's
            tokenizer cannot read.
        ExportError: if ONNX Runtime cannot quantize the file, or the INT8 perplexity passes the limit even
            with ``max_excluded`` MatMuls in FP32 (nothing is written then).
    """
    from optkit.export.decode import decode_path
    from optkit.kinds import kind_of

    start = time.perf_counter()
    settings = settings or Int8Settings()
    source, target = Path(fp32_path), Path(int8_path)
    if not source.is_file():
        raise ExportError(f"{source} not found; export the model first (optkit export MODEL --onnx {source})")
    shape = check_input_shape(input_shape)
    kind = kind_of(model)
    kind.check_shape(model, shape)
    check = check or token_check(source, model, shape, settings)
    decode_source = decode_path(source)
    decode_target = target.with_name(decode_int8_path(source).name)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".int8", dir=target.parent))
    try:
        pre, op_types, outcome, quantized = _quantize_main(source, scratch, settings, check)
        decode_file, decode = None, None
        if decode_source.is_file():
            decode_file, decode = _quantize_decode(decode_source, scratch, pre, outcome.excluded, op_types, settings,
                                                   check)
        publish(outcome.path, target)
        files = {target.name: target.stat().st_size}
        if decode_file is not None:
            publish(decode_file, decode_target)
            decode.update(file=decode_target.name, size=decode_target.stat().st_size)
            files[decode_target.name] = decode["size"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(source, target, settings, check, outcome, quantized, decode, files, time.perf_counter() - start)


def token_check(fp32_path: str | os.PathLike, model: nn.Module, input_shape: tuple[int, ...],
                settings: Int8Settings, *, random: bool | None = None) -> TokenCheck:
    """How files of a language model are checked against its FP32 file ``fp32_path``: perplexity on the ``val``
    split of the text in ``settings.calib_data``, or, without text, top-1 agreement on random token ids.

    Args:
        fp32_path: the FP32 ONNX file (its outputs are the reference, computed now).
        model: the PyTorch model it was exported from (its kind scores, its tokenizer reads the text).
        input_shape: the token input shape ``N,L`` (the text is scored in blocks of ``L`` tokens).
        settings: the data, samples, seed and limits.
        random: check on random token ids even without ``random_calibration`` (``None``: only with it).

    Raises:
        DataError: without text (and without ``random_calibration`` or ``random``), for image data, or text the
            model's tokenizer cannot read.
    """
    from optkit.kinds import kind_of

    kind = kind_of(model)
    if settings.calib_data is not None:
        return _text_check(Path(fp32_path), model, kind, input_shape, settings)
    if not (settings.random_calibration or random):
        raise DataError(NO_TEXT)
    return _random_check(Path(fp32_path), model, kind, input_shape, settings)


def _text_check(fp32: Path, model: nn.Module, kind: ModelKind, shape: tuple[int, ...],
                settings: Int8Settings) -> TokenCheck:
    """Perplexity on the first blocks of the text's ``val`` split, against the FP32 file's."""
    from optkit.analysis.evaluation import DataReaders
    from optkit.data.specs import is_text

    spec = settings.calib_data
    if not is_text(spec):
        raise DataError(f"{spec} holds images, but a language model's INT8 model is checked on text: give "
                        "--calib-data text (the Python documentation) or text:FILE|DIR")
    length = shape[1]
    eval_set = kind.eval_set(model, (1, length), spec, split="val", samples=min(settings.eval_samples,
                             max(1, TEXT_TOKENS // length)), data=DataReaders(model))
    reference = kind.eval_outputs(os.fspath(fp32), eval_set, settings.batch_size)
    base = kind.score(reference, eval_set)

    def run(path: Path, increase: float | None = None) -> tuple[dict[str, Any], list[str]]:
        increase = settings.max_perplexity_increase if increase is None else increase
        scores = kind.score(kind.eval_outputs(os.fspath(path), eval_set, settings.batch_size), eval_set, reference)
        if scores["perplexity"] <= base["perplexity"] * (1 + increase):
            return scores, []
        return scores, [f"perplexity {scores['perplexity']:.4f} vs {base['perplexity']:.4f} FP32 "
                        f"({scores['perplexity'] / base['perplexity'] - 1:+.2%} > +{increase:.2%})"]

    tensors = [t.numpy() for t in eval_set.model_inputs().tensors()]
    mask = tensors[1] if len(tensors) > 1 else None
    return TokenCheck(f"{spec} (val)", base, run, tensors, _text_prompts(tensors[0], mask, length), True)


def _text_prompts(ids: np.ndarray, mask: np.ndarray | None, length: int) -> list[tuple[list[int], list[int]]]:
    """The start of the first :data:`DECODE_PROMPTS` blocks without padding, and the tokens that follow it."""
    prompt = max(1, min(DECODE_PROMPT_TOKENS, length - DECODE_STEPS))
    steps = min(DECODE_STEPS, length - prompt)
    rows = [row for index, row in enumerate(ids) if mask is None or int(mask[index].sum()) >= prompt + steps]
    return [(row[:prompt].tolist(), row[prompt:prompt + steps].tolist()) for row in rows[:DECODE_PROMPTS]]


def _random_check(fp32: Path, model: nn.Module, kind: ModelKind, shape: tuple[int, ...],
                  settings: Int8Settings) -> TokenCheck:
    """The logits' top-1 agreement with the FP32 file on :data:`RANDOM_ROWS` rows of random token ids."""
    import torch

    from optkit.kinds.base import EvalSet, output_batches
    from optkit.kinds.tokens import token_inputs, vocab_size
    from optkit.passes.quantize import verify

    length = shape[1]
    generator = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(0, vocab_size(model), (RANDOM_ROWS, length), generator=generator)
    eval_set = EvalSet("random token ids", token_inputs(model, ids, torch.ones_like(ids)), None, kind=kind.name,
                       split="random", unit=f"sequences of {length} random tokens")

    def logits(path: Path) -> np.ndarray:
        values = torch.cat(list(output_batches(kind, os.fspath(path), eval_set, settings.batch_size))).numpy()
        return values.reshape(-1, values.shape[-1])

    reference = logits(fp32)

    def run(path: Path, increase: float | None = None) -> tuple[dict[str, Any], list[str]]:
        result = verify.agreement(reference, logits(path))
        figures = {"samples": RANDOM_ROWS, "tokens": result.samples, "agreement": result.agreement,
                   "relative_error": result.relative_error}
        return figures, verify.misses(result, settings.min_agreement, 1.0)

    prompt = max(1, min(DECODE_PROMPT_TOKENS, length - DECODE_STEPS))
    tensors = [t.numpy() for t in eval_set.model_inputs().tensors()]
    return TokenCheck("random token ids", {"samples": RANDOM_ROWS, "tokens": ids.numel()}, run, tensors,
                  [(row[:prompt].tolist(), None) for row in ids], False)


def _quantize_main(source: Path, scratch: Path, settings: Int8Settings,
                   check: TokenCheck) -> tuple[Path, set[str], exclusion.SearchOutcome, int]:
    """The checked INT8 model in ``scratch``: ``(pre-processed FP32 file, op types, outcome, nodes quantized)``.

    Raises:
        ExportError: for unknown exclusions, nothing to quantize, or a model that misses the check.
    """
    op_types = set(settings.op_types) or static.supported_op_types("dynamic")
    pre, groups, known = prepare(source, scratch, op_types, settings.exclude)
    counter = itertools.count()

    def build(excluded: Collection[str]) -> Path:
        out = scratch / f"int8-{next(counter)}.onnx"
        _quantize(pre, out, settings, op_types, set(settings.exclude) | set(excluded))
        return out

    first = build([])
    searched = {n for group, names in groups.items() if group not in exclusion.NOT_SEARCHED for n in names}
    candidates = int8_nodes(first, searched)

    def rank(path: Path, excluded: list[str]) -> list[tuple[str, float]]:
        return exclusion.node_scores(pre, path, check.inputs, candidates - set(excluded), scratch)

    outcome = exclusion.search(build, check.run, rank, max_excluded=settings.max_excluded if settings.auto_exclude
                               else 0, first=(first, *check.run(first)), record=_step)
    if outcome.missed:
        tried = (f" even with {len(outcome.excluded)} MatMul(s) left in FP32 ({', '.join(outcome.excluded)})"
                 if outcome.excluded else "")
        hint = ("raise --max-perplexity-increase or --max-excluded" if check.perplexity
                else "lower --min-agreement, or check on text with --calib-data text")
        raise ExportError(f"the INT8 model missed the threshold on {check.source}{tried}: {'; '.join(outcome.missed)}; "
                          f"nothing was written ({hint}, or keep the FP32 model)")
    return pre, op_types, outcome, len(int8_nodes(outcome.path, known))


def _quantize(pre: Path, out: Path, settings: Int8Settings, op_types: Collection[str], exclude: Collection[str]) -> None:
    static.quantize_file(pre, out, mode="dynamic", method="minmax", per_channel=settings.per_channel,
                         op_types=sorted(op_types), exclude=sorted(exclude), calibration=None, cache_path=None)


def _step(node: str, score: float, figures: dict[str, Any]) -> dict[str, Any]:
    """One exclusion of the search, as the result lists it."""
    return {"node": node, "score": round(score, 6), "perplexity": figures.get("perplexity"),
            "agreement": figures["agreement"]}


def _quantize_decode(source: Path, scratch: Path, main_pre: Path, excluded: list[str], op_types: set[str],
                     settings: Int8Settings, check: TokenCheck) -> tuple[Path | None, dict[str, Any]]:
    """The decode graph quantized like the model (the same weights left in FP32) and checked step by step.

    Returns:
        ``(the INT8 decode graph in scratch, or None when it missed the check, its figures)``.
    """
    import onnx

    pre = scratch / "decode-fp32.onnx"
    static.preprocess(source, pre)
    kept = _same_weights(main_pre, set(settings.exclude) | set(excluded), pre)
    out = scratch / "decode-int8.onnx"
    _quantize(pre, out, settings, op_types, kept)
    figures, missed = decode_figures(source, out, check, settings)
    graph = onnx.load(str(source), load_external_data=False).graph
    parameters, nodes = sum(math.prod(init.dims) for init in graph.initializer), len(graph.node)
    info = {"fp32_file": source.name, "file": None, "size": None, "checked_on": check.source, **figures,
            "excluded_nodes": kept, "missed": missed, "parameters": parameters, "nodes": nodes}
    return (None if missed else out), info


def _same_weights(main: Path, nodes: Collection[str], other: Path) -> list[str]:
    """Nodes of the graph ``other`` that read the same weights (equal values) as ``nodes`` of the graph ``main``."""
    import onnx
    from onnx import numpy_helper

    if not nodes:
        return []

    def digests(graph) -> dict[str, tuple[str, ...]]:
        return {init.name: (tuple(init.dims), hashlib.sha256(numpy_helper.to_array(init).tobytes()).hexdigest())
                for init in graph.initializer if len(init.dims) >= 2}

    first, second = onnx.load(str(main)).graph, onnx.load(str(other)).graph
    known = digests(first)
    wanted = {(n.op_type, known[i]) for n in first.node if n.name in set(nodes) for i in n.input if i in known}
    found = digests(second)
    return sorted(n.name for n in second.node if any((n.op_type, found.get(i)) in wanted for i in n.input))


def decode_figures(fp32: Path, int8: Path, check: TokenCheck,
                   settings: Int8Settings) -> tuple[dict[str, Any], list[str]]:
    """The decode graphs compared on the check's prompts: figures and what the INT8 graph missed (``int8``
    may be any lower-precision decode graph, an ONNX file or an OpenVINO IR).

    On text the tokens fed after each prompt are the text's, and the INT8 graph's perplexity over those steps
    may be at most ``1 + max_perplexity_increase`` times FP32's; on random ids they are the FP32 graph's greedy
    tokens, and its top-1 agreement must reach ``min_agreement``.
    """
    import numpy as np

    from optkit.export import decode

    sessions = [decode.session(fp32), decode.session(int8)]
    picked: list[list[np.ndarray]] = [[], []]
    agreed = total = same = 0
    greedy = []
    for prompt, text in check.prompts:
        steps = len(text) if text is not None else DECODE_STEPS
        reference, fp32_greedy = _steps(sessions[0], prompt, steps)
        _, int8_greedy = _steps(sessions[1], prompt, steps)
        fed = text if text is not None else fp32_greedy
        if text is not None:
            reference, _ = _steps(sessions[0], prompt, steps, fed)
        logits, _ = _steps(sessions[1], prompt, steps, fed)
        for index, values in enumerate((reference, logits)):
            shifted = values - values.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            picked[index].append(log_probs[np.arange(steps), fed])
        agreed += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        total += steps
        same += sum(a == b for a, b in zip(fp32_greedy, int8_greedy))
        greedy.append({"prompt": prompt, "fp32": fp32_greedy, "int8": int8_greedy})
    figures: dict[str, Any] = {"prompts": len(check.prompts), "steps": total, "agreement": agreed / total,
                               "greedy_match": same / sum(len(g["fp32"]) for g in greedy), "greedy": greedy}
    if not check.perplexity:
        missed = ([] if figures["agreement"] >= settings.min_agreement else
                  [f"top-1 agreement {figures['agreement']:.2%} < {settings.min_agreement:.2%} over the decode steps"])
        return figures, missed
    fp32_ppl, int8_ppl = (math.exp(-float(np.concatenate(p).astype(np.float64).mean())) for p in picked)
    figures.update(perplexity_fp32=fp32_ppl, perplexity_int8=int8_ppl)
    limit = fp32_ppl * (1 + settings.max_perplexity_increase)
    missed = ([] if int8_ppl <= limit else
              [f"perplexity over the decode steps {int8_ppl:.4f} vs {fp32_ppl:.4f} FP32 "
               f"({int8_ppl / fp32_ppl - 1:+.2%} > +{settings.max_perplexity_increase:.2%})"])
    return figures, missed


def _steps(session, prompt: list[int], count: int, fed: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """A decode graph's next-token logits after ``prompt`` and after each of the ``count - 1`` tokens that follow,
    fed one at a time through its KV cache (``count × vocabulary``), and those tokens: ``fed``, else its own greedy
    choices."""
    import numpy as np

    from optkit.export import decode

    past = [np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in session.get_inputs()
            if i.name.startswith("past.")]
    ids = np.asarray([prompt], dtype=np.int64)
    out = session.run(None, decode.feed(session, [ids, np.ones_like(ids), *past]))
    rows, tokens = [], []
    for step in range(count):
        rows.append(out[0][0, -1])
        tokens.append(int(fed[step]) if fed is not None else int(rows[-1].argmax()))
        if step + 1 < count:
            mask = np.ones((1, len(prompt) + step + 1), dtype=np.int64)
            out = session.run(None, decode.feed(session, [np.asarray([[tokens[-1]]], dtype=np.int64), mask,
                                                          *out[1:]]))
    return np.stack(rows), tokens


def _result(source: Path, target: Path, settings: Int8Settings, check: TokenCheck, outcome: exclusion.SearchOutcome,
            quantized: int, decode: dict[str, Any] | None, files: dict[str, int], seconds: float) -> TokenQuantizeResult:
    figures = outcome.result
    weights = "per output channel" if settings.per_channel else "per tensor"
    notes = [f"language models are quantized dynamically (weights INT8 {weights}, activations at run time); "
             "static QDQ is not applied to them"]
    if static.int8_can_saturate():
        notes.append(static.REDUCED_RANGE_NOTE)
    if not check.perplexity:
        notes.append(RANDOM_NOTE)
    if outcome.excluded:
        notes.append(f"the exclusion search left {len(outcome.excluded)} MatMul(s) in FP32 to meet the threshold: "
                     f"{', '.join(outcome.excluded)}")
    if decode is not None and decode["excluded_nodes"]:
        notes.append(f"{decode_int8_path(source).name} keeps in FP32 the {len(decode['excluded_nodes'])} node(s) "
                     "that read the same weights as the layers left in FP32")
    if decode is not None and decode["file"] is None:
        notes.append(f"{decode_int8_path(source).name} was not written: the INT8 decode graph missed its check "
                     f"({'; '.join(decode['missed'])}); {target.name} passed and was written")
    return TokenQuantizeResult(
        str(target), "dynamic", check.source, source.stat().st_size, target.stat().st_size, figures["samples"],
        figures["tokens"], figures["agreement"], check.base.get("perplexity"), figures.get("perplexity"),
        check.base.get("accuracy"), figures.get("accuracy"), figures.get("mean_kl"), figures.get("relative_error"),
        list(outcome.excluded), list(settings.exclude), quantized, outcome.steps, decode, files, round(seconds, 3),
        notes)


def _summary(result: dict[str, Any], settings: Int8Settings, input_shape: tuple[int, ...]) -> str:
    """The one-line summary that leads the notes: sizes, the check, the timings."""
    head = f"{result['path']}: dynamic INT8, {result['fp32_size']:,} -> {result['int8_size']:,} bytes"
    if result["perplexity_int8"] is not None:
        fp32, int8 = result["perplexity_fp32"], result["perplexity_int8"]
        check = (f"perplexity {fp32:.3f} -> {int8:.3f} ({int8 / fp32 - 1:+.2%}, limit "
                 f"+{settings.max_perplexity_increase:.2%}) on {result['checked_on']}, next-token top-1 "
                 f"{result['accuracy_fp32']:.2%} -> {result['accuracy_int8']:.2%}, agreement "
                 f"{result['agreement']:.1%} with FP32")
    else:
        check = f"top-1 agreement {result['agreement']:.1%} with FP32 on random token ids (fit for timing only)"
    timing = "; ".join(f"batch {r['batch_size']} x {input_shape[-1]} tokens, {r['threads']} thread(s): "
                       f"{r['fp32']['median_ms']:.2f} -> {r['int8']['median_ms']:.2f} ms"
                       for r in result["latency"]["runs"])
    parts = [head, check, f"ONNX Runtime {timing}"]
    info = result["decode"]
    if info is not None and info.get("speedup") is not None:
        words = (f"{info['file']} ({info['size']:,} bytes): decode {info['fp32_tokens_per_s']:.0f} -> "
                 f"{info['int8_tokens_per_s']:.0f} tokens/s "
                 f"({info['speedup']:.2f}x)")
        if info["speedup"] < DECODE_SPEEDUP:
            words += (f", under {DECODE_SPEEDUP}x: a step of this {info['parameters'] / 1e6:.1f}M-parameter model "
                      f"takes {info['fp32_speed']['median_ms']:.2f} ms over {info['nodes']:,} ONNX nodes, so fixed "
                      "per-node costs and quantizing each activation at run time weigh as much as the weight "
                      "arithmetic INT8 speeds up")
        parts.append(words)
    return "; ".join(parts)
