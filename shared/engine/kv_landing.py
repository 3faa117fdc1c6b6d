"""Which requests wait for their KV after a transition resumed serving (KunServe §4.2): pure bookkeeping.

With the coordinated exchange a transition's members resume as soon as the layout has changed; the KV of the
running requests that changed hands is still on the wire and lands afterwards, member by member. A request
may run again only once every member that receives part of its KV has written it: until then the head keeps
it out of its scheduler (its blocks stay reserved, so nobody else is given them), while new requests use the
freed memory at once. Each member reports the requests whose KV it has finished landing; the head releases a
request when its last member has reported.

``epoch`` also guards the writes: KV of a transition may only be written while the engine is still in the
layout that transition made (a group that broke meanwhile, or a later transition, makes it stale).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class KVLanding:
    epoch: int
    # request id -> the workers whose share of its KV has not landed yet (only the head tracks requests)
    waits: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def expecting(cls, epoch: int, waits: Mapping[str, Iterable[str]]) -> KVLanding:
        return cls(epoch, {rid: set(ws) for rid, ws in waits.items() if ws})

    def landed(self, worker: str, request_ids: Iterable[str]) -> list[str]:
        """`worker` has written its share of these requests' KV: the requests that now have all of theirs."""
        ready = []
        for rid in request_ids:
            left = self.waits.get(rid)
            if left is None:
                continue
            left.discard(worker)
            if not left:
                del self.waits[rid]
                ready.append(rid)
        return ready

    def waiting(self, request_id: str) -> bool:
        return request_id in self.waits
