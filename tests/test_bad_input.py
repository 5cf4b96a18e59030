"""Bad input through the CLI: one clear ``Error:`` line, a non-zero exit, nothing half-written.

Every case runs against an output folder that already holds an earlier run's
results, and checks those files are byte-for-byte untouched (same content,
same mtime) and that no temporary or staging file is left beside them.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from optkit.cli import main
from optkit.core.registry import get_pass, list_passes

SMALL = ["--input-shape", "1,3,32,32"]
PRODUCED = ("channels.png", "model.pt", "recipe.toml", "report.json", "report.md")


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """An output folder holding a real earlier run."""
    out = tmp_path_factory.mktemp("earlier") / "out"
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", *SMALL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    if not folder.exists():
        return {}
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def check_clean_failure(args: list[str], out: Path, *, expect: list[str], exit_code: int = 1) -> str:
    """Run ``optkit ARGS``; check one Error line naming ``expect``, and ``out`` unchanged. Returns the line."""
    before = _snapshot(out)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    line = errors[0]
    for fragment in expect:
        assert fragment in line, line
    assert _snapshot(out) == before, "earlier outputs changed or stray files appeared"
    return line


def optimize(model: str, out: Path, *extra: str) -> list[str]:
    return ["optimize", model, *extra, "--out", str(out)]


def test_missing_file(tmp_path, earlier):
    check_clean_failure(optimize(str(tmp_path / "nope.pt"), earlier, "--prune", "0.3"), earlier,
                        expect=["no such file", "torchvision:NAME"])


def test_empty_file(tmp_path, earlier):
    (tmp_path / "empty.pt").touch()
    check_clean_failure(optimize(str(tmp_path / "empty.pt"), earlier, "--prune", "0.3"), earlier,
                        expect=["is empty", "not a PyTorch checkpoint"])


def test_text_file(tmp_path, earlier):
    (tmp_path / "notes.txt").write_text("these are not weights\n")
    check_clean_failure(optimize(str(tmp_path / "notes.txt"), earlier, "--prune", "0.3"), earlier,
                        expect=["not a PyTorch checkpoint"])


@pytest.fixture(scope="module")
def state_dict_file(tmp_path_factory) -> Path:
    import torchvision

    path = tmp_path_factory.mktemp("sd") / "weights.pt"
    torch.save(torchvision.models.squeezenet1_1(num_classes=10).state_dict(), path)
    return path


def test_state_dict_without_arch(state_dict_file, earlier):
    check_clean_failure(optimize(str(state_dict_file), earlier, "--prune", "0.3"), earlier,
                        expect=["holds only weights", "--arch torchvision:NAME"])


def test_state_dict_not_matching_arch(state_dict_file, earlier):
    check_clean_failure(optimize(str(state_dict_file), earlier, "--prune", "0.3", "--arch", "torchvision:squeezenet1_1"),
                        earlier, expect=["does not match --arch torchvision:squeezenet1_1", "--num-classes"])


@pytest.mark.parametrize("shape", ["1,1,32,32", "1,3,32", "1,3,8,8,8"])
def test_wrong_input_shape(shape, earlier):
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--prune", "0.3", "--input-shape", shape, "--force"),
                        earlier,
                        expect=[f"input shape {shape}", "--input-shape"])


@pytest.mark.parametrize("ratio", ["1", "-0.1", "nan", "inf", "0.3x"])
def test_bad_prune_ratio(ratio, earlier):
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--prune", ratio, *SMALL), earlier,
                        expect=["--prune"], exit_code=2)


def test_unknown_pass_in_recipe(tmp_path, earlier):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[pass]]\nname = "quantum_prune"\n')
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--recipe", str(recipe), *SMALL), earlier,
                        expect=["unknown pass 'quantum_prune'", "valid passes:", "structured_prune"])


def test_malformed_toml(tmp_path, earlier):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[pass]\nname = "structured_prune"\n')
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--recipe", str(recipe), *SMALL), earlier,
                        expect=["is not valid TOML"])


def _data_pass() -> str | None:
    import dataclasses

    for name in list_passes():
        if any(f.name == "data" for f in dataclasses.fields(get_pass(name))):
            return name
    return None


@pytest.mark.parametrize("spec, expect", [("nosuchset:/x", "unknown dataset spec"),
                                          ("imagefolder:{empty}", "has no class sub-folders")])
def test_bad_dataset_spec(tmp_path, earlier, spec, expect):
    name = _data_pass()
    if name is None:
        pytest.skip("no registered pass takes a dataset on this branch")
    (tmp_path / "empty").mkdir()
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[[pass]]\nname = "{name}"\ndata = "{spec.format(empty=tmp_path / "empty")}"\n')
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--recipe", str(recipe), *SMALL, "--force"), earlier,
                        expect=[expect])


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_unwritable_output_folder(tmp_path, where):
    """As root, chmod does not stop writes: use folders no one can create instead."""
    if where == "under-a-file":
        (tmp_path / "plain").write_text("x")
        out = tmp_path / "plain" / "out"
    else:
        out = Path("/proc/optkit-out")
    check_clean_failure(optimize("torchvision:resnet18", out, "--prune", "0.3", *SMALL), out,
                        expect=["cannot write to output folder", str(out)])
    assert not out.exists()


def test_output_is_a_file(tmp_path):
    (tmp_path / "out").write_text("keep me")
    check_clean_failure(optimize("torchvision:resnet18", tmp_path / "out", "--prune", "0.3", *SMALL), tmp_path,
                        expect=["is a file", "--out"], exit_code=2)
    assert (tmp_path / "out").read_text() == "keep me"


def test_full_disk_while_writing(earlier, monkeypatch):
    """ENOSPC in the middle of writing model.pt (simulated: half the bytes, then the error)."""
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as handle:
            handle.truncate(os.path.getsize(f) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    monkeypatch.setattr(torch, "save", save_until_full)
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--prune", "0.3", *SMALL, "--force"), earlier,
                        expect=["No space left on device", "free space or choose another --out"])


def test_existing_results_need_force(earlier):
    check_clean_failure(optimize("torchvision:resnet18", earlier, "--prune", "0.3", *SMALL), earlier,
                        expect=["already holds results", "--force"])


def test_force_replaces_results(earlier, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for name in PRODUCED:
        (out / name).write_bytes((earlier / name).read_bytes())
    (out / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, optimize("torchvision:resnet18", out, "--prune", "0.5", *SMALL, "--force"))
    assert result.exit_code == 0, result.output
    assert (out / "model.pt").read_bytes() != (earlier / "model.pt").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted([*PRODUCED, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"


def test_a_run_refused_before_it_writes_leaves_no_output_folder(tmp_path):
    out = tmp_path / "new" / "run"
    result = CliRunner().invoke(main, ["optimize", "torchvision:resnet18", "--prune", "0.3", "--no-latency",
                                       "--eval", f"imagefolder:{tmp_path / 'missing'}", "--out", str(out)])
    assert result.exit_code != 0 and "missing" in result.output
    assert not out.exists()
