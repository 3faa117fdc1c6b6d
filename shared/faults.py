"""Fault injection for the fault-tolerance tests: crash a process at a named point, as a real crash would.

``KUNSERVE_FAULT=<point>:<who>`` makes the process whose identity is ``who`` (a worker id, or
``memory-manager``) exit at once with code 70 when it reaches ``fault_point(<point>, who)``: no cleanup, no
goodbye to its peers, no reply to the RPC in progress. Unset (always, outside tests) it costs one lookup.
"""

from __future__ import annotations

import os

from kunserve.shared.log import get_logger

FAULT_ENV = "KUNSERVE_FAULT"
FAULT_EXIT_CODE = 70


def fault_armed(point: str, who: str) -> bool:
    return os.environ.get(FAULT_ENV) == f"{point}:{who}"


def fault_point(point: str, who: str) -> None:
    if fault_armed(point, who):
        get_logger().error("fault_injected", fault=point)
        os._exit(FAULT_EXIT_CODE)
