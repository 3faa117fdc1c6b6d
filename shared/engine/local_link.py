"""A pipeline group inside one process: the head Engine reaches its later stages, Engines over their own
layer ranges with their own KV caches, through `LocalPipelineLink` instead of UCX.

Why: the pipeline benchmark and the tests run the code a live group runs (the head's
`Engine._step_pipelined`: scheduling, microbatches, its layers, sampling; each later stage's
`Engine.forward_stage`) without workers, a cluster or a transport. Only the hop between stages differs:
the microbatch (`StageBatch`) and the hidden states are handed over by reference, or with `wire=True`
encoded and decoded as one wire message per hop (shared/engine/stage_wire.py), as between workers.
An optional `observe(stage, batch, start_s, end_s)` hears of every later stage's forward (the benchmark's
per-microbatch log).

Each later stage runs on its own thread and takes microbatches strictly in arrival order, as a worker's
engine thread does, so a request's chunks reach every stage's KV cache in order and microbatches overlap
across stages as they do across workers. A stage that raises breaks the group: the head's next `result`
raises GroupBroken, as when a worker is lost.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import torch

from kunserve.shared.engine import stage_wire
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.link_results import LinkResults
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights
from kunserve.shared.policy.batch_scheduler import SchedulerConfig

_STOP = object()

Observer = Callable[[int, StageBatch, float, float], None]  # (stage, microbatch, start, end): perf_counter seconds


class LocalPipelineLink:
    """The head's PipelineLink to later-stage Engines in this process, one thread per stage (see the module
    doc). max_inflight defaults to one microbatch per member (head included), as a live group's does.
    close() (or leaving a `with` block) stops the stage threads."""

    def __init__(self, stages: Sequence[Engine], max_inflight: int = 0, timeout_s: float = 300.0,
                 wire: bool = False, observe: Observer | None = None) -> None:
        if not stages:
            raise ValueError("a pipeline link needs at least one later stage")
        for prev, nxt in zip(stages, stages[1:]):
            if prev.runner.end != nxt.runner.start:
                raise ValueError(f"stages must hold contiguous layers: [{prev.runner.start}, {prev.runner.end}) "
                                 f"is followed by [{nxt.runner.start}, {nxt.runner.end})")
        if not stages[-1].runner.is_last:
            raise ValueError(f"the last stage must hold the model's last layer, it holds "
                             f"[{stages[-1].runner.start}, {stages[-1].runner.end})")
        self.stages = list(stages)
        self.max_inflight = max_inflight or len(self.stages) + 1
        self.timeout_s = timeout_s
        self.wire = wire
        self.observe = observe
        self._inboxes: list[queue.Queue] = [queue.Queue() for _ in self.stages]
        self._results = LinkResults(timeout_s)
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"stage-{i + 1}", daemon=True)
                         for i in range(len(self.stages))]
        for t in self._threads:
            t.start()

    def send(self, batch: StageBatch, hidden: torch.Tensor) -> None:
        self._inboxes[0].put(self._pack(batch, hidden))

    def _pack(self, batch: StageBatch, hidden: torch.Tensor) -> tuple[StageBatch, torch.Tensor] | torch.Tensor:
        return stage_wire.encode(batch, hidden) if self.wire else (batch, hidden)

    def result(self, mb_id: int, block: bool) -> torch.Tensor | None:
        return self._results.take(mb_id, block)

    def _serve(self, i: int) -> None:
        """Stage i+1 of the group (the head is stage 0): run each microbatch, pass the output on."""
        stage = self.stages[i]
        last = i == len(self.stages) - 1
        while True:
            item = self._inboxes[i].get()
            if item is _STOP:
                return
            try:
                batch, hidden = stage_wire.decode(item, stage.cfg.torch_dtype) if self.wire else item
                start = time.perf_counter()
                out = stage.forward_stage(batch, hidden)
                if self.observe is not None:
                    self.observe(i + 1, batch, start, time.perf_counter())
            except Exception as exc:  # the group breaks; this stage takes no more work
                self._results.lost(f"stage {i + 1} (layers [{stage.runner.start}, {stage.runner.end})) "
                                   f"failed: {type(exc).__name__}: {exc}")
                return
            if last:
                self._results.deliver(batch.mb_id, out)
            else:
                self._inboxes[i + 1].put(self._pack(batch, out))

    @property
    def running(self) -> bool:
        """Whether any stage thread is still alive."""
        return any(t.is_alive() for t in self._threads)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every stage thread (each finishes the microbatch it is computing first)."""
        for inbox in self._inboxes:
            inbox.put(_STOP)
        for t in self._threads:
            t.join(timeout_s)

    def __enter__(self) -> LocalPipelineLink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def local_group(cfg: ModelConfig, weights: Weights, ranges: Sequence[tuple[int, int]], *, num_kv_blocks: int,
                block_size: int = 16, device: str | torch.device = "cpu",
                scheduler_config: SchedulerConfig | None = None, max_inflight: int = 0,
                pack_weights: bool | None = None, timeout_s: float = 300.0, wire: bool = False,
                observe: Observer | None = None) -> tuple[Engine, LocalPipelineLink]:
    """A pipeline group over `ranges` (contiguous, covering the model, two or more): the head Engine (add
    requests, step it, as any engine) and the link to its later stages. Every member has `num_kv_blocks`
    blocks, so the block-id space the head hands out addresses every member's cache."""
    if len(ranges) < 2 or ranges[0][0] != 0 or ranges[-1][1] != cfg.num_layers or any(
            a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"layer ranges {list(ranges)} must be two or more contiguous ranges covering "
                         f"[0, {cfg.num_layers})")

    def member(layers: tuple[int, int]) -> Engine:
        return Engine(cfg, weights, num_kv_blocks=num_kv_blocks, block_size=block_size, device=device,
                      layer_range=layers, scheduler_config=scheduler_config, pack_weights=pack_weights)

    stages = [member(r) for r in ranges[1:]]
    for stage in stages:
        stage.become_stage()
    link = LocalPipelineLink(stages, max_inflight, timeout_s, wire, observe)
    head = member(ranges[0])
    head.become_head(link, num_kv_blocks, ())
    return head, link
