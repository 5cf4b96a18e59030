"""Model transforms. Each pass family lives in its own module; see :mod:`optkit.passes._registry`."""

from optkit.passes._registry import describe_passes, get_pass, list_passes
from optkit.passes.base import Pass, PassResult

__all__ = ["Pass", "PassResult", "describe_passes", "get_pass", "list_passes"]
