"""Test-wide settings: IR invariants are verified after every pass."""

import os
import sys
from pathlib import Path

os.environ.setdefault("ZEROCC_VERIFY", "1")
# The tests import their helper modules (models, multirank) and the example GPT by name.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "gpt"))
