"""The services that never compute (dispatcher, memory manager, monitor) start without torch: importing it costs
each of them over a second of CPU and ~250 MiB of memory, on every `kunserve up` and every supervised restart."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("service", ["dispatcher", "memory_manager", "monitor"])
def test_a_service_that_never_computes_does_not_import_torch(service):
    probe = f"import sys, kunserve.services.{service}.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=60)  # -P: not the cwd's tree
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"kunserve.services.{service} imports torch"
