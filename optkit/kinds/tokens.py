"""Token models: language-model encoders and decoders that take token ids and an attention mask ``N,L``."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import weakref
from typing import TYPE_CHECKING, Any

from optkit.core.errors import DataError, OptkitError
from optkit.kinds.base import (EvalData, EvalSet, ModelInputs, ModelKind, ScoreColumn, Throughput, export_view,
                               is_hf_pretrained, model_device, output_batches)
from optkit.kinds.registry import register_kind

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from torch import nn

DEFAULT_SEQ_LEN = 128
#: Output fields compared and exported, first found wins: a task head's logits, else the hidden states.
OUTPUT_FIELDS = ("logits", "last_hidden_state")
EMBEDDING_REASON = "token embedding: the hidden size every block adds to stays"
ATTENTION_REASON = ("attention projection: heads are kept whole (structured pruning of a token model removes "
                    "MLP channels)")
#: Direct linear children of one module reading the hidden width that mark it as attention (q, k, v, ...).
MIN_ATTENTION_PROJECTIONS = 3
#: The target of a position with no next token to predict (a block's padding).
IGNORE = -100
#: Logits held at once while scoring (float32 values): batches of long sequences and large vocabularies shrink.
LOGITS_PER_BATCH = 2 ** 25


@register_kind
class TokenModel(ModelKind):
    """Encoders and causal LMs: ``input_ids`` and ``attention_mask`` of shape ``N,L``, ids below the vocabulary size.

    Recognised by structure: a Hugging Face model whose main input is
    ``input_ids``, or a model whose first parameterised layer is an embedding.
    The compared output is the task head's ``logits`` (or the encoder's
    ``last_hidden_state``); the hidden size and the attention heads keep their
    width, MLP channels are pruned. Exported graphs take any batch size and
    sequence length; throughput is counted in tokens (a call is a prefill).

    Causal LMs are scored on text (``--eval text[:FILE|DIR]``): perplexity, the
    exp of the mean next-token negative log-likelihood over the positions that
    have a next token (padding excluded), next-token top-1 accuracy, and against
    the original model the top-1 agreement and mean KL(original || this) per token.
    """

    name = "tokens"
    description = "language models taking token ids (N,L) and an attention mask"
    priority = 30
    shape_help = "N,L (batch, sequence length)"
    throughput_unit = "tokens"
    language_model = True
    score_columns = (ScoreColumn("perplexity", "perplexity", ".3f"),
                     ScoreColumn("accuracy", "next-token top-1", ".2%"),
                     ScoreColumn("agreement", "agreement with original", ".2%"),
                     ScoreColumn("mean_kl", "mean KL per token", ".4f"))

    def matches(self, model: nn.Module) -> bool:
        from torch import nn

        if is_hf_pretrained(model) and model.main_input_name == "input_ids":
            return True
        if not any(isinstance(m, nn.Embedding) for m in model.modules()):
            return False
        first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
        return isinstance(first, nn.Embedding) or isinstance(_first_consumer(model), nn.Embedding)

    def default_shape(self, model: nn.Module) -> tuple[int, ...]:
        positions = max_positions(model)
        return (1, min(DEFAULT_SEQ_LEN, positions) if positions else DEFAULT_SEQ_LEN)

    def check_shape(self, model: nn.Module, shape: tuple[int, ...]) -> None:
        if len(shape) != 2:
            raise OptkitError(f"a token model takes inputs of shape N,L (batch, sequence length), not "
                              f"{','.join(map(str, shape))}; set --seq-len L (or --input-shape N,L)")
        positions = max_positions(model)
        if positions and shape[1] > positions:
            raise OptkitError(f"sequence length {shape[1]} is beyond the model's {positions} positions; "
                              f"set --seq-len {positions} or less")

    def shape_hint(self, model: nn.Module) -> str:
        return "set --seq-len L"

    def throughput(self, shape: tuple[int, ...]) -> Throughput:
        """A call on ``N,L`` token ids is a prefill of ``N × L`` tokens."""
        tokens = int(shape[0]) * int(shape[1])
        return Throughput(tokens, self.throughput_unit, f"prefill of {tokens} tokens")

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        import torch

        self.check_shape(model, shape)
        generator = torch.Generator().manual_seed(seed)
        device = model_device(model)
        ids = torch.randint(0, vocab_size(model), tuple(shape), generator=generator).to(device)
        return token_inputs(model, ids, torch.ones(tuple(shape), dtype=torch.long, device=device))

    def outputs(self, output: Any) -> list[torch.Tensor]:
        import torch

        if isinstance(output, torch.Tensor):
            return [output]
        for field_name in OUTPUT_FIELDS:
            value = _field(output, field_name)
            if isinstance(value, torch.Tensor):
                return [value]
        return super().outputs(output)

    def output_names(self, count: int) -> list[str]:
        return ["logits"] if count == 1 else super().output_names(count)

    def dynamic_axes(self, inputs: ModelInputs, outputs: list[torch.Tensor]) -> dict[str, dict[int, str]]:
        """Batch and sequence of every input; the batch of every output, and its sequence from rank 3 (logits)."""
        axes = {name: {0: "batch", 1: "sequence"} for name in inputs.names}
        for name, output in zip(self.output_names(len(outputs)), outputs):
            axes[name] = {0: "batch", **({1: "sequence"} if output.dim() >= 3 else {})}
        return axes

    def export_module(self, model: nn.Module, inputs: ModelInputs) -> nn.Module:
        return export_view(model, inputs, self)

    def eval_set(self, model: nn.Module, shape: tuple[int, ...], spec: str, *, split: str, samples: int,
                 data: EvalData) -> EvalSet:
        """Blocks of ``shape[1]`` tokens of a text spec, tokenized by the model's own tokenizer.

        Raises:
            DataError: for a model without a causal LM head (a text needs next-token logits), text that
                gives no next token to predict, or text the readers refuse (see :class:`EvalData`).
        """
        self.check_shape(model, shape)
        can_generate = getattr(model, "can_generate", None)
        if callable(can_generate) and not can_generate():
            raise DataError(f"{type(model).__name__} is not a causal language model (it cannot generate), so it has no "
                            "perplexity on text; --eval text scores causal LMs")
        ids, mask = data.token_blocks(spec, split, shape[1], samples, vocab_size=vocab_size(model),
                                      max_positions=max_positions(model))
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
        if not bool((targets != IGNORE).any()):
            raise DataError(f"{spec} gives no token with a next one to predict at --seq-len {shape[1]}; give more text")
        eval_set = EvalSet(spec, token_inputs(model, ids, mask), targets, vocab_size(model), kind=self.name,
                           split=split, unit=f"sequences of {shape[1]} tokens")
        probe = EvalSet(spec, token_inputs(model, ids[:1], mask[:1]), None)
        first = list(output_batches(self, model, probe, 1))[0]
        if first.dim() != 3 or first.shape[-1] < eval_set.num_classes:
            raise DataError(f"the model's output {tuple(first.shape)} is not next-token logits over its "
                            f"{eval_set.num_classes:,}-token vocabulary; --eval text scores causal LMs")
        return eval_set

    def eval_outputs(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int) -> TokenLogits:
        return TokenLogits(self, model, eval_set, batch_size)

    def reference(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int) -> TokenReference:
        """The original's next-token distributions in one pass, kept compactly (:class:`TokenReference`)."""
        return TokenReference.measure(self, model, eval_set, batch_size)

    def score_model(self, model: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int,
                    reference: TokenReference | TokenLogits | None = None) -> dict[str, Any]:
        return self.score(TokenLogits(self, model, eval_set, batch_size, copy=False), eval_set, reference)

    def score(self, outputs: TokenLogits | TokenReference, eval_set: EvalSet,
              reference: TokenLogits | TokenReference | None = None) -> dict[str, Any]:
        """Perplexity and next-token top-1 over the positions with a next token and, given the original's
        outputs, top-1 agreement and mean KL(original || this) per position.

        ``outputs`` may be a :class:`TokenReference` (the original's figures, taken when it was measured).
        Against a :class:`TokenReference` the KL is exact over the original's top
        :attr:`TokenReference.top_k` tokens per position, and the rest of the vocabulary's share is estimated
        from tokens drawn from the original's distribution (exact when ``top_k`` is the whole vocabulary).

        Returns:
            ``{"samples", "tokens", "perplexity", "accuracy", "agreement", "mean_kl"}`` (``tokens``: the
            positions scored; the last two ``None`` without a reference).
        """
        import torch

        if isinstance(outputs, TokenReference):
            return dict(outputs.scores)
        nll = kl = 0.0
        correct = agreed = count = samples = 0
        references = reference.batches() if isinstance(reference, TokenLogits) else None
        for start, logits in outputs.batches():
            targets = eval_set.targets[start:start + len(logits)]
            scored = targets != IGNORE
            log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
            del logits
            nll -= float(log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[scored].double().sum())
            predicted = log_probs.argmax(-1)
            correct += int((predicted == targets)[scored].sum())
            count += int(scored.sum())
            samples += len(targets)
            if isinstance(reference, TokenReference):
                original_top, kl_sum = reference.compare(start, log_probs, scored)
                agreed += int((predicted == original_top)[scored].sum())
                kl += kl_sum
            elif references is not None:
                _, original = next(references)
                original = torch.log_softmax(original[:, :-1], dim=-1)
                agreed += int((predicted == original.argmax(-1))[scored].sum())
                kl += float((original.exp() * (original - log_probs)).sum(-1)[scored].double().sum())
        return {"samples": samples, "tokens": count, "perplexity": math.exp(nll / count), "accuracy": correct / count,
                "agreement": agreed / count if reference is not None else None,
                "mean_kl": kl / count if reference is not None else None}

    def held_layers(self, model: nn.Module) -> dict[str, str]:
        from torch import nn

        held = {name: EMBEDDING_REASON for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
        hidden = hidden_size(model)
        for parent_name, parent in model.named_modules():
            readers = [(name, child) for name, child in parent.named_children()
                       if isinstance(child, nn.Linear) and child.in_features == hidden]
            if len(readers) < MIN_ATTENTION_PROJECTIONS:
                continue
            prefix = f"{parent_name}." if parent_name else ""
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear) and hidden in (child.in_features, child.out_features):
                    held[prefix + name] = ATTENTION_REASON
        return held


class TokenLogits:
    """A token model's logits on an eval set, computed a batch at a time each time they are read.

    The logits of a whole text (blocks × length × vocabulary floats) do not fit in
    memory, so they are never kept: :meth:`batches` runs the model, or the ONNX
    file, again. With ``copy`` (the default) the model is copied when this is made,
    so passes that later change it in place do not change these outputs; without it
    (read at once, as :meth:`TokenModel.score_model` does) no copy is made.

    Args:
        kind: the token kind.
        source: a PyTorch model, or the path of an ONNX file.
        eval_set: the samples.
        batch_size: blocks per forward pass, at most (fewer when their logits would pass
            :data:`LOGITS_PER_BATCH` values).
        copy: keep a copy of a PyTorch model (see above).
    """

    def __init__(self, kind: TokenModel, source: nn.Module | str | os.PathLike, eval_set: EvalSet, batch_size: int,
                 *, copy: bool = True):
        import copy as copying

        self.kind = kind
        self.source = source if isinstance(source, (str, os.PathLike)) or not copy else copying.deepcopy(source)
        self.eval_set = eval_set
        self.batch_size = logits_batch_size(eval_set, batch_size)

    def batches(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first block's index, logits)`` per batch, float32 on the CPU."""
        start = 0
        for logits in output_batches(self.kind, self.source, self.eval_set, self.batch_size):
            yield start, logits
            start += len(logits)


def logits_batch_size(eval_set: EvalSet, batch_size: int) -> int:
    """Blocks per forward pass while scoring: at most ``batch_size``, and fewer when their logits would pass
    :data:`LOGITS_PER_BATCH` values."""
    length = eval_set.targets.shape[1] + 1
    return max(1, min(batch_size, LOGITS_PER_BATCH // (length * (eval_set.num_classes or 1))))


#: Bytes a :class:`TokenReference` may keep for the original's top tokens (8 bytes per token and position);
#: the vocabulary is kept whole where it fits, else at least :data:`REFERENCE_MIN_TOP_K` tokens per position.
REFERENCE_BYTES = 2 ** 27
REFERENCE_MIN_TOP_K = 64
#: Tokens drawn per position from the original's distribution beyond its top tokens (the rest of the KL).
REFERENCE_SAMPLES = 32


class TokenReference:
    """The original model's next-token distributions on an eval set, kept compactly for comparing later stages.

    Per position: the argmax (agreement); the ``top_k`` most likely tokens with their log-probabilities; and,
    when they are not the whole vocabulary, the log of the probability left to the rest and
    :data:`REFERENCE_SAMPLES` tokens drawn from the original's distribution over the rest, with their
    log-probabilities. KL(original || stage) is then the sum over the top tokens, exact, plus the rest's
    share estimated from the drawn tokens (unbiased; averaged over every position scored). ``top_k`` is the
    whole vocabulary where that fits in :data:`REFERENCE_BYTES` (the KL is then exact), else as many tokens
    as fit, at least :data:`REFERENCE_MIN_TOP_K`: the memory grows with the positions scored, never with
    blocks × length × vocabulary. The original's own figures are taken in the same pass.

    Attributes:
        top_k: tokens kept per position.
        vocabulary: the size of the distributions.
        scores: the original's figures (as :meth:`TokenModel.score` returns them, without a reference).
    """

    def __init__(self, top_k: int, vocabulary: int, tensors: dict[str, torch.Tensor], scores: dict[str, Any]):
        self.top_k, self.vocabulary, self.tensors, self.scores = top_k, vocabulary, tensors, scores

    @property
    def exact(self) -> bool:
        """Whether the KL against this reference is exact (the top tokens are the whole vocabulary)."""
        return self.top_k >= self.vocabulary

    @classmethod
    def measure(cls, kind: TokenModel, source: nn.Module | str | os.PathLike, eval_set: EvalSet,
                batch_size: int, *, seed: int = 0) -> TokenReference:
        """Run ``source`` (a model or an ONNX file) on ``eval_set`` once and keep what later scores need."""
        import torch

        blocks, positions = eval_set.targets.shape
        generator = torch.Generator().manual_seed(seed)
        kept: dict[str, torch.Tensor] = {}
        nll = 0.0
        correct = count = samples = 0
        top_k = vocabulary = 0
        for start, logits in TokenLogits(kind, source, eval_set, batch_size, copy=False).batches():
            log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
            del logits
            if not kept:
                vocabulary = log_probs.shape[-1]
                fits = REFERENCE_BYTES // max(1, 8 * blocks * positions)
                top_k = min(vocabulary, max(REFERENCE_MIN_TOP_K, fits))
                shapes = {"argmax": ((), torch.int32), "top_ids": ((top_k,), torch.int32),
                          "top_log_probs": ((top_k,), torch.float32)}
                if top_k < vocabulary:
                    shapes.update({"rest_log_prob": ((), torch.float32),
                                   "sample_ids": ((REFERENCE_SAMPLES,), torch.int32),
                                   "sample_log_probs": ((REFERENCE_SAMPLES,), torch.float32)})
                kept = {name: torch.empty(blocks, positions, *shape, dtype=dtype)
                        for name, (shape, dtype) in shapes.items()}
            end = start + len(log_probs)
            targets = eval_set.targets[start:end]
            scored = targets != IGNORE
            nll -= float(log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[scored].double().sum())
            predicted = log_probs.argmax(-1)
            correct += int((predicted == targets)[scored].sum())
            count += int(scored.sum())
            samples += len(targets)
            kept["argmax"][start:end] = predicted
            values, ids = log_probs.topk(top_k, dim=-1)
            kept["top_ids"][start:end], kept["top_log_probs"][start:end] = ids, values
            if top_k < vocabulary:
                rest, drawn = _draw_from_rest(log_probs, ids, REFERENCE_SAMPLES, generator)
                kept["rest_log_prob"][start:end] = rest
                kept["sample_ids"][start:end] = drawn
                kept["sample_log_probs"][start:end] = log_probs.gather(-1, drawn)
        scores = {"samples": samples, "tokens": count, "perplexity": math.exp(nll / count),
                  "accuracy": correct / count, "agreement": None, "mean_kl": None}
        return cls(top_k, vocabulary, kept, scores)

    def compare(self, start: int, log_probs: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The original's argmax for the blocks from ``start`` on, and the summed KL(original || ``log_probs``)
        over the ``scored`` positions (log-probabilities of the blocks being scored, ``B×P×V``)."""
        end = start + len(log_probs)
        part = {name: tensor[start:end] for name, tensor in self.tensors.items()}
        original = part["top_log_probs"].double()
        kl = (original.exp() * (original - log_probs.gather(-1, part["top_ids"].long()).double())).sum(-1)
        if not self.exact:
            drawn = part["sample_log_probs"].double() - log_probs.gather(-1, part["sample_ids"].long()).double()
            kl = kl + part["rest_log_prob"].double().exp() * drawn.mean(-1)
        return part["argmax"].long(), float(kl[scored].sum())


def _draw_from_rest(log_probs: torch.Tensor, top_ids: torch.Tensor, count: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The log of the probability of every token but ``top_ids``, and ``count`` tokens drawn (with replacement)
    from the distribution over those tokens, per position."""
    import torch

    rest = log_probs.scatter(-1, top_ids, float("-inf"))
    total = rest.logsumexp(-1, keepdim=True)
    # Where the rest has no probability at all its share of the KL is 0: draw from anything.
    rest = torch.where(torch.isfinite(total), rest - total, torch.zeros_like(rest)).exp_()
    drawn = torch.multinomial(rest.reshape(-1, rest.shape[-1]), count, replacement=True, generator=generator)
    return total.squeeze(-1), drawn.reshape(*log_probs.shape[:-1], count)


def token_inputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> ModelInputs:
    """The call of ``model`` on token ids and their attention mask, as its ``forward`` accepts them.

    Ids alone, positionally, for a forward without an ``input_ids`` keyword; keywords otherwise,
    with ``use_cache=False`` where accepted (a cache object is no tensor to compare or export).
    """
    accepted = _keywords(model)
    if "input_ids" not in accepted:
        return ModelInputs((ids,), {}, ("input_ids",))
    kwargs: dict[str, Any] = {"input_ids": ids}
    if "attention_mask" in accepted:
        kwargs["attention_mask"] = mask
    if "use_cache" in accepted:
        kwargs["use_cache"] = False
    return ModelInputs((), kwargs, tuple(k for k in ("input_ids", "attention_mask") if k in kwargs))


#: Probe results by model: the probe runs a forward pass, and kinds are asked for often.
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROBE_LENGTH = 8


def _first_consumer(model: nn.Module) -> nn.Module | None:
    """The first layer with parameters that a forward pass on token ids reaches (an embedding for a token model).

    The ids are zeros, valid in any vocabulary; an image model fails at its
    first convolution, which is then the first layer reached.
    """
    import torch

    if model in _probed:
        return _probed[model]()
    reached: list = []
    hooks = [m.register_forward_pre_hook(lambda module, args: reached.append(module))
             for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), contextlib.suppress(Exception):
            model(torch.zeros(1, PROBE_LENGTH, dtype=torch.long))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    first = reached[0] if reached else None
    _probed[model] = weakref.ref(first) if first is not None else (lambda: None)
    return first


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


def _keywords(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _config_value(model: nn.Module, *names: str) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    sources = [config, *(getattr(config, sub, None) for sub in ("text_config",))]
    for source in sources:
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def _first_embedding(model: nn.Module) -> nn.Embedding | None:
    from torch import nn

    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def vocab_size(model: nn.Module) -> int:
    """Token ids must be below this: the config's ``vocab_size``, else the first embedding's rows.

    Raises:
        OptkitError: when the model has neither.
    """
    size = _config_value(model, "vocab_size")
    if size is None:
        embedding = _first_embedding(model)
        size = embedding.num_embeddings if embedding is not None else None
    if size is None:
        raise OptkitError(f"{type(model).__name__} has no vocab_size in its config and no embedding layer; "
                          "it does not take token ids: give --kind image_classifier or another kind")
    return size


def hidden_size(model: nn.Module) -> int | None:
    """The width of the residual stream: the config's hidden size, else the first embedding's dimension."""
    size = _config_value(model, "hidden_size", "d_model", "n_embd", "dim")
    if size is None:
        embedding = _first_embedding(model)
        size = embedding.embedding_dim if embedding is not None else None
    return size


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model takes (its config's position count), or ``None`` when unbounded or unknown."""
    return _config_value(model, "max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
