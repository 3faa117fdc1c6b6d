"""[[tensor_parallel]] in the cluster config: what it accepts, what it refuses (with the field named), how it travels
to the children (to_toml), how a worker finds its rank, and the model check at a worker's start."""

from __future__ import annotations

import pytest

from kunserve.services.worker.tp_member import membership_of
from kunserve.shared.config import ConfigError, config_from_dict, load_config, validate
from kunserve.shared.model.weights import load_model_source

WORKERS = [{"id": f"w{i}"} for i in range(5)]


def cfg_with(tp, **extra):
    cfg = config_from_dict({"workers": WORKERS, "tensor_parallel": tp, **extra}, source="c.toml")
    validate(cfg)
    return cfg


def test_an_instance_round_trips_through_toml_and_each_member_finds_its_rank(tmp_path):
    cfg = cfg_with([{"members": ["w1", "w0"], "port": 29500, "timeout_s": 5}])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path, environ={})
    (tp,) = again.tensor_parallel
    assert tp.members == ["w1", "w0"] and tp.port == 29500 and tp.timeout_s == 5.0 and tp.degree == 2
    m = membership_of(again, "w0")
    assert m is not None and (m.rank, m.members, m.port) == (1, ("w1", "w0"), 29500)
    assert m.describe() == "rank 1 of tensor-parallel instance w1 (TP2: w1, w0)"
    assert membership_of(again, "w1").is_leader and membership_of(again, "w2") is None
    assert again.tensor_parallel_of("w3") is None


@pytest.mark.parametrize(
    "tp,extra,message",
    [
        ([{"members": ["w0", "w1", "w2"]}], {}, "tensor_parallel[0].members: a tensor-parallel instance spans 1, 2, 4 workers, got 3"),
        ([{"members": ["w0", "nobody"]}], {}, "no worker 'nobody'"),
        ([{"members": ["w0", "w0"]}], {}, "worker 'w0' is named twice"),
        ([{"members": ["w0", "w1"]}, {"members": ["w1", "w2"]}], {}, "worker 'w1' is already in tensor_parallel[0]"),
        ([{"members": "w0,w1"}], {}, "expected a list of worker ids"),
        ([{"members": ["w0", "w1"], "port": 70000}], {}, "tensor_parallel[0].port must be in [0, 65535]"),
        ([{"members": ["w0", "w1"], "timeout_s": 0}], {}, "timeout_s and rendezvous_timeout_s must be > 0"),
        ([{"members": ["w0", "w1"], "tcp": 1}], {}, "tensor_parallel[0].tcp: unknown key"),
        ([{"members": ["w0", "w1"]}], {"policy": {"overload": "swap"}}, "policy.overload = swap is not supported"),
        ([{"members": ["w0", "w1"]}], {"policy": {"overload": "static-pp"}}, "tensor-parallel members cannot join one"),
    ],
)
def test_bad_instances_are_refused_with_the_field_named(tp, extra, message):
    with pytest.raises(ConfigError) as e:
        cfg_with(tp, **extra)
    assert message in str(e.value) and "c.toml" in str(e.value)


def test_a_member_must_hold_every_layer():
    workers = [{"id": "w0"}, {"id": "w1", "layer_end": 2}]
    with pytest.raises(ConfigError, match=r"worker 'w1' holds layers \[0, 2\)"):
        validate(config_from_dict({"workers": workers, "tensor_parallel": [{"members": ["w0", "w1"]}]}))


def test_environment_overrides_do_not_reach_tensor_parallel():
    with pytest.raises(ConfigError, match="expected KUNSERVE__<section>__<key>"):
        load_config(None, environ={"KUNSERVE__TENSOR_PARALLEL__PORT": "1"})


def test_a_degree_that_does_not_divide_the_model_is_refused_at_the_worker():
    """The embedded model has 2 KV heads: TP4 cannot split them. The worker names the section and the count."""
    cfg = cfg_with([{"members": ["w0", "w1", "w2", "w3"], "port": 1}])
    m = membership_of(cfg, "w2")
    with pytest.raises(ValueError, match=r"tensor_parallel\[0\]: .*does not divide the model's 2 KV heads"):
        m.shard(load_model_source(None))
    assert membership_of(cfg, "w4") is None
