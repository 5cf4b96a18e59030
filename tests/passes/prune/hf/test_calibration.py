"""Calibration-aware transformer pruning: activation norms, and the least-squares refit of layers that lost inputs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from optkit.passes.prune.passes import StructuredPrune  # noqa: E402
from optkit.passes.prune.hf.calibration import input_norms  # noqa: E402
from optkit.passes.prune.hf.refit import DAMPING, refit_narrowed_layers  # noqa: E402


def _batches(seed: int, count: int = 4, features: int = 6) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    # Correlated inputs (a fixed mixing), so the removed channels are partly predictable from the kept ones.
    mixing = torch.randn(features, features, generator=torch.Generator().manual_seed(99))
    return [{"input": torch.randn(32, features, generator=generator) @ mixing} for _ in range(count)]


def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()


def test_input_norms_are_the_root_mean_square_of_each_input_channel():
    model, batches = _two_layers(), _batches(1)
    norms = input_norms(model, batches)
    x = torch.cat([b["input"] for b in batches])
    torch.testing.assert_close(norms["0"], x.pow(2).mean(0).sqrt(), rtol=1e-5, atol=0)
    hidden = torch.tanh(model[0](x))
    torch.testing.assert_close(norms["2"], hidden.pow(2).mean(0).sqrt(), rtol=1e-5, atol=1e-7)
    assert model.training is False


def test_a_layer_that_lost_inputs_is_refitted_to_the_least_squares_solution():
    original, batches = _two_layers(), _batches(2)
    kept = [0, 2, 3, 5, 7]
    pruned = copy.deepcopy(original)
    with torch.no_grad():
        pruned[0] = nn.Linear(6, 5)
        pruned[0].weight.copy_(original[0].weight[kept])
        pruned[0].bias.copy_(original[0].bias[kept])
        pruned[2] = nn.Linear(5, 3)
        pruned[2].weight.copy_(original[2].weight[:, kept])
        pruned[2].bias.copy_(original[2].bias)
    plain = copy.deepcopy(pruned)

    assert refit_narrowed_layers(original, pruned, batches) == ["2"]

    # The normal equations, solved here in float64 numpy from the hidden activations.
    x = np.concatenate([torch.tanh(original[0](b["input"])).detach().numpy() for b in batches]).astype(np.float64)
    w = original[2].weight.detach().numpy().astype(np.float64)
    xk = x[:, kept]
    gram = xk.T @ xk
    gram += np.eye(len(kept)) * DAMPING * np.diag(gram).mean()
    expected = np.linalg.solve(gram, xk.T @ x @ w.T).T
    np.testing.assert_allclose(pruned[2].weight.detach().numpy(), expected, rtol=1e-4, atol=1e-5)
    assert pruned[0].weight.shape == (5, 6)  # the layer that lost outputs is left alone

    held_out = torch.cat([b["input"] for b in _batches(3)])
    with torch.no_grad():
        target = original(held_out)
        error_refit = (pruned(held_out) - target).pow(2).mean()
        error_plain = (plain(held_out) - target).pow(2).mean()
    assert error_refit < 0.5 * error_plain


def _tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _token_batches(seed: int, count: int = 4) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 128, (8, 24), generator=generator),
             "attention_mask": torch.ones(8, 24, dtype=torch.long)} for _ in range(count)]


@pytest.mark.parametrize("importance", ["l1", "activation"])
def test_the_refit_brings_a_pruned_language_model_closer_to_the_original_on_unseen_tokens(importance):
    model = _tiny_llama()
    with_refit = StructuredPrune(ratio=0.5, importance=importance, calibration=_token_batches(1),
                                 input_shape=(1, 24)).apply(copy.deepcopy(model))
    without = StructuredPrune(ratio=0.5, importance=importance, calibration=_token_batches(1), bias_correction=False,
                              input_shape=(1, 24)).apply(copy.deepcopy(model))
    assert len(with_refit.details["refitted_layers"]) == 4  # o_proj and down_proj of both blocks
    assert without.details["refitted_layers"] == []
    assert with_refit.model.config.num_attention_heads == 2 and with_refit.model.config.intermediate_size == 64

    errors = {}
    for name, result in (("refit", with_refit), ("plain", without)):
        total = 0.0
        with torch.no_grad():
            for batch in _token_batches(5):
                total += (result.model(**batch).logits - model(**batch).logits).pow(2).mean().item()
        errors[name] = total
    assert errors["refit"] < errors["plain"]


def test_activation_importance_is_for_transformers_and_needs_data():
    with pytest.raises(ValueError, match="importance 'activation' needs data"):
        StructuredPrune(ratio=0.3, importance="activation")
    convnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    with pytest.raises(ValueError, match="ranks a Hugging Face transformer's heads"):
        StructuredPrune(ratio=0.3, importance="activation", data="synthetic:8:3x8x8:2",
                        input_shape=(1, 3, 8, 8)).apply(convnet)


def _llama_with_the_shipped_tokenizer(folder) -> nn.Module:
    """A tiny Llama saved with the shipped language model's tokenizer, loaded back as a user's folder is."""
    import shutil
    from pathlib import Path

    from optkit.io.models import load_model

    shipped = Path(__file__).resolve().parents[4] / "optkit" / "demo" / "python_docs_lm"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped / name, folder / name)
    return load_model(str(folder)).eval()


def test_a_parameter_target_split_between_heads_and_mlp_keeps_the_mix_with_the_lowest_val_perplexity(tmp_path):
    from optkit.analysis.evaluation import EvalSettings, load_eval_set, score, torch_logits
    from optkit.passes.prune.targets.mix import VAL_BLOCKS

    model = _llama_with_the_shipped_tokenizer(tmp_path / "lm")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the function returns a list of {i % 9} values." for i in range(1500)))
    params_before = sum(p.numel() for p in model.parameters())
    # Statistics on the unpruned activations: the kept model is then exactly the one its candidate scored.
    result = StructuredPrune(target_params=0.9, allocation="sensitivity", data=f"text:{text}", input_shape=(1, 32),
                             block_inputs="unpruned").apply(copy.deepcopy(model))

    candidates = result.details["candidates"]
    assert len(candidates) >= 2
    assert len({(c["heads"], c["kv_heads"], *c["intermediate"]) for c in candidates}) == len(candidates)
    assert all(abs(c["planned_fraction"] - 0.9) <= 0.02 for c in candidates)
    chosen = min(candidates, key=lambda c: c["val_loss"])
    assert result.details["val_measure"] == "perplexity"
    pruned = result.model
    assert (pruned.config.num_attention_heads, pruned.config.num_key_value_heads, pruned.config.intermediate_size) == \
        (chosen["heads"], chosen["kv_heads"], chosen["intermediate"][0])
    assert sum(p.numel() for p in pruned.parameters()) / params_before == pytest.approx(0.9, abs=0.02)
    # The recorded figure is the kind's perplexity on the first val rows it scored, recomputed here on the kept model.
    rows = result.details["val_rows"]
    assert 1 <= rows <= VAL_BLOCKS
    val = load_eval_set(EvalSettings(data=f"text:{text}", samples=rows), model, (1, 32), split="val")
    assert score(torch_logits(pruned, val), val)["perplexity"] == pytest.approx(chosen["val_loss"], rel=1e-3)


def test_finetune_on_text_trains_a_causal_lm_on_the_next_token(tmp_path):
    from optkit.analysis.evaluation import EvalSettings, load_eval_set, score, torch_logits
    from optkit.passes.finetune.passes import FineTune

    model = _llama_with_the_shipped_tokenizer(tmp_path / "lm")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the function returns a list of {i % 9} values." for i in range(1500)))
    val = load_eval_set(EvalSettings(data=f"text:{text}", samples=32), model, (1, 32), split="val")
    before = score(torch_logits(model, val), val)["perplexity"]
    result = FineTune(data=f"text:{text}", epochs=1, max_steps=30, batch_size=8, lr=3e-3, input_shape=(1, 32),
                      amp="off", num_workers=0).apply(model)
    after = score(torch_logits(result.model, val), val)["perplexity"]
    assert after < 0.5 * before  # random weights start near the vocabulary size; the repeated text is easy
    history = result.details["history"]
    assert len(history) == 1 and history[0]["val_accuracy"] > 0.2


def test_the_default_split_over_its_time_budget_cuts_uniformly_and_says_why(tmp_path, monkeypatch):
    from optkit.passes.prune.hf import entry
    from optkit.passes.prune.hf.candidates import MIN_ROWS
    from optkit.passes.prune.hf.entry import first_block
    from optkit.passes.prune.targets import mix

    model = _llama_with_the_shipped_tokenizer(tmp_path / "lm")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the function returns a list of {i % 9} values." for i in range(1500)))
    monkeypatch.setattr(mix, "SCORE_BUDGET_S", 0.0)
    uniform = StructuredPrune(target_params=0.9, data=f"text:{text}", input_shape=(1, 32),
                              allocation="uniform").apply(copy.deepcopy(model)).model
    parsed = []
    monkeypatch.setattr(entry, "first_block", lambda *a: parsed.append(1) or first_block(*a))

    def no_val(*args, **kwargs):
        raise AssertionError("the validation split was read for a split that is not measured")

    monkeypatch.setattr(mix, "_val_rows", no_val)
    by_default = StructuredPrune(target_params=0.9, data=f"text:{text}", input_shape=(1, 32)).apply(copy.deepcopy(model))
    assert len(parsed) == 1  # the first block parsed once, for the estimate and the cut
    after = by_default.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in uniform.state_dict().items())  # the uniform allocation's cut
    monkeypatch.undo()
    monkeypatch.setattr(mix, "SCORE_BUDGET_S", 0.0)
    assert "candidates" not in by_default.details
    assert by_default.details["notes"][0].startswith("structured_prune cut heads and MLP channels by the same share: "
                                                     "measuring the split")
    assert "over its budget of 0 s" in by_default.details["notes"][0]
    asked = StructuredPrune(target_params=0.9, data=f"text:{text}", input_shape=(1, 32),
                            allocation="sensitivity").apply(copy.deepcopy(model))
    assert asked.details["val_rows"] == MIN_ROWS  # asked for: measured anyway, on the fewest rows
