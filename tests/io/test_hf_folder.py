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


def test_a_config_without_weights_builds_random_weights_and_says_so(folders, tmp_path):
    root, _, _ = folders
    (tmp_path / "config.json").write_text((root / "llama" / "config.json").read_text())
    loaded = load(f"hf:{tmp_path}")
    assert type(loaded.model) is LlamaForCausalLM
    assert loaded.notes == [f"{tmp_path} has a config but no weights (model.safetensors): the model has random "
                            "weights, so accuracy figures mean nothing"]


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


def test_optimize_takes_a_folder(folders, tmp_path):
    root, _, _ = folders
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", f"hf:{root / 'llama'}", "--prune", "0.3", "--seq-len", "16",
                                       "--export", "onnx", "--latency", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "model.onnx").is_file()
    reloaded = load(out / "model.pt").model
    assert reloaded.model.layers[0].mlp.up_proj.out_features < 160
