"""The KV exchange of a transition: each flow (``shared/policy/transition_plan.kv_flows``) as one message on
the transfer service's KV-exchange class.

A flow's message is its parts' blocks in order, each part as ``Engine.export_blocks`` lays it out (layer-major
over the part's layers); the receiver computes the same flows from the same spec, so it knows which messages
to wait for and how to slice them (``import_flow``). The engine copies the bytes; this module only packs,
sends, receives and unpacks.
"""

from __future__ import annotations

import time

import torch

from kunserve.shared.engine.engine import Engine
from kunserve.shared.log import get_logger
from kunserve.shared.policy.transition_plan import Flow
from kunserve.shared.transfer.framing import KV_EXCHANGE
from kunserve.shared.transfer.service import SendHandle, TransferService

Pair = tuple[str, str]  # (source worker, destination worker)


def export_flow(engine: Engine, flow: Flow) -> torch.Tensor:
    """The flow's message: the KV of every part's old blocks, parts in order (engine thread)."""
    return torch.cat([engine.export_blocks(p.old_blocks, p.layer_start, p.layer_end) for p in flow.parts])


def import_flow(engine: Engine, flow: Flow, data: torch.Tensor) -> None:
    """Write a flow's message at every part's new blocks (engine thread); checks its length first."""
    if data.shape[0] != flow.num_block_layers():
        raise ValueError(f"KV exchange: {data.shape[0]} blocks received from {flow.src}, "
                         f"{flow.num_block_layers()} expected")
    at = 0
    for p in flow.parts:
        n = p.num_layers * len(p.new_blocks)
        engine.import_blocks(p.new_blocks, p.layer_start, p.layer_end, data[at:at + n])
        at += n


def send_flows(svc: TransferService, outgoing: dict[Pair, Flow], messages: dict[str, torch.Tensor],
               epoch: int) -> tuple[list[SendHandle], int]:
    """Submit every outgoing flow's message to its destination (a local one stays); returns the handles and
    the bytes submitted."""
    handles, sent = [], 0
    for (src, dst), flow in outgoing.items():
        if dst == src:
            continue
        data = messages[dst]
        handles.append(svc.submit(dst, KV_EXCHANGE, data, request_ids=[pt.request_id for pt in flow.parts],
                                  epoch=epoch, name=f"kv:{epoch}"))
        sent += data.numel() * data.element_size()
    return handles, sent


async def receive_flows(svc: TransferService, incoming: dict[Pair, Flow], me: str, epoch: int,
                        timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
    """The message of every incoming flow, by source, and the bytes received; messages of another epoch or
    from a worker that sends this one nothing are dropped. TimeoutError names who did not send in time."""
    received: dict[str, torch.Tensor] = {}
    nbytes = 0
    deadline = time.monotonic() + timeout_s
    while len(received) < len(incoming):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(f.src for f in incoming.values() if f.src not in received)
            raise TimeoutError(f"KV exchange: nothing from {', '.join(missing)} within {timeout_s} s")
        msg = await svc.recv(KV_EXCHANGE, timeout=left)
        if msg.header.epoch != epoch or (msg.peer, me) not in incoming:
            get_logger().warning("stale_kv_message_dropped", peer=msg.peer, epoch=msg.header.epoch)
            continue
        received[msg.peer] = msg.data
        nbytes += msg.data.numel() * msg.data.element_size()
    return received, nbytes
