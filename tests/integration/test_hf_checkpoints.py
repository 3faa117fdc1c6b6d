"""A real local cluster serving a checkpoint written by `transformers` 5.x (Qwen2, `rope_parameters` with
theta 1e6: the case that generated wrong tokens from the first step while the loader fell back to 10000)
answers greedy token-id prompts of several lengths exactly as `transformers`' own `generate`."""

from __future__ import annotations

import pytest
from helpers import generate_many, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")
from hf_checkpoints import MAX_NEW, hf_greedy, prompts, write_checkpoint  # noqa: E402


def test_cluster_serves_a_transformers_checkpoint_like_transformers(tmp_path):
    model = write_checkpoint(tmp_path / "model", "qwen2", seed=21,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = make_config(1)
    cfg.model.path = str(tmp_path / "model")
    c = LocalCluster(cfg, run_dir=tmp_path / "run")
    c.start(timeout_s=120)
    try:
        ps = [p for p in prompts(21) if len(p) in (7, 300, 1000)]
        reqs = [client.make_request(p, max_tokens=MAX_NEW) for p in ps]
        results = run(generate_many(cfg.dispatcher.address, reqs))
    finally:
        c.stop()
    for p, res in zip(ps, results):
        assert not isinstance(res, BaseException), res
        assert list(res.token_ids) == hf_greedy(model, p), f"prompt of {len(p)} tokens"
