"""Fault injection for the fault-tolerance tests: crash a process at a named point, as a real crash would.

``KUNSERVE_FAULT=<point>:<who>`` makes the process whose identity is ``who`` (a worker id, or
``memory-manager``) exit at once with code 70 when it reaches ``fault_point(<point>, who)``: no cleanup, no
goodbye to its peers, no reply to the RPC in progress. Unset (always, outside tests) it costs one lookup.

``KUNSERVE_DELAY=<point>:<who>:<seconds>`` makes ``fault_delay(<point>, who)`` return that many seconds (0 when
unset): the caller waits that long there, as a slow link or a loaded peer would make it.
"""

from __future__ import annotations

import os

from kunserve.shared.log import get_logger

FAULT_ENV = "KUNSERVE_FAULT"
DELAY_ENV = "KUNSERVE_DELAY"
FAULT_EXIT_CODE = 70


def fault_armed(point: str, who: str) -> bool:
    return os.environ.get(FAULT_ENV) == f"{point}:{who}"


def fault_point(point: str, who: str) -> None:
    if fault_armed(point, who):
        get_logger().error("fault_injected", fault=point)
        os._exit(FAULT_EXIT_CODE)


def fault_delay(point: str, who: str) -> float:
    point_, _, rest = os.environ.get(DELAY_ENV, "").partition(":")
    who_, _, seconds = rest.partition(":")
    if point_ != point or who_ != who:
        return 0.0
    get_logger().warning("delay_injected", fault=point, seconds=seconds)
    return float(seconds)
