"""Makes ``doclines`` (the documented-lines extractor these tests share) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
