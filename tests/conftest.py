"""Shared fixtures: small real models and a CLI runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

# tests/support holds importable user-style model classes (e.g. `usernets:BranchyNet`),
# as a user's own package would be.
SUPPORT_DIR = Path(__file__).parent / "support"
sys.path.insert(0, str(SUPPORT_DIR))

from usernets import BranchyNet  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def branchy() -> BranchyNet:
    return BranchyNet()
