"""Tiny Hugging Face configs for the development set of issue #29: every type built with
``transformers.AutoConfig.for_model`` at small sizes (hidden 64, 2 blocks, 4 heads, 2 KV heads where the type
has grouped-query attention), so a model builds from it with random weights, offline.
"""

from __future__ import annotations

# Decoders first, then text encoders, then image encoders; the benchmark and the slow test keep this order.
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox", "opt", "mixtral")
ENCODERS = ("bert", "roberta", "distilbert")
IMAGE = ("vit", "swin")
DEV_SET = DECODERS + ENCODERS + IMAGE

VOCAB = 256
POSITIONS = 128
IMAGE_SIZE = 32
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Llama-style decoders: rotary attention with grouped KV heads and a gated MLP.
GQA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=POSITIONS)
ENCODER = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=POSITIONS + 2, num_labels=3)
SIZES: dict[str, dict] = {
    "llama": GQA,
    "mistral": GQA,
    "qwen2": GQA,
    "qwen3": {**GQA, "head_dim": 16},
    "phi3": GQA,
    "gemma2": {**GQA, "head_dim": 16},
    "gpt2": dict(n_embd=64, n_inner=160, n_layer=2, n_head=4, n_positions=POSITIONS),
    "gpt_neox": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=POSITIONS),
    "opt": dict(hidden_size=64, ffn_dim=160, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=POSITIONS),
    "mixtral": {**GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
    "bert": ENCODER,
    "roberta": ENCODER,
    "distilbert": dict(dim=64, hidden_dim=160, n_layers=2, n_heads=4, max_position_embeddings=POSITIONS,
                       num_labels=3),
    "vit": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                image_size=IMAGE_SIZE, patch_size=4, num_labels=10),
    "swin": dict(embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, image_size=IMAGE_SIZE, patch_size=2,
                 num_labels=10),
}
AUTO_CLASS = {**dict.fromkeys(DECODERS, "AutoModelForCausalLM"),
              **dict.fromkeys(ENCODERS, "AutoModelForSequenceClassification"),
              **dict.fromkeys(IMAGE, "AutoModelForImageClassification")}


def is_image(model_type: str) -> bool:
    """Whether the type takes pixel values (``--input-shape 1,3,H,W``) rather than token ids."""
    return model_type in IMAGE


def build(model_type: str, seed: int = 0):
    """The type's tiny model in eval mode, random weights; weight matrices initialized to all zeros (some
    classifier heads) get small random values so that no output is constant."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **({} if is_image(model_type) else TOKENS),
                                               **SIZES[model_type])
    torch.manual_seed(seed)
    model = getattr(transformers, AUTO_CLASS[model_type]).from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    return model


def shape_of(config) -> dict:
    """Heads, KV heads, intermediate width and layer count as a config states them (lists for swin's stages)."""
    heads = getattr(config, "num_heads", None) if hasattr(config, "depths") else config.num_attention_heads
    layers = sum(config.depths) if hasattr(config, "depths") else config.num_hidden_layers
    intermediate = next((getattr(config, name) for name in ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim")
                         if getattr(config, name, None) is not None), None)
    if intermediate is None and hasattr(config, "mlp_ratio"):
        intermediate = f"{config.mlp_ratio:g}×embed"
    return {"heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None), "intermediate": intermediate,
            "layers": layers}
