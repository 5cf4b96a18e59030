"""Timing in a fresh interpreter: what a file runs at where it is deployed, away from this process's state.

A process that has pruned, checked and timed models runs an ONNX file slower
than a new one does: the shipped language model's FP32 decode step measured
2.6–2.7 ms in ``optkit optimize`` after its checks and 2.2–2.3 ms in a fresh
process (2 threads, every graph of the run about alike). A time that is
compared with an absolute budget (milliseconds, tokens/s) is therefore taken
relative to the same file timed in a new interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from optkit.core.errors import OptkitError

_RUN = ("import json, sys\n"
        "from optkit.analysis.fresh import call_here\n"
        "print(json.dumps(call_here(sys.argv[1], **json.loads(sys.argv[2]))))\n")


def call_here(function: str, **arguments: Any) -> Any:
    """``module:function(**arguments)`` in this process: what :func:`call_fresh` runs in the new one."""
    import importlib

    module, name = function.split(":")
    return getattr(importlib.import_module(module), name)(**arguments)


def call_fresh(function: str, **arguments: Any) -> Any:
    """``module:function(**arguments)`` run in a new Python interpreter (arguments and result as JSON).

    Raises:
        OptkitError: when the call fails there, with its last line of error output.
    """
    done = subprocess.run([sys.executable, "-c", _RUN, function, json.dumps(arguments)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        raise OptkitError(f"a call in a fresh process failed ({function}): {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])
