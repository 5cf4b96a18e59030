"""Shared fixtures: small real models and a CLI runner."""

from __future__ import annotations

import socket
import sys
import urllib.request
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
def _private_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own optkit cache folder (confirmed architectures, measured tables), never ~/.cache."""
    monkeypatch.setenv("OPTKIT_CACHE_DIR", str(tmp_path_factory.mktemp("optkit-cache")))
    yield


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """The load average reads as a quiet machine's, and no spread counts as noise: what a report says of a timing
    must not depend on what else this machine runs during the tests (the tests of the load flag set their own
    figures and limit)."""
    from optkit.analysis import latency

    monkeypatch.setattr(latency, "load_average", lambda: 0.0)
    monkeypatch.setattr(latency, "NOISY_SPREAD", float("inf"))
    yield


@pytest.fixture(autouse=True)
def _short_report_timings(monkeypatch):
    """A report's ONNX Runtime timing of the original against the result takes 6 timed calls of each file instead
    of 30: the tests check what the report says of a timing, never the figure, and the 30 calls (on fresh sessions,
    twice for a model timed at a larger batch too) were the largest cost of the command-line tests."""
    from optkit import workflow

    monkeypatch.setitem(workflow.onnx_latency.__kwdefaults__, "repeats", 6)
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


LOOPBACK = {"localhost", "127.0.0.1", "::1"}


class NetworkAccess(AssertionError):
    """A test reached for the network; optkit must never download anything."""


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Fail any test that downloads weights or opens a connection beyond this machine.

    ``load_state_dict_from_url`` is patched where torch and torchvision hold it, since
    a cached checkpoint would otherwise load without touching a socket.
    """
    import torch.hub
    import torchvision.models._api

    def refuse(*args, **kwargs):
        raise NetworkAccess(f"network access attempted: {args[:1]}")

    def connect(address, *args, **kwargs):
        if address[0] not in LOOPBACK:
            refuse(address)
        return real_connect(address, *args, **kwargs)

    real_connect = socket.create_connection
    for owner in (torch.hub, torchvision.models._api):
        monkeypatch.setattr(owner, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(socket, "create_connection", connect)
    yield


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def branchy() -> BranchyNet:
    return BranchyNet()
