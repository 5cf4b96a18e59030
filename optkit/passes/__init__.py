"""Model transforms, one family per folder: each folder's ``passes.py`` holds its pass classes, the rest is their engine.

Registered names are listed by :func:`optkit.core.registry.list_passes` (``optkit passes``).
"""

from optkit.core.contract import Pass, PassResult
from optkit.core.registry import describe_passes, get_pass, list_passes

__all__ = ["Pass", "PassResult", "describe_passes", "get_pass", "list_passes"]
