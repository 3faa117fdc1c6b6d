"""The single-instance engine: scheduler + model runner + sampler over a paged KV cache.

`step()` is one iteration: the scheduler picks decodes and prompt chunks and reserves their KV
blocks, the runner computes one flat token batch (decodes first, then chunks), the sampler picks a
token for every sequence whose KV is complete. Not thread-safe by itself; `EngineLoop` runs it on a
dedicated thread and feeds it commands between iterations.

The runner already handles any layer range; this class drives the whole model (one instance). The
in-process pipeline (shared/engine/pipeline.py) splits the forward at runner boundaries instead.

Busy / idle accounting (`busy_idle()`): an iteration is busy from scheduling to the sampled tokens;
idle time while requests were queued is this instance's "bubble" (accounting.py).
"""

from __future__ import annotations

import random
from typing import Iterable

import torch

from kunserve.shared.engine.accounting import BusyIdle, BusyIdleClock
from kunserve.shared.engine.api import EngineRequest, EngineStats, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.engine.attention import build_metadata
from kunserve.shared.engine.kv_cache import BlockAllocator, BlockTable, KVStorage, TorchKVStorage
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.sampler import sample
from kunserve.shared.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence, TokenBudget
from kunserve.shared.model.config import ModelConfig
from kunserve.shared.model.weights import Weights

__all__ = ["Engine", "SchedulerConfig"]


class Engine:
    """One model instance: add requests, call step() until has_work() is False.

    num_kv_blocks sizes the default torch-allocated cache; with `kv_storage` (the memory pool's
    layout) the storage's own num_blocks wins and `sync_kv_capacity()` follows later changes."""

    def __init__(self, cfg: ModelConfig, weights: Weights, *, num_kv_blocks: int = 0, block_size: int = 16,
                 device: str | torch.device = "cpu", layer_range: tuple[int, int] | None = None,
                 scheduler_config: SchedulerConfig | None = None, budget: TokenBudget | None = None,
                 kv_storage: KVStorage | None = None, pack_weights: bool | None = None) -> None:
        if kv_storage is None and num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {num_kv_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        self.pack_weights = pack_weights
        self.runner = ModelRunner(cfg, weights, layer_range, self.device, pack_weights=pack_weights)
        if not (self.runner.is_first and self.runner.is_last):
            raise ValueError("a single-instance engine needs the whole model; pipeline stages come with groups")
        self.kv = kv_storage or TorchKVStorage(range(self.runner.start, self.runner.end), num_kv_blocks,
                                               cfg.num_kv_heads, block_size, cfg.head_dim, cfg.torch_dtype, self.device)
        cache = self.kv.layer_cache(self.runner.start)
        want = (2, cfg.num_kv_heads, block_size, cfg.head_dim)
        if tuple(cache.shape[1:]) != want:
            raise ValueError(f"KV storage blocks are {tuple(cache.shape[1:])}, this model needs {want} "
                             "([K/V, kv_heads, block_size, head_dim])")
        del cache  # never hold KV tensors across steps: the pool may remap them
        self.allocator = BlockAllocator(self.kv.num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size, scheduler_config, budget)
        self.seqs: dict[str, Sequence] = {}
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.clock = BusyIdleClock()

    # -- requests -------------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """Raise InvalidRequest (naming the field) for anything this engine could never serve."""
        request.validate(self.cfg.vocab_size, self.cfg.max_position_embeddings)
        self.scheduler.check_fits(request)

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        if request.request_id in self.seqs:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        gen = None
        if not request.sampling.greedy:
            seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
            gen = torch.Generator().manual_seed(seed)
        seq = Sequence(request, list(request.prompt_token_ids), BlockTable(self.block_size), generator=gen)
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)
        self.clock.work_waiting()

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.seqs)

    # -- one iteration ----------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One iteration; returns the tokens it produced (finished requests have left already)."""
        if not self.seqs:
            return []
        self.clock.begin_busy()
        try:
            return self._step()
        finally:
            self.clock.end_busy(still_waiting=bool(self.seqs))

    def _step(self) -> list[TokenEvent]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits, sampled = self._forward(chunks)
        for chunk in chunks:
            seq = chunk.seq
            if chunk.start == 0 and seq.num_preemptions == 0:
                self.prompt_tokens_total += len(seq.request.prompt_token_ids)
            seq.num_computed = chunk.start + chunk.num_tokens
        if not sampled:
            return []
        tokens = sample(logits, [c.seq.request.sampling for c in sampled], [c.seq.generator for c in sampled])
        return [self._append(chunk.seq, tok) for chunk, tok in zip(sampled, tokens)]

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run the flat token batch of this step; logits [len(sampled), vocab] for the completing chunks."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        decodes, prefills, logit_rows, sampled = [], [], [], []
        row = 0
        for c in chunks:
            s, start, n = c.seq, c.start, c.num_tokens
            table = s.block_table.ids
            if n == 1:
                ids.append(s.tokens[start])
                positions.append(start)
                slot_b.append(table[start // bs])
                slot_o.append(start % bs)
                decodes.append((row, start + 1, table))
            else:
                ids.extend(s.tokens[start:start + n])
                positions.extend(range(start, start + n))
                b, o = s.block_table.slots(start, n)
                slot_b.extend(b)
                slot_o.extend(o)
                prefills.append((row, n, start + n, table))
            if c.completes:
                logit_rows.append(row + n - 1)
                sampled.append(c)
            row += n
        dev = self.device
        meta = build_metadata(slot_b, slot_o, decodes, prefills, bs, dev)
        rows = None if len(logit_rows) == row else torch.tensor(logit_rows, dtype=torch.long, device=dev)
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                     torch.tensor(positions, dtype=torch.long, device=dev), self.kv, meta, rows)
        return logits.cpu(), sampled

    def _append(self, seq: Sequence, token: int) -> TokenEvent:
        seq.tokens.append(token)
        seq.generated.append(token)
        self.generated_tokens_total += 1
        p = seq.request.sampling
        reason = FinishReason.NONE
        if not p.ignore_eos and self.cfg.eos_token_id is not None and token == self.cfg.eos_token_id:
            reason = FinishReason.EOS
        elif token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif len(seq.generated) >= p.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not FinishReason.NONE:
            self.seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return TokenEvent(seq.request_id, token, len(seq.generated) - 1, reason)

    # -- KV capacity changes (memory pool drop / restore) ----------------------------------------------
    def sync_kv_capacity(self) -> int:
        """Follow kv_storage.num_blocks after the pool remapped pages: grow the allocator at the tail, or
        shrink it when the tail blocks are free (else BlockAllocatorError: compact first). Returns the
        new block count. Call between steps."""
        new = self.kv.num_blocks
        old = self.allocator.num_blocks
        if new > old:
            self.allocator.grow(new - old)
        elif new < old:
            self.allocator.shrink_to(new)
        return new

    def apply_compaction(self, mapping: dict[int, int]) -> None:
        """After the KV bytes of blocks were moved (old id -> new id), rewrite the bookkeeping: the
        allocator's free set and every sequence's block table."""
        self.allocator.remap(mapping)
        for seq in self.seqs.values():
            seq.block_table.remap(mapping)

    # -- observation ------------------------------------------------------------------------------------
    def busy_idle(self) -> BusyIdle:
        """Busy, idle and bubble seconds since the engine was built (safe from any thread)."""
        return self.clock.snapshot()

    def stats(self) -> EngineStats:
        sch = self.scheduler
        return EngineStats(
            kv_blocks_total=self.allocator.num_blocks, kv_blocks_used=self.allocator.num_used, block_size=self.block_size,
            num_running=len(sch.running), num_waiting=len(sch.waiting), queued_demand_blocks=sch.queued_demand_blocks(),
            num_preemptions=sch.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
        )

    # -- convenience for tests and benchmarks -------------------------------------------------------------
    def generate(self, requests: Iterable[EngineRequest], max_steps: int = 1_000_000) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in requests:
            self.add_request(r)
            out[r.request_id] = []
        for _ in range(max_steps):
            if not self.has_work():
                return out
            for ev in self.step():
                out[ev.request_id].append(ev.token_id)
        raise RuntimeError(f"requests unfinished after {max_steps} steps")
