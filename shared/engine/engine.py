"""The single-instance engine: scheduler + model runner + sampler over a paged KV cache.

Not thread-safe by itself; `EngineLoop` runs it on a dedicated thread and feeds it commands.
"""

from __future__ import annotations

import random
from typing import Iterable

import torch

from kunserve.shared.engine.api import EngineRequest, EngineStats, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.engine.attention import build_metadata
from kunserve.shared.engine.kv_cache import BlockAllocator, KVStorage, TorchKVStorage
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.sampler import sample
from kunserve.shared.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence, TokenBudget
from kunserve.shared.model.config import ModelConfig
from kunserve.shared.model.weights import Weights

__all__ = ["Engine", "SchedulerConfig"]


class Engine:
    def __init__(self, cfg: ModelConfig, weights: Weights, *, num_kv_blocks: int, block_size: int = 16,
                 device: str = "cpu", layer_range: tuple[int, int] | None = None,
                 scheduler_config: SchedulerConfig = SchedulerConfig(), budget: TokenBudget | None = None,
                 kv_storage: KVStorage | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        self.runner = ModelRunner(cfg, weights, layer_range, self.device)
        if not (self.runner.is_first and self.runner.is_last):
            raise ValueError("a single-instance engine needs the whole model; pipeline stages come with groups")
        self.kv = kv_storage or TorchKVStorage(range(self.runner.start, self.runner.end), num_kv_blocks,
                                               cfg.num_kv_heads, block_size, cfg.head_dim, cfg.torch_dtype, self.device)
        self.allocator = BlockAllocator(self.kv.num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size, scheduler_config, budget)
        self.seqs: dict[str, Sequence] = {}
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0

    # -- requests -------------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
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
        seq = Sequence(request, list(request.prompt_token_ids), generator=gen)
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)

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
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits, sampled = self._forward(chunks)
        events: list[TokenEvent] = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.num_computed == 0 and seq.num_preemptions == 0:
                self.prompt_tokens_total += len(seq.request.prompt_token_ids)
            seq.num_computed += chunk.num_tokens
        if sampled:
            params = [c.seq.request.sampling for c in sampled]
            tokens = sample(logits, params, [c.seq.generator for c in sampled])
            for chunk, tok in zip(sampled, tokens):
                events.append(self._append(chunk.seq, tok))
        return events

    def _forward(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        ids, positions, slot_b, slot_o = [], [], [], []
        decodes, prefills, logit_rows, sampled = [], [], [], []
        row = 0
        for c in chunks:
            s = c.seq
            start, n = s.num_computed, c.num_tokens
            pos = range(start, start + n)
            ids.extend(s.tokens[start:start + n])
            positions.extend(pos)
            slot_b.extend(s.block_table[p // bs] for p in pos)
            slot_o.extend(p % bs for p in pos)
            ctx = start + n
            if n == 1:
                decodes.append((row, ctx, s.block_table))
            else:
                prefills.append((row, n, ctx, s.block_table))
            if c.completes:
                logit_rows.append(row + n - 1)
                sampled.append(c)
            row += n
        dev = self.device
        meta = build_metadata(slot_b, slot_o, decodes, prefills, bs, dev)
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                     torch.tensor(positions, dtype=torch.long, device=dev), self.kv, meta,
                                     torch.tensor(logit_rows, dtype=torch.long, device=dev))
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

    # -- observation ------------------------------------------------------------------------------------
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
