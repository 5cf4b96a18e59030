"""Killing ``optkit optimize`` (SIGKILL: no cleanup code runs) never leaves a corrupt output.

Deterministic kill points come from a small driver that patches one function
to SIGKILL its own process at that moment (inside pruning, halfway through
writing model.pt, with the temporary file complete but not moved, between
moving one finished file and the next). Random kill points come from real
``python -m optkit`` runs killed after seeded random delays.

Afterwards every visible file in the output folder must be complete (model.pt
loads and runs, the reports parse), leftovers may only be hidden staging
folders, and the next run removes those and succeeds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from optkit.io.models import load
from optkit.io.outputs import STAGING_PREFIX, remove_stale_staging
from optkit.workflow import OUTPUT_FILES

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["optimize", "torchvision:resnet18", "--prune", "0.3", "--input-shape", "1,3,32,32"]

DRIVER = r"""
import io, os, signal, sys
point, args = sys.argv[1], sys.argv[2:]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "prune":
    import torch_pruning
    torch_pruning.pruner.BasePruner.step = lambda self, *a, **k: die()
elif point == "torch-save":
    import torch
    real_save = torch.save
    def half_save(obj, f, *a, **k):
        buffer = io.BytesIO()
        real_save(obj, buffer, *a, **k)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: buffer.tell() // 2])
            out.flush()
            os.fsync(out.fileno())
        die()
    torch.save = half_save
elif point.startswith("replace-"):
    # os.replace call 1 moves the temporary model.pt into the staging folder;
    # calls 2.. publish the staged files into the output folder.
    limit, calls, real_replace = int(point.split("-")[1]), [], os.replace
    def counting_replace(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == limit:
            die()
        return real_replace(src, dst, *a, **k)
    os.replace = counting_replace

from optkit.cli import main
main(args)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run_killed_at(point: str, out: Path, *extra: str) -> int:
    done = subprocess.run([sys.executable, "-c", DRIVER, point, *ARGS, "--out", str(out), *extra],
                          env=_env(), capture_output=True, text=True, timeout=600)
    return done.returncode


def check_outputs_intact(out: Path, also: tuple[str, ...] = (), classes: int = 1000) -> set[str]:
    """Every visible file is a complete output (or one of ``also``); returns the output names present."""
    visible = {p.name for p in out.iterdir() if not p.name.startswith(".")} if out.exists() else set()
    assert visible <= set(OUTPUT_FILES) | set(also), visible
    visible -= set(also)
    hidden = [p for p in out.iterdir() if p.name.startswith(".")] if out.exists() else []
    assert all(p.is_dir() and p.name.startswith(STAGING_PREFIX) for p in hidden), hidden
    if "model.pt" in visible:
        model = load(out / "model.pt").model.eval()
        with torch.no_grad():
            assert model(torch.randn(1, 3, 32, 32)).shape == (1, classes)
    if "report.json" in visible:
        json.loads((out / "report.json").read_text())
    if "recipe.toml" in visible:
        tomllib.loads((out / "recipe.toml").read_text())
    return visible


def _rerun_cleans_up(out: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "optkit", *ARGS, "--out", str(out), "--force"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert check_outputs_intact(out) == set(OUTPUT_FILES)
    assert not list(out.glob(f"{STAGING_PREFIX}*")), "stale staging folders were not removed"


@pytest.mark.parametrize("point, published, staged", [
    ("prune", set(), 0),
    ("torch-save", set(), 1),
    ("replace-1", set(), 1),
    ("replace-4", {"channels.png", "model.pt"}, 1),
])
def test_sigkill_at_a_fixed_point(tmp_path, point, published, staged):
    out = tmp_path / "out"
    assert _run_killed_at(point, out) == -signal.SIGKILL
    assert check_outputs_intact(out) == published
    assert len(list(out.glob(f"{STAGING_PREFIX}*"))) == staged
    if point == "replace-1":
        _rerun_cleans_up(out)


@pytest.mark.slow  # 20 s of killed runs; the fixed points above cover each stage
def test_sigkill_at_random_moments_over_earlier_results(tmp_path):
    """Kill a --force rerun at seeded random moments: each file stays a complete old or new version."""
    out = tmp_path / "out"
    start = time.perf_counter()
    first = subprocess.run([sys.executable, "-m", "optkit", *ARGS, "--out", str(out)], env=_env(),
                           capture_output=True, text=True, timeout=600)
    duration = time.perf_counter() - start
    assert first.returncode == 0, first.stderr
    rng = random.Random(9)
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "optkit", *ARGS, "--prune", "0.5", "--out", str(out), "--force"],
                                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.0) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert check_outputs_intact(out) == set(OUTPUT_FILES)


def test_staging_of_a_live_process_is_kept(tmp_path):
    live = tmp_path / f"{STAGING_PREFIX}{os.getpid()}-abc"
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    dead = tmp_path / f"{STAGING_PREFIX}{dead_pid}-abc"
    foreign = tmp_path / f"{STAGING_PREFIX}notapid"
    for folder in (live, dead, foreign):
        folder.mkdir()
    assert remove_stale_staging(tmp_path) == [dead]
    assert live.exists() and foreign.exists() and not dead.exists()


def test_an_interrupt_between_a_folders_creation_and_its_cleanup_leaves_nothing(tmp_path):
    """A signal can land after ``mkdtemp`` made a staging or scratch folder and before the block that removes it
    starts: the run's outermost guard removes this process's folders (and another process's stay)."""
    from optkit.io.outputs import removed_if_left_empty

    out = tmp_path / "out"
    out.mkdir()
    other = out / f"{STAGING_PREFIX}1-original-abc"
    other.mkdir()
    with pytest.raises(KeyboardInterrupt), removed_if_left_empty(out, created=True):
        (out / f"{STAGING_PREFIX}{os.getpid()}-original-xyz").mkdir()
        raise KeyboardInterrupt
    assert list(out.iterdir()) == [other]
    other.rmdir()
    with pytest.raises(KeyboardInterrupt), removed_if_left_empty(out, created=True):
        (out / f"{STAGING_PREFIX}{os.getpid()}-abc").mkdir()
        raise KeyboardInterrupt
    assert not out.exists()


def _require_command(name: str) -> None:
    from optkit.cli import main

    if name not in main.commands:
        pytest.skip(f"optkit has no {name} command on this branch")


@pytest.mark.slow  # 20 s; the fixed-point kills above cover publishing a file
def test_sigkill_during_export_leaves_no_broken_onnx(tmp_path):
    """Kill ``optkit export --force`` over a verified file at seeded random moments: the file stays valid."""
    _require_command("export")
    onnx = pytest.importorskip("onnx")
    target = tmp_path / "model.onnx"
    args = [sys.executable, "-m", "optkit", "export", "torchvision:resnet18", "--onnx", str(target),
            "--input-shape", "1,3,32,32"]
    start = time.perf_counter()
    first = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=600)
    duration = time.perf_counter() - start
    assert first.returncode == 0, first.stderr
    rng = random.Random(7)
    for _ in range(2):
        proc = subprocess.Popen([*args, "--force"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.0) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        onnx.checker.check_model(str(target))
    visible = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert visible == {"model.onnx"}, visible


@pytest.mark.slow  # 25 s; tests/passes/finetune/test_checkpoints.py resumes after a kill by default
def test_sigkill_during_finetune_then_resume(tmp_path):
    """Kill a fine-tune right after its first training checkpoint; --resume continues and finishes."""
    _require_command("finetune")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "optkit", "finetune", "torchvision:resnet18", "--data", "synthetic:96:3x32x32:4",
            "--num-classes", "4", "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "2",
            "--out", str(out)]
    log = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=log)
    ckpt = out / "finetune.ckpt"
    deadline = time.monotonic() + 600
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    assert ckpt.exists(), (tmp_path / "stderr.txt").read_text()[-2000:]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state"]
    assert state, "the checkpoint records where training stopped"
    assert check_outputs_intact(out, also=("finetune.ckpt",)) == set()
    resumed = subprocess.run([*args, "--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert check_outputs_intact(out, also=("finetune.ckpt",), classes=4) == set(OUTPUT_FILES)


def _scratch_of_a_run_killed_by(sig: signal.Signals, out: Path, tmp: Path) -> subprocess.CompletedProcess:
    """Start ``optimize --export onnx`` with its own temporary folder ``tmp``, and send it ``sig`` once it is
    working in its scratch folder (the original model's ONNX export, for the latency comparison)."""
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "optkit", *ARGS, "--export", "onnx", "--out", str(out)],
                            env={**_env(), "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if list(out.glob(f"{STAGING_PREFIX}*original*")) or list(tmp.glob("optkit-original-*")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it exported the original model"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("sig, code", [
    pytest.param(signal.SIGTERM, 128 + signal.SIGTERM, id="SIGTERM"),
    pytest.param(signal.SIGINT, 130, id="SIGINT", marks=pytest.mark.slow),  # Ctrl-C always unwound; 25 s
])
def test_a_run_stopped_by_a_signal_leaves_nothing_behind(tmp_path, sig, code):
    """Stopped while it works on the original model's files, the run unwinds: no scratch folder is left in the
    temporary folder or the output folder, and the output folder it created is gone."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    done = _scratch_of_a_run_killed_by(sig, out, tmp)
    assert done.returncode == code, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith("no output was written")
    assert list(tmp.iterdir()) == []
    assert not out.exists(), list(out.iterdir())


def test_a_run_killed_outright_leaves_its_scratch_only_where_the_next_run_removes_it(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    done = _scratch_of_a_run_killed_by(signal.SIGKILL, out, tmp)
    assert done.returncode == -signal.SIGKILL
    assert not list(tmp.glob("optkit-*")), list(tmp.iterdir())
    left = list(out.glob(f"{STAGING_PREFIX}*"))
    assert check_outputs_intact(out) == set() and left
    assert sorted(remove_stale_staging(out)) == sorted(left)  # what every next run does first
    assert list(out.iterdir()) == []
