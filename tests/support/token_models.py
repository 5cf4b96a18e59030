"""Token-input models that stand in for a user's own classes: tiny Hugging Face configs built in ``__init__``,
and a plain PyTorch language model, so they load with ``--arch tests.support.token_models:Class``."""

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

VOCAB = 257
POSITIONS = 64


def tiny_llama_config() -> LlamaConfig:
    """Grouped-query attention (4 query heads, 2 KV heads), gated MLP, two blocks."""
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS)


def tiny_bert_config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=POSITIONS, num_labels=3)


class TinyLlama(LlamaForCausalLM):
    """A causal LM whose class builds its own config, as a user's wrapper module would."""

    def __init__(self):
        super().__init__(tiny_llama_config())


class TinyBertClassifier(BertForSequenceClassification):
    """A BERT-style encoder with a 3-class head."""

    def __init__(self):
        super().__init__(tiny_bert_config())


class PlainTokenModel(nn.Module):
    """A language model written with torch.nn alone: embedding, one encoder layer, a next-token head."""

    def __init__(self, vocab: int = VOCAB, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=96, batch_first=True, dropout=0.0)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


class LateEmbeddingModel(nn.Module):
    """A token model whose head is registered before its embedding: only a forward pass shows the ids go in first."""

    def __init__(self, vocab: int = VOCAB, width: int = 32):
        super().__init__()
        self.head = nn.Linear(width, vocab)
        self.mix = nn.Linear(width, width)
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(ids))))
