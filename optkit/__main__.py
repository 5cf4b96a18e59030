"""``python -m optkit`` runs the CLI (also what ``torchrun -m optkit`` uses)."""

from optkit.cli import main

main()
