import pathlib
import sys

# Test helpers that live next to the tests (not installed): make them importable.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "unit"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_compute_thread() -> None:
    """Every test starts with this process computing on one thread (an engine loop a test runs may set its own). The
    test process's forwards are small, and on two threads each op waits at the OpenMP barrier whenever the cluster
    processes a test started hold the cores: a 200-token reference forward measured 1.25 s on two threads against
    0.027 s on one, beside a busy cluster."""
    torch.set_num_threads(1)


@pytest.fixture
def repo_root() -> pathlib.Path:
    return ROOT
