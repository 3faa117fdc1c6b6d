"""Profile files: fitted cost-model coefficients keyed by model, device and layer range (JSON).

Written by `kunserve profile`, read by the worker (`[engine] profile = "FILE"`) to build its SLO-aware
token budget, and by benchmarks. One file may hold many profiles::

    {"format": "kunserve-profile/1",
     "profiles": {"<model>/<dtype>/layers=<start>-<end>/<device>": {
         "model": ..., "dtype": ..., "layers": [start, end], "device": ...,
         "kunserve": {"alpha", "beta", "gamma", "lambda"}, "conserve": {"k1" .. "k5"},
         "fit": {"kunserve": {...errors...}, "conserve": {...}, "train_points", "heldout_points"},
         "loop_overhead": {"iteration_s", "per_sequence_s", "points", "mean_abs_err_s"},
         "samples": [[phase, [[c, p], ...], seconds], ...]}}}

`loop_overhead` is what an engine iteration costs beyond the forward pass (scheduling, sampling, bookkeeping:
`profiler.measure_loop_overhead`); a file written before it was measured has none, which reads as zero with
`points` 0, so a reader can say the profile prices forward passes alone.

The device string includes the CPU thread count: on a CPU the cost of a batch depends on it as much
as on the chip.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
from dataclasses import dataclass, field
from typing import Any

from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel, LoopOverhead, Sample

FORMAT = "kunserve-profile/1"


class ProfileError(ValueError):
    """The profile file is missing, malformed, or holds no profile for this model / device / layers."""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_signature(device: str, threads: int = 1) -> str:
    """"cpu[<model name>]x<threads>t" or "cuda[<GPU name>]": what a profile's timings are valid for."""
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        return f"cuda[{torch.cuda.get_device_name(idx)}]"
    return f"cpu[{_cpu_name()}]x{max(1, int(threads))}t"


def profile_key(model: str, dtype: str, layers: tuple[int, int], device_sig: str) -> str:
    return f"{model}/{dtype}/layers={layers[0]}-{layers[1]}/{device_sig}"


@dataclass
class Profile:
    model: str
    dtype: str
    layers: tuple[int, int]
    device: str
    kunserve: KunServeCostModel
    conserve: ConServeLatencyModel
    fit: dict[str, Any]
    samples: list[Sample]
    created_unix_s: float = 0.0
    torch_version: str = ""
    loop: LoopOverhead = field(default_factory=LoopOverhead)

    @property
    def key(self) -> str:
        return profile_key(self.model, self.dtype, self.layers, self.device)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "layers": list(self.layers), "device": self.device,
                "created_unix_s": self.created_unix_s, "torch": self.torch_version,
                "kunserve": self.kunserve.to_dict(), "conserve": self.conserve.to_dict(), "fit": self.fit,
                "loop_overhead": self.loop.to_dict(), "samples": [s.to_json() for s in self.samples]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        try:
            return cls(model=str(d["model"]), dtype=str(d["dtype"]), layers=(int(d["layers"][0]), int(d["layers"][1])),
                       device=str(d["device"]), kunserve=KunServeCostModel.from_dict(d["kunserve"]),
                       conserve=ConServeLatencyModel.from_dict(d["conserve"]), fit=dict(d.get("fit", {})),
                       samples=[Sample.from_json(s) for s in d.get("samples", [])],
                       created_unix_s=float(d.get("created_unix_s", 0.0)), torch_version=str(d.get("torch", "")),
                       loop=LoopOverhead.from_dict(d.get("loop_overhead") or {}))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ProfileError(f"malformed profile entry: {exc!r}") from None


def read_profiles(path: str | os.PathLike[str]) -> dict[str, Profile]:
    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"profile file {p} does not exist (create it with `kunserve profile --out {p}`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile file {p}: cannot read it: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("profiles"), dict):
        raise ProfileError(f"profile file {p}: not a {FORMAT} file")
    out = {}
    for key, entry in data["profiles"].items():
        try:
            out[key] = Profile.from_json(entry)
        except ProfileError as exc:
            raise ProfileError(f"profile file {p}: {key}: {exc}") from None
    return out


def write_profile(path: str | os.PathLike[str], profile: Profile) -> None:
    """Add or replace this profile's entry; other entries in the file are kept. Atomic replace."""
    p = pathlib.Path(path)
    entries: dict[str, Any] = {}
    if p.exists():
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("profiles"), dict):
                entries = data["profiles"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            entries = {}
    entries[profile.key] = profile.to_json()
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "profiles": entries}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, p)


def find_profile(path: str | os.PathLike[str], *, model: str, dtype: str, layers: tuple[int, int],
                 device_sig: str) -> Profile:
    """The profile for exactly this model, dtype, layer range and device, else ProfileError saying
    what the file holds instead."""
    profiles = read_profiles(path)
    key = profile_key(model, dtype, layers, device_sig)
    if key in profiles:
        return profiles[key]
    held = ", ".join(sorted(profiles)) or "nothing"
    raise ProfileError(f"profile file {path} has no profile for {key} (it holds: {held})")
