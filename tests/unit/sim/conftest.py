"""A small simulated cluster for the simulator's tests: the embedded model's shape on 2 instances with 36 MiB pools
(~2k KV tokens each, what `bench compare` gives a 2-core CPU), a hand-made CPU-like profile, and bursty traces
that overload it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kunserve.benchkit.trace import Burst, TraceRequest, generate_trace
from kunserve.cli.simulate import row_config
from kunserve.shared.config import load_config
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.profile_files import Profile
from kunserve.sim.cluster import ClusterSetup
from kunserve.sim.scenario import LOCAL_LINKS
from kunserve.sim.shapes import Memory, ModelShape, load_model_config
from kunserve.sim.timing import TimeModel

POOL_BYTES = 36 << 20


def cpu_profile(shape: ModelShape) -> Profile:
    return Profile(
        model=shape.name,
        dtype=shape.config.dtype,
        layers=(0, shape.num_layers),
        device="test-cpu",
        kunserve=KunServeCostModel(alpha=5e-8, beta=3e-4, gamma=1e-2, lam=8e-3),
        conserve=ConServeLatencyModel(k1=3e-4, k2=5e-8, k4=2e-6, k5=1e-2),
        fit={},
        samples=[],
    )


@pytest.fixture
def make_setup() -> Callable[..., ClusterSetup]:
    def make(policy: str = "kunserve", instances: int = 2, **config: object) -> ClusterSetup:
        cfg = row_config(load_config(None), policy, 600.0)
        for key, value in config.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        shape = ModelShape(load_model_config("embedded"), block_size=cfg.engine.block_size)
        memory = Memory(shape, POOL_BYTES, cfg.engine.page_kib * 1024)
        return ClusterSetup(cfg, shape, memory, TimeModel(cpu_profile(shape), LOCAL_LINKS, "test"), instances, policy)

    return make


@pytest.fixture
def profile_file(tmp_path):
    """A `kunserve profile` file holding cpu_profile for the embedded model."""
    from kunserve.shared.profile_files import write_profile

    path = tmp_path / "profiles.json"
    write_profile(path, cpu_profile(ModelShape(load_model_config("embedded"))))
    return path


@pytest.fixture
def bursty_trace() -> list[TraceRequest]:
    """Light load, then a burst whose KV demand exceeds both instances, then quiet long enough to restore."""
    return generate_trace(
        rate=1.0,
        cv=1.0,
        duration_s=30.0,
        profile="burstgpt",
        seed=3,
        scale=0.5,
        burst=[Burst(3.0, 6.0, 12.0)],
        max_prompt=1024,
        max_output=256,
    )
