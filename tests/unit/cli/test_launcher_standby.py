"""`kunserve up --standby N`: the standby workers the launcher starts beside the configured ones."""

from __future__ import annotations

from kunserve.cli.launcher import LocalCluster, standby_sections, with_workers
from kunserve.shared.config import load_config


def test_standby_workers_take_the_ids_and_ports_after_the_configured_ones(tmp_path):
    cfg = load_config(None, environ={})
    with_workers(cfg, 2)
    cfg.workers[1].transfer_port = 50072
    standby = standby_sections(cfg, 2)
    assert [w.id for w in standby] == ["worker-2", "worker-3"]
    assert [w.port for w in standby] == [cfg.workers[1].port + 1, cfg.workers[1].port + 2]
    assert [w.metrics_port for w in standby] == [cfg.workers[1].metrics_port + 1, cfg.workers[1].metrics_port + 2]
    free = standby_sections(cfg, 2, free_ports=True)
    ports = {p for w in free for p in (w.port, w.metrics_port, w.transfer_port)}
    assert len(ports) == 6 and not ports & {w.port for w in cfg.workers}
    cluster = LocalCluster(cfg, run_dir=tmp_path, standby=standby)
    argv = {c.name: c.argv for c in cluster._plan()}
    assert "--standby" in argv["worker-2"] and "--standby" not in argv["worker-0"]
    assert argv["worker-3"][argv["worker-3"].index("--port") + 1] == str(standby[1].port)


def test_a_configured_id_is_skipped():
    cfg = load_config(None, environ={})
    with_workers(cfg, 2)
    cfg.workers[1].id = "worker-2"
    assert [w.id for w in standby_sections(cfg, 1)] == ["worker-3"]
