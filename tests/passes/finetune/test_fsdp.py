"""FSDP2 fine-tuning: two CPU processes (gloo) distil a tiny Llama with the losses of one process; the rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from optkit.cli import main
from optkit.core.errors import TrainingError
from optkit.data.text import PYTHON_DOCS_DIR, next_token_dataset
from optkit.passes.finetune import loop
from optkit.passes.finetune.loop import fit
from optkit.passes.finetune.passes import FineTune
from optkit.runtime import fsdp

ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
#: 8 training blocks: one step per epoch, of 8 blocks in one process or 4 on each of two.
TRAIN_BLOCKS, EPOCHS = 8, 4
#: Per-step losses of the two runs agree to this relative difference. Both train in fp32 on the CPU from the same
#: weights on the same blocks; they differ only in the order floating-point sums are taken (each rank's loss and
#: gradient is the mean over its 4 blocks, and FSDP's reduce-scatter averages the two), which moves fp32 results
#: by about 1e-7 relative per step and AdamW carries over 4 steps; a wrong gradient scale or a rank on other data
#: shows up at 1e-2 or more.
LOSS_RTOL = 1e-4


def _student() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _teacher() -> LlamaForCausalLM:
    """A wider random Llama (MLP 256) to distil from."""
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**CONFIG | {"intermediate_size": 256}))


def _blocks(count: int, seed: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (count, 16), generator=torch.Generator().manual_seed(seed))
    return next_token_dataset(ids, torch.ones_like(ids))


def _settings(batch_size: int, **changes) -> FineTune:
    return FineTune(**{"data": "text", "epochs": EPOCHS, "batch_size": batch_size, "lr": 1e-3, "warmup": 0.25,
                       "amp": "off", "distill": True, "num_workers": 0, "device": "cpu", "seed": 0, **changes})


def _run(batch_size: int, checkpoint: str, **changes):
    # 5 validation blocks: an odd count, so the second rank's share is padded.
    return fit(_student(), _blocks(TRAIN_BLOCKS, 0), _blocks(5, 1), _settings(batch_size, checkpoint=checkpoint,
               **changes), teacher=_teacher(), progress=False)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        checkpoint = os.path.join(out_dir, "fsdp.ckpt")
        result = _run(TRAIN_BLOCKS // world, checkpoint, sharding="fsdp")
        # Resuming the finished run loads the gathered checkpoint back into the shards and keeps its best weights.
        resumed = _run(TRAIN_BLOCKS // world, checkpoint, sharding="fsdp", resume=True)
        torch.save({"history": result.history, "weights": result.model.state_dict(),
                    "resumed": resumed.model.state_dict(), "resumed_line": resumed.resumed},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp_distillation_on_two_processes_matches_one(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    single = _run(TRAIN_BLOCKS, str(tmp_path / "single.ckpt"))

    losses = [[epoch["train_loss"] for epoch in r["history"]] for r in ranks]
    expected = [epoch["train_loss"] for epoch in single.history]
    assert losses[0] == losses[1] and len(expected) == EPOCHS
    assert losses[0] == pytest.approx(expected, rel=LOSS_RTOL), (losses[0], expected)
    assert [e["val_loss"] for e in ranks[0]["history"]] == pytest.approx(
        [e["val_loss"] for e in single.history], rel=LOSS_RTOL)
    assert expected[-1] < expected[0]

    # Every rank gets the trained weights back whole, in the plain model, as one process would.
    start = _student().state_dict()
    for key, value in single.model.state_dict().items():
        assert torch.equal(ranks[0]["weights"][key], ranks[1]["weights"][key]), key
        assert torch.equal(ranks[0]["resumed"][key], ranks[0]["weights"][key]), key
        torch.testing.assert_close(ranks[0]["weights"][key], value, rtol=1e-4, atol=1e-5)
    assert not torch.equal(start["model.layers.0.mlp.up_proj.weight"], single.model.model.layers[0].mlp.up_proj.weight)
    assert ranks[0]["resumed_line"].startswith("resumed from") and "finished all 4 steps" in ranks[0]["resumed_line"]

    # Rank 0 wrote the checkpoint with the state dict gathered whole: it loads into the stock class.
    saved = torch.load(tmp_path / "fsdp.ckpt", weights_only=True)
    assert saved["settings"]["sharding"] == "fsdp" and saved["settings"]["world_size"] == 2
    stock = LlamaForCausalLM(LlamaConfig(**CONFIG))
    stock.load_state_dict(saved["model"], strict=True)
    reference = torch.load(tmp_path / "single.ckpt", weights_only=True)
    for key, value in reference["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=1e-4, atol=1e-5)


def _on(monkeypatch, world: int, memory_gib: float) -> torch.device:
    monkeypatch.setattr(fsdp, "rank_and_world", lambda: (0, world))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=memory_gib * 2**30))
    return torch.device("cuda:0")


def test_auto_shards_when_training_states_exceed_half_the_gpu(monkeypatch):
    model, teacher = nn.Linear(1024, 1024), nn.Linear(1024, 1024)  # 4 MiB of fp32 parameters each
    # 4 x 4 MiB + 4 MiB = 20 MiB of training states against half of 36 MiB, then of 48 MiB; 16 MiB without the teacher.
    assert fsdp.resolve_sharding("auto", model, teacher, _on(monkeypatch, 2, 36 / 1024)) == "fsdp"
    assert fsdp.resolve_sharding("auto", model, teacher, _on(monkeypatch, 2, 48 / 1024)) == "ddp"
    assert fsdp.resolve_sharding("auto", model, None, _on(monkeypatch, 2, 36 / 1024)) == "ddp"
    assert fsdp.resolve_sharding("auto", model, teacher, torch.device("cpu")) == "ddp"
    assert fsdp.resolve_sharding("fsdp", model, teacher, torch.device("cpu")) == "fsdp"
    # One process trains the model as it is, whatever the setting.
    assert fsdp.resolve_sharding("fsdp", model, teacher, _on(monkeypatch, 1, 1)) == "ddp"


def test_blocks_are_the_hf_no_split_modules_or_the_longest_module_list():
    llama = _student()
    assert fsdp.transformer_blocks(llama) == list(llama.model.layers)
    plain = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]))
    assert fsdp.transformer_blocks(plain) == list(plain[1])
    assert fsdp.transformer_blocks(nn.Linear(4, 4)) == []


def _through(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def test_checkpointed_blocks_give_the_same_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]))
    run = lambda m, x: _through(m[0], x)  # noqa: E731
    x = torch.randn(4, 8)
    run(model, x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    fsdp.checkpoint_blocks(model, fsdp.transformer_blocks(model))
    run(model, x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))


def test_in_one_process_the_setting_is_recorded_and_trains_the_model_as_it_is(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["finetune", "torchvision:resnet18", "--data", "synthetic:16", "--epochs", "1",
                                       "--batch-size", "8", "--input-shape", "1,3,32,32", "--workers", "0",
                                       "--sharding", "fsdp", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert 'sharding = "fsdp"' in (out / "recipe.toml").read_text(encoding="utf-8")
    assert torch.load(out / "finetune.ckpt", weights_only=True)["settings"]["sharding"] == "ddp"


def test_fsdp_refuses_fp16(monkeypatch):
    monkeypatch.setattr(loop, "resolve_sharding", lambda *args: "fsdp")
    with pytest.raises(TrainingError, match="FSDP trains in bf16 or fp32"):
        fit(_student(), _blocks(8, 0), None, _settings(8, amp="fp16"), progress=False)


@pytest.mark.slow
@pytest.mark.skipif(not Path(PYTHON_DOCS_DIR).is_dir(), reason="python3.11-doc is not installed (make data)")
def test_torchrun_prune_and_distill_with_fsdp_writes_a_stock_folder(tmp_path):
    """The documented command (docs/techniques/finetune.md) on two CPU processes, the shipped model, a few steps."""
    out = tmp_path / "out"
    args = ["optimize", str(ROOT / "optkit" / "demo" / "python_docs_lm"), "--prune", "0.3", "--finetune", "text",
            "--distill", "--sharding", "fsdp", "--epochs", "1", "--max-train-samples", "16", "--batch-size", "4",
            "--seq-len", "64", "--workers", "0", "--no-latency", "--out", str(out)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "optkit", *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Wrote config.json") == 1 and "sharded with FSDP over 2 processes" in done.stderr
    assert torch.load(out / "finetune.ckpt", weights_only=True)["settings"]["sharding"] == "fsdp"
    AutoModelForCausalLM.from_pretrained(out)
