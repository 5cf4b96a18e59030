"""Token models scored on text (#30 part 7, #28): perplexity, next-token top-1, agreement and KL with the original."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from optkit.cli import main
from optkit.kinds import kind_of
from optkit.kinds.tokens import TokenModel

WORDS = "the model prunes heads and channels of a small network while its text keeps meaning".split()


class Bigram(nn.Module):
    """Logits that depend on the current token only: row ``t`` of a fixed table."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Embedding.from_pretrained(table.clone(), freeze=False)

    def forward(self, input_ids, attention_mask=None):
        return self.table(input_ids)


class GivenBlocks:
    """Readers that hand over fixed token blocks (what ``optkit.data.text`` would read)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor):
        self.ids, self.mask = ids, mask

    def token_blocks(self, spec, split, seq_len, samples, *, vocab_size, max_positions):
        assert seq_len == self.ids.shape[1]
        return self.ids[:samples], self.mask[:samples]

    def labelled_images(self, *args):
        raise AssertionError("a token model reads text")


TABLE = [[2.0, 0.5, -1.0, 0.0], [0.0, 1.0, 3.0, -0.5], [1.0, 1.0, 1.0, 2.5], [-2.0, 0.0, 0.7, 0.3]]
OTHER = [[1.0, 0.5, -1.0, 0.5], [0.0, 2.0, 1.0, -0.5], [1.0, 0.0, 1.0, 2.0], [0.5, 0.0, 0.7, 0.3]]
# Two blocks of 4; the second ends in one padding position (mask 0), which predicts and is predicted by nothing.
IDS = [[0, 1, 2, 3], [3, 3, 1, 0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_sum = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - log_sum for v in row]


def _pairs() -> list[tuple[int, int]]:
    """(token, next token) at every scored position, by hand from IDS and MASK."""
    return [(0, 1), (1, 2), (2, 3), (3, 3), (3, 1)]


def test_perplexity_top1_agreement_and_kl_of_a_model_with_known_logits():
    model, other = Bigram(torch.tensor(TABLE)), Bigram(torch.tensor(OTHER))
    kind = kind_of(model)
    assert isinstance(kind, TokenModel)
    eval_set = kind.eval_set(model, (1, 4), "text:x", split="test", samples=10,
                             data=GivenBlocks(torch.tensor(IDS), torch.tensor(MASK)))
    # Batches of one block: the scores are summed across batches, not averaged per batch.
    reference = kind.eval_outputs(model, eval_set, 1)
    scores = kind.score(kind.eval_outputs(other, eval_set, 1), eval_set, reference)

    pairs = _pairs()
    nll = -sum(_log_softmax(OTHER[a])[b] for a, b in pairs) / len(pairs)
    top1 = sum(OTHER[a].index(max(OTHER[a])) == b for a, b in pairs) / len(pairs)
    agreement = sum(OTHER[a].index(max(OTHER[a])) == TABLE[a].index(max(TABLE[a])) for a, _ in pairs) / len(pairs)
    p = [np.exp(_log_softmax(TABLE[a])) for a, _ in pairs]
    q = [np.exp(_log_softmax(OTHER[a])) for a, _ in pairs]
    kl = float(np.mean([np.sum(pi * np.log(pi / qi)) for pi, qi in zip(p, q)]))  # KL(original || this)
    assert scores["tokens"] == 5 and scores["samples"] == 2
    assert scores["perplexity"] == pytest.approx(math.exp(nll), rel=1e-6)
    assert scores["accuracy"] == pytest.approx(top1, abs=1e-12)
    assert scores["agreement"] == pytest.approx(agreement, abs=1e-12)
    assert scores["mean_kl"] == pytest.approx(kl, rel=1e-5)

    alone = kind.score(reference, eval_set)
    own = -sum(_log_softmax(TABLE[a])[b] for a, b in pairs) / len(pairs)
    assert alone["perplexity"] == pytest.approx(math.exp(own), rel=1e-6)
    assert alone["agreement"] is None and alone["mean_kl"] is None


def test_the_reference_is_the_model_as_it_was_when_scored():
    """Passes change the model in place; the original's outputs must not follow them."""
    model = Bigram(torch.tensor(TABLE))
    kind = kind_of(model)
    eval_set = kind.eval_set(model, (1, 4), "text:x", split="test", samples=10,
                             data=GivenBlocks(torch.tensor(IDS), torch.tensor(MASK)))
    reference = kind.eval_outputs(model, eval_set, 8)
    before = kind.score(reference, eval_set)["perplexity"]
    with torch.no_grad():
        model.table.weight.mul_(3.0)
    assert kind.score(reference, eval_set)["perplexity"] == pytest.approx(before, rel=1e-12)
    changed = kind.score(kind.eval_outputs(model, eval_set, 8), eval_set, reference)
    assert changed["perplexity"] != pytest.approx(before, rel=1e-3) and changed["mean_kl"] > 0


# --- end to end: a tiny Llama folder with its own tokenizer, scored through the CLI --------------------------


def _split_of(name: str) -> str:
    share = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2 ** 64
    return "train" if share < 0.90 else "val" if share < 0.95 else "test"


def _tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def _llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama ``save_pretrained`` folder with its tokenizer, and a folder of text (every split has files)."""
    root = tmp_path_factory.mktemp("text-lm")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(40):
        lines = [" ".join(WORDS[(i * 5 + j * 3 + k) % len(WORDS)] for k in range(8)) for j in range(5)]
        (corpus / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = _tokenizer([p.read_text() for p in corpus.iterdir()], 300)
    folder = root / "lm"
    _llama(len(tokenizer)).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder, corpus


def _independent_blocks(tokenizer_folder: Path, corpus: Path, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test split by the documented rule, each file's ids plus <eos>, joined, cut, the tail padded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids: list[int] = []
    for path in sorted(corpus.iterdir()):
        if _split_of(path.name) == "test":
            ids += tokenizer.encode(path.read_text(), add_special_tokens=False) + [tokenizer.eos_token_id]
    rows = -(-len(ids) // seq_len)
    padded = torch.zeros(rows * seq_len, dtype=torch.long)
    padded[:len(ids)] = torch.tensor(ids)
    mask = (torch.arange(rows * seq_len) < len(ids)).long()
    return padded.view(rows, seq_len), mask.view(rows, seq_len)


def _independent_perplexity(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    picked = log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    scored = mask[:, 1:].bool()
    return math.exp(-float(picked[scored].mean()))


def test_the_reports_perplexity_equals_an_independent_evaluation_of_the_written_model(runner, text_lm, tmp_path):
    from transformers import LlamaForCausalLM

    folder, corpus = text_lm
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", str(folder), "--seq-len", "16", "--prune", "0.5", "--eval",
                                  f"text:{corpus}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    evaluation = json.loads((out / "report.json").read_text())["evaluation"]
    stages = {row["stage"]: row for row in evaluation["stages"]}
    assert list(stages) == ["original", "after structured_prune"]
    assert evaluation["unit"] == "sequences of 16 tokens"
    assert [c["key"] for c in evaluation["columns"]] == ["perplexity", "accuracy", "agreement", "mean_kl"]

    ids, mask = _independent_blocks(out, corpus, 16)
    assert evaluation["samples"] == len(ids) and stages["original"]["tokens"] == int(mask[:, 1:].sum())
    for stage, source in (("original", folder), ("after structured_prune", out)):
        model = LlamaForCausalLM.from_pretrained(str(source)).eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert stages[stage]["perplexity"] == pytest.approx(_independent_perplexity(logits, ids, mask), rel=1e-5)
    assert 0 < stages["after structured_prune"]["mean_kl"] and stages["original"]["mean_kl"] is None
    assert "| stage | perplexity | next-token top-1 | agreement with original | mean KL per token |" in (
        out / "report.md").read_text()


@pytest.mark.slow
def test_the_onnx_files_perplexity_equals_an_independent_onnx_runtime_evaluation(runner, text_lm, tmp_path):
    import onnxruntime as ort

    folder, corpus = text_lm
    out = tmp_path / "out"
    result = runner.invoke(main, ["optimize", str(folder), "--seq-len", "16", "--prune", "0.5", "--export", "onnx",
                                  "--no-latency", "--eval", f"text:{corpus}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    stages = {row["stage"]: row for row in json.loads((out / "report.json").read_text())["evaluation"]["stages"]}
    ids, mask = _independent_blocks(out, corpus, 16)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == ["input_ids", "attention_mask"]
    logits = torch.from_numpy(session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
    assert stages["model.onnx (ONNX Runtime)"]["perplexity"] == pytest.approx(
        _independent_perplexity(logits, ids, mask), rel=1e-5)


def _refused(runner, args: list[str], out: Path, fragment: str) -> None:
    result = runner.invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote files"


def test_bad_text_input_is_one_line_and_writes_nothing(runner, text_lm, tmp_path):
    folder, corpus = text_lm
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    base = ["optimize", str(folder), "--seq-len", "16", "--prune", "0.5", "--eval"]
    _refused(runner, [*base, f"text:{tmp_path / 'empty.txt'}"], tmp_path / "o1", "has no text")
    _refused(runner, [*base, f"text:{tmp_path / 'missing'}"], tmp_path / "o2", "no such file or folder")
    _refused(runner, [*base, "synthetic:8:3x32x32:10"], tmp_path / "o3", "a language model is scored on text")
    _refused(runner, ["optimize", str(folder), "--seq-len", "128", "--prune", "0.5", "--eval", f"text:{corpus}"],
             tmp_path / "o4", "beyond the model's 64 positions")


def test_a_model_without_its_tokenizer_or_with_a_larger_one_is_refused(runner, text_lm, tmp_path):
    folder, corpus = text_lm
    bare = tmp_path / "bare"
    _llama(300).save_pretrained(str(bare))
    base = ["--seq-len", "16", "--prune", "0.5", "--eval", f"text:{corpus}"]
    _refused(runner, ["optimize", str(bare), *base], tmp_path / "o1", "no tokenizer files")
    small = tmp_path / "small"
    _llama(200).save_pretrained(str(small))
    for path in folder.glob("tokenizer*"):
        (small / path.name).write_bytes(path.read_bytes())
    _refused(runner, ["optimize", str(small), *base], tmp_path / "o2",
             "has 300 tokens but the model's embedding has 200 rows")


def test_an_image_model_is_refused_text(runner, text_lm, tmp_path):
    _, corpus = text_lm
    _refused(runner, ["optimize", "torchvision:resnet18", "--input-shape", "1,3,32,32", "--prune", "0.3",
                      "--eval", f"text:{corpus}"], tmp_path / "o", "text for language models")
