"""Distributed fine-tuning: two CPU processes (gloo) end with identical weights; each torchrun worker gets its GPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

from optkit.core.errors import OptkitError
from optkit.passes.device.passes import resolve_device
from optkit.runtime.distributed import init_distributed, is_main_process
from optkit.passes.finetune.loop import fit
from optkit.passes.finetune.passes import FineTune

ROOT = Path(__file__).resolve().parents[3]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 6, 6, generator=g)
    return TensorDataset(x, (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(rank)  # different starting weights: DDP must broadcast rank 0's
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                              nn.Linear(144, 3))
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(out_dir, "initial.pt"))
        settings = FineTune(data="synthetic:64:1x6x6:3", epochs=2, batch_size=8, lr=1e-2, num_workers=0,
                            device="cpu", checkpoint=os.path.join(out_dir, "train.ckpt"))
        result = fit(model, _data(), _data(), settings, progress=False)
        torch.save({"weights": model.state_dict(), "history": result.history,
                    "joined": init_distributed(), "main": is_main_process()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_cpu_processes_end_with_identical_weights(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    initial = torch.load(tmp_path / "initial.pt", weights_only=True)
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
    assert not torch.allclose(ranks[0]["weights"]["4.weight"], initial["4.weight"])
    assert [r["joined"] for r in ranks] == [(0, 2), (1, 2)] and [r["main"] for r in ranks] == [True, False]
    # Both ranks report the same all-reduced figures, and only one checkpoint was written, for 2 processes.
    assert ranks[0]["history"] == ranks[1]["history"]
    saved = torch.load(tmp_path / "train.ckpt", weights_only=True)
    assert saved["settings"]["world_size"] == 2
    # 64 samples over 2 ranks in batches of 8: 4 steps per epoch.
    assert saved["state"]["step"] == 8


def test_outside_torchrun_there_is_one_main_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() == (0, 1)
    assert is_main_process()
    monkeypatch.setenv("RANK", "1")
    assert not is_main_process()


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("local_rank, expected", [(None, "cuda:0"), ("0", "cuda:0"), ("1", "cuda:1")])
def test_auto_device_is_this_workers_gpu(two_gpus, monkeypatch, local_rank, expected):
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device("auto") == torch.device(expected)
    assert resolve_device(None) == torch.device(expected)


def test_more_workers_than_gpus_is_a_clear_error(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(OptkitError, match="only 2 CUDA GPU"):
        resolve_device("auto")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_prune_and_finetune_writes_once(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", "-m", "optkit", "optimize", "torchvision:mobilenet_v3_small",
               "--num-classes", "4", "--prune", "0.3", "--finetune", "synthetic:64:3x32x32:4", "--epochs", "1",
               "--batch-size", "8", "--workers", "0", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["finetune.ckpt", "model.pt", "recipe.toml", "report.json",
                                                      "report.md"]
    assert done.stdout.count("Wrote model.pt") == 1
