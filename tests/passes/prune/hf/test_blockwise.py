"""Block-by-block pruning: fp32 statistics on any checkpoint dtype, the refit, grouped-query head options."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from optkit.passes.prune.hf import blockwise, least_squares  # noqa: E402
from optkit.passes.prune.passes import StructuredPrune  # noqa: E402

VOCAB = 300


def _qwen(seed: int = 0, layers: int = 3) -> torch.nn.Module:
    """14 query heads sharing 2 KV heads (Qwen2.5-0.5B's grouping), hidden 112, head width 16."""
    config = transformers.Qwen2Config(hidden_size=112, num_attention_heads=14, num_key_value_heads=2, head_dim=16,
                                      intermediate_size=288, num_hidden_layers=layers, vocab_size=VOCAB,
                                      tie_word_embeddings=True, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Random init gives every head the same scale; uneven scales make the choice of heads mean something.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(torch.linspace(0.2, 2.0, 14).repeat_interleave(16)[:, None])
            layer.mlp.up_proj.weight.mul_(torch.rand(288, 1) + 0.25)
    return model


def _batches(count: int = 3, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (4, 24), generator=generator),
             "attention_mask": torch.ones(4, 24, dtype=torch.long)} for _ in range(count)]


def _first_block(model: torch.nn.Module) -> blockwise.Block:
    blocks = blockwise.chained_blocks(model)
    captured = blockwise.capture_inputs(model, blocks, _batches(1))
    return blockwise.parse_first(model, blocks, captured, torch.device("cpu"))


PLAN = blockwise.Plan(kv_keep=2, q_keep=4, mlp_keep={288: 192})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_is_cut_exactly_where_its_fp32_copy_is(dtype):
    half = _qwen().to(dtype)
    fp32_copy = copy.deepcopy(half).float()  # the same weights, exactly
    for model in (half, fp32_copy):
        blockwise.prune_blockwise(model, PLAN, _batches(), importance="activation")
    assert next(half.parameters()).dtype == dtype
    assert next(fp32_copy.parameters()).dtype == torch.float32
    pruned_half, pruned_fp32 = dict(half.named_parameters()), dict(fp32_copy.named_parameters())
    assert pruned_half.keys() == pruned_fp32.keys()
    for name, param in pruned_half.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            # Refitted in fp32/fp64 from the same statistics, then rounded to the checkpoint's dtype.
            assert torch.equal(param, pruned_fp32[name].to(dtype)), name
        else:
            # Kept rows and columns are copies: the same ones were chosen.
            assert torch.equal(param.float(), pruned_fp32[name]), name


def test_the_half_precision_layout_check_finds_every_unit():
    model = _qwen().to(torch.bfloat16)
    structure = _first_block(model)
    assert structure.skipped == []
    assert len(structure.attentions) == 1 and len(structure.mlps) == 1
    assert structure.attentions[0].kv_heads == 2 and structure.attentions[0].heads == 14


def test_query_heads_go_from_every_group_and_the_stock_class_reloads_it(tmp_path):
    model = _qwen()
    blockwise.prune_blockwise(model, blockwise.Plan(kv_keep=2, q_keep=5, mlp_keep={288: 288}), _batches())
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (10, 2)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (10 * 16, 112)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 112)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    batch = _batches(1, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)


def test_head_options_remove_whole_groups_or_the_same_query_heads_from_every_group():
    options = blockwise.head_options(14, 2)
    assert (1, 7) in options  # one whole group
    assert {(2, q) for q in range(1, 7)} <= set(options)  # query heads from both groups, groups kept
    assert (2, 7) not in options  # removes nothing
    assert options[0] == (2, 6)  # the smallest cut first
    assert blockwise.head_options(8, 8) == [(k, 1) for k in range(7, 0, -1)]  # multi-head: one head a group


def test_the_refit_error_is_the_measured_output_error():
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 5, bias=False)
    x = torch.randn(400, 12) @ torch.randn(12, 12)  # correlated inputs
    weight = layer.weight.detach().clone()
    kept = torch.tensor([0, 2, 3, 7, 8, 11])
    gram = x.double().t() @ x.double()
    narrowed = torch.nn.Linear(6, 5, bias=False)
    unit = blockwise.Layer(narrowed, "layer", 6, 5, 0)
    error = least_squares.refit_layer(unit, weight, kept, gram)
    with torch.no_grad():
        target = x @ weight.t()
        measured = (x[:, kept] @ narrowed.weight.t() - target).pow(2).sum() / target.pow(2).sum()
        dropped_only = (x[:, kept] @ weight[:, kept].t() - target).pow(2).sum() / target.pow(2).sum()
    assert error == pytest.approx(measured.item(), rel=1e-4)
    assert measured < 0.5 * dropped_only  # the refit recovers much of what the dropped inputs gave


@pytest.mark.parametrize("calls", [4, 5])  # 80 rows of 80 inputs, kept as they are; 100, summed as they come
def test_a_refit_from_the_kept_inputs_equals_the_refit_from_the_gram_matrix(calls):
    torch.manual_seed(0)
    width, out = 80, 12
    layer = torch.nn.Linear(width, out, bias=True)
    weight = layer.weight.detach().clone()
    mix = torch.randn(width, width) * torch.linspace(0.2, 3.0, width)  # correlated inputs of uneven scales
    batches = [torch.randn(20, width) @ mix for _ in range(calls)]
    kept = torch.tensor(sorted(torch.randperm(width)[:60].tolist()))  # 3/4 kept: cheaper from the inputs
    gathered = least_squares.LayerInputs(width, keep_rows=True)
    for x in batches:
        gathered.add_input(x, x)
        gathered.add_output(layer(x).detach(), layer.bias)
    x_all = torch.cat(batches).double()
    assert gathered.kept_is_cheaper(len(kept), out) == (len(x_all) <= width)
    refitted = [torch.nn.Linear(60, out, bias=False) for _ in range(2)]
    error = least_squares.refit_layer(blockwise.Layer(refitted[0], "a", 60, out, 0), weight, kept, gathered)
    expected_error = least_squares.refit_layer(blockwise.Layer(refitted[1], "b", 60, out, 0), weight, kept,
                                               x_all.t() @ x_all)
    torch.testing.assert_close(refitted[0].weight, refitted[1].weight, rtol=1e-3, atol=1e-4)
    assert error == pytest.approx(expected_error, rel=1e-3)
    assert gathered.inputs == [] and gathered.outputs == []  # let go once used
    with torch.no_grad():
        target = x_all @ weight.double().t()
        measured = (x_all[:, kept] @ refitted[0].weight.double().t() - target).pow(2).sum() / target.pow(2).sum()
    assert error == pytest.approx(measured.item(), rel=1e-3)


def test_which_products_a_refit_takes_follows_their_cost():
    gathered = least_squares.LayerInputs(8192, keep_rows=True)
    x = torch.zeros(4, 8192)
    gathered.add_input(x, torch.empty(0))
    gathered.add_output(torch.zeros(4, 2048), None)
    gathered.rows = 8192  # an MLP down projection over 8,192 calibration rows
    assert gathered.kept_is_cheaper(6554, 2048)  # 80 % kept: 0.57 against 0.83 TFLOP
    assert not gathered.kept_is_cheaper(8192, 8192 * 4)  # many outputs, nothing dropped
    other = least_squares.LayerInputs(8192, keep_rows=False)  # not an nn.Linear: its output may not be X W^T
    other.add_input(x, torch.empty(0))
    other.add_output(torch.zeros(4, 2048), None)
    assert not other.kept_is_cheaper(10, 2048) and other.inputs == []
    elsewhere = least_squares.LayerInputs(16, keep_rows=False)  # summed where the block runs (a GPU's device)
    elsewhere.add_input(torch.empty(4, 16, device="meta"), torch.empty(0))
    assert elsewhere.gram().device.type == "meta"


def test_gram_matrices_summed_tile_by_tile_equal_the_full_products():
    torch.manual_seed(0)
    width = 2 * least_squares.GRAM_TILE + 37  # three uneven tiles
    batches = [torch.randn(300, width) * torch.linspace(0.1, 3.0, width) for _ in range(3)]
    gram = torch.zeros(width, width)
    for x in batches:
        least_squares.add_upper_gram(gram, x)
    least_squares.mirror_gram(gram)
    expected = sum(x.double().t() @ x.double() for x in batches)
    torch.testing.assert_close(gram.double(), expected, rtol=1e-5, atol=1e-3)
    assert torch.equal(gram, gram.t())


def test_a_plan_the_stock_class_cannot_describe_changes_nothing():
    model = _qwen()
    structure = _first_block(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    problem = blockwise.check_plan(model, blockwise.Plan(kv_keep=2, q_keep=7, mlp_keep={999: 10}), structure)
    assert problem is None  # a width no MLP has is not cut
    with pytest.raises(Exception, match="stock class"):
        blockwise.prune_blockwise(model, blockwise.Plan(kv_keep=2, q_keep=8, mlp_keep={}), _batches(1))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.config.num_attention_heads == 14


@pytest.mark.parametrize("plan", [blockwise.Plan(kv_keep=1, q_keep=7, mlp_keep={288: 160}),
                                  blockwise.Plan(kv_keep=2, q_keep=3, mlp_keep={288: 200})])
def test_a_plan_is_checked_on_shapes_alone_and_they_are_the_shapes_of_the_model_cut_to_it(plan):
    model = _qwen()
    structure = _first_block(model)
    first = {n: p.clone() for n, p in structure.module.named_parameters()}
    expected = blockwise._expected_shapes(model, plan, structure)
    assert all(torch.equal(first[n], p) for n, p in structure.module.named_parameters())  # the block is as it was
    assert structure.attentions[0].heads == 14 and structure.mlps[0].width == 288
    assert blockwise.check_plan(model, plan, structure) is None
    blockwise.prune_blockwise(model, plan, _batches(1))
    assert expected == {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    assert expected["model.layers.2.self_attn.q_proj.weight"] == (plan.heads() * 16, 112)


def test_a_parameter_target_on_a_grouped_query_model_is_met_without_losing_a_kv_group():
    model = _qwen(layers=2)
    before = sum(p.numel() for p in model.parameters())
    prune = StructuredPrune(target_params=0.8, round_to=8, input_shape=(2, 24), allocation="uniform")
    pruned = prune(model)
    after = sum(p.numel() for p in pruned.parameters())
    assert after / before == pytest.approx(0.8, abs=0.02)
    assert pruned.config.num_key_value_heads == 2
    assert pruned.config.num_attention_heads < 14


@pytest.mark.parametrize("plan", [blockwise.Plan(kv_keep=1, q_keep=7, mlp_keep={288: 160}),
                                  blockwise.Plan(kv_keep=2, q_keep=3, mlp_keep={288: 288})])
def test_a_plan_scored_in_one_sweep_has_the_perplexity_of_the_model_cut_to_it(plan):
    from optkit.passes.prune.hf.candidates import score_plans

    model = _qwen()
    structure = _first_block(model)
    val = _batches(2, seed=9)
    ids = torch.cat([b["input_ids"] for b in val])
    ids[:, -3:] = 0
    mask = torch.cat([b["attention_mask"] for b in val])
    targets = ids[:, 1:].clone()
    targets[:, -3:] = -100  # positions without a scored next token
    state = {k: v.clone() for k, v in model.state_dict().items()}
    [scored] = score_plans(model, structure, [plan], _batches(), {"input_ids": ids, "attention_mask": mask}, targets,
                           importance="activation")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # scoring changed nothing
    blockwise.prune_blockwise(model, plan, _batches(), importance="activation", inputs_from="unpruned")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    expected = torch.exp(losses.sum() / (targets != -100).sum()).item()
    assert scored == pytest.approx(expected, rel=1e-4)


def test_the_default_allocation_measures_the_split_for_a_language_model_given_text_and_a_target(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("some words\n" * 50)
    model = _qwen(layers=1)
    assert StructuredPrune(target_params=0.8, data=f"text:{text}").resolved_allocation(model) == "sensitivity"
    assert StructuredPrune(target_macs=0.8, data=f"text:{text}").resolved_allocation(model) == "sensitivity"
    assert StructuredPrune(target_params=0.8).resolved_allocation(model) == "uniform"  # no text to measure on
    assert StructuredPrune(ratio=0.3, data=f"text:{text}").resolved_allocation(model) == "uniform"  # no target
    convnet = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    assert StructuredPrune(target_macs=0.5, data="fashion-mnist").resolved_allocation(convnet) == "uniform"
    assert StructuredPrune(target_params=0.8, data=f"text:{text}",
                           allocation="uniform").resolved_allocation(model) == "uniform"


@pytest.mark.parametrize("model_type", ["phi3", "vit"])
def test_a_block_that_reads_its_config_as_it_runs_or_takes_pixels_is_cut_and_reloads(model_type, tmp_path):
    """Phi-3's fused attention reads its head count from the config it keeps while it runs, so a cut block must run
    with the edited config before the next block's inputs are taken; a ViT's input embeddings are a patch
    convolution, not a token table (both failed in the house's commits while the slow development-set test alone
    would have seen it)."""
    from benchmarks._hf_configs import AUTO_CLASS, IMAGE_SIZE, build, is_image

    model = build(model_type)
    if is_image(model_type):
        shape = (1, 3, IMAGE_SIZE, IMAGE_SIZE)
        inputs = {"pixel_values": torch.randn(2, *shape[1:], generator=torch.Generator().manual_seed(3))}
    else:
        shape = (1, 16)
        inputs = {"input_ids": torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(3))}
    params = sum(p.numel() for p in model.parameters())
    result = StructuredPrune(ratio=0.3, input_shape=shape).apply(model)
    assert result.details["transformer"]["engine"] == "blockwise"
    assert sum(p.numel() for p in model.parameters()) <= 0.8 * params
    assert model.config.num_attention_heads < 4
    model.save_pretrained(tmp_path)
    reloaded = getattr(transformers, AUTO_CLASS[model_type]).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model.eval()(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_the_default_importance_is_activation_for_a_language_model_given_text_and_l1_otherwise(tmp_path):
    """benchmarks/results/llm-defaults-shipped.md measured activation importance best for language models; the
    default follows it there and leaves every other model on l1."""
    from optkit.io.models import load_model

    text = tmp_path / "corpus.txt"
    text.write_text("some words\n" * 50)
    model = _qwen(layers=1)
    assert StructuredPrune(ratio=0.3, data=f"text:{text}").resolved_importance(model) == "activation"
    assert StructuredPrune(ratio=0.3).resolved_importance(model) == "l1"  # no text to measure on
    assert StructuredPrune(ratio=0.3, data=f"text:{text}", importance="l2").resolved_importance(model) == "l2"
    convnet = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    assert StructuredPrune(target_macs=0.5, data="fashion-mnist").resolved_importance(convnet) == "l1"

    code = tmp_path / "code.txt"
    code.write_text("".join(f"def f{i}(x):\n    return x * {i} + len(str(x))\n\n" for i in range(400)))
    shipped = load_model("hf:optkit/demo/python_docs_lm").eval()
    weights = {}
    for importance in ("auto", "activation", "l1"):
        pruned = copy.deepcopy(shipped)
        StructuredPrune(ratio=0.5, data=f"text:{code}", importance=importance, input_shape=(1, 64),
                        calibration_batches=1, batch_size=4).apply(pruned)
        weights[importance] = pruned.model.layers[0].mlp.up_proj.weight
    assert torch.equal(weights["auto"], weights["activation"])
    assert weights["auto"].shape != weights["l1"].shape or not torch.equal(weights["auto"], weights["l1"])


def test_a_language_model_cut_deeply_reads_more_calibration_text_by_default(tmp_path):
    """At half the parameters four times the calibration text chose a better split on two language models
    (benchmarks/results/llm-defaults-*.md); at 0.6 and above it gained 0.2 % or nothing, so lighter cuts and every
    other model keep 4 batches, and a number given is used as given."""
    from optkit.passes.prune import passes as prune_passes

    text = tmp_path / "corpus.txt"
    text.write_text("some words\n" * 50)
    model = _qwen(layers=1)
    convnet = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    deep, light = prune_passes.DEEP_CUT_BATCHES, prune_passes.CALIBRATION_BATCHES
    assert deep > light
    data = f"text:{text}"
    resolved = {
        "params 0.5": StructuredPrune(target_params=0.5, data=data).resolved_calibration_batches(model),
        "macs 0.55": StructuredPrune(target_macs=0.55, data=data).resolved_calibration_batches(model),
        "ratio 0.5": StructuredPrune(ratio=0.5, data=data).resolved_calibration_batches(model),
        "params 0.56": StructuredPrune(target_params=0.56, data=data).resolved_calibration_batches(model),
        "params 0.8": StructuredPrune(target_params=0.8, data=data).resolved_calibration_batches(model),
        "default ratio": StructuredPrune(data=data).resolved_calibration_batches(model),
        "no text": StructuredPrune(target_params=0.5).resolved_calibration_batches(model),
        "images": StructuredPrune(target_macs=0.3, data="fashion-mnist").resolved_calibration_batches(convnet),
        "given": StructuredPrune(target_params=0.5, data=data, calibration_batches=3).resolved_calibration_batches(model),
    }
    assert resolved == {"params 0.5": deep, "macs 0.55": deep, "ratio 0.5": deep, "params 0.56": light,
                        "params 0.8": light, "default ratio": light, "no text": light, "images": light, "given": 3}

    # What the pruning engines read: the spec the pass builds for the model.
    assert StructuredPrune(target_params=0.5, data=data).spec(model).calibration_batches == deep
    assert StructuredPrune(target_params=0.8, data=data).spec(model).calibration_batches == light


def test_the_measured_split_tries_the_heads_the_uniform_cut_keeps_even_past_half_of_them():
    from optkit.passes.prune.targets.configs import MixTarget, ParamsTarget
    from optkit.passes.prune.targets.mix import HEAD_SHARES, mix_plans
    from optkit.passes.prune.targets.ratio import uniform_heads

    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                      intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB,
                                      tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    structure = _first_block(model)
    kv_keep, q_keep = uniform_heads(ParamsTarget(0.5, 0.02, 1), model, structure)
    assert 1 - kv_keep * q_keep / 6 > max(HEAD_SHARES)  # past what the shares alone would try
    plans = mix_plans(model, structure, MixTarget(0.5, 0.02, 1))
    assert (kv_keep, q_keep) in [(plan.kv_keep, plan.q_keep) for plan, _ in plans]
    assert all(abs(planned - 0.5) <= 0.02 for _, planned in plans)
