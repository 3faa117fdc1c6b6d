"""The committed stubs in kunserve/v1 must be exactly what grpcio-tools generates from protos/."""

import pathlib
import tempfile

from scripts_loader import load_gen_protos

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_match_protos():
    gen = load_gen_protos()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in gen.generate(pathlib.Path(tmp))}
    committed = {p.name: p.read_bytes() for p in (ROOT / "kunserve" / "v1").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys(), "stub files differ from the .proto set: run `make protos`"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated stubs {stale}: run `make protos` and commit"


def test_every_service_is_importable():
    from kunserve.v1 import admin_pb2_grpc, generation_pb2_grpc, memory_manager_pb2_grpc, monitor_pb2_grpc, worker_pb2_grpc

    for mod, name in [(generation_pb2_grpc, "Generation"), (worker_pb2_grpc, "Worker"), (monitor_pb2_grpc, "Monitor"),
                      (memory_manager_pb2_grpc, "MemoryManager"), (admin_pb2_grpc, "Admin")]:
        assert hasattr(mod, f"{name}Stub") and hasattr(mod, f"add_{name}Servicer_to_server")
