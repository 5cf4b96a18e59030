"""Makes ``tinytrain`` (tiny data, model and settings shared by these tests and their subprocesses) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
