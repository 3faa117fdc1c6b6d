import pathlib
import sys

# Test helpers that live next to the tests (not installed): make them importable.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "unit"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> pathlib.Path:
    return ROOT
