"""Hostile and damaged files: no code from a file runs without --trust, and every refusal is one clear line.

Each hostile file, if unpickled, creates a marker file; the tests check that
the marker never appears. A positive control shows the same file does create
it once the user passes --trust, so the marker check can fail.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from optkit.io import checkpoint
from optkit.cli import main
from optkit.core.errors import ModelLoadError
from optkit.io.models import arch_spec, load, read_checkpoint

HOSTILE_MODULE = "_optkit_hostile_import"

# How each command that reads a model or checkpoint is invoked on a file.
# A command that takes a MODEL argument and is missing here fails
# test_every_model_command_is_covered, so new commands get these tests too.
# Keys are the command name, then a variant after a space.
COMMAND_ARGS = {
    "optimize": lambda path, out: ["optimize", str(path), "--prune", "0.3", "--input-shape", "1,3,32,32",
                                   "--out", str(out)],
    "export": lambda path, out: ["export", str(path), "--onnx", str(out / "model.onnx"), "--input-shape", "1,3,32,32"],
    "inspect": lambda path, out: ["inspect", str(path), "--input-shape", "1,3,32,32"],
    "bench": lambda path, out: ["bench", str(path), "--input-shape", "1,3,32,32", "--warmup", "0", "--repeats", "1"],
    "bench --compare": lambda path, out: ["bench", "--compare", "torchvision:resnet18", str(path),
                                          "--input-shape", "1,3,32,32", "--warmup", "0", "--repeats", "1"],
    "sensitivity": lambda path, out: ["sensitivity", str(path), "--data", "synthetic:8", "--input-shape", "1,3,32,32",
                                      "--out", str(out)],
    "finetune": lambda path, out: ["finetune", str(path), "--data", "synthetic:8", "--epochs", "1",
                                   "--input-shape", "1,3,32,32", "--out", str(out)],
    "finetune --teacher": lambda path, out: ["finetune", "torchvision:resnet18", "--data", "synthetic:8", "--epochs", "1",
                                             "--distill", "--teacher", str(path), "--input-shape", "1,3,32,32",
                                             "--out", str(out)],
}


class _OpenForWriting:
    """Unpickles as ``open(marker, "w")``: creating the marker file is the code running."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _ShellCommand:
    """Unpickles as ``os.system("touch marker")``, the classic hostile pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _raw_pickle(path: Path, marker: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(_OpenForWriting(marker), f, protocol=2)


def _nested_pickle(path: Path, marker: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump({"state_dict": {"conv.weight": torch.zeros(1), "payload": [_ShellCommand(marker)]}}, f, protocol=2)


def _zip_checkpoint(path: Path, marker: Path) -> None:
    torch.save({"model": {"fc.weight": torch.zeros(2, 2)}, "epoch": 3, "hook": _OpenForWriting(marker)}, path)


HOSTILE_FILES = {"raw-pickle": _raw_pickle, "nested-in-dict": _nested_pickle, "zip-checkpoint": _zip_checkpoint}


def _model_commands() -> list[str]:
    return sorted(name for name, command in main.commands.items()
                  if command.params and command.params[0].name == "model")


def _invoke(args: list[str]):
    return CliRunner().invoke(main, args)


def _error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert lines, "no output"
    assert "Traceback" not in result.output
    return lines[-1]


def test_every_model_command_is_covered():
    assert set(_model_commands()) <= {key.split()[0] for key in COMMAND_ARGS}, "add the new command to COMMAND_ARGS"


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
def test_hostile_pickle_is_refused_without_trust(tmp_path, command, kind):
    if command.split()[0] not in main.commands:
        pytest.skip(f"optkit has no {command.split()[0]} command on this branch")
    marker, path = tmp_path / "marker", tmp_path / f"{kind}.pt"
    HOSTILE_FILES[kind](path, marker)
    result = _invoke(COMMAND_ARGS[command](path, tmp_path / "out"))
    assert result.exit_code == 1
    line = _error_line(result)
    assert line.startswith("Error: ") and "--trust" in line
    assert not marker.exists(), "code from the file ran"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
def test_trust_does_unpickle_so_the_marker_check_can_fail(tmp_path, kind):
    marker, path = tmp_path / "marker", tmp_path / f"{kind}.pt"
    HOSTILE_FILES[kind](path, marker)
    try:
        read_checkpoint(path, trust=True)
    except ModelLoadError:
        pass  # the payload is not a model; what matters is that it ran
    assert marker.exists()


@pytest.fixture(scope="module")
def _good_checkpoint(tmp_path_factory) -> Path:
    loaded = load("torchvision:squeezenet1_1", num_classes=4)
    path = tmp_path_factory.mktemp("good") / "good.pt"
    checkpoint.save(loaded.model, path, loaded.arch)
    return path


@pytest.fixture
def good(tmp_path, _good_checkpoint) -> tuple[Path, dict]:
    """A fresh path to write a doctored checkpoint to, and a real slimmed checkpoint's payload."""
    return tmp_path / "doctored.pt", torch.load(_good_checkpoint, weights_only=True)


@pytest.mark.parametrize("qualified", ["subprocess.Popen", "os.system", "builtins.eval"])
def test_slimmed_checkpoint_naming_a_foreign_class_is_refused(tmp_path, good, qualified):
    path, payload = good
    payload["structure"]["classifier.1"] = {"type": qualified, "new": True, "attrs": {"args": "touch marker"}}
    torch.save(payload, path)
    result = _invoke(COMMAND_ARGS["optimize"](path, tmp_path / "out"))
    assert result.exit_code == 1
    line = _error_line(result)
    assert "--trust" in line and ("outside torch.nn/torchvision/optkit" in line or "not an nn.Module" in line)


def test_slimmed_checkpoint_cannot_import_an_unknown_module(tmp_path, good, monkeypatch):
    """Importing a module runs its top-level code: a file alone cannot make optkit import one."""
    marker = tmp_path / "imported"
    (tmp_path / f"{HOSTILE_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\nNet = torch.nn.Identity\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, HOSTILE_MODULE, raising=False)
    path, payload = good
    payload["arch"] = {"spec": f"{HOSTILE_MODULE}:Net", "kwargs": {}}
    payload["structure"], payload["state_dict"] = {}, {}
    torch.save(payload, path)

    result = _invoke(COMMAND_ARGS["optimize"](path, tmp_path / "out"))
    assert result.exit_code == 1
    line = _error_line(result)
    assert f"--arch {HOSTILE_MODULE}:Net" in line and "--trust" in line
    assert not marker.exists()

    # Naming the architecture yourself is consent to import it.
    assert isinstance(load(path, arch=f"{HOSTILE_MODULE}:Net").model, torch.nn.Identity)
    assert marker.exists()


@pytest.mark.parametrize("spec", ["subprocess:Popen", "os:system", "builtins:eval"])
def test_slimmed_checkpoint_arch_that_is_not_a_module_class_is_refused(tmp_path, good, spec):
    path, payload = good
    payload["arch"] = {"spec": spec, "kwargs": {"args": ["touch", str(tmp_path / "marker")]}}
    torch.save(payload, path)
    with pytest.raises(ModelLoadError, match="not an nn.Module class"):
        load(path)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("damage", ["no-arch", "structure-not-a-dict", "bad-path", "bad-attr"])
def test_malformed_slimmed_checkpoint_is_one_clear_error(tmp_path, good, damage):
    path, payload = good
    if damage == "no-arch":
        del payload["arch"]
    elif damage == "structure-not-a-dict":
        payload["structure"] = [1, 2]
    elif damage == "bad-path":
        payload["structure"]["no.such.layer"] = {"type": "torch.nn.modules.conv.Conv2d", "new": False, "attrs": {}}
    else:
        payload["structure"]["classifier.1"] = {"type": "torch.nn.modules.conv.Conv2d", "new": False,
                                                "attrs": {"__class__": 1}}
    torch.save(payload, path)
    result = _invoke(COMMAND_ARGS["optimize"](path, tmp_path / "out"))
    assert result.exit_code == 1
    line = _error_line(result)
    assert line.startswith("Error: ") and "malformed optkit checkpoint" in line and "unexpected" not in line


def test_truncated_checkpoint(tmp_path, _good_checkpoint):
    cut = tmp_path / "cut.pt"
    data = _good_checkpoint.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    result = _invoke(COMMAND_ARGS["optimize"](cut, tmp_path / "out"))
    assert result.exit_code == 1
    line = _error_line(result)
    assert "truncated or damaged" in line and "save it again" in line


def test_truncated_legacy_pickle(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"fc.weight": torch.zeros(4, 4)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ModelLoadError, match="not a readable PyTorch checkpoint"):
        read_checkpoint(path)


def _deflated_copy(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as original, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in original.infolist():
            out.writestr(info.filename, original.read(info.filename))


def test_zip_bomb_like_checkpoint_is_not_inflated(tmp_path):
    """torch.load inflates deflated members; a 64 MiB tensor of zeros deflates to ~65 KB."""
    plain, bomb = tmp_path / "plain.pt", tmp_path / "bomb.pt"
    torch.save({"w": torch.zeros(16 << 20)}, plain)
    _deflated_copy(plain, bomb)
    plain.unlink()
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(ModelLoadError, match="compressed archive that would expand"):
        read_checkpoint(bomb)
    result = _invoke(COMMAND_ARGS["optimize"](bomb, tmp_path / "out"))
    assert result.exit_code == 1 and "re-save the model with torch.save" in _error_line(result)


def test_zip_bomb_like_training_checkpoint_is_not_resumed(tmp_path):
    """``--resume`` reads its checkpoint through the same guard as models."""
    plain, out = tmp_path / "plain.pt", tmp_path / "out"
    out.mkdir()
    torch.save({"w": torch.zeros(16 << 20)}, plain)
    _deflated_copy(plain, out / "finetune.ckpt")
    result = _invoke(["finetune", "torchvision:resnet18", "--data", "synthetic:64", "--epochs", "1", "--batch-size", "8",
                      "--input-shape", "1,3,32,32", "--resume", "--out", str(out)])
    assert result.exit_code == 1
    assert "cannot resume" in _error_line(result) and "would expand" in _error_line(result)


def test_small_deflated_checkpoint_still_loads(tmp_path):
    """The expansion limit has slack: a small re-zipped checkpoint is not a bomb."""
    plain, small = tmp_path / "plain.pt", tmp_path / "small.pt"
    torch.save({"fc.weight": torch.ones(8, 8)}, plain)
    _deflated_copy(plain, small)
    assert torch.equal(read_checkpoint(small)["fc.weight"], torch.ones(8, 8))


@pytest.mark.parametrize("head", [b"PK\x03\x04", b"\x80\x02", b"\x00garbage"])
def test_large_garbage_file(tmp_path, head):
    """A 16 MiB file of random bytes fails with one line."""
    path = tmp_path / "garbage.pt"
    with open(path, "wb") as f:
        f.write(head + os.urandom(16 << 20))
    result = _invoke(COMMAND_ARGS["optimize"](path, tmp_path / "out"))
    assert result.exit_code == 1
    assert _error_line(result).startswith(f"Error: {path}")


def test_huge_sparse_file(tmp_path):
    """An 8 GiB (sparse) file is never read into memory: the archive check fails on its missing directory."""
    path = tmp_path / "huge.pt"
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(8 << 30)
    with pytest.raises(ModelLoadError, match="truncated or damaged"):
        read_checkpoint(path)


def test_directory_passed_as_a_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    result = _invoke(COMMAND_ARGS["optimize"](tmp_path / "ckpt", tmp_path / "out"))
    assert result.exit_code == 1
    assert "is a directory; give the checkpoint file inside it" in _error_line(result)


def test_fifo_passed_as_a_file_does_not_hang(tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="not a regular file"):
        read_checkpoint(fifo)


def test_hostile_training_checkpoint_is_not_resumed(tmp_path):
    """``--resume`` reads finetune.ckpt from --out: a planted hostile one is refused, its code never runs."""
    if "finetune" not in main.commands:
        pytest.skip("optkit has no finetune command on this branch")
    marker, out = tmp_path / "marker", tmp_path / "out"
    out.mkdir()
    _zip_checkpoint(out / "finetune.ckpt", marker)
    result = _invoke(["finetune", "torchvision:resnet18", "--data", "synthetic:64", "--epochs", "1", "--batch-size", "8",
                      "--input-shape", "1,3,32,32", "--resume", "--out", str(out)])
    assert result.exit_code == 1
    assert "finetune.ckpt" in _error_line(result)
    assert not marker.exists()
