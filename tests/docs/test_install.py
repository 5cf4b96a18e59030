"""A quiet install: building optkit prints no deprecation banner from the build backend (#31)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from doclines import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_license_is_an_spdx_string_and_the_build_backend_reads_it():
    """A license table makes setuptools>=77 print a deprecation banner on every install; a string needs >=77."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    setuptools = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert len(setuptools) == 1
    floor = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools[0])
    assert floor and int(floor[1]) >= 77, f"{setuptools[0]} admits setuptools that cannot read an SPDX license string"


@pytest.mark.slow
def test_building_the_wheel_prints_no_deprecation_warning(tmp_path):
    """What `make demo` and `make test` do first: pip builds optkit (in isolation, with the build requirement)."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    output = built.stdout + built.stderr
    assert "deprecated" not in output.lower(), output[-3000:]
    assert list(tmp_path.glob("optkit-*.whl"))


@pytest.mark.slow
def test_make_demo_in_a_fresh_clone_prints_no_build_warning(tmp_path):
    """A fresh clone, its own .venv: `make demo` sets everything up and says nothing of deprecation."""
    clone = tmp_path / "optkit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    demo = subprocess.run(["make", "demo"], cwd=clone, capture_output=True, text=True, timeout=3000)
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output[-3000:]
    assert "deprecat" not in output.lower(), output[-3000:]
    assert "BuildBackendWarning" not in output, output[-3000:]
    assert (clone / "runs" / "demo" / "model.pt").is_file()
