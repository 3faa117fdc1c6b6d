"""The memory pool through real processes: kunctl memory / drop-layers / restore-layers via the admin port."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import generate_many, kunctl_argv, reference_for, run
from oracle import compare_greedy

from kunserve import client

pytestmark = pytest.mark.integration


def kunctl(cluster, *args, check=True):
    out = subprocess.run(kunctl_argv(cluster, *args), capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_drop_and_restore_through_kunctl(fresh_cluster):
    c = fresh_cluster(2)
    before = json.loads(kunctl(c, "memory", "worker-0", "--json").stdout)
    assert before["layer_start"] == 0 and before["layer_end"] == 4
    owners = {r["owner"] for r in before["page_runs"]}
    assert {"weights:0", "kv:3", "group:embed", "group:head"} <= owners

    dropped = json.loads(kunctl(c, "drop-layers", "worker-0", "2-3", "--json").stdout)
    assert (dropped["layer_start"], dropped["layer_end"]) == (0, 2)
    assert int(dropped["kv_blocks_after"]) > int(dropped["kv_blocks_before"])
    after = json.loads(kunctl(c, "memory", "worker-0", "--json").stdout)
    assert not any(r["owner"] in ("weights:2", "kv:3") for r in after["page_runs"])
    # the table form names layers and pages
    table = kunctl(c, "memory", "worker-0").stdout
    assert "physical pages" in table and "kv:0" in table

    # a partial worker serves only in a group: the dispatcher routes every request to worker-1
    prompts = [[5, 6, 7 + i] for i in range(4)]
    results = run(generate_many(c.cfg.dispatcher.address,
                                [client.make_request(p, max_tokens=4, ignore_eos=True) for p in prompts]))
    assert all(not isinstance(r, BaseException) and r.worker_id == "worker-1" for r in results), results

    # bad input: precise statuses, nothing changes
    for args, needle in [(("drop-layers", "worker-0", "0-1"), "FAILED_PRECONDITION"),
                         (("drop-layers", "worker-0", "9"), "INVALID_ARGUMENT"),
                         (("restore-layers", "worker-0", "1"), "FAILED_PRECONDITION"),
                         (("memory", "worker-9"), "NOT_FOUND")]:
        out = kunctl(c, *args, check=False)
        assert out.returncode == 1 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr

    restored = json.loads(kunctl(c, "restore-layers", "worker-0", "2-3", "--source", "checkpoint", "--json").stdout)
    assert (restored["layer_start"], restored["layer_end"]) == (0, 4)
    assert int(restored["kv_blocks_after"]) == int(before["kv_blocks"])

    # serving again, with the reference tokens
    import time

    deadline = time.monotonic() + 10
    seen = set()
    while time.monotonic() < deadline and "worker-0" not in seen:
        results = run(generate_many(c.cfg.dispatcher.address,
                                    [client.make_request(p, max_tokens=6, ignore_eos=True) for p in prompts]))
        for p, r in zip(prompts, results):
            assert not isinstance(r, BaseException), r
            ref, margins = reference_for(p, 6)
            compare_greedy(r.token_ids, ref, margins)
            seen.add(r.worker_id)
    assert "worker-0" in seen
