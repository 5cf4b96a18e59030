"""How this process runs: its place in a distributed launch (``torchrun``), shared by the CLI, workflow and passes."""
