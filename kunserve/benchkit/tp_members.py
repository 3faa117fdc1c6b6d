"""Driving the members of a tensor-parallel instance from one process (bench/tp_transform_bench.py and the engine's
in-place transformation tests): each member on its own thread, as it would run in its own worker, and every
request's tokens collected wherever the request runs, so a token lost or emitted twice across a change shows."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kunserve.shared.engine.api import TokenEvent
from kunserve.shared.engine.engine import Engine, TPHealed
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup, TPLeader
from kunserve.shared.engine.tp_stagger import StaggeredSplit
from kunserve.shared.engine.tp_transform import Exchange, MemberWeights
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights

RANK_TIMEOUT_S = 120.0  # a member still running after this long hangs


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def on_ranks(degree: int, fn: Callable[[int], Any], timeout_s: float = RANK_TIMEOUT_S) -> list[Any]:
    """fn(rank) on one thread per rank, each computing on one torch thread; the results in rank order. Re-raises the
    first failure; RuntimeError when a member is still running after timeout_s."""
    out: list[Any] = [None] * degree
    errors: list[BaseException] = []

    def run(r: int) -> None:
        torch.set_num_threads(1)
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        if t.is_alive():
            raise RuntimeError("a member of the tensor-parallel instance hangs")
    if errors:
        raise errors[0]
    return out


class TokenLog:
    """Every request's tokens as the engines emit them, wherever it runs; a failed request, or a token lost or
    repeated, is a RuntimeError."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def add(self, events: list[TokenEvent]) -> None:
        for e in events:
            if e.token_id < 0:
                raise RuntimeError(f"request {e.request_id} failed: {e}")
            got = self.by_request.setdefault(e.request_id, [])
            if e.index != len(got):
                raise RuntimeError(f"{e.request_id}: token {e.index} after {len(got)} (a token re-emitted or lost)")
            got.append(e.token_id)
            if e.finish_reason.name != "NONE":
                self.finished.add(e.request_id)

    def at_least(self, n: int, ids: Iterable[str]) -> Callable[[], bool]:
        """A condition: every request of `ids` not finished yet has `n` tokens."""
        wanted = list(ids)
        return lambda: all(len(self.by_request.get(rid, [])) >= n for rid in wanted if rid not in self.finished)


def staggered_split(groups: Sequence[TPGroup], leader: TPLeader, engines: Sequence[Engine], tokens: TokenLog,
                    whole_cfg: ModelConfig, whole: Callable[[int], Weights | MemberWeights], *,
                    steps_per_layer: int = 2, before_first_layer: Callable[[], None] = lambda: None,
                    exchange: Callable[[int], Exchange | None] = lambda rank: None,
                    timeout_s: float = RANK_TIMEOUT_S) -> tuple[list[object], list[StaggeredSplit | None]]:
    """A layer-staggered split of a TP instance whose followers are not running (tp_stagger.py), driven as a worker
    drives it: rank 0 sends STAGGER and begins, steps `steps_per_layer` times between the layers' moves (LAYER,
    split_layer), then SPLIT and finish; each follower runs its loop on its thread (beginning and moving each layer
    as rank 0 says) and finishes with rank 0. Returns each rank's TransformReport (or the TPHealed it raised) and its
    StaggeredSplit."""
    degree = len(groups)
    splits: list[StaggeredSplit | None] = [None] * degree

    def member(r: int) -> object:
        e, g = engines[r], groups[r]
        try:
            if r == 0:
                leader.stagger()
                s = splits[0] = StaggeredSplit.begin(e, g, whole_cfg, whole(0), exchange=exchange(0))
                before_first_layer()
                while not s.done:
                    for _ in range(steps_per_layer):
                        tokens.add(e.step())
                    leader.split_layer()
                    s.split_layer()
                leader.split()
                return s.finish()

            def begin() -> StaggeredSplit:
                split = StaggeredSplit.begin(e, g, whole_cfg, whole(r), exchange=exchange(r))
                splits[r] = split
                return split

            f = TPFollower(g, e, begin_stagger=begin)
            f.run()
            if f.healed is not None:
                return TPHealed(f.healed)
            if not f.split or f.error is not None:
                raise RuntimeError(f"rank {r}'s loop ended without a split: {f.error}")
            mine = splits[r]
            assert mine is not None
            return mine.finish()
        except TPHealed as exc:
            return exc

    return on_ranks(degree, member, timeout_s), splits
