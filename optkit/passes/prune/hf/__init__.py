"""Hugging Face models pruned so that their stock classes still load them.

:func:`prune_transformer` removes attention heads (whole KV groups with
grouped-query attention), MLP and expert channels, and whole blocks, to the same
widths in every block, and updates the config to match.
"""

from optkit.passes.prune.hf.transformer import describes_transformer, prune_transformer

__all__ = ["describes_transformer", "prune_transformer"]
