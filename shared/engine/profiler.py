"""The offline profiler: time a stage's forward pass over a grid of batch shapes, fit both cost models.

`BatchTimer` runs one layer range (a `ModelRunner`, as the worker does) over its own paged KV cache
for an arbitrary batch of chunks `(c, p)`: each chunk gets its own blocks, the flat token batch,
positions and attention metadata are built exactly as `Engine._forward` builds them, and the time
covers metadata + forward + logits to host (what one engine iteration spends outside the scheduler).
The KV contents are zeros: attention cost does not depend on the values.

The grid covers the four phases both papers profile: prefill (one or several fresh prompts), chunked
prefill with a cached prefix, decode (batch size x context) and mixed batches (decodes plus a prompt
chunk, what the token budget builds). Every point is the median of `repeats` timed runs after one
warm-up run. One point in four (per phase, seeded) is held out of the fit and only used to report
its error.

A forward pass is not all of an iteration: `measure_loop_overhead` then runs a real `Engine` on the same weights
through decode batches of several sizes, times each `Engine.step` plus the stats snapshot the engine loop takes
after it, and fits what they cost beyond the ConServe prediction for the same batch (`costmodel.LoopOverhead`: a
constant per iteration and a cost per sequence). Decode iterations only: a decode step is priced within a few
percent by the fit, while the fit's own error on a prefill (up to ~10 %) is larger than the overhead itself.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kunserve.shared.engine.attention import build_metadata
from kunserve.shared.engine.kv_blocks import blocks_needed
from kunserve.shared.engine.kv_storage import TorchKVStorage
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights
from kunserve.shared.policy.costmodel import (
    BatchShape,
    Chunk,
    ConServeLatencyModel,
    LoopOverhead,
    Sample,
    fit_conserve,
    fit_kunserve,
    fit_loop_overhead,
    relative_errors,
    split_holdout,
)
from kunserve.shared.profile_files import Profile

GridPoint = tuple[str, tuple[Chunk, ...]]


class BatchTimer:
    """Times batches of chunks on one layer range of the model."""

    def __init__(self, cfg: ModelConfig, weights: Weights, layer_range: tuple[int, int] | None = None,
                 device: str | torch.device = "cpu", *, block_size: int = 16, max_blocks: int = 1024,
                 pack_weights: bool | None = None, seed: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.block_size = block_size
        self.runner = ModelRunner(cfg, weights, layer_range, self.device, pack_weights=pack_weights)
        self.kv = TorchKVStorage(range(self.runner.start, self.runner.end), max_blocks, cfg.num_kv_heads,
                                 block_size, cfg.head_dim, cfg.torch_dtype, self.device)
        self.max_blocks = max_blocks
        self._gen = torch.Generator().manual_seed(seed)

    def blocks_for(self, chunks: Iterable[Chunk]) -> int:
        return sum(blocks_needed(c + p, self.block_size) for c, p in chunks)

    def _inputs(self, chunks: tuple[Chunk, ...]):
        bs = self.block_size
        ids_len = 0
        positions: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        decodes, prefills, logit_rows = [], [], []
        row = 0
        next_block = 0
        for c, p in chunks:
            nb = blocks_needed(c + p, bs)
            table = list(range(next_block, next_block + nb))
            next_block += nb
            positions.extend(range(p, p + c))
            slot_b.extend(table[q // bs] for q in range(p, p + c))
            slot_o.extend(q % bs for q in range(p, p + c))
            if c == 1:
                decodes.append((row, p + 1, table))
            else:
                prefills.append((row, c, p + c, table))
            logit_rows.append(row + c - 1)
            row += c
            ids_len += c
        if next_block > self.max_blocks:
            raise ValueError(f"batch needs {next_block} KV blocks, the timer has {self.max_blocks}")
        if self.runner.is_first:
            inputs = torch.randint(0, self.cfg.vocab_size, (ids_len,), generator=self._gen)
        else:
            inputs = torch.randn(ids_len, self.cfg.hidden_size, generator=self._gen).to(self.cfg.torch_dtype)
        return inputs.to(self.device), positions, slot_b, slot_o, decodes, prefills, logit_rows

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, chunks: tuple[Chunk, ...]) -> float:
        """Seconds for one forward of this batch, metadata build included: every engine, a pipeline stage's
        too, builds its own attention metadata each iteration."""
        inputs, positions, slot_b, slot_o, decodes, prefills, logit_rows = self._inputs(chunks)
        dev = self.device
        self._sync()
        t0 = time.perf_counter()
        meta = build_metadata(slot_b, slot_o, decodes, prefills, self.block_size, dev)
        rows = None
        if self.runner.is_last and len(logit_rows) != len(positions):
            rows = torch.tensor(logit_rows, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        out = self.runner.forward(inputs, pos, self.kv, meta, rows)
        out = out.cpu()
        self._sync()
        return time.perf_counter() - t0

    def measure(self, chunks: tuple[Chunk, ...], repeats: int = 5) -> float:
        self.run(chunks)  # warm-up (allocator, caches, lazy kernels)
        return statistics.median(self.run(chunks) for _ in range(max(1, repeats)))


# Decode batches are kept below this many context tokens in all. On the CPU path the batched decode
# gathers every sequence's KV into one fresh tensor per layer; past ~32 MiB per layer (32k tokens of the
# tiny model) glibc serves it with mmap and every step pays ~8k page faults per layer: a 3-5x cliff that
# neither paper's model has a term for (measured: 32 x 1024 context 134 ms vs 16 x 1024 35 ms).
MAX_DECODE_CONTEXT = 16384


def profile_grid(max_len: int, quick: bool = False, max_decode_context: int = MAX_DECODE_CONTEXT) -> list[GridPoint]:
    """Batch shapes to time: (phase, chunks). Every chunk keeps prefix + tokens <= max_len."""
    pts: list[GridPoint] = []

    def add(phase: str, chunks: list[Chunk]) -> None:
        if not chunks or not all(c + p <= max_len and c > 0 and p >= 0 for c, p in chunks):
            return
        if sum(p + 1 for c, p in chunks if c == 1) > max_decode_context:
            return
        pts.append((phase, tuple(chunks)))

    if quick:
        pre = [16, 48, 128, 256, 512, 1024]
        multi = [(2, 64), (4, 128), (8, 32)]
        cp_c, cp_p = [32, 128, 384], [128, 512, 1024]
        dec_b, dec_ctx = [1, 4, 16, 48], [32, 256, 1024]
        mixed = [(4, 128, 64, 0), (16, 512, 128, 256), (8, 256, 256, 0), (32, 128, 32, 512)]
        multi_cp = [(3, 64, 512), (2, 128, 1024), (4, 32, 256)]
    else:
        pre = [8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072]
        multi = [(2, 32), (2, 256), (4, 64), (4, 128), (8, 32), (8, 64), (16, 16)]
        cp_c, cp_p = [16, 64, 128, 256, 512], [64, 256, 512, 1024, 1536, 3072]
        dec_b, dec_ctx = [1, 2, 4, 8, 16, 32, 64], [16, 128, 512, 1024]
        mixed = [(b, ctx, c, p) for b in (4, 16) for ctx in (128, 512) for c, p in ((32, 0), (128, 256), (256, 0))]
        multi_cp = [(k, c, p) for k in (2, 4) for c in (32, 128) for p in (256, 1024)] + [(8, 32, 512), (3, 256, 512)]
    for c in pre:
        add("prefill", [(c, 0)])
    for k, c in multi:
        add("prefill", [(c, 0)] * k)
    for c in cp_c:
        for p in cp_p:
            add("chunked_prefill", [(c, p)])
    for k, c, p in multi_cp:  # several chunks deep into their prompts: what lookahead microbatches hold
        add("chunked_prefill", [(c, p + 16 * i) for i in range(k)])
    for b in dec_b:
        for ctx in dec_ctx:
            add("decode", [(1, ctx - 1)] * b)
    for b, ctx, c, p in mixed:
        add("mixed", [(1, ctx - 1)] * b + [(c, p)])
    return pts


@dataclass
class ProfileRun:
    profile: Profile
    train: list[Sample]
    heldout: list[Sample]


def fit_profile(samples: list[Sample], *, model: str, dtype: str, layers: tuple[int, int], device_sig: str,
                torch_version: str = "") -> ProfileRun:
    """Fit both models on the training points; report errors on the held-out ones."""
    train, held = split_holdout(samples)
    kun = fit_kunserve(train)
    con = fit_conserve(train)
    fit = {
        "kunserve": {"heldout": relative_errors(kun, held).to_dict(), "train": relative_errors(kun, train).to_dict()},
        "conserve": {"heldout": relative_errors(con, held).to_dict(), "train": relative_errors(con, train).to_dict()},
        "train_points": len(train), "heldout_points": len(held),
    }
    prof = Profile(model=model, dtype=dtype, layers=layers, device=device_sig, kunserve=kun, conserve=con, fit=fit,
                   samples=samples, created_unix_s=time.time(), torch_version=torch_version)
    return ProfileRun(prof, train, held)


def measure_grid(timer: BatchTimer, grid: list[GridPoint], repeats: int,
                 progress: Callable[[int, int, GridPoint], None] | None = None) -> list[Sample]:
    out = []
    for i, (phase, chunks) in enumerate(grid):
        if timer.blocks_for(chunks) > timer.max_blocks:
            continue
        out.append(Sample(phase, chunks, timer.measure(chunks, repeats)))
        if progress is not None:
            progress(i + 1, len(grid), (phase, chunks))
    return out


def grid_blocks(grid: list[GridPoint], block_size: int) -> int:
    return max(sum(blocks_needed(c + p, block_size) for c, p in chunks) for _, chunks in grid)


def profile_layers(cfg: ModelConfig, weights: Weights, *, model: str, layers: tuple[int, int], device: str,
                   device_sig: str, block_size: int, max_len: int = 2048, quick: bool = True, repeats: int = 0,
                   progress: Callable[[int, int, GridPoint], None] | None = None) -> ProfileRun:
    """Measure one layer range over the grid and fit both models: what `kunserve profile` and a worker that
    profiles itself at start-up both run. Weights are not oneDNN-packed, as in the worker's memory pool."""
    grid = profile_grid(min(cfg.max_position_embeddings, max_len), quick=quick)
    timer = BatchTimer(cfg, weights, layers, device, block_size=block_size, max_blocks=grid_blocks(grid, block_size))
    samples = measure_grid(timer, grid, repeats or (3 if quick else 7), progress)
    del timer
    run = fit_profile(samples, model=model, dtype=cfg.dtype, layers=layers, device_sig=device_sig,
                      torch_version=torch.__version__)
    if layers == (0, cfg.num_layers):
        run.profile.loop = measure_loop_overhead(cfg, weights, run.profile.conserve, device=device,
                                                 block_size=block_size, quick=quick)
    return run


# Decode batches the loop overhead is measured on: (requests, prompt tokens, generated tokens). Sizes 1 to 32 separate
# the per-iteration constant from the per-sequence cost; contexts stay short so no batch nears MAX_DECODE_CONTEXT.
LOOP_BATCHES = ((1, 32, 33), (4, 32, 33), (16, 32, 33), (32, 32, 33))
LOOP_BATCHES_QUICK = ((1, 32, 17), (8, 32, 17), (32, 32, 17))


def measure_loop_overhead(cfg: ModelConfig, weights: Weights, model: ConServeLatencyModel, *,
                          device: str | torch.device = "cpu", block_size: int = 16, quick: bool = True,
                          batches: Iterable[tuple[int, int, int]] | None = None, seed: int = 0) -> LoopOverhead:
    """What a whole-model `Engine` iteration costs beyond `model`'s prediction for its batch: each batch of
    `batches` runs to completion on a fresh request set, every decode iteration is timed (step + stats, as
    `EngineLoop` runs them) and `fit_loop_overhead` fits the difference. Weights are not packed, as in the worker's
    memory pool. Runs one warm-up batch first (allocator, lazy kernels)."""
    from kunserve.shared.engine.api import EngineRequest, SamplingParams
    from kunserve.shared.engine.engine import Engine

    plan = list(batches if batches is not None else (LOOP_BATCHES_QUICK if quick else LOOP_BATCHES))
    blocks = max(n * blocks_needed(p + o + 1, block_size) for n, p, o in plan) + 1
    engine = Engine(cfg, weights, num_kv_blocks=blocks, block_size=block_size, device=device, pack_weights=False)
    scheduled: list[BatchShape] = []
    engine.on_schedule = lambda chunks: scheduled.append(BatchShape.of((c.num_tokens, c.start) for c in chunks))
    rng = random.Random(seed)
    steps: list[tuple[BatchShape, float]] = []
    for k, (n, prompt, out) in enumerate([(1, 16, 4), *plan]):
        for i in range(n):
            ids = [rng.randrange(cfg.vocab_size) for _ in range(prompt)]
            engine.add_request(EngineRequest(f"loop-{k}-{i}", ids, SamplingParams(max_tokens=out, ignore_eos=True)))
        while engine.has_work():
            scheduled.clear()
            t0 = time.perf_counter()
            engine.step()
            engine.stats()
            seconds = time.perf_counter() - t0
            if k > 0 and len(scheduled) == 1 and scheduled[0].tokens == scheduled[0].num_chunks:
                steps.append((scheduled[0], seconds))
    return fit_loop_overhead(steps, model)
