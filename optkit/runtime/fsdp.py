"""FSDP2 for models that do not fit one device: shard a copy of the model, train it, gather the weights back.

Under ``torchrun``, :func:`shard` builds the copy that trains: a skeleton of
the model on the meta device (no memory), each decoder block and then the root
wrapped with :func:`torch.distributed.fsdp.fully_shard`, so every rank holds
1/N of each weight, gradient and AdamW moment, and only the weights of the block
running are gathered whole. Then each rank takes its shard of the model's
weights. The caller's model is never sharded: it stays a plain ``nn.Module``
where it was, and :func:`full_state_dict` gives every rank the trained weights
back to load into it. Blocks are checkpointed (their activations recomputed
in backward), and under bf16 the policy is
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: weights
gathered and used in bf16, gradients reduced and AdamW run in fp32.

A frozen copy (a distillation teacher) is sharded the same way, each block's
weights freed again right after its forward.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from optkit.core.errors import TrainingError
from optkit.runtime.distributed import rank_and_world

#: ``auto`` shards when training would hold more than this share of one GPU's memory (see :func:`resolve_sharding`).
AUTO_FSDP_SHARE = 0.5


def resolve_sharding(sharding: str, model: nn.Module, teacher: nn.Module | None, device: torch.device) -> str:
    """How a training run spreads over the processes: ``"ddp"`` or ``"fsdp"``.

    ``auto`` picks FSDP on CUDA when the student's weights, gradients and two
    AdamW moments (4 × its parameter bytes) plus the teacher's weights would take
    more than :data:`AUTO_FSDP_SHARE` of the GPU's memory, leaving the rest to
    activations; DDP otherwise, and always on CPU and MPS. In one process
    (outside ``torchrun``) the answer is ``"ddp"``: the model trains as it is.

    Args:
        sharding: ``auto``, ``ddp`` or ``fsdp`` (the fine-tune pass's ``sharding`` setting).
        model: the model to train.
        teacher: the model it distils from, if any.
        device: this rank's training device.

    Returns:
        ``"fsdp"`` or ``"ddp"``.
    """
    if rank_and_world()[1] == 1 or sharding == "ddp":
        return "ddp"
    if sharding == "fsdp":
        return "fsdp"
    if device.type != "cuda":
        return "ddp"
    needed = 4 * parameter_bytes(model) + (parameter_bytes(teacher) if teacher is not None else 0)
    return "fsdp" if needed > AUTO_FSDP_SHARE * torch.cuda.get_device_properties(device).total_memory else "ddp"


def parameter_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s parameters take, each counted once (tied weights too)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one, in :meth:`~torch.nn.Module.modules` order.

    A Hugging Face model names its block classes in ``_no_split_modules``
    (``LlamaDecoderLayer``); any other model's blocks are the children of its
    longest ``nn.ModuleList`` (none when it has no list of two or more).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    longest = max(lists, key=len, default=None)
    return list(longest) if longest is not None and len(longest) > 1 else []


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them (activation checkpointing).

    A Hugging Face model that supports it uses its own switch, and its config's
    ``use_cache`` is turned off (a KV cache is of no use in training, and would
    grow again when a block is recomputed); on any other model each block's
    forward runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint`.
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def shard(model: nn.Module, device: torch.device, *, dtype: torch.dtype | None, frozen: bool = False) -> nn.Module:
    """A copy of ``model`` sharded over the process group with FSDP2, holding ``model``'s weights.

    Every rank calls it with the same model. Each block of
    :func:`transformer_blocks` is sharded, then the root (which keeps the rest:
    embeddings, final norm, head). ``model`` itself is not changed or moved.

    Args:
        model: the model (whole, on any device: each rank takes its shard of every tensor).
        device: this rank's device.
        dtype: the training autocast dtype; ``bfloat16`` also gathers the weights in bf16 and reduces
            gradients in fp32 (:class:`~torch.distributed.fsdp.MixedPrecisionPolicy`).
        frozen: a model that only runs forward (a teacher): no gradients, no activation
            checkpointing, every module's weights freed right after its forward, eval mode.

    Returns:
        the sharded copy, in ``model``'s training mode (eval when ``frozen``).

    Raises:
        TrainingError: on a torch older than 2.6 (no public ``fully_shard``).
    """
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        raise TrainingError(f"sharding with FSDP needs torch 2.6 or newer (this is {torch.__version__}); "
                           "use --sharding ddp") from e

    sharded = _meta_copy(model)
    blocks = transformer_blocks(sharded)
    if frozen:
        sharded.requires_grad_(False)
    else:
        checkpoint_blocks(sharded, blocks)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if dtype == torch.bfloat16 else MixedPrecisionPolicy())
    options = {"mesh": init_device_mesh(device.type, (rank_and_world()[1],)), "mp_policy": policy}
    if frozen:
        # The root's weights would otherwise stay gathered after forward, waiting for a backward that never comes.
        options["reshard_after_forward"] = True
    # Innermost first: a block nested in another must be sharded before the one that holds it.
    for block in reversed(blocks):
        fully_shard(block, **options)
    fully_shard(sharded, **options)
    sharded.to_empty(device=device)
    set_model_state_dict(sharded, model.state_dict(), options=StateDictOptions(full_state_dict=True))
    # Buffers are not sharded; the non-persistent ones (rotary frequencies) are in no state dict.
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, buffer in sharded.named_buffers():
            buffer.copy_(buffers[name])
    return sharded.train(model.training and not frozen)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are on the meta device (tied ones stay tied); buffers are copied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every tensor whole, on the CPU, on every rank.

    A sharded (FSDP) tensor is gathered one at a time, so the device holds one
    whole tensor at most; every rank must call this. Unlike
    ``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``, which
    gives the weights to rank 0 alone, every rank gets them, to load into its
    own copy of the model. A plain model's state dict is copied to the CPU.
    """
    return {key: _whole(value).detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds, as a plain tensor sharing its storage (the whole of an unsharded one)."""
    data = tensor.data
    return data.to_local() if hasattr(data, "to_local") else data


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gathered_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model and optimizer state dicts of a sharded model, on rank 0's CPU (empty on other ranks).

    Every rank must call this. The optimizer's state is keyed by parameter name.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Give a sharded model and its optimizer the whole state dicts :func:`gathered_states` wrote.

    Every rank calls it with the same (whole) state dicts and keeps its shard.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
