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
# Types outside the development set (benchmarks/hf_beyond.py): how optkit does on architectures it was not built
# against. Field names follow each config class.
_MHA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=POSITIONS)
_VIT = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, patch_size=4,
            image_size=IMAGE_SIZE, num_labels=10)
_STAGES = dict(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)
BEYOND_DECODERS = {
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                   new_decoder_architecture=True),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS, rotary_dim=8),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS, n_ctx=POSITIONS, rotary_dim=8),
    "stablelm": GQA, "olmo": GQA, "olmo2": GQA, "granite": GQA, "starcoder2": GQA, "cohere": GQA,
    "gemma": {**GQA, "head_dim": 16},
    "phi": _MHA, "persimmon": _MHA,
    "qwen2_moe": {**GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=POSITIONS),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS, multi_query=True),
}
BEYOND_ENCODERS = {name: {**ENCODER, **extra} for name, extra in {
    "electra": {"embedding_size": 64}, "albert": {"embedding_size": 32}, "deberta-v2": {}, "xlm-roberta": {},
    "mpnet": {}, "ernie": {}}.items()}
BEYOND_IMAGE = {
    "deit": _VIT, "beit": _VIT, "data2vec-vision": _VIT,
    "dinov2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=4, image_size=IMAGE_SIZE,
                   num_labels=10),
    "convnext": _STAGES, "convnextv2": _STAGES, "poolformer": _STAGES,
    "resnet": {**_STAGES, "embedding_size": 32},
    "swinv2": dict(embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, patch_size=2, image_size=IMAGE_SIZE,
                   num_labels=10),
    "pvt_v2": {**_STAGES, "num_attention_heads": [1, 2, 4, 8]},
    "levit": dict(hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[16, 16, 16],
                  image_size=IMAGE_SIZE, num_labels=10),
    "regnet": dict(num_labels=10),
}
BEYOND = (*BEYOND_DECODERS, *BEYOND_ENCODERS, *BEYOND_IMAGE)
SIZES.update({**BEYOND_DECODERS, **BEYOND_ENCODERS, **BEYOND_IMAGE})
# Types held out from both sets (issue #41): checked once the development and "beyond" sets were done. ESM with
# 8 heads of 16 (its contact head reads every block's attention maps); Nystromformer with as many landmarks as its
# segment length, as its defaults (its landmark path reshapes by the configured length, so a graph of it takes no
# other length); FocalNet at 12.3 M parameters (the size
# whose prune once ran silent for ten minutes); CvT's depths grow by stage (its class indexes a stage's drop-path
# rates by the stage number); EfficientNet's top width (hidden_dim) is round_filters(1280) at its coefficient, and
# it pools with a kernel of hidden_dim (ceil mode): the mean over that window of a 1x1 map is zero, the max is not;
# at the default initializer_range (0.02) its activations vanish within a few blocks (1e-9 per block).
HELD_OUT_ENCODERS = {
    "esm": {**ENCODER, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8},
    "nystromformer": {**ENCODER, "segment_means_seq_len": 32, "num_landmarks": 32, "conv_kernel_size": 9},
}
HELD_OUT_IMAGE = {
    "efficientnet": dict(image_size=IMAGE_SIZE, width_coefficient=0.5, depth_coefficient=0.5, hidden_dim=640,
                         pooling_type="max", initializer_range=0.5, num_labels=10),
    "mobilevit": dict(image_size=IMAGE_SIZE, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[16, 16, 24, 32, 48, 64, 128],
                      num_attention_heads=4, num_labels=10),
    "cvt": dict(embed_dim=[32, 64, 96], num_heads=[1, 2, 3], depth=[1, 2, 3], num_labels=10),
    "focalnet": dict(embed_dim=64, depths=[2, 2, 6, 2], hidden_sizes=[128, 256, 512, 512], image_size=IMAGE_SIZE,
                     num_labels=10),
}
HELD_OUT = (*HELD_OUT_ENCODERS, *HELD_OUT_IMAGE)
SIZES.update({**HELD_OUT_ENCODERS, **HELD_OUT_IMAGE})
# AutoModelForImageClassification maps neither DeiT nor LeViT to a class here.
_IMAGE_CLASS = {"deit": "DeiTForImageClassification", "levit": "LevitForImageClassification"}

AUTO_CLASS = {**dict.fromkeys(DECODERS, "AutoModelForCausalLM"),
              **dict.fromkeys(ENCODERS, "AutoModelForSequenceClassification"),
              **dict.fromkeys(IMAGE, "AutoModelForImageClassification"),
              **dict.fromkeys(BEYOND_DECODERS, "AutoModelForCausalLM"),
              **dict.fromkeys(BEYOND_ENCODERS, "AutoModelForSequenceClassification"),
              **{t: _IMAGE_CLASS.get(t, "AutoModelForImageClassification") for t in BEYOND_IMAGE},
              **dict.fromkeys(HELD_OUT_ENCODERS, "AutoModelForSequenceClassification"),
              **dict.fromkeys(HELD_OUT_IMAGE, "AutoModelForImageClassification")}


def is_image(model_type: str) -> bool:
    """Whether the type takes pixel values (``--input-shape 1,3,H,W``) rather than token ids."""
    return model_type in IMAGE or model_type in BEYOND_IMAGE or model_type in HELD_OUT_IMAGE


def is_decoder(model_type: str) -> bool:
    """Whether the type is a causal LM (it should ``generate``)."""
    return model_type in DECODERS or model_type in BEYOND_DECODERS


def build(model_type: str, seed: int = 0):
    """The type's tiny model in eval mode, random weights; weight matrices initialized to all zeros (some
    classifier heads) get small random values so that no output is constant."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **({} if is_image(model_type) else TOKENS),
                                               **SIZES[model_type])
    torch.manual_seed(seed)
    model_class = getattr(transformers, AUTO_CLASS[model_type])
    model = (model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    return model


def shape_of(config) -> dict:
    """Heads, KV heads, intermediate width and layer count as a config states them (lists for swin's stages)."""
    staged = hasattr(config, "depths") or isinstance(getattr(config, "depth", None), list | tuple)
    heads = getattr(config, "num_heads", None) if staged else None
    heads = heads if heads is not None else getattr(config, "num_attention_heads", None)
    depths = getattr(config, "depths", None) or getattr(config, "depth", None)
    layers = sum(depths) if isinstance(depths, list | tuple) else getattr(config, "num_hidden_layers", None)
    intermediate = next((getattr(config, name) for name in ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim")
                         if getattr(config, name, None) is not None), None)
    ratio = getattr(config, "mlp_ratio", None)
    if intermediate is None and ratio is not None:
        intermediate = f"{ratio:g}×embed" if isinstance(ratio, int | float) else f"{list(ratio)}×embed"
    return {"heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None), "intermediate": intermediate,
            "layers": layers}
