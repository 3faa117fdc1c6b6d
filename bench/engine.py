"""Engine throughput on this machine: prefill and decode tokens/s, and the vLLM-CPU reference workload.

Three parts, printed as tables and written as JSON (`--out`):

1. prefill   — B prompts of --prompt-len random tokens, max_tokens=1, default scheduler (512-token
               budget, chunked): prompt tokens / wall time, at batch 1, 8, 32;
2. decode    — B requests already prefilled (prompt --prompt-len), then --decode-steps pure decode
               iterations: generated tokens / wall time of those iterations, at batch 1, 8, 32;
3. reference — the workload vLLM-CPU was measured on (2,200 output tok/s): 16 prompts of 128 random
               tokens -> 64 output tokens each, ignore_eos, greedy, float32, one torch thread, on the
               TINY_CONFIG shape; output tokens / wall time of the whole run (prefill included).

Both parts 1-2 run on TINY_CONFIG (hidden 256, 4 layers) and on a larger shape (8 layers, hidden 1024,
16 / 4 heads, intermediate 2816, vocab 8192). Each figure is the best of --repeats runs (the machine
is shared and noisy: the best run is the least disturbed one); the median is in the JSON too.

    python bench/engine.py --quick
    python bench/engine.py --out bench/results/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.weights import random_weights

LARGER_CONFIG = ModelConfig(vocab_size=8192, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                            intermediate_size=2816, head_dim=64, max_position_embeddings=2048,
                            bos_token_id=256, eos_token_id=257, name="larger-8L-1024")
VLLM_CPU_REFERENCE_TOK_S = 2200.0
BLOCK_SIZE = 16


def _requests(cfg: ModelConfig, n: int, prompt_len: int, max_tokens: int, seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", [rng.randrange(258, cfg.vocab_size) for _ in range(prompt_len)],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


DEVICE = "cpu"


def _engine(cfg: ModelConfig, weights: dict, batch: int, tokens_per_req: int) -> Engine:
    blocks = batch * (-(-tokens_per_req // BLOCK_SIZE) + 1) + 8
    return Engine(cfg, weights, num_kv_blocks=blocks, block_size=BLOCK_SIZE, device=DEVICE,
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max(64, batch)))


def _best(fn: Callable[[int], float], repeats: int) -> dict[str, float]:
    """Run fn(rep) -> tokens/s `repeats` times; best and median."""
    vals = [fn(rep) for rep in range(repeats)]
    return {"best": max(vals), "median": statistics.median(vals), "runs": vals}


def bench_prefill(cfg: ModelConfig, weights: dict, batch: int, prompt_len: int, repeats: int) -> dict[str, float]:
    eng = _engine(cfg, weights, batch, prompt_len + 1)
    eng.generate(_requests(cfg, min(batch, 2), min(prompt_len, 32), 1, seed=99))  # warm-up

    def once(rep: int) -> float:
        reqs = _requests(cfg, batch, prompt_len, 1, seed=rep)
        t = time.perf_counter()
        eng.generate(reqs)
        return batch * prompt_len / (time.perf_counter() - t)

    return _best(once, repeats)


def bench_decode(cfg: ModelConfig, weights: dict, batch: int, prompt_len: int, steps: int,
                 repeats: int) -> dict[str, float]:
    def once(rep: int) -> float:
        eng = _engine(cfg, weights, batch, prompt_len + steps + 2)
        for r in _requests(cfg, batch, prompt_len, steps + 2, seed=rep):
            eng.add_request(r)
        while eng.scheduler.waiting or any(s.remaining > 1 for s in eng.scheduler.running):
            eng.step()  # prefill (and the first decode tokens) outside the timed window
        eng.step()
        t = time.perf_counter()
        n = 0
        for _ in range(steps):
            n += len(eng.step())
        return n / (time.perf_counter() - t)

    return _best(once, repeats)


def bench_reference(repeats: int, pooled: bool = False) -> dict[str, Any]:
    """16 x 128-token prompts -> 64 tokens each on the TINY shape, fp32, greedy, ignore_eos.

    pooled=True runs it as a worker does: weights and KV in the unified memory pool (host backend,
    2 MiB pages), the engine computing on views of the pages (no pre-packed weight copies)."""
    cfg = TINY_CONFIG
    weights = random_weights(cfg, 0)
    instance = None
    if pooled:
        from kunserve.shared.engine.pooled import PooledInstance
        from kunserve.shared.model.weights import load_model_source

        instance = PooledInstance(load_model_source(None), layer_range=(0, cfg.num_layers), pool_bytes=64 << 20,
                                  page_size=2 << 20, block_size=16)
        eng = instance.engine
    else:
        eng = _engine(cfg, weights, 16, 128 + 64)
    eng.generate(_requests(cfg, 4, 32, 4, seed=99))  # warm-up (allocator, oneDNN primitives)
    walls = []
    for rep in range(repeats):
        reqs = _requests(cfg, 16, 128, 64, seed=rep)
        t = time.perf_counter()
        out = eng.generate(reqs)
        walls.append(time.perf_counter() - t)
        assert sum(len(v) for v in out.values()) == 16 * 64
    best = 16 * 64 / min(walls)
    if instance is not None:
        instance.close()
    return {"output_tokens": 16 * 64, "best_tok_s": best, "median_tok_s": 16 * 64 / statistics.median(walls),
            "wall_s": walls, "vllm_cpu_tok_s": VLLM_CPU_REFERENCE_TOK_S, "ratio_to_vllm": best / VLLM_CPU_REFERENCE_TOK_S}


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
            "loadavg_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: fewer repeats, shorter prompts, fewer steps")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the reference workload uses 1)")
    ap.add_argument("--repeats", type=int, default=0, help="runs per figure (default 3, quick 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda for parts 1-2; the reference is CPU")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    prompt_len = 64 if args.quick else 128
    steps = 8 if args.quick else 32
    batches = (1, 8, 32)
    console = Console()
    result: dict[str, Any] = {"machine": _machine(), "quick": args.quick, "repeats": repeats,
                              "prompt_len": prompt_len, "decode_steps": steps, "shapes": []}
    for cfg in (TINY_CONFIG, LARGER_CONFIG):
        console.print(f"[bold]{cfg.name}[/]: hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
                      f"{cfg.num_heads}/{cfg.num_kv_heads} heads, intermediate {cfg.intermediate_size}, "
                      f"vocab {cfg.vocab_size} ...")
        weights = random_weights(cfg, 0)
        rows = []
        for b in batches:
            pre = bench_prefill(cfg, weights, b, prompt_len, repeats)
            dec = bench_decode(cfg, weights, b, prompt_len, steps, repeats)
            rows.append({"batch": b, "prefill_tok_s": pre, "decode_tok_s": dec})
        result["shapes"].append({"config": cfg.name, "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                                 "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                                 "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "rows": rows})
        del weights
    result["device"] = args.device
    console.print("reference workload ...")
    DEVICE = "cpu"
    torch.set_num_threads(1)
    result["reference"] = bench_reference(repeats if not args.quick else 2)
    result["reference_pooled"] = bench_reference(repeats if not args.quick else 2, pooled=True)
    torch.set_num_threads(args.threads)
    result["machine"]["loadavg_end"] = os.getloadavg()

    t = Table(title=f"engine throughput on {args.device} (tokens/s, best of {repeats}; prompt {prompt_len}, "
                    f"{args.threads} thread(s))")
    for col in ("shape", "batch", "prefill tok/s", "decode tok/s"):
        t.add_column(col, justify="right" if col != "shape" else "left")
    for shape in result["shapes"]:
        for row in shape["rows"]:
            t.add_row(shape["config"], str(row["batch"]), f"{row['prefill_tok_s']['best']:,.0f}",
                      f"{row['decode_tok_s']['best']:,.0f}")
    console.print(t)
    r = Table(title="reference workload: 16 x 128-token prompts -> 64 tokens, fp32 greedy, 1 thread, TINY shape")
    for col in ("engine", "output tok/s (best)", "median", "vLLM-CPU tok/s", "ratio"):
        r.add_column(col, justify="right")
    for label, key in (("torch-allocated, pre-packed weights", "reference"),
                       ("in the memory pool (as a worker runs)", "reference_pooled")):
        ref = result[key]
        r.add_row(label, f"{ref['best_tok_s']:,.0f}", f"{ref['median_tok_s']:,.0f}", f"{ref['vllm_cpu_tok_s']:,.0f}",
                  f"{ref['ratio_to_vllm']:.2f}")
    console.print(r)
    console.print(f"load average start {result['machine']['loadavg_start']}, end {result['machine']['loadavg_end']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
