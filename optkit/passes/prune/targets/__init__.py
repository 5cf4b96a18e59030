"""What a structured prune aims at: ratio, MACs/parameter, latency, heads/MLP mix and sensitivity targets.

``configs`` holds the typed target configs and the handler registry; one module per handler
(``ratio``, ``latency``, ``mix``, ``sensitivity``), and what they share: the greedy allocation
under a cost budget, the per-layer latency table, and the measured sensitivity curves.
"""
