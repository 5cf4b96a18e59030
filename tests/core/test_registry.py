import dataclasses
import subprocess
import sys

import pytest

from optkit.passes import describe_passes, get_pass, list_passes
from optkit.core.contract import Pass


def test_every_registered_name_resolves_to_its_pass_class():
    names = list_passes()
    assert {"structured_prune", "l1_unstructured"} <= set(names)
    for name in names:
        cls = get_pass(name)
        assert issubclass(cls, Pass) and dataclasses.is_dataclass(cls)
        assert cls.name == name
        assert cls.__dataclass_params__.frozen


def test_descriptions_are_the_first_docstring_line():
    descriptions = describe_passes()
    for name, text in descriptions.items():
        assert text and text == get_pass(name).__doc__.strip().splitlines()[0]


def test_list_passes_filters_with_fnmatch():
    assert list_passes("*prune*") == ["structured_prune"]
    assert list_passes("nothing*") == []


def test_unknown_pass_lists_the_valid_names():
    with pytest.raises(KeyError, match="valid passes: .*structured_prune"):
        get_pass("structured_prun")


def test_listing_and_help_do_not_import_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from optkit.cli import main\n"
        "r1 = CliRunner().invoke(main, ['--help'])\n"
        "r2 = CliRunner().invoke(main, ['passes'])\n"
        "assert r1.exit_code == 0 and r2.exit_code == 0, (r1.output, r2.output)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
