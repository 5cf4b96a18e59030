"""``optkit.core`` and each of its modules import without torch, so the CLI can list passes and print help instantly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "optkit" / "core"


def _core_modules() -> list[str]:
    names = sorted(f"optkit.core.{path.stem}" for path in CORE.glob("*.py") if path.stem != "__init__")
    return ["optkit.core", *names]


def _torch_loaded_by(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip() == "True"


@pytest.mark.parametrize("module", _core_modules())
def test_importing_core_loads_no_torch(module):
    assert not _torch_loaded_by(module)


def test_the_check_sees_torch_when_it_is_loaded():
    assert _torch_loaded_by("torch.nn")
