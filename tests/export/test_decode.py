"""The decode-step graph of a causal LM: its cache, its generation against transformers' own, and the report section."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from optkit.cli import main
from optkit.core.errors import ExportError
from optkit.export import decode
from optkit.passes.export.passes import ExportOnnx
from tests.support.token_models import TinyBertClassifier

VOCAB = 97


def _llama(query_heads: int, kv_heads: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=query_heads, num_key_value_heads=kv_heads, head_dim=8,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's: well separated logits, so greedy ids have no near ties
        for p in model.parameters():
            p.mul_(8.0)
    return model


def _gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


@pytest.mark.parametrize("query_heads, kv_heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa-3:1", "mqa"])
def test_the_graph_caches_each_layers_kv_heads_and_generates_what_transformers_generates(tmp_path, query_heads,
                                                                                          kv_heads):
    model = _llama(query_heads, kv_heads)
    path = tmp_path / "model.decode.onnx"
    written = decode.export_decode(model, path)
    assert written.layers == 3 and all(diff <= tol for _, _, diff, tol in written.checks)
    session = ort.InferenceSession(str(path))
    prompt = np.array([[5, 17, 3, 40, 2]], dtype=np.int64)
    empty = [np.zeros((1, kv_heads, 0, 8), np.float32)] * 6
    logits, *present = session.run(None, decode.feed(session, [prompt, np.ones_like(prompt), *empty]))
    assert logits.shape == (1, 5, VOCAB)
    assert [p.shape for p in present] == [(1, kv_heads, 5, 8)] * 6
    expected = model.generate(torch.from_numpy(prompt), attention_mask=torch.ones(1, 5, dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert decode.generate_onnx(path, prompt[0].tolist(), 12) == expected
    assert decode.generate_torch(model, prompt[0].tolist(), 12) == expected


def test_a_model_with_a_fused_qkv_projection_and_learned_positions_exports_too(tmp_path):
    model = _gpt2()
    path = decode.decode_path(tmp_path / "model.onnx")
    assert path.name == "model.decode.onnx"
    decode.export_decode(model, path)
    expected = model.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                              max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert decode.generate_onnx(path, [1, 2, 3], 8) == expected


def test_a_model_that_does_not_generate_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    path = tmp_path / "model.decode.onnx"
    with pytest.raises(ExportError, match="does not generate") as error:
        decode.export_decode(TinyBertClassifier().eval(), path)
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_decode_speeds_count_the_steps_they_time(tmp_path):
    model = _llama(6, 2)
    path = tmp_path / "model.decode.onnx"
    decode.export_decode(model, path)
    first, second = decode.onnx_decode_speed([path, path], prompt_tokens=16, steps=4, rounds=2, threads=1)
    assert first["steps"] == second["steps"] == 8 and first["threads"] == 1
    assert first["tokens_per_s"] == pytest.approx(1e3 / first["median_ms"], rel=1e-3)
    speed = decode.torch_decode_speed(model, prompt_tokens=16, steps=4, rounds=1)
    assert speed["steps"] == 4 and speed["p90_ms"] >= speed["median_ms"] > 0


def test_pytorch_decode_timing_stops_once_enough_steps_are_timed(monkeypatch):
    from optkit.core.progress import show_progress

    generations = []
    step_ms = [100.0]

    def timed_steps(model, prompt, tokens, *, timed, count=None, stop=None):
        times = []
        for _ in range(tokens):
            times.append(step_ms[0]) if timed else None
            count.step()
            if stop is not None and stop(times):
                break
        generations.append((len(times) if timed else tokens, timed))
        return [0] * tokens, times

    monkeypatch.setattr(decode, "_generate_torch", timed_steps)
    model = _llama(6, 2)
    lines = []
    with show_progress(lines.append):
        speed = decode.torch_decode_speed(model, steps=32, rounds=3, enough_s=3.0)
    assert generations == [(8, False), (30, True)]  # a quarter-length warm-up; 30 steps of 0.1 s reach 3 s
    assert speed["steps"] == 30 and speed["tokens_per_s"] == pytest.approx(10.0)
    assert lines[-1].startswith("generation: PyTorch decode steps timed 38/38")
    generations.clear()
    step_ms[0] = 1000.0  # 3 s after 3 steps, but at least MIN_TIMED_STEPS are timed
    decode.torch_decode_speed(model, steps=10, rounds=3, enough_s=3.0, warmup=False)
    assert generations == [(10, True), (decode.MIN_TIMED_STEPS - 10, True)]
    generations.clear()
    step_ms[0] = 0.1  # a small model times every step of every round
    decode.torch_decode_speed(model, steps=4, rounds=3, enough_s=3.0, warmup=False)
    assert generations == [(4, True)] * 3


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm") / "lm"
    _llama(4, 2, seed=1).save_pretrained(str(folder))
    return folder


def test_an_optimize_run_writes_the_decode_graph_of_the_pruned_model_and_its_greedy_sample(lm_folder, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", str(lm_folder), "--seq-len", "16", "--prune", "0.5",
                                       "--export", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert "model.decode.onnx" in report["files"]
    assert "model.decode.onnx: one step with a KV cache over 3 layers" in "\n".join(report["notes"])
    generation = report["generation"]
    pruned = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    original = AutoModelForCausalLM.from_pretrained(str(lm_folder)).eval()
    prompt = torch.tensor([generation["prompt_ids"]])

    def greedy(model):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                              do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()

    assert generation["before"]["ids"] == greedy(original)
    assert generation["after"]["ids"] == greedy(pruned)
    assert generation["after"]["ids"] != generation["before"]["ids"]
    assert generation["after_onnx_matches"] is True
    assert decode.generate_onnx(out / "model.decode.onnx", generation["prompt_ids"], 20) == greedy(pruned)
    for runtime in ("pytorch", "onnxruntime"):
        pair = generation[runtime]
        assert pair["speedup"] == pytest.approx(pair["before"]["median_ms"] / pair["after"]["median_ms"], rel=1e-2)
    markdown = (out / "report.md").read_text()
    assert "## Generation" in markdown and "ONNX Runtime:" in markdown


def test_decode_graph_false_writes_model_onnx_alone(lm_folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(lm_folder)).eval()
    target = tmp_path / "model.onnx"
    result = ExportOnnx(decode_graph=False, input_shape=(1, 16), path=str(target)).apply(model)
    assert target.is_file() and "decode" not in result.details
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    with_graph = ExportOnnx(input_shape=(1, 16), path=str(tmp_path / "b" / "model.onnx")).apply(model)
    assert with_graph.details["files"] == {"model.onnx": with_graph.details["file_size"],
                                           "model.decode.onnx": (tmp_path / "b" / "model.decode.onnx").stat().st_size}


def test_optkit_export_writes_the_decode_graph_beside_and_refuses_to_replace_it_without_force(lm_folder, tmp_path):
    target = tmp_path / "lm.onnx"
    command = ["export", str(lm_folder), "--onnx", str(target), "--seq-len", "16"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    assert "Wrote lm.decode.onnx beside it" in result.output
    assert decode.generate_onnx(tmp_path / "lm.decode.onnx", [3, 4], 5) == decode.generate_torch(
        AutoModelForCausalLM.from_pretrained(str(lm_folder)).eval(), [3, 4], 5)
    target.unlink()
    refused = CliRunner().invoke(main, command)
    assert refused.exit_code != 0 and "lm.decode.onnx already exists; pass --force" in refused.output
    assert not target.exists()


def test_weights_over_the_threshold_go_to_external_data_beside_each_graph_and_verify(lm_folder, tmp_path, monkeypatch):
    """Files over 2 GB keep their weights in NAME.data; the threshold is lowered here so a tiny model crosses it."""
    import onnx

    from optkit.export import onnx as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1024)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["optimize", str(lm_folder), "--seq-len", "16", "--prune", "0.5",
                                       "--export", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    for name in ("model.onnx", "model.decode.onnx"):
        graph, data = out / name, out / f"{name}.data"
        assert data.stat().st_size > 100_000  # the pruned weights (about 37k), in float32
        assert report["files"][name] == graph.stat().st_size and report["files"][data.name] == data.stat().st_size
        onnx.checker.check_model(str(graph))  # by path: the checker reads the data beside
        proto = onnx.load(str(graph), load_external_data=False)
        inline = [init for init in proto.graph.initializer if init.data_location != onnx.TensorProto.EXTERNAL]
        assert len(inline) < len(proto.graph.initializer) and all(len(init.raw_data) <= 1024 for init in inline)
    assert report["export"]["external_data"] and report["export"]["decode"]["external_data"]
    pruned = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (actual,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())})
    with torch.no_grad():
        expected = pruned(ids).logits.numpy()
    np.testing.assert_allclose(actual, expected, atol=1e-4 * float(np.abs(expected).max()))
    generation = report["generation"]
    assert generation["after_onnx_matches"] is True and "onnxruntime" in generation  # the original's graph too
    prompt = torch.tensor([generation["prompt_ids"]])
    greedy = pruned.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert decode.generate_onnx(out / "model.decode.onnx", generation["prompt_ids"], 20) == greedy
