"""Variants of the kunserve policy, as rows of `bench compare --policies` (KunServe Fig. 14 and 16, and §4.4).

An ablation variant is the kunserve policy with one mechanism switched off through the cluster config; the
``kunserve+autoscale`` variant adds one instead: standby workers the memory manager activates when no drop plan meets
the requirement (README "Discovery and autoscaling"). This table is the only place that says which switch each
variant turns. A variant whose switch this build's config does not have is refused by name
(:class:`VariantUnavailable`): running it as plain kunserve would put a wrong label on a row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kunserve.shared.config import ClusterConfig


@dataclass(frozen=True)
class Override:
    section: str      # a ClusterConfig section: engine, monitor, memory_manager, ...
    key: str
    value: bool | int | float | str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


@dataclass(frozen=True)
class PolicyVariant:
    name: str
    policy: str                      # the overload policy it varies
    overrides: tuple[Override, ...]
    without: str                     # what it switches off ("" for a variant that adds something)
    adds: str = ""                   # what it adds
    standby: int = 0                 # standby workers its cluster starts beside the configured ones

    def describe(self) -> str:
        sets = ", ".join(f"{o.name} = {o.value!r}" for o in self.overrides)
        if self.adds:
            return f"{self.policy} with {self.adds} ({sets})"
        return f"{self.policy} without {self.without} ({sets})"


POLICY_VARIANTS: dict[str, PolicyVariant] = {v.name: v for v in (
    PolicyVariant("kunserve-no-coord", "kunserve", (Override("memory_manager", "coordinated_exchange", False),),
                  "the coordinated, non-blocking KV exchange of a drop (§4.2): every member pauses until Commit"),
    PolicyVariant("kunserve-no-lookahead", "kunserve", (Override("engine", "lookahead", False),),
                  "lookahead microbatches in live pipeline groups (§4.3): token chunking only"),
    # No underload is held forever, so the monitor's automatic restore never fires (restore_threshold must stay
    # in (0, 1), so it cannot be the switch).
    PolicyVariant("kunserve-no-restore", "kunserve", (Override("monitor", "restore_hold_s", math.inf),),
                  "the automatic restore after the burst (§4.4): groups stay merged"),
    # §4.4: the seconds a drop buys hide a new instance's cold start. One standby worker (loaded, not serving) joins
    # when no drop plan meets the requirement or a drop holds for 5 s, and is given back after 10 s calm.
    PolicyVariant("kunserve+autoscale", "kunserve", (
        Override("autoscale", "scaler", "local"), Override("autoscale", "hold_s", 5.0),
        Override("autoscale", "scale_down_hold_s", 10.0), Override("autoscale", "cooldown_s", 1.0)), "",
        adds="one standby worker the autoscaler activates behind the drop (§4.4)", standby=1),
)}


class VariantUnavailable(ValueError):
    """The variant's config switch does not exist in this build."""


def missing_switches(variant: PolicyVariant, cfg: ClusterConfig) -> list[str]:
    """The variant's overrides that name no field of the config."""
    missing = []
    for o in variant.overrides:
        section = getattr(cfg, o.section, None)
        if section is None or not dataclasses.is_dataclass(section) or o.key not in {f.name for f in dataclasses.fields(section)}:
            missing.append(o.name)
    return missing


def check_variant(name: str, cfg: ClusterConfig) -> PolicyVariant:
    """The variant, or VariantUnavailable naming the switch it needs and this build lacks."""
    variant = POLICY_VARIANTS[name]
    missing = missing_switches(variant, cfg)
    if missing:
        raise VariantUnavailable(f"{name} needs the config switch {', '.join(missing)}, which this build does not have "
                                 f"(it switches off {variant.without}); refusing to run it as plain {variant.policy}")
    return variant


def apply_variant(cfg: ClusterConfig, name: str) -> None:
    """Set the variant's policy and overrides on `cfg` (VariantUnavailable when a switch is missing)."""
    variant = check_variant(name, cfg)
    cfg.policy.overload = variant.policy
    for o in variant.overrides:
        setattr(getattr(cfg, o.section), o.key, o.value)


def base_policy(row: str) -> str:
    """The overload policy a row runs: the variant's base policy, else the row itself."""
    variant = POLICY_VARIANTS.get(row)
    return variant.policy if variant is not None else row


__all__ = ["Override", "POLICY_VARIANTS", "PolicyVariant", "VariantUnavailable", "apply_variant", "base_policy",
           "check_variant", "missing_switches"]
