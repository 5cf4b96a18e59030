"""Token models: language-model encoders and decoders that take token ids and an attention mask ``N,L``."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError
from optkit.kinds.base import ModelInputs, ModelKind, export_view, model_device

if TYPE_CHECKING:
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


class TokenModel(ModelKind):
    """Encoders and causal LMs: ``input_ids`` and ``attention_mask`` of shape ``N,L``, ids below the vocabulary size.

    Recognised by structure: a Hugging Face model whose main input is
    ``input_ids``, or a model whose first parameterised layer is an embedding.
    The compared output is the task head's ``logits`` (or the encoder's
    ``last_hidden_state``); the hidden size and the attention heads keep their
    width, MLP channels are pruned.
    """

    name = "tokens"
    description = "language models taking token ids (N,L) and an attention mask"
    priority = 30
    shape_help = "N,L (batch, sequence length)"

    def matches(self, model: nn.Module) -> bool:
        from torch import nn

        if getattr(model, "main_input_name", None) == "input_ids":
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

    def example_inputs(self, model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> ModelInputs:
        import torch

        self.check_shape(model, shape)
        generator = torch.Generator().manual_seed(seed)
        device = model_device(model)
        ids = torch.randint(0, vocab_size(model), tuple(shape), generator=generator).to(device)
        accepted = _keywords(model)
        if "input_ids" not in accepted:
            return ModelInputs((ids,), {}, ("input_ids",))
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "attention_mask" in accepted:
            kwargs["attention_mask"] = torch.ones(tuple(shape), dtype=torch.long, device=device)
        if "use_cache" in accepted:
            kwargs["use_cache"] = False  # a cache object is no tensor to compare or export
        return ModelInputs((), kwargs, tuple(k for k in ("input_ids", "attention_mask") if k in kwargs))

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

    def export_module(self, model: nn.Module, inputs: ModelInputs) -> nn.Module:
        return export_view(model, inputs, self)

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
