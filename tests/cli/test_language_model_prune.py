"""`optkit optimize` on a Hugging Face language model: block by block, in its dtype, the result a stock-class folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from optkit.cli import main  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[2] / "optkit" / "demo" / "python_docs_lm"


def _bf16_folder(folder: Path) -> Path:
    """A grouped-query Llama in bf16 (8 query heads sharing 2 KV heads) with the shipped model's tokenizer."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, folder / name)
    return folder


def test_a_bf16_language_model_is_pruned_block_by_block_to_its_target_and_stays_bf16(runner, tmp_path):
    folder = _bf16_folder(tmp_path / "lm")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the function returns a list of {i % 9} values." for i in range(800)))
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", str(folder), "--target-params", "0.85", "--calib-data", f"text:{text}",
                                  "--seq-len", "32", "--block-inputs", "pruned", "--allocation", "uniform",
                                  "--no-latency", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    prune = next(p for p in report["passes"] if p["name"] == "structured_prune")["details"]
    assert prune["transformer"]["engine"] == "blockwise"
    assert prune["transformer"]["block_inputs"] == "pruned"
    assert prune["achieved_fraction"] == pytest.approx(0.85, abs=0.02)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    assert reloaded.config.num_attention_heads % reloaded.config.num_key_value_heads == 0
