"""In-process pipeline executor: a pipeline group (KunServe §3, §4.3) inside one process.

N stages, each a `ModelRunner` over a contiguous layer range with its own paged KV cache
(`TorchKVStorage` for its layers only) on its own thread. The head (the caller's thread) owns the
requests: it admits them, forms microbatches (`MicrobatchFormer`: lookahead or token-count), builds
each microbatch's token ids, positions and attention metadata once, and puts it in stage 0's queue.
Stage 0 embeds and runs its layers, hands the hidden states to stage 1's queue, ..., the last stage
computes logits for the rows that complete a sequence and returns them to the head, which samples
(the engine's sampler) and updates the requests. Up to `max_inflight` microbatches are in flight
(default: one per stage), so every stage can work on a different microbatch at the same time.

Every stage's KV cache has the same block geometry, so one block table per request (owned by the
head) addresses the request's KV in every stage. Microbatches run in order on every stage, so a
chunk's prefix is always in a stage's cache before the chunk reaches it; a request waits for its
sampled token (the logits come back) before its next decode is dispatched.

Memory: a request is admitted only when blocks for prompt + max_tokens - 1 tokens are free, and keeps
them to the end (no preemption inside a pipeline group); admission is FCFS.

Accounting: each stage records the (start, end) of every forward it runs; over the run's window
(first dispatch to last result) its busy time is the sum and the rest is idle, i.e. pipeline bubble
(fill and drain included). Because threads on a small CPU compete for cores, `compute_slots`
(default: the number of CPU cores) bounds how many stages compute at once; time spent waiting for a
slot counts as idle, not busy, so busy times are the stages' own compute times. `replay()` then
schedules the measured per-stage times on dedicated devices (one per stage, as on GPUs), with the
same dispatch decisions (a microbatch starts no earlier than the results the head had seen when it
formed it), which is the bubble ratio a real pipeline group would see for these microbatches.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest
from kunserve.shared.engine.attention import build_metadata
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed
from kunserve.shared.engine.kv_storage import TorchKVStorage
from kunserve.shared.policy.microbatch import MicroChunk, MicrobatchFormer, WorkItem, token_microbatches
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.sampler import sample
from kunserve.shared.model.config import ModelConfig
from kunserve.shared.model.weights import Weights


class PipelineError(RuntimeError):
    """A stage failed; the message names it."""


def balanced_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges whose sizes differ by at most one (earlier stages get the extra layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass
class PipelineConfig:
    num_stages: int = 2
    layer_ranges: list[tuple[int, int]] | None = None  # default: balanced_layer_ranges
    num_kv_blocks: int = 1024
    block_size: int = 16
    lookahead: bool = True
    min_tokens: int = 128  # MIN of KunServe Fig. 11 (and the lookahead's average microbatch size)
    chunk_tokens: int = 256  # token-count microbatch size (decodes included)
    lookahead_min_tokens: int = 0  # queued prompt tokens before looking ahead; 0 = 4 * min_tokens
    max_inflight: int = 0  # 0 = num_stages
    max_decodes_per_microbatch: int = 256
    threads_per_stage: int = 1
    compute_slots: int = -1  # stages computing at once; -1 = CPU cores on CPU (unbounded on CUDA); 0 = unbounded
    pack_weights: bool | None = None


@dataclass(eq=False)
class _Seq:
    request: EngineRequest
    tokens: list[int]
    table: BlockTable
    generator: torch.Generator | None
    planned: int = 0  # tokens handed to microbatches (planned, in flight or done)
    generated: list[int] = field(default_factory=list)
    finished: FinishReason = FinishReason.NONE

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class _Microbatch:
    index: int
    chunks: list[tuple[_Seq, int, int]]  # (seq, start, num_tokens), decodes first
    sampled: list[_Seq]
    inputs: torch.Tensor
    positions: torch.Tensor
    meta: object
    rows: torch.Tensor | None
    results_seen: int  # results the head had received when it formed this microbatch
    num_tokens: int
    predicted_cost: float = 0.0
    stage_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per stage
    lookahead: bool = False


@dataclass
class StageStats:
    stage: int
    layers: tuple[int, int]
    busy_s: float
    idle_s: float

    @property
    def bubble_ratio(self) -> float:
        d = self.busy_s + self.idle_s
        return self.idle_s / d if d > 0 else 0.0


@dataclass
class PipelineRun:
    tokens: dict[str, list[int]]
    window_s: float
    stages: list[StageStats]
    microbatches: list[dict]  # per microbatch: tokens, chunks, predicted cost, per-stage (start, end)
    prompt_tokens: int
    generated_tokens: int
    inflight_limit: int

    @property
    def bubble_ratio(self) -> float:
        busy = sum(s.busy_s for s in self.stages)
        total = sum(s.busy_s + s.idle_s for s in self.stages)
        return 1.0 - busy / total if total > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.window_s if self.window_s > 0 else 0.0

    def replay(self) -> dict[str, float]:
        """The measured per-stage times scheduled on one dedicated device per stage (see module doc):
        makespan, bubble ratio, throughput."""
        n_st = len(self.stages)
        ends: list[list[float]] = []
        for m, mb in enumerate(self.microbatches):
            durs = [e - s for s, e in mb["stage_times"]]
            row = []
            for s in range(n_st):
                t = 0.0
                if s > 0:
                    t = row[s - 1]
                if m > 0:
                    t = max(t, ends[m - 1][s])
                if s == 0:
                    seen = mb["results_seen"]
                    if seen > 0:
                        t = max(t, ends[seen - 1][n_st - 1])
                    if m >= self.inflight_limit:
                        t = max(t, ends[m - self.inflight_limit][n_st - 1])
                row.append(t + durs[s])
            ends.append(row)
        makespan = ends[-1][-1] if ends else 0.0
        per_stage = [sum(mb["stage_times"][s][1] - mb["stage_times"][s][0] for mb in self.microbatches)
                     for s in range(n_st)]
        busy = sum(per_stage)
        bubble = 1.0 - busy / (n_st * makespan) if makespan > 0 else 0.0
        tps = (self.prompt_tokens + self.generated_tokens) / makespan if makespan > 0 else 0.0
        # the bubble no microbatch formation can remove: stages with less total work wait for the slowest
        floor = 1.0 - busy / (n_st * max(per_stage)) if busy > 0 else 0.0
        return {"makespan_s": makespan, "bubble_ratio": bubble, "tokens_per_s": tps, "stage_imbalance_floor": floor}


class _Stage:
    def __init__(self, index: int, runner: ModelRunner, kv: TorchKVStorage) -> None:
        self.index = index
        self.runner = runner
        self.kv = kv
        self.inbox: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None


_STOP = object()


class PipelineExecutor:
    """See the module doc. Not thread-safe: one `generate()` at a time."""

    def __init__(self, cfg: ModelConfig, weights: Weights, config: PipelineConfig | None = None, *,
                 cost_model=None, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.config = pc = config or PipelineConfig()
        self.device = torch.device(device)
        ranges = pc.layer_ranges or balanced_layer_ranges(cfg.num_layers, pc.num_stages)
        if len(ranges) != pc.num_stages or ranges[0][0] != 0 or ranges[-1][1] != cfg.num_layers or any(
                a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"layer ranges {ranges} must be {pc.num_stages} contiguous ranges covering "
                             f"[0, {cfg.num_layers})")
        self.stages: list[_Stage] = []
        for i, (a, b) in enumerate(ranges):
            runner = ModelRunner(cfg, weights, (a, b), self.device, pack_weights=pc.pack_weights)
            kv = TorchKVStorage(range(a, b), pc.num_kv_blocks, cfg.num_kv_heads, pc.block_size, cfg.head_dim,
                                cfg.torch_dtype, self.device)
            self.stages.append(_Stage(i, runner, kv))
        self.former = MicrobatchFormer(cost_model, min_tokens=pc.min_tokens, chunk_tokens=pc.chunk_tokens,
                                       lookahead=pc.lookahead, lookahead_min_tokens=pc.lookahead_min_tokens)
        self.cost_model = cost_model
        self.inflight_limit = pc.max_inflight or pc.num_stages
        slots = pc.compute_slots
        if slots < 0:
            slots = 0 if self.device.type == "cuda" else (os.cpu_count() or 1)
        self._slots_n = slots
        self._slots = threading.BoundedSemaphore(slots) if slots > 0 else None
        self._results: queue.Queue = queue.Queue()

    # -- stage threads -------------------------------------------------------------------------------
    def _stage_loop(self, st: _Stage) -> None:
        torch.set_num_threads(max(1, self.config.threads_per_stage))
        last = st.index == len(self.stages) - 1
        try:
            while True:
                item = st.inbox.get()
                if item is _STOP:
                    return
                mb, x = item
                if self._slots is not None:
                    self._slots.acquire()
                try:
                    t0 = time.perf_counter()
                    out = st.runner.forward(x, mb.positions, st.kv, mb.meta, mb.rows if last else None)
                    if last:
                        out = out.cpu()
                    elif self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    t1 = time.perf_counter()
                finally:
                    if self._slots is not None:
                        self._slots.release()
                mb.stage_times.append((t0, t1))
                if last:
                    self._results.put((mb, out))
                else:
                    self.stages[st.index + 1].inbox.put((mb, out))
        except BaseException as exc:  # surface to the head, which stops the run
            self._results.put((None, PipelineError(f"stage {st.index} (layers {st.runner.start}-{st.runner.end}) "
                                                   f"failed: {exc!r}")))

    def _start(self) -> None:
        for st in self.stages:
            st.inbox = queue.Queue()
            st.thread = threading.Thread(target=self._stage_loop, args=(st,), name=f"stage-{st.index}", daemon=True)
            st.thread.start()

    def _stop(self) -> None:
        for st in self.stages:
            st.inbox.put(_STOP)
        for st in self.stages:
            if st.thread is not None:
                st.thread.join(timeout=30)
                st.thread = None

    # -- the head ------------------------------------------------------------------------------------
    def _validate(self, r: EngineRequest) -> None:
        r.validate(self.cfg.vocab_size, self.cfg.max_position_embeddings)
        need = blocks_needed(len(r.prompt_token_ids) + r.sampling.max_tokens - 1, self.config.block_size)
        if need > self.config.num_kv_blocks:
            raise InvalidRequest("max_tokens", f"needs {need} KV blocks, the pipeline has {self.config.num_kv_blocks}")

    def _admit(self) -> None:
        bs = self.config.block_size
        while self._waiting:
            r = self._waiting[0]
            need = blocks_needed(len(r.prompt_token_ids) + r.sampling.max_tokens - 1, bs)
            if need > self._alloc.num_free:
                return
            self._waiting.pop(0)
            gen = None
            if not r.sampling.greedy:
                seed = r.sampling.seed if r.sampling.seed is not None else random.getrandbits(63)
                gen = torch.Generator().manual_seed(seed)
            seq = _Seq(r, list(r.prompt_token_ids), BlockTable(bs, self._alloc.allocate(need)), gen)
            self._seqs[r.request_id] = seq

    def _ready_decodes(self) -> list[_Seq]:
        return [s for s in self._seqs.values() if s.generated and s.planned == len(s.tokens) - 1]

    def _prompt_items(self) -> list[WorkItem]:
        return [WorkItem(s.request_id, len(s.tokens) - s.planned, s.planned) for s in self._seqs.values()
                if not s.generated and s.planned < len(s.tokens)]

    def _next_chunks(self) -> tuple[list[MicroChunk], bool] | None:
        """The next microbatch's chunks and whether it came from a lookahead plan; None: nothing to run."""
        pc = self.config
        decodes = self._ready_decodes()[: pc.max_decodes_per_microbatch]
        dec = [MicroChunk(s.request_id, s.planned, 1) for s in decodes]
        if self._plan:
            return dec + self._plan.pop(0), True
        items = self._prompt_items()
        if items and self.former.uses_lookahead(items):
            self._plan = self.former.form(items)
            for mb in self._plan:  # the whole plan is handed out now: mark its tokens planned
                for c in mb:
                    self._seqs[c.request_id].planned = max(self._seqs[c.request_id].planned, c.end)
            return dec + self._plan.pop(0), True
        room = pc.chunk_tokens - len(dec)
        chunks: list[MicroChunk] = []
        if items and room > 0:
            chunks = token_microbatches(items, room)[0]
            for c in chunks:
                self._seqs[c.request_id].planned = c.end
        out = dec + chunks
        return (out, False) if out else None

    def _build(self, chunks: list[MicroChunk], lookahead: bool) -> _Microbatch:
        bs = self.config.block_size
        ordered = sorted(chunks, key=lambda c: c.num_tokens != 1)  # decodes (one token) first, stable
        ids: list[int] = []
        positions: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        decodes, prefills, logit_rows, sampled, parts = [], [], [], [], []
        row = 0
        for c in ordered:
            s = self._seqs[c.request_id]
            start, n = c.start, c.num_tokens
            s.planned = max(s.planned, start + n)
            table = s.table.ids
            ids.extend(s.tokens[start:start + n])
            positions.extend(range(start, start + n))
            b, o = s.table.slots(start, n)
            slot_b.extend(b)
            slot_o.extend(o)
            if n == 1:
                decodes.append((row, start + 1, table))
            else:
                prefills.append((row, n, start + n, table))
            if start + n == len(s.tokens):
                logit_rows.append(row + n - 1)
                sampled.append(s)
            parts.append((s, start, n))
            row += n
        dev = self.device
        meta = build_metadata(slot_b, slot_o, decodes, prefills, bs, dev)
        rows = None if len(logit_rows) == row else torch.tensor(logit_rows, dtype=torch.long, device=dev)
        cost = 0.0
        if self.cost_model is not None:
            cost = self.cost_model.batch_cost([(n, st) for _, st, n in parts])
        mb = _Microbatch(self._next_index, parts, sampled, torch.tensor(ids, dtype=torch.long, device=dev),
                         torch.tensor(positions, dtype=torch.long, device=dev), meta, rows, self._results_seen, row,
                         cost, lookahead=lookahead)
        self._next_index += 1
        return mb

    def _finish_check(self, s: _Seq, tok: int) -> FinishReason:
        p = s.request.sampling
        if not p.ignore_eos and self.cfg.eos_token_id is not None and tok == self.cfg.eos_token_id:
            return FinishReason.EOS
        if tok in p.stop_token_ids:
            return FinishReason.STOP
        if len(s.generated) >= p.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _complete(self, mb: _Microbatch, logits: torch.Tensor) -> None:
        if not mb.sampled:
            return
        toks = sample(logits, [s.request.sampling for s in mb.sampled], [s.generator for s in mb.sampled])
        for s, tok in zip(mb.sampled, toks):
            s.tokens.append(tok)
            s.generated.append(tok)
            self._out[s.request_id].append(tok)
            reason = self._finish_check(s, tok)
            if reason is not FinishReason.NONE:
                s.finished = reason
                self._alloc.free(s.table.clear())
                del self._seqs[s.request_id]

    def generate(self, requests: Iterable[EngineRequest]) -> PipelineRun:
        """Run every request to completion through the pipeline; greedy tokens equal the single engine's."""
        reqs = list(requests)
        ids = set()
        for r in reqs:
            self._validate(r)
            if r.request_id in ids:
                raise InvalidRequest("request_id", f"{r.request_id!r} is given twice")
            ids.add(r.request_id)
        self._alloc = BlockAllocator(self.config.num_kv_blocks)
        self._waiting = list(reqs)
        self._seqs: dict[str, _Seq] = {}
        self._out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        self._plan: list[list[MicroChunk]] = []
        self._next_index = 0
        self._results_seen = 0
        self._results = queue.Queue()
        done: list[_Microbatch] = []
        inflight = 0
        t_first = t_last = None
        self._start()
        try:
            while self._waiting or self._seqs:
                self._admit()
                while inflight < self.inflight_limit:
                    nxt = self._next_chunks()
                    if nxt is None:
                        break
                    mb = self._build(*nxt)
                    if t_first is None:
                        t_first = time.perf_counter()
                    self.stages[0].inbox.put((mb, mb.inputs))
                    inflight += 1
                if inflight == 0:
                    raise PipelineError("no progress: nothing to run and nothing in flight")
                mb, out = self._results.get()
                if mb is None:
                    raise out
                t_last = time.perf_counter()
                inflight -= 1
                self._results_seen += 1
                self._complete(mb, out)
                done.append(mb)
        finally:
            self._stop()
        window = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
        stages = []
        for st in self.stages:
            busy = sum(mb.stage_times[st.index][1] - mb.stage_times[st.index][0] for mb in done)
            stages.append(StageStats(st.index, (st.runner.start, st.runner.end), busy, max(0.0, window - busy)))
        t0 = t_first or 0.0
        log = [{"index": mb.index, "tokens": mb.num_tokens, "chunks": len(mb.chunks), "lookahead": mb.lookahead,
                "predicted_cost_s": mb.predicted_cost, "results_seen": mb.results_seen,
                "stage_times": [(a - t0, b - t0) for a, b in mb.stage_times]} for mb in done]
        return PipelineRun(tokens=self._out, window_s=window, stages=stages, microbatches=log,
                           prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
                           generated_tokens=sum(len(v) for v in self._out.values()), inflight_limit=self.inflight_limit)
