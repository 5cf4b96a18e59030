"""A causal language model's step with a KV cache, as a verified ONNX graph, and its decode speed.

``model.onnx`` of a language model maps a whole sequence to its logits. Generating
text one token at a time needs the keys and values of the tokens already seen:
the *decode step* graph takes ``input_ids`` (N,T), ``attention_mask`` (N,P+T) and
every layer's cached ``past.I.key`` / ``past.I.value`` (N,KV heads,P,head dim),
and returns ``logits`` and ``present.I.key`` / ``present.I.value`` with the new
tokens appended. With P = 0 it is a prefill, with T = 1 one decode step, so the
one file generates text in ONNX Runtime (:func:`generate_onnx`).

The graph is traced through the stock ``transformers`` cache, so nothing here
depends on the architecture's name: a model is supported when it generates and
its forward accepts a ``DynamicCache``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import ExportError, first_line
from optkit.core.progress import progress
from optkit.export.symbolics import exporter_symbolics

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

FILE_SUFFIX = ".decode.onnx"
#: Tokens of the prompt before the timed decode steps, and the steps timed per round.
PROMPT_TOKENS = 128
DECODE_STEPS = 32
#: Seconds of timed PyTorch decode steps after which :func:`torch_decode_speed` takes no further rounds.
ENOUGH_S = 3.0
#: The fewest steps :func:`torch_decode_speed` times before it may stop.
MIN_TIMED_STEPS = 16
#: Traced with several new tokens on a non-empty cache, so that neither count is baked into the graph.
TRACE_NEW, TRACE_PAST = 3, 5
DEFAULT_RTOL = 1e-3
#: Names of the KV cache argument and output field, newest first.
CACHE_KEYWORDS = ("cache", "past_key_values")


@dataclass
class DecodeExport:
    """A written decode-step graph and how it was checked.

    Attributes:
        path: the file.
        layers: cached layers (two inputs each, key and value).
        checks: ``(new tokens, cached tokens, max |diff|, tolerance)`` per verification call.
        seconds: wall time.
        external_data: whether the weights are in ``<path>.data`` beside the file (weights over
            :data:`optkit.export.onnx.EXTERNAL_DATA_THRESHOLD`, which one protobuf cannot hold).
    """

    path: str
    layers: int
    checks: list[tuple[int, int, float, float]]
    seconds: float
    external_data: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_path(onnx_path: str | os.PathLike) -> Path:
    """Where the decode graph of ``NAME.onnx`` goes: ``NAME.decode.onnx``."""
    path = Path(onnx_path)
    return path.with_name(path.name.removesuffix(".onnx") + FILE_SUFFIX)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` has no decode step here, or ``None`` when it has one."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        return f"{type(model).__name__} does not generate text"
    if cache_keyword(model) is None:
        return f"{type(model).__name__}.forward takes no cache"
    return None


def cache_keyword(model: nn.Module) -> str | None:
    """The keyword ``model.forward`` takes its KV cache by (``cache`` in recent ``transformers``), or ``None``."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), None)


def returned_cache(output: Any) -> Any:
    """The KV cache a model's output carries."""
    return next(getattr(output, name) for name in CACHE_KEYWORDS if getattr(output, name, None) is not None)


def decode_step(model: nn.Module) -> nn.Module:
    """``model`` called with its cache as flat tensors: the module the decode graph is traced from."""
    from torch import nn
    from transformers import DynamicCache

    keyword = cache_keyword(model)

    class DecodeStep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=self.model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            output = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                                **{keyword: cache})
            flat = []
            for layer in returned_cache(output).layers:
                flat += [layer.keys, layer.values]
            return (output.logits, *flat)

    return DecodeStep().eval()


def cache_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """Each cached tensor's shape after one token, ``(1, KV heads, 1, head dim)``, keys and values by layer."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        output = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
    return [tuple(t.shape) for layer in returned_cache(output).layers for t in (layer.keys, layer.values)]


def names(layers: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names for ``layers`` cached layers."""
    cached = [f"{{}}.{layer}.{which}" for layer in range(layers) for which in ("key", "value")]
    return (["input_ids", "attention_mask", *(n.format("past") for n in cached)],
            ["logits", *(n.format("present") for n in cached)])


def example(model: nn.Module, shapes: list[tuple[int, ...]], *, batch: int, new: int, past: int,
            seed: int) -> list[torch.Tensor]:
    """Random inputs of the decode step: token ids, a mask of ones, and a random cache of ``past`` tokens."""
    import torch

    from optkit.kinds.tokens import vocab_size

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size(model), (batch, new), generator=generator)
    mask = torch.ones(batch, past + new, dtype=torch.long)
    cache = [torch.randn(batch, s[1], past, s[3], generator=generator) for s in shapes]
    return [ids, mask, *cache]


def export_decode(model: nn.Module, path: str | os.PathLike, *, opset: int = 17,
                  rtol: float = DEFAULT_RTOL) -> DecodeExport:
    """Write the decode-step graph of a causal LM, verified against PyTorch in ONNX Runtime.

    Checked at batch 2, one row left-padded, on a prefill (4 new tokens, empty cache) and a decode step (1 new
    token on 7 cached ones): the logits and every present key/value must match PyTorch within ``rtol`` times
    that output's largest value. Weights over :data:`optkit.export.onnx.EXTERNAL_DATA_THRESHOLD` go to
    ``NAME.data`` beside the file, written together with it; ``onnx.checker`` reads the file by path.

    Raises:
        ExportError: for a model without a decode step (see :func:`unsupported`) or a graph that does not
            verify; nothing is written then.
    """
    import onnx
    import torch

    from optkit.export.onnx import prepare_for_export

    start = time.perf_counter()
    reason = unsupported(model)
    if reason:
        raise ExportError(f"no decode step to export: {reason}")
    prepared = prepare_for_export(model).cpu().float().eval()
    shapes = cache_shapes(prepared)
    step = decode_step(prepared)
    inputs, outputs = names(len(shapes) // 2)
    dynamic = {"input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
               **{n: {0: "batch", 2: "past"} for n in inputs[2:]}, "logits": {0: "batch", 1: "new"},
               **{n: {0: "batch", 2: "total"} for n in outputs[1:]}}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".export", dir=target.parent))
    steps = progress("export", f"{target.name} steps", 4)
    try:
        raw = scratch / "raw" / target.name
        raw.parent.mkdir()
        trace = example(prepared, shapes, batch=1, new=TRACE_NEW, past=TRACE_PAST, seed=0)
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                with exporter_symbolics(opset):
                    torch.onnx.export(step, tuple(trace), str(raw), input_names=inputs, output_names=outputs,
                                      dynamic_axes=dynamic, opset_version=opset, dynamo=False)
        except Exception as e:
            raise ExportError(f"the decode step of {type(model).__name__} did not export ({first_line(e)}); "
                              "nothing was written") from e
        steps.step(detail="traced")
        out = scratch / target.name
        external = _rewrite(raw, out)
        shutil.rmtree(raw.parent)
        try:
            onnx.checker.check_model(str(out))
        except Exception as e:
            raise ExportError(f"onnx.checker rejected the decode step ({first_line(e)}); nothing was written") from e
        steps.step(detail="checked" + (f", weights in {target.name}.data" if external else ""))
        checks = []
        for new, past in ((4, 0), (1, 7)):
            checks.append(_verify(step, out, prepared, shapes, new=new, past=past, rtol=rtol))
            steps.step(detail=f"verified {new} new on {past} cached tokens")
        if external:
            os.replace(out.with_name(f"{out.name}.data"), target.with_name(f"{target.name}.data"))
        else:
            target.with_name(f"{target.name}.data").unlink(missing_ok=True)
        os.replace(out, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DecodeExport(str(target), len(shapes) // 2, checks, round(time.perf_counter() - start, 3), external)


def _rewrite(raw: Path, out: Path) -> bool:
    """Save the exported graph ``raw`` as ``out``, with its weights in ``out.name + ".data"`` beside it when they
    pass :data:`optkit.export.onnx.EXTERNAL_DATA_THRESHOLD` (the exporter writes a file per weight above 2 GB, and
    a protobuf cannot hold more); returns whether they do."""
    import onnx

    from optkit.export.onnx import _save

    proto = onnx.load(str(raw))
    return _save(proto, out, None)


def _verify(step: nn.Module, path: Path, model: nn.Module, shapes: list[tuple[int, ...]], *, new: int, past: int,
            rtol: float) -> tuple[int, int, float, float]:
    import numpy as np
    import torch

    inputs = example(model, shapes, batch=2, new=new, past=past, seed=new + past)
    inputs[1][1, :2] = 0  # the second row is left-padded: the graph must honour the mask
    with torch.no_grad():
        expected = [t.numpy() for t in step(*inputs)]
    try:
        actual = session(path).run(None, feed(path, inputs))
    except Exception as e:
        raise ExportError(f"ONNX Runtime failed to run the decode step ({first_line(e)}); nothing was written") from e
    # Each output against its own scale: the logits' error is not hidden by larger cached values.
    diff, tolerance = max(((float(np.abs(a - e).max()), rtol * float(np.abs(e).max()))
                           for a, e in zip(actual, expected)), key=lambda pair: pair[0] / max(pair[1], 1e-30))
    if diff > tolerance:
        raise ExportError(f"the decode step differs from PyTorch with {new} new and {past} cached tokens: max |diff| "
                          f"{diff:.3g} > tolerance {tolerance:.3g}; nothing was written")
    return new, past, diff, tolerance


def session(path: str | os.PathLike, threads: int | None = None, *, spinning: bool = False):
    """An ONNX Runtime CPU session of a decode graph (every core unless ``threads``); for an OpenVINO IR
    (``.xml``), an :class:`optkit.runtime.openvino.Session` at the precision it records, called the same way."""
    from optkit.runtime import openvino as ov
    from optkit.runtime.onnxrt import onnx_session

    if Path(path).suffix == ".xml":
        return ov.session(path, threads or os.cpu_count() or 1)
    return onnx_session(path, threads or os.cpu_count() or 1, spinning=spinning)


def feed(path_or_session: Any, inputs: list[torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    """The ONNX Runtime feed of decode-step inputs given in :func:`names` order."""
    import numpy as np

    layers = (len(inputs) - 2) // 2
    values = [t if isinstance(t, np.ndarray) else t.detach().cpu().numpy() for t in inputs]
    return dict(zip(names(layers)[0], values))


def generate_onnx(path: str | os.PathLike, prompt: list[int], tokens: int, *, threads: int | None = None) -> list[int]:
    """Greedy generation of ``tokens`` ids after ``prompt`` with a decode graph in ONNX Runtime."""
    import numpy as np

    ids, _ = _generate(session(path, threads), prompt, tokens, timed=False)
    return ids


def _empty_cache(sess, batch: int = 1) -> list[np.ndarray]:
    import numpy as np

    past = [i for i in sess.get_inputs() if i.name.startswith("past.")]
    return [np.zeros((batch, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in past]


def _generate(sess, prompt: list[int], tokens: int, *, timed: bool, count=None,
              batch: int = 1) -> tuple[list[int], list[float]]:
    """Greedy ids after ``prompt`` and, with ``timed``, the milliseconds of each one-token step (``count``: a
    :class:`optkit.core.progress.Progress` stepped per token); ``batch`` rows of the same prompt decode together
    (the first row's ids are returned)."""
    import numpy as np

    ids = np.asarray([prompt] * batch, dtype=np.int64)
    cache = _empty_cache(sess, batch)
    out = sess.run(None, _feed_arrays(ids, np.ones_like(ids), cache))
    generated, times = [], []
    total = ids.shape[1]
    for _ in range(tokens):
        next_ids = out[0][:, -1].argmax(-1).astype(np.int64).reshape(batch, 1)
        generated.append(int(next_ids[0, 0]))
        total += 1
        begin = time.perf_counter()
        out = sess.run(None, _feed_arrays(next_ids, np.ones((batch, total), dtype=np.int64), out[1:]))
        if timed:
            times.append((time.perf_counter() - begin) * 1e3)
        if count is not None:
            count.step()
    return generated, times


def _feed_arrays(ids, mask, cache) -> dict[str, np.ndarray]:
    return dict(zip(names(len(cache) // 2)[0], [ids, mask, *cache]))


#: Decode graphs larger than this together are timed one after the other, each session closed before the next
#: opens (one model's weights in ONNX Runtime at a time); smaller ones are timed in alternating rounds.
INTERLEAVE_MAX_BYTES = 2 ** 30


def onnx_decode_speed(paths: list[str | os.PathLike], *, prompt_tokens: int = PROMPT_TOKENS,
                      steps: int = DECODE_STEPS, rounds: int = 5, threads: int | None = None,
                      seed: int = 0, batch: int = 1) -> list[dict[str, Any]]:
    """Decode speed of several decode graphs at batch 1 (or ``batch`` rows at once) in ONNX Runtime (an
    OpenVINO IR in OpenVINO, see :func:`session`), timed in alternating rounds.

    Each round prefills the same random prompt of ``prompt_tokens`` tokens in every file (untimed), then
    times ``steps`` greedy one-token steps; the first round is a warm-up. Pool threads do not spin, so one
    session does not slow the other. Files larger than :data:`INTERLEAVE_MAX_BYTES` together are timed one
    after the other instead, so only one is in memory at a time.

    Returns:
        per file ``median_ms`` (one step), ``p90_ms``, ``tokens_per_s`` (``batch`` × 1000 / median) and ``steps``
        timed.
    """
    threads = threads or os.cpu_count() or 1
    count = progress("generation", "ONNX Runtime decode steps timed", len(paths) * (rounds + 1) * steps)
    times: list[list[float]] = [[] for _ in paths]
    if sum(graph_bytes(p) for p in paths) > INTERLEAVE_MAX_BYTES:
        for index, path in enumerate(paths):
            sess = session(path, threads)
            prompt = _random_prompt(_vocabulary([sess]), prompt_tokens, seed)
            for round_index in range(rounds + 1):
                _, steps_ms = _generate(sess, prompt, steps, timed=True, count=count, batch=batch)
                if round_index:
                    times[index] += steps_ms
            del sess
        return [_speed(t, threads, batch) for t in times]
    sessions = [session(p, threads) for p in paths]
    prompt = _random_prompt(_vocabulary(sessions), prompt_tokens, seed)
    for round_index in range(rounds + 1):
        for index, sess in enumerate(sessions):
            _, steps_ms = _generate(sess, prompt, steps, timed=True, count=count, batch=batch)
            if round_index:
                times[index] += steps_ms
    return [_speed(t, threads, batch) for t in times]


def graph_bytes(path: str | os.PathLike) -> int:
    """Bytes of an ONNX file and its external data (``NAME.data``) beside it."""
    path = Path(path)
    data = path.with_name(f"{path.name}.data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _vocabulary(sessions: list) -> int:
    """The smallest vocabulary of the sessions' logits (2**31 where a graph leaves it symbolic)."""
    return min(int(s.get_outputs()[0].shape[-1]) if isinstance(s.get_outputs()[0].shape[-1], int) else 2 ** 31
               for s in sessions)


def _random_prompt(vocabulary: int, tokens: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, min(vocabulary, 2 ** 31 - 1), tokens).tolist()


def generate_torch(model: nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """Greedy generation of ``tokens`` ids after ``prompt`` with a PyTorch causal LM and its own cache."""
    ids, _ = _generate_torch(model, prompt, tokens, timed=False)
    return ids


def _generate_torch(model: nn.Module, prompt: list[int] | torch.Tensor, tokens: int, *,
                    timed: bool, count=None, stop=None) -> tuple[list[int], list[float]]:
    """Greedy ids after ``prompt`` and, with ``timed``, the milliseconds of each one-token step (``count``: a
    :class:`optkit.core.progress.Progress` stepped per token; ``stop``: called with the step times so far after
    each step, ends the generation early when true)."""
    import torch

    device = next(model.parameters()).device
    keyword = cache_keyword(model)
    ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(device)
    generated, times = [], []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(input_ids=ids, use_cache=True)
            for _ in range(tokens):
                next_id = output.logits[:, -1:].argmax(-1)
                generated.append(int(next_id))
                begin = time.perf_counter()
                output = model(input_ids=next_id, use_cache=True, **{keyword: returned_cache(output)})
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if timed:
                    times.append((time.perf_counter() - begin) * 1e3)
                if count is not None:
                    count.step()
                if stop is not None and stop(times):
                    break
    finally:
        model.train(was_training)
    return generated, times


def torch_decode_speed(model: nn.Module, *, prompt_tokens: int = PROMPT_TOKENS, steps: int = DECODE_STEPS,
                       rounds: int = 3, seed: int = 0, enough_s: float | None = ENOUGH_S,
                       warmup: bool = True) -> dict[str, Any]:
    """Decode speed of a causal LM in PyTorch eager at batch 1, with its own KV cache, on the model's device.

    A warm-up generation of a quarter of ``steps`` (``warmup=False``: the caller has just run the model), then
    up to ``rounds`` timed generations of ``steps`` one-token steps each. Timing stops once ``enough_s`` seconds
    of at least :data:`MIN_TIMED_STEPS` steps are timed (``None``: every step of every round), so a
    billion-parameter model, whose steps take a tenth of a second or more, is timed in a few seconds.
    """
    import torch

    from optkit.kinds.tokens import vocab_size

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size(model), (prompt_tokens,), generator=generator)
    warmup_steps = max(1, steps // 4) if warmup else 0
    count = progress("generation", "PyTorch decode steps timed", warmup_steps + rounds * steps)
    if warmup_steps:
        _generate_torch(model, prompt, warmup_steps, timed=False, count=count)
    times: list[float] = []

    def enough(current: list[float]) -> bool:
        return enough_s is not None and sum(times) + sum(current) >= enough_s * 1e3 and \
            len(times) + len(current) >= MIN_TIMED_STEPS

    for _ in range(rounds):
        _, steps_ms = _generate_torch(model, prompt, steps, timed=True, count=count, stop=enough)
        times += steps_ms
        if enough([]):
            break
    count.finish()
    return _speed(times, torch.get_num_threads())


def _speed(times_ms: list[float], threads: int, batch: int = 1) -> dict[str, Any]:
    """A step's median and p90 milliseconds, and the tokens per second ``batch`` rows generate at the median."""
    import numpy as np

    median = float(np.median(times_ms))
    return {"median_ms": round(median, 4), "p90_ms": round(float(np.percentile(times_ms, 90)), 4),
            "tokens_per_s": round(batch * 1e3 / median, 1), "steps": len(times_ms), "threads": threads,
            **({"batch": batch} if batch != 1 else {})}
