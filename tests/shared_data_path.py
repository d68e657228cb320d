"""Where the project's shared datasets are: ``../shared/data`` beside the checkout (CI has it; a
user's clone does not, and every test that needs it skips there).

``CLIPKIT_TESTS_SHARED_DATA=none python -m pytest`` runs the suite as in a user's clone, so a test
whose assertions only hold with the shared photos shows up without making a second clone (one did:
tests/test_eval_preprocess.py's random model gave the noise images alone one class). Any other value
is the folder to use instead. Imported by tests/conftest.py and by the test modules that look at the
folder themselves (under the whole suite ``conftest`` may name tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The variable that overrides the folder ("none": as if absent).
VARIABLE = "CLIPKIT_TESTS_SHARED_DATA"


def shared_data_dir() -> Path:
    """The shared data folder to use (it may not exist: callers check ``is_dir()`` or skip)."""
    chosen = os.environ.get(VARIABLE, "")
    if chosen.lower() == "none":
        return Path(__file__).resolve().parent / "no-shared-data-in-this-run"
    if chosen:
        return Path(chosen)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


SHARED_DATA = shared_data_dir()
