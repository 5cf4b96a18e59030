"""The pass contract, the registry, pipelines, recipes and errors: what every other part builds on.

Nothing here imports torch at import time, so the CLI can list passes and print help instantly.
"""
