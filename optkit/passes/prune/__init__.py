"""Pruning: L1 unstructured (zeroes weights) and structured (removes channels with torch-pruning)."""

from optkit.passes.prune.passes import L1Unstructured, StructuredPrune, skipped_layers

__all__ = ["L1Unstructured", "StructuredPrune", "skipped_layers"]
