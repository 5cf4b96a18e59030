"""Reading and writing: model specs, slimmed checkpoints, atomic output files."""
