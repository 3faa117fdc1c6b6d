"""How fast the unified memory pool drops and restores layers, and what a drop buys.

Three parts, printed as tables and written as JSON (`--out`):

1. micro   — one page mapped / unmapped per call (µs per page), a run of consecutive pages in one
             call, MAP_POPULATE (host), hole punching (host), making a tensor view;
2. layers  — `LayerMemoryLayout.drop_layers(N)` and `restore_layers(N)` on a synthetic model
             (remap time per page and per GiB remapped, weight-fill time, KV blocks before/after);
3. qwen14b — pure arithmetic: KV capacity of a Qwen2.5-14B-shaped model (48 layers, hidden 5120,
             40 / 8 heads, head_dim 128, intermediate 13824, vocab 152064, bf16) on one 80 GB GPU,
             before and after dropping half the layers (two instances merged into a 2-stage
             pipeline), using the layout's own capacity rule with 2 MiB pages.

    python bench/remap.py --quick                    # host backend, a short run
    python bench/remap.py --out bench/results/remap.json
    python bench/remap.py --backend cuda --shape qwen14b --layers 16 --pool-gib 24   # on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kunserve.shared.memory import (
    DEFAULT_PAGE_SIZE,
    KVCacheSpec,
    LayerMemoryLayout,
    TensorSpec,
    WeightGroupSpec,
    arena_pages,
    create_pool,
    kv_capacity,
)

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------- model shapes
def qwen14b_shapes(dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Tensor specs of Qwen2.5-14B (QKV bias, untied lm_head)."""
    h, inter, vocab, heads, kvh, hd, layers = 5120, 13824, 152064, 40, 8, 128, 48

    def layer(i: int) -> list[TensorSpec]:
        p = f"model.layers.{i}."
        return [
            TensorSpec(p + "input_layernorm.weight", (h,), dtype),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * hd, h), dtype),
            TensorSpec(p + "self_attn.q_proj.bias", (heads * hd,), dtype),
            TensorSpec(p + "self_attn.k_proj.weight", (kvh * hd, h), dtype),
            TensorSpec(p + "self_attn.k_proj.bias", (kvh * hd,), dtype),
            TensorSpec(p + "self_attn.v_proj.weight", (kvh * hd, h), dtype),
            TensorSpec(p + "self_attn.v_proj.bias", (kvh * hd,), dtype),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * hd), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), dtype),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), dtype),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), dtype),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), dtype),
        ]

    groups = [
        WeightGroupSpec("embed", (TensorSpec("model.embed_tokens.weight", (vocab, h), dtype),), "first"),
        WeightGroupSpec("head", (TensorSpec("model.norm.weight", (h,), dtype),
                                 TensorSpec("lm_head.weight", (vocab, h), dtype)), "last"),
    ]
    return {"layers": layers, "layer_specs": layer, "groups": groups,
            "kv": KVCacheSpec(num_kv_heads=kvh, head_dim=hd, block_size=16, dtype=dtype)}


def synthetic_shapes(layer_mib: int, group_mib: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Layers of `layer_mib` MiB in four tensors, embed/head groups of `group_mib`; Qwen-14B KV blocks."""
    isz = torch.empty((), dtype=dtype).element_size()
    n = layer_mib * MiB // isz // 4

    def layer(i: int) -> list[TensorSpec]:
        return [TensorSpec(f"model.layers.{i}.w{j}", (n,), dtype) for j in range(4)]

    g = group_mib * MiB // isz
    groups = [WeightGroupSpec("embed", (TensorSpec("model.embed_tokens.weight", (g,), dtype),), "first"),
              WeightGroupSpec("head", (TensorSpec("lm_head.weight", (g,), dtype),), "last")]
    return {"layers": None, "layer_specs": layer, "groups": groups,
            "kv": KVCacheSpec(num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)}


# ---------------------------------------------------------------------- helpers
def _sync(pool: Any) -> None:
    if pool.backend == "cuda":
        torch.cuda.synchronize(pool.device)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def micro(backend: str, page_size: int, pages: int, trials: int) -> dict[str, Any]:
    """Per-call costs of the pool primitives."""
    out: dict[str, Any] = {"pages": pages}
    variants = [("default", {})]
    if backend == "host":
        variants.append(("populate", {"populate": True}))
    for name, kw in variants:
        pool = create_pool(backend, num_pages=pages, page_size=page_size, **kw)
        vr = pool.reserve(pages, "micro")
        single_map, single_unmap, run_map, run_unmap, views = [], [], [], [], []
        order = list(range(0, pages, 2)) + list(range(1, pages, 2))  # no two neighbours in a row: no coalescing
        for _ in range(trials):
            t0 = time.perf_counter()
            for s, p in enumerate(order):
                pool.map(vr, s, [p])
            _sync(pool)
            single_map.append((time.perf_counter() - t0) / pages)
            t0 = time.perf_counter()
            v = pool.view(vr, 0, (pages * page_size,), torch.uint8)
            views.append(time.perf_counter() - t0)
            del v
            t0 = time.perf_counter()
            for s in range(pages):
                pool.unmap(vr, s, 1)
            single_unmap.append((time.perf_counter() - t0) / pages)
            t0 = time.perf_counter()
            pool.map(vr, 0, list(range(pages)))
            _sync(pool)
            run_map.append((time.perf_counter() - t0) / pages)
            t0 = time.perf_counter()
            pool.unmap(vr, 0, pages)
            run_unmap.append((time.perf_counter() - t0) / pages)
        res = {
            "map_us_per_page": _median(single_map) * 1e6,
            "unmap_us_per_page": _median(single_unmap) * 1e6,
            "map_run_us_per_page": _median(run_map) * 1e6,
            "unmap_run_us_per_page": _median(run_unmap) * 1e6,
            "view_us": _median(views) * 1e6,
        }
        if backend == "host":
            # Touch every page, then punch them all out again.
            pool.map(vr, 0, list(range(pages)))
            v = pool.view(vr, 0, (pages * page_size,), torch.uint8)
            v.fill_(1)
            del v
            pool.unmap(vr, 0, pages)
            pool._discarded.clear()  # noqa: SLF001 - force one fallocate per page below
            t0 = time.perf_counter()
            for p in range(pages):
                pool._discard([p])  # noqa: SLF001
            res["discard_us_per_page"] = (time.perf_counter() - t0) / pages * 1e6
        pool.close()
        out[name] = res
    return out


def layer_bench(backend: str, page_size: int, shapes: dict[str, Any], num_layers: int, pool_bytes: int,
                drops: list[int], trials: int, populate: bool) -> list[dict[str, Any]]:
    """Drop and restore the last N layers of a worker holding all `num_layers`, `trials` times each."""
    kw = {"populate": True} if (backend == "host" and populate) else {}
    pool = create_pool(backend, pool_bytes=pool_bytes, page_size=page_size, **kw)
    layout = LayerMemoryLayout(pool, num_layers_model=num_layers, layer_start=0, layer_end=num_layers,
                               layer_specs=shapes["layer_specs"], kv=shapes["kv"], groups=shapes["groups"])
    with torch.no_grad():
        for i, (_name, t) in enumerate(sorted(layout.weights().items())):
            t.fill_(float(i % 7) + 0.5)  # cheap, distinct contents
        del t  # a loop variable left alive would pin the last layer's pages (drop would refuse)
        for x in layout.layers:
            kv = layout.layer_cache(x)
            kv.fill_(1.0)  # fault the KV pages in, as a serving worker would have
            del kv
    _sync(pool)
    rows = []
    for n in drops:
        if n >= num_layers:
            continue
        layers = list(range(num_layers - n, num_layers))
        source = layout.host_copy(layers)  # the host copy a restore reads from (KunServe §4.4)
        weight_bytes = sum(t.numel() * t.element_size() for t in source.values())
        drop_s, restore_s, fill_s = [], [], []
        last_drop = last_restore = None
        for _ in range(trials):
            gc.collect()
            s0 = dict(pool.stats)
            t0 = time.perf_counter()
            last_drop = layout.drop_layers(layers)
            _sync(pool)
            drop_s.append(time.perf_counter() - t0)
            drop_calls = pool.stats["map_calls"] - s0["map_calls"] + pool.stats["unmap_calls"] - s0["unmap_calls"]
            s1 = dict(pool.stats)
            t0 = time.perf_counter()
            last_restore = layout.restore_layers(layers, source, used_block_ids=())
            _sync(pool)
            total = time.perf_counter() - t0
            restore_s.append(last_restore.seconds)
            fill_s.append(total - last_restore.seconds)
            restore_calls = (pool.stats["map_calls"] - s1["map_calls"] + pool.stats["unmap_calls"]
                             - s1["unmap_calls"])
        assert last_drop is not None and last_restore is not None
        d_pages = last_drop.pages_unmapped + last_drop.pages_mapped
        r_pages = last_restore.pages_unmapped + last_restore.pages_mapped
        d, r, f = _median(drop_s), _median(restore_s), _median(fill_s)
        rows.append({
            "layers_dropped": n,
            "pages_freed": last_drop.pages_unmapped,
            "gib_remapped": last_drop.pages_unmapped * page_size / GiB,
            "drop_ms": d * 1e3,
            "drop_us_per_page": d / d_pages * 1e6,
            "drop_ms_per_gib": d * 1e3 / (last_drop.pages_unmapped * page_size / GiB),
            "drop_backend_calls": drop_calls,
            "restore_remap_ms": r * 1e3,
            "restore_us_per_page": r / r_pages * 1e6,
            "restore_ms_per_gib": r * 1e3 / (last_restore.pages_mapped * page_size / GiB),
            "restore_backend_calls": restore_calls,
            "restore_fill_ms": f * 1e3,
            "fill_gb_per_s": weight_bytes / f / 1e9 if f > 0 else float("nan"),
            "kv_blocks_before": last_drop.old_num_blocks,
            "kv_blocks_after_drop": last_drop.new_num_blocks,
            "trials": trials,
        })
        del source
    layout.close()
    pool.close()
    return rows


def qwen14b_arithmetic(gpu_gib: float, util: float, page_size: int) -> dict[str, Any]:
    """KV capacity before/after dropping half the layers of Qwen2.5-14B, per the layout's rule."""
    s = qwen14b_shapes()
    L, kv = s["layers"], s["kv"]
    pool_bytes = int(gpu_gib * GiB * util)
    total_pages = pool_bytes // page_size
    layer_pages = arena_pages(s["layer_specs"](0), page_size)
    layer_bytes = sum(t.nbytes for t in s["layer_specs"](0))
    groups = {g.name: (arena_pages(g.tensors, page_size), sum(t.nbytes for t in g.tensors)) for g in s["groups"]}

    def plan(start: int, end: int) -> Any:
        w = (end - start) * layer_pages
        w += groups["embed"][0] if start == 0 else 0
        w += groups["head"][0] if end == L else 0
        return kv_capacity(total_pages, w, end - start, page_size, kv.block_bytes, start)

    full = plan(0, L)
    first, second = plan(0, L // 2), plan(L // 2, L)
    tok_before = full.num_blocks * kv.block_size  # tokens one instance can hold
    # After the drop the two workers form one 2-stage pipeline: a token needs a block in both stages.
    tok_after = min(first.num_blocks, second.num_blocks) * kv.block_size
    weights_total = L * layer_bytes + sum(b for _, b in groups.values())
    return {
        "gpu_gib": gpu_gib, "memory_utilization": util, "pool_bytes": pool_bytes, "page_size": page_size,
        "total_pages": total_pages,
        "weight_bytes_total": weights_total,
        "layer_weight_bytes": layer_bytes, "layer_weight_pages": layer_pages,
        "embed_pages": groups["embed"][0], "head_pages": groups["head"][0],
        "kv_block_bytes": kv.block_bytes, "kv_bytes_per_token_all_layers": kv.block_bytes // kv.block_size * L,
        "before": {"layers": [0, L], "weight_pages": full.weight_pages, "kv_pages_per_layer": full.kv_pages_per_layer,
                   "kv_blocks": full.num_blocks, "kv_tokens": tok_before, "spare_pages": full.spare_pages},
        "after_stage0": {"layers": [0, L // 2], "weight_pages": first.weight_pages,
                         "kv_pages_per_layer": first.kv_pages_per_layer, "kv_blocks": first.num_blocks,
                         "spare_pages": first.spare_pages},
        "after_stage1": {"layers": [L // 2, L], "weight_pages": second.weight_pages,
                         "kv_pages_per_layer": second.kv_pages_per_layer, "kv_blocks": second.num_blocks,
                         "spare_pages": second.spare_pages},
        "pair_tokens_before": 2 * tok_before,
        "pair_tokens_after": tok_after,
        "gain": tok_after / (2 * tok_before),
    }


# ---------------------------------------------------------------------- output
def print_tables(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=200)  # rich assumes 80 columns in a pipe
    m = res["micro"]
    t = Table(title=f"pool primitives — {res['backend']}, {res['page_size'] // MiB} MiB pages, {m['pages']} pages")
    for col in ("variant", "map µs/page", "unmap µs/page", "map run µs/page", "unmap run µs/page", "view µs",
                "discard µs/page"):
        t.add_column(col, justify="right")
    for name, r in m.items():
        if name == "pages":
            continue
        t.add_row(name, f"{r['map_us_per_page']:.1f}", f"{r['unmap_us_per_page']:.1f}",
                  f"{r['map_run_us_per_page']:.1f}", f"{r['unmap_run_us_per_page']:.1f}", f"{r['view_us']:.1f}",
                  f"{r['discard_us_per_page']:.1f}" if "discard_us_per_page" in r else "-")
    con.print(t)

    c = res["config"]
    t = Table(title=f"drop / restore the last N layers — {res['backend']}, {c['shape']} model, {c['layers']} layers, "
                    f"pool {c['pool_gib']:.2f} GiB ({'populate' if c['populate'] else 'lazy'})")
    for col in ("N", "GiB freed", "drop ms", "µs/page", "ms/GiB", "calls", "restore ms", "µs/page", "ms/GiB",
                "calls", "fill ms", "fill GB/s", "KV blocks", "after drop"):
        t.add_column(col, justify="right")
    for r in res["layers"]:
        t.add_row(str(r["layers_dropped"]), f"{r['gib_remapped']:.2f}", f"{r['drop_ms']:.2f}",
                  f"{r['drop_us_per_page']:.1f}", f"{r['drop_ms_per_gib']:.1f}", str(r["drop_backend_calls"]),
                  f"{r['restore_remap_ms']:.2f}", f"{r['restore_us_per_page']:.1f}",
                  f"{r['restore_ms_per_gib']:.1f}", str(r["restore_backend_calls"]), f"{r['restore_fill_ms']:.1f}",
                  f"{r['fill_gb_per_s']:.2f}", str(r["kv_blocks_before"]), str(r["kv_blocks_after_drop"]))
    con.print(t)

    q = res["qwen14b"]
    t = Table(title=f"Qwen2.5-14B (bf16, 16-token blocks) on one {q['gpu_gib']:.0f} GiB GPU × "
                    f"{q['memory_utilization']:.2f}, {q['page_size'] // MiB} MiB pages: drop half the layers")
    for col in ("worker", "layers", "weight GiB", "KV pages/layer", "KV blocks", "KV tokens", "spare pages"):
        t.add_column(col, justify="right")
    P = q["page_size"]
    b = q["before"]
    t.add_row("before (each of 2)", f"[0, {b['layers'][1]})", f"{b['weight_pages'] * P / GiB:.2f}",
              str(b["kv_pages_per_layer"]), str(b["kv_blocks"]), str(b["kv_tokens"]), str(b["spare_pages"]))
    for k in ("after_stage0", "after_stage1"):
        s = q[k]
        t.add_row(k.replace("_", " "), f"[{s['layers'][0]}, {s['layers'][1]})", f"{s['weight_pages'] * P / GiB:.2f}",
                  str(s["kv_pages_per_layer"]), str(s["kv_blocks"]), str(s["kv_blocks"] * 16), str(s["spare_pages"]))
    con.print(t)
    con.print(f"two instances hold {q['pair_tokens_before']:,} tokens of KV; merged into one 2-stage pipeline they "
              f"hold {q['pair_tokens_after']:,} ({q['gain']:.2f}×). KV per token, all layers: "
              f"{q['kv_bytes_per_token_all_layers'] // 1024} KiB; weights {q['weight_bytes_total'] / 1e9:.1f} GB.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["host", "cuda"], default="host")
    ap.add_argument("--quick", action="store_true", help="a short run: small pool, fewer layers and trials")
    ap.add_argument("--page-mib", type=int, default=DEFAULT_PAGE_SIZE // MiB)
    ap.add_argument("--shape", choices=["synthetic", "qwen14b"], default="synthetic")
    ap.add_argument("--layers", type=int, default=None, help="layers the worker holds (default 8; quick 4)")
    ap.add_argument("--layer-mib", type=int, default=64, help="synthetic layer size")
    ap.add_argument("--pool-gib", type=float, default=None, help="pool size (default 2; quick 0.5)")
    ap.add_argument("--drop", default=None, help="comma-separated N to drop (default 1,2,4; quick 1,2)")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--micro-pages", type=int, default=None)
    ap.add_argument("--populate", action="store_true", help="host: MAP_POPULATE every mapping")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory for the Qwen arithmetic")
    ap.add_argument("--gpu-util", type=float, default=0.90, help="share of it given to the pool")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/remap.json, or remap_cuda.json)")
    args = ap.parse_args(argv)

    q = args.quick
    layers = args.layers or (4 if q else 8)
    pool_gib = args.pool_gib or (0.5 if q else 2.0)
    drops = [int(x) for x in (args.drop or ("1,2" if q else "1,2,4")).split(",")]
    trials = args.trials or (3 if q else 7)
    micro_pages = args.micro_pages or (64 if q else 256)
    page_size = args.page_mib * MiB
    shapes = qwen14b_shapes() if args.shape == "qwen14b" else synthetic_shapes(
        args.layer_mib if not q else min(args.layer_mib, 16), 32 if not q else 8)
    if args.backend == "cuda":
        torch.cuda.init()

    res: dict[str, Any] = {
        "backend": args.backend,
        "page_size": page_size,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if args.backend == "cuda" else platform.processor()},
        "config": {"shape": args.shape, "layers": layers, "pool_gib": pool_gib, "drops": drops, "trials": trials,
                   "populate": args.populate, "quick": q},
    }
    res["micro"] = micro(args.backend, page_size, micro_pages, trials)
    res["layers"] = layer_bench(args.backend, page_size, shapes, layers, int(pool_gib * GiB), drops, trials,
                                args.populate)
    res["qwen14b"] = qwen14b_arithmetic(args.gpu_gib, args.gpu_util, page_size)
    print_tables(res)
    out = Path(args.out or f"bench/results/remap{'_cuda' if args.backend == 'cuda' else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
