"""A tiny Llama trained for a few seconds on patterned text (each word is followed by the next one in a fixed list),
saved with its tokenizer: its predictions are confident, so a lower precision has a real task to keep."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = "the model prunes heads and channels of a small network while its text keeps meaning".split()
VOCAB = 300
POSITIONS = 64


def write_corpus(folder: Path) -> None:
    """40 short documents of the patterned text."""
    for i in range(40):
        lines = [" ".join(WORDS[(i * 5 + j * 3 + k) % len(WORDS)] for k in range(8)) for j in range(5)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def train_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer of :data:`VOCAB` tokens trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def train(model, ids: torch.Tensor, mask: torch.Tensor, steps: int = 60) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    labels = ids.masked_fill(mask == 0, -100)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()


def trained_lm(root: Path, length: int, *, hidden: int = 32) -> tuple[Path, Path]:
    """Write the corpus and the trained model (``save_pretrained``, with its tokenizer) under ``root``.

    Args:
        root: an empty folder.
        length: the training blocks' length in tokens.
        hidden: the hidden size (the MLP is twice as wide).

    Returns:
        ``(model folder, corpus folder)``; the model was trained on blocks of ``length`` tokens.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from optkit.data.text import token_blocks

    corpus = root / "corpus"
    corpus.mkdir()
    write_corpus(corpus)
    folder = root / "lm"
    train_tokenizer([p.read_text() for p in sorted(corpus.iterdir())]).save_pretrained(str(folder))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=POSITIONS))
    blocks = token_blocks(str(corpus), "train", folder, length, vocab_size=VOCAB, max_positions=POSITIONS)
    train(model, blocks.input_ids[:16], blocks.attention_mask[:16])
    model.save_pretrained(str(folder))
    return folder, corpus
