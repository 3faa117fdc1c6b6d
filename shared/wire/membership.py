"""Runtime membership between protobuf and plain data: a worker's registration and its model fingerprint."""

from __future__ import annotations

import dataclasses

from kunserve.shared.policy.membership import Fingerprint, Registration
from kunserve.v1 import memory_manager_pb2


def fingerprint_to_pb(f: Fingerprint) -> memory_manager_pb2.ModelFingerprint:
    return memory_manager_pb2.ModelFingerprint(**dataclasses.asdict(f))


def fingerprint_from_pb(pb: memory_manager_pb2.ModelFingerprint) -> Fingerprint:
    return Fingerprint(**{f.name: getattr(pb, f.name) for f in dataclasses.fields(Fingerprint)})


def registration_from_pb(pb: memory_manager_pb2.RegisterWorkerRequest) -> Registration:
    return Registration(
        pb.worker_id,
        pb.address,
        fingerprint_from_pb(pb.model),
        incarnation=pb.incarnation,
        standby=pb.standby,
        members_version=pb.members_version,
        kv_blocks=pb.kv_blocks_total,
    )
