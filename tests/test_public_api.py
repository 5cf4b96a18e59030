"""The public API: every built-in pass class and the kinds API are importable from ``optkit``, lazily."""

from __future__ import annotations

import subprocess
import sys

import optkit
from optkit.core.registry import builtin_passes, get_pass


def test_every_builtin_pass_class_is_public():
    for name in builtin_passes():
        cls = get_pass(name)
        assert getattr(optkit, cls.__name__) is cls, name
        assert cls.__name__ in optkit.__all__
    for name in ("InsertBatchNorm", "FoldBatchNorm", "RecalibrateBatchNorm", "ExportOnnx", "Int8"):
        assert name in optkit.__all__


def test_kinds_and_core_names_are_public():
    from optkit.kinds import kind_of, register_kind

    assert optkit.kind_of is kind_of and optkit.register_kind is register_kind
    assert optkit.save_checkpoint.__name__ == "save" and "__version__" in optkit.__all__


def test_import_optkit_and_its_name_list_load_no_torch():
    code = "import sys, optkit; names = optkit.__all__; print('torch' in sys.modules, len(names) > 30)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
