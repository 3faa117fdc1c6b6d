"""Conversions of layout transitions between protobuf and plain data: units, planned units and the
requests that move with a transition (both the memory manager and the workers use them)."""

from __future__ import annotations

from collections.abc import Iterable

from kunserve.shared.engine.api import EngineRequest, SeqSnapshot
from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.wire.requests import request_class_to_pb, sampling_from_pb, sampling_to_pb
from kunserve.v1 import common_pb2, memory_manager_pb2, worker_pb2


def unit_to_pb(u: Unit) -> worker_pb2.Unit:
    return worker_pb2.Unit(unit_id=u.unit_id, kv_blocks=u.kv_blocks, members=[
        worker_pb2.UnitMember(worker_id=m.worker_id, transfer_address=m.transfer_address, layer_start=m.layer_start,
                              layer_end=m.layer_end) for m in u.members])


def planned_to_pb(u: Unit, changed: bool = True) -> memory_manager_pb2.PlannedGroup:
    return memory_manager_pb2.PlannedGroup(group_id=u.unit_id, changed=changed, members=[
        memory_manager_pb2.WorkerLayout(worker_id=m.worker_id, layer_start=m.layer_start, layer_end=m.layer_end,
                                        group_id=u.unit_id, transfer_address=m.transfer_address,
                                        serving=i == 0, reachable=True) for i, m in enumerate(u.members)])


def units_from_pb(units: Iterable[worker_pb2.Unit]) -> list[Unit]:
    return [Unit(u.unit_id, tuple(Member(m.worker_id, m.layer_start, m.layer_end, m.transfer_address)
                                     for m in u.members), u.kv_blocks) for u in units]


def snapshot_to_pb(s: SeqSnapshot, unit_id: str, now: float) -> worker_pb2.SeqState:
    r = s.request
    return worker_pb2.SeqState(
        request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), generated_token_ids=s.generated,
        num_computed=s.num_computed, sampling=sampling_to_pb(r.sampling), generator_state=s.generator_state,
        num_preemptions=s.num_preemptions, age_s=max(0.0, now - r.arrival_time), old_blocks=s.blocks,
        old_unit=unit_id, request_class=request_class_to_pb(r.offline))


def snapshot_from_pb(m: worker_pb2.SeqState, now: float) -> SeqSnapshot:
    req = EngineRequest(m.request_id, list(m.prompt_token_ids), sampling_from_pb(m.sampling), now - m.age_s,
                        offline=m.request_class == common_pb2.REQUEST_CLASS_OFFLINE)
    return SeqSnapshot(req, list(m.generated_token_ids), m.num_computed, list(m.new_blocks),
                       bytes(m.generator_state), m.num_preemptions)


def snapshots_to_bytes(snaps: Iterable[SeqSnapshot], now: float) -> bytes:
    """Requests with their block tables as one message (an in-place TP change hands them between the members of
    an instance over its process group)."""
    out = worker_pb2.TransitionPrepared()
    for s in snaps:
        m = snapshot_to_pb(s, "", now)
        m.new_blocks.extend(s.blocks)
        out.seqs.append(m)
    return out.SerializeToString()


def snapshots_from_bytes(data: bytes, now: float) -> list[SeqSnapshot]:
    return [snapshot_from_pb(m, now) for m in worker_pb2.TransitionPrepared.FromString(data).seqs]
