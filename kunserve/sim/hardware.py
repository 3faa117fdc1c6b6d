"""Accelerators the simulator knows by name: what an analytic roofline of one iteration needs.

Numbers are the vendors' data-sheet peaks for the SXM parts (dense BF16 tensor-core FLOP/s, HBM bandwidth,
per-direction NVLink bandwidth, PCIe to the host); `compute_efficiency` and `memory_efficiency` are the
fractions of those peaks a serving engine's kernels reach (GEMMs near 60-70 % of peak, streaming reads near
80 % of HBM bandwidth), and `iteration_overhead_s` the fixed cost of one iteration (scheduling, sampling,
kernel launches) that no roofline sees. The scale-out network (RDMA between servers) is not a property of the
chip: a scenario gives it (`network_gbps`); pipeline activations and KV exchange between instances use it
unless the instances share an NVLink domain.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense BF16 / FP16 tensor FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int  # HBM capacity
    nvlink_bytes_per_s: float  # one direction, one GPU
    pcie_bytes_per_s: float  # host <-> device, one direction
    compute_efficiency: float = 0.65
    memory_efficiency: float = 0.8
    iteration_overhead_s: float = 2e-3

    @property
    def flops(self) -> float:
        """FLOP/s a serving engine's GEMMs reach."""
        return self.peak_flops * self.compute_efficiency

    @property
    def bandwidth(self) -> float:
        """HBM bytes/s a serving engine's streaming reads reach."""
        return self.hbm_bytes_per_s * self.memory_efficiency


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("H100", 989e12, 3.35e12, 80 * 1024**3, 450 * GB, 64 * GB),
        Accelerator("H200", 989e12, 4.8e12, 141 * 1024**3, 450 * GB, 64 * GB),
        Accelerator("A100", 312e12, 2.039e12, 80 * 1024**3, 300 * GB, 32 * GB),
        Accelerator("A800", 312e12, 2.039e12, 80 * 1024**3, 200 * GB, 32 * GB),
    )
}


class UnknownAccelerator(ValueError):
    """An accelerator name the simulator has no numbers for."""


def accelerator(name: str) -> Accelerator:
    """The accelerator called `name` (case-insensitive); UnknownAccelerator names the known ones."""
    for key, acc in ACCELERATORS.items():
        if key.lower() == name.strip().lower():
            return acc
    raise UnknownAccelerator(f"unknown accelerator {name!r} (known: {', '.join(ACCELERATORS)})")
