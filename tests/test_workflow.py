"""optimize's outputs and measuring stages (#43 items 5, 6): one copy of a Hugging Face result, as a save_pretrained
folder in the checkpoint's dtype (sharded with its index above the shard size), model.pt only on request; the peak
memory of every stage in the report; an evaluation that keeps neither the original model nor its logits."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from optkit import workflow
from optkit.analysis import evaluation
from optkit.cli import main
from optkit.core.pipeline import PassRecord
from optkit.io import hf
from optkit.io.models import load
from optkit.kinds import kind_of
from optkit.kinds import tokens as token_kind
from tests.support.token_models import VOCAB, tiny_llama_config


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    folder = tmp_path_factory.mktemp("bf16") / "llama"
    LlamaForCausalLM(config).to(torch.bfloat16).eval().save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def _optimize(folder, out, *extra: str):
    result = CliRunner().invoke(main, ["optimize", str(folder), "--prune", "0.3", "--seq-len", "16", "--no-latency",
                                       "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text())


def _safetensors_dtypes(folder) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {str(f.get_slice(key).get_dtype()) for key in f.keys()}
    return dtypes


@pytest.fixture(scope="module")
def bf16_run(bf16_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    return out, _optimize(bf16_folder, out)


def test_a_bf16_folder_gives_one_bf16_save_pretrained_copy_and_no_model_pt(bf16_folder, bf16_run):
    out, report = bf16_run
    assert not (out / "model.pt").exists() and "model.pt" not in report["files"]
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(report["files"])
    assert _safetensors_dtypes(out) == {"BF16"}
    assert report["dtype"] == {"before": "bfloat16", "after": "bfloat16", "on_disk": "bfloat16"}
    assert report["file_size"]["after"] == (out / "model.safetensors").stat().st_size
    stock = AutoModelForCausalLM.from_pretrained(out)
    assert type(stock) is LlamaForCausalLM and stock.dtype == torch.bfloat16
    assert stock.config.intermediate_size < 160
    # The same logits as the run's own result, read back by optkit from the folder.
    again = load(out).model
    with torch.no_grad():
        assert torch.equal(stock.eval()(_ids()).logits, again(_ids()).logits)
    assert "Weights dtype | bfloat16 | bfloat16 |" in (out / "report.md").read_text()


def test_every_stage_and_pass_records_its_peak_memory(bf16_run):
    out, report = bf16_run
    (prune,) = report["passes"]
    assert prune["peak_rss_mb"] > 0
    memory = report["memory"]
    stages = {row["stage"]: row for row in memory["stages"]}
    assert {"check", "inspect", "passes", "save"} <= set(stages)
    assert all(row["peak_rss_mb"] >= row["end_rss_mb"] > 0 for row in stages.values())
    assert memory["peak_rss_mb"] >= max(row["peak_rss_mb"] for row in stages.values())
    assert stages["passes"]["peak_rss_mb"] >= prune["peak_rss_mb"]
    assert "ru_maxrss" in memory["method"]
    text = (out / "report.md").read_text()
    assert "| pass | seconds | params | MACs | sparsity | peak RSS (MiB) |" in text and "## Memory" in text
    assert PassRecord("p", 1.0, None, peak_rss_mb=12.5).to_dict()["peak_rss_mb"] == 12.5


def test_a_large_result_is_sharded_with_its_index_and_checked_without_a_second_copy(bf16_folder, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(hf, "MAX_SHARD_SIZE", "40KB")
    reloads = []
    original = hf._reload_mismatch
    monkeypatch.setattr(hf, "_reload_mismatch", lambda *a: reloads.append(a) or original(*a))
    monkeypatch.setattr(hf, "RELOAD_CHECK_MAX_BYTES", 1)  # every model counts as large: checked tensor by tensor
    out = tmp_path / "out"
    report = _optimize(bf16_folder, out)
    assert reloads == []
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert set(shards) <= set(report["files"]) and "model.safetensors.index.json" in report["files"]
    assert report["file_size"]["after"] == sum((out / name).stat().st_size for name in shards)
    assert _safetensors_dtypes(out) == {"BF16"}
    stock = AutoModelForCausalLM.from_pretrained(out)
    again = load(out).model
    with torch.no_grad():
        assert torch.equal(stock.eval()(_ids()).logits, again(_ids()).logits)
    # A second run with fewer shards leaves none of the first run's behind.
    monkeypatch.setattr(hf, "MAX_SHARD_SIZE", "5GB")
    _optimize(bf16_folder, out, "--force")
    assert not (out / "model.safetensors.index.json").exists() and not list(out.glob("model-*.safetensors"))


def test_save_pt_also_writes_the_slimmed_checkpoint(bf16_folder, tmp_path):
    out = tmp_path / "out"
    report = _optimize(bf16_folder, out, "--save-pt")
    assert {"model.pt", "model.safetensors"} <= set(report["files"])
    pruned = load(out / "model.pt").model
    stock = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(stock.eval()(_ids()).logits, pruned.eval()(_ids()).logits)
    assert report["file_size"]["after"] == (out / "model.pt").stat().st_size


class WideVocabulary(nn.Module):
    """A language model with a large vocabulary and little else: embedding, then a head back to the vocabulary."""

    def __init__(self, vocabulary: int, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.embed(input_ids)))


class GivenBlocks:
    def __init__(self, ids):
        self.ids = ids

    def token_blocks(self, spec, split, seq_len, samples, *, vocab_size, max_positions):
        return self.ids[:samples], torch.ones_like(self.ids[:samples])


def _scorer(model, ids, monkeypatch):
    kind = kind_of(model)
    eval_set = kind.eval_set(model, (1, ids.shape[1]), "text:x", split="test", samples=len(ids),
                             data=GivenBlocks(ids))
    monkeypatch.setattr(evaluation, "load_eval_set", lambda *args, **kwargs: eval_set)
    return workflow.Scorer(evaluation.EvalSettings(data="text:x", batch_size=4), model, (1, ids.shape[1])), eval_set


def _held(obj, seen=None) -> list:
    """Every tensor and module reachable from ``obj``'s attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, nn.Module)):
        return [obj]
    items = (list(obj.values()) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple))
             else list(vars(obj).values()) if hasattr(obj, "__dict__") else [])
    return [held for item in items for held in _held(item, seen)]


def test_the_evaluation_keeps_neither_the_original_model_nor_its_logits(monkeypatch):
    vocabulary, blocks, length = 32_000, 12, 24
    torch.manual_seed(0)
    model = WideVocabulary(vocabulary)
    ids = torch.randint(0, vocabulary, (blocks, length), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(token_kind, "REFERENCE_BYTES", 1)  # as when the positions are many: the fewest tokens kept
    scorer, eval_set = _scorer(model, ids, monkeypatch)
    held = _held(scorer)
    assert not [m for m in held if isinstance(m, nn.Module)]  # no copy of the original
    logits_bytes = blocks * (length - 1) * vocabulary * 4
    kept = sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
    assert kept < logits_bytes / 10 and max(t.numel() for t in held) < blocks * (length - 1) * vocabulary / 10
    assert scorer.reference.top_k == token_kind.REFERENCE_MIN_TOP_K
    # The passes change the model in place; the comparison is still with the original.
    unchanged = token_kind.TokenModel().score(token_kind.TokenLogits(kind_of(model), model, eval_set, 4), eval_set,
                                              token_kind.TokenLogits(kind_of(model), model, eval_set, 4))
    with torch.no_grad():
        model.head.weight.add_(0.5 * torch.randn_like(model.head.weight))
    scorer.after_pass(PassRecord("structured_prune", 0.0, None), model)
    original, after = scorer.stages
    assert original["perplexity"] == pytest.approx(unchanged["perplexity"], rel=1e-9)
    assert after["agreement"] < 1 and after["mean_kl"] > 0
    assert scorer.section()["kl_top_k"] == token_kind.REFERENCE_MIN_TOP_K


def test_the_kl_is_exact_where_the_vocabulary_fits_and_estimated_without_bias_where_it_does_not(monkeypatch):
    torch.manual_seed(0)
    model = WideVocabulary(512)
    ids = torch.randint(0, 512, (16, 24), generator=torch.Generator().manual_seed(3))
    kind = kind_of(model)
    scorer, eval_set = _scorer(model, ids, monkeypatch)
    reference = token_kind.TokenLogits(kind, model, eval_set, 4)  # the whole distributions, recomputed
    assert scorer.reference.exact and scorer.reference.top_k == 512
    with torch.no_grad():
        model.head.weight.add_(0.3 * torch.randn_like(model.head.weight))
    exact = kind.score(token_kind.TokenLogits(kind, model, eval_set, 4), eval_set, reference)
    scorer.after_pass(PassRecord("structured_prune", 0.0, None), model)
    assert scorer.stages[1]["mean_kl"] == pytest.approx(exact["mean_kl"], rel=1e-6)
    assert scorer.stages[1]["agreement"] == exact["agreement"]
    assert scorer.stages[1]["perplexity"] == pytest.approx(exact["perplexity"], rel=1e-9)
    assert "kl_top_k" not in scorer.section()
    # 64 of 512 tokens kept: on these near-uniform distributions most of the KL is in the rest, which the
    # drawn tokens estimate (a single bucket for the rest would give about a quarter of it).
    monkeypatch.setattr(token_kind, "REFERENCE_BYTES", 1)
    estimates = [kind.score_model(model, eval_set, 4, token_kind.TokenReference.measure(
        kind, reference.source, eval_set, 4, seed=seed))["mean_kl"] for seed in range(3)]
    assert all(estimate == pytest.approx(exact["mean_kl"], rel=0.1) for estimate in estimates)
