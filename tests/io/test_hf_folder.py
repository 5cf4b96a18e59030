"""Hugging Face save_pretrained folders in: weights from safetensors (one file or shards), the class from the config,
tied embeddings, and one-line refusals that load nothing."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import BertForSequenceClassification, LlamaForCausalLM

from optkit.cli import main
from optkit.core.errors import ModelLoadError, UntrustedPickleError
from optkit.io.models import load
from tests.support.token_models import VOCAB, tiny_bert_config, tiny_llama_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    llama = LlamaForCausalLM(config).eval()
    llama.save_pretrained(root / "llama")
    bert = BertForSequenceClassification(tiny_bert_config()).eval()
    bert.save_pretrained(root / "bert", max_shard_size="100KB")
    return root, llama, bert


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def test_a_folder_loads_with_its_class_weights_and_tied_embeddings(folders):
    root, llama, bert = folders
    loaded = load(f"hf:{root / 'llama'}")
    assert type(loaded.model) is LlamaForCausalLM and loaded.notes == []
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded.model(_ids()).logits, llama(_ids()).logits)
    assert json.loads((root / "bert" / "model.safetensors.index.json").read_text())["weight_map"]  # really sharded
    sharded = load(root / "bert")  # a plain folder path with config.json works too
    assert type(sharded.model) is BertForSequenceClassification
    with torch.no_grad():
        assert torch.equal(sharded.model(_ids()).logits, bert(_ids()).logits)


def test_a_config_without_weights_is_refused_unless_random_weights_are_asked_for(folders, tmp_path):
    from optkit.io.weights import random_weights

    root, _, _ = folders
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((root / "llama" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="has a config.json but no weights .* pass --random-weights") as error:
        load(f"hf:{bare}")
    assert "\n" not in str(error.value)
    loaded = load(bare, random_weights=True)
    assert type(loaded.model) is LlamaForCausalLM and random_weights(loaded.model)
    assert loaded.notes == [f"{bare} has a config but no weights (model.safetensors): the model has random weights "
                            "(--random-weights), so accuracy figures mean nothing"]

    out = tmp_path / "out"
    refused = CliRunner().invoke(main, ["optimize", str(bare), "--prune", "0.3", "--seq-len", "8", "--out", str(out)])
    assert refused.exit_code != 0 and refused.output.count("\n") == 1, refused.output
    assert refused.output.startswith("Error: ") and "--random-weights" in refused.output
    assert not out.exists()  # nothing written, not even the folder
    allowed = CliRunner().invoke(main, ["inspect", str(bare), "--seq-len", "8", "--random-weights"])
    assert allowed.exit_code == 0, allowed.output


def test_shards_missing_from_their_index_or_without_it_are_refused(folders, tmp_path):
    import shutil

    root, _, _ = folders
    shards = sorted(p.name for p in (root / "bert").glob("model-*.safetensors"))
    partial = tmp_path / "partial"
    shutil.copytree(root / "bert", partial)
    (partial / shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match=f"lacks 1 of the {len(shards)} weight shards .*{shards[-1]}"):
        load(partial)
    unlisted = tmp_path / "unlisted"
    shutil.copytree(root / "bert", unlisted)
    (unlisted / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError, match="holds weight shards .* but not the model.safetensors.index.json"):
        load(unlisted, random_weights=True)


def test_refusals_are_one_line(folders, tmp_path):
    root, llama, _ = folders
    with pytest.raises(ModelLoadError, match="has no config.json; hf:DIR needs a folder written by save_pretrained"):
        load(f"hf:{tmp_path}")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text((root / "bert" / "config.json").read_text())
    (wrong / "model.safetensors").write_bytes((root / "llama" / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match=r"do not fit its config.json: \d+ missing, \d+ unexpected and 0 mis-shaped"):
        load(f"hf:{wrong}")
    pickled = tmp_path / "pickled"
    llama.save_pretrained(pickled, safe_serialization=False) if _can_save_pickle() else _save_pickle(llama, pickled)
    with pytest.raises(UntrustedPickleError, match="stores its weights only as a pickle"):
        load(f"hf:{pickled}")
    assert type(load(f"hf:{pickled}", trust=True).model) is LlamaForCausalLM
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((root / "llama" / "config.json").read_text())
    config["architectures"] = ["MyOwnLlama"]
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'MyOwnLlama', which is not a transformers class"):
        load(f"hf:{foreign}")


def _can_save_pickle() -> bool:
    import inspect

    return "safe_serialization" in inspect.signature(LlamaForCausalLM.save_pretrained).parameters


def _save_pickle(model, folder):
    folder.mkdir()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


def test_optimize_writes_a_folder_the_stock_class_loads(folders, tmp_path):
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    root, llama, _ = folders
    (root / "llama" / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", f"hf:{root / 'llama'}", "--prune", "0.3", "--drop-blocks", "1",
                                       "--seq-len", "16", "--export", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output
    stock, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(stock) is LlamaForCausalLM and not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    config = stock.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)  # one of two KV groups, whole
    assert config.intermediate_size < 160 and config.num_hidden_layers == 1
    assert stock.lm_head.weight is stock.model.embed_tokens.weight  # still tied
    assert (out / "tokenizer_config.json").is_file()
    assert sum(p.numel() for p in stock.parameters()) <= 0.8 * sum(p.numel() for p in llama.parameters())
    assert not (out / "model.pt").exists()  # one copy: the folder
    pruned = load(out).model.eval()
    ids = _ids()
    with torch.no_grad():
        expected = pruned(ids).logits
        assert torch.equal(stock.eval()(ids).logits, expected)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (actual,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())})
    np.testing.assert_allclose(actual, expected.numpy(), atol=1e-4 * float(expected.abs().max()))
    generated = stock.generate(ids[:1, :4], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 12)
    report = json.loads((out / "report.json").read_text())
    assert {"config.json", "model.safetensors"} <= set(report["files"])
