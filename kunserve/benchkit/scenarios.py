"""Presets of `kunserve bench compare --scenario`: the flags that reproduce one of the paper's experiments.

A scenario only fills in the flags the user did not give (an explicit `--duration 45` beats the preset's), so
it is a starting point to adjust, not a fixed recipe. The burst factors are the generator's; calibration
(on by default in `compare`) replaces them with what overloads the machine it runs on, keeping the windows.

- ``fig16`` (KunServe §5.5, Fig. 16: dynamic restoration): two separate bursts on 2 workers, kunserve against
  kunserve-no-restore. The gap between them outlasts the monitor's restore rules at their defaults (no restore
  within ``restore_cooldown_s`` = 30 s of a drop, usage under half the undropped capacity for
  ``restore_hold_s`` = 10 s) once the first burst's backlog has drained on a 2-core CPU (15-25 s after it ends
  in the runs measured), so kunserve meets the second burst restored while the variant is still pipelined.
- ``fig17`` (§5.6, Fig. 17: extreme bursts): one burst replayed four times with short gaps on 4 workers,
  kunserve against the KV-centric baselines. The gaps are too short to drain, so the load stacks up: the
  question is how long each policy holds before requests queue, and how many drops (pairs, then a quad)
  kunserve makes on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kunserve.benchkit.trace import Burst


@dataclass(frozen=True)
class Scenario:
    name: str
    figure: str                  # what it reproduces
    measures: str
    flags: Mapping[str, Any]     # argparse dest -> value, as the parsed flag would hold it

    def describe(self) -> str:
        return f"{self.name} ({self.figure}: {self.measures})"


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("fig16", "KunServe Fig. 16, §5.5", "restore vs no restore over two bursts",
             {"policies": "kunserve,kunserve-no-restore", "workers": 2, "duration": 70.0,
              "burst": [Burst(5.0, 8.0, 7.0), Burst(56.0, 8.0, 7.0)]}),
    Scenario("fig17", "KunServe Fig. 17, §5.6", "a repeated burst on 4 workers: how long each policy holds before "
             "requests queue, and kunserve's drops",
             {"policies": "kunserve,recompute,swap,migrate", "workers": 4, "duration": 40.0,
              "burst": [Burst(5.0, 6.0, 7.0)], "bursts": 4, "burst_gap": 2.0}),
)}


def resolve(values: dict[str, Any], plain: Mapping[str, Any], scenario: Scenario | None) -> set[str]:
    """Fill every key of ``plain`` that ``values`` holds as None (a flag not given) with the scenario's value,
    else the plain default; return the keys that were given."""
    given = {key for key in plain if values.get(key) is not None}
    for key, default in plain.items():
        if key not in given:
            chosen = scenario.flags[key] if scenario is not None and key in scenario.flags else default
            values[key] = list(chosen) if isinstance(chosen, list) else chosen
    return given


__all__ = ["SCENARIOS", "Scenario", "resolve"]
