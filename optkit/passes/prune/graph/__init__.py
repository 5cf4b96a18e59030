"""Channel pruning on the traced graph: the torch-pruning engine and what it needs around it.

``channels.prune_to`` is the entry every target calls; ``pruner`` builds torch-pruning's pruner,
``fallback`` verifies a pruned copy and holds what breaks it, ``groups`` lists the dependency
groups, and the rest teach torch-pruning about attention, patch merging, opaque blocks and
width attributes.
"""
