"""A call in a fresh interpreter (:func:`optkit.analysis.fresh.call_fresh`): its JSON result, and a failure there
as one error line."""

from __future__ import annotations

import os

import pytest

from optkit.analysis.fresh import call_fresh
from optkit.core.errors import OptkitError


def test_a_function_runs_in_another_interpreter_and_returns_its_json_result():
    assert call_fresh("os:getpid") != os.getpid()
    assert call_fresh("json:dumps", obj={"b": [1, 2.5]}, sort_keys=True) == '{"b": [1, 2.5]}'


def test_a_failure_in_the_fresh_interpreter_is_one_error_line_naming_the_call():
    with pytest.raises(OptkitError, match=r"^a call in a fresh process failed \(json:no_such\): AttributeError"):
        call_fresh("json:no_such")
