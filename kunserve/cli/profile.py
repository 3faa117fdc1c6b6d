"""`kunserve profile`: time the worker's model on this device over a grid of batch shapes, fit both
cost models by least squares, write a profile file and print the fit's held-out error.

    kunserve profile --quick                                   # embedded model, all layers, ~10 s on CPU
    kunserve --config configs/cluster.toml profile --out profiles.json
    kunserve profile --model /models/qwen2-0.5b --layers 0-12 --threads 2 --out profiles.json

The profile is keyed by model, dtype, layer range [START, END) and device (on a CPU: the chip and the
torch thread count), and the worker uses it only when all of them match (`[engine] profile = FILE`).
Weights are not oneDNN-packed, as in the worker's memory pool.
"""

from __future__ import annotations

import argparse
import sys


def _layers(text: str) -> tuple[int, int]:
    try:
        a, b = text.split("-", 1)
        start, end = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START-END (half-open, like the worker's layer_start / "
                                         f"layer_end), got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {text!r}")
    return start, end


def _fail(msg: str) -> None:
    print(f"kunserve profile: {msg}", file=sys.stderr)
    raise SystemExit(1)


def cmd_profile(args: argparse.Namespace) -> None:
    import torch
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kunserve.shared.config import ConfigError, load_config
    from kunserve.shared.engine.profiler import profile_grid, profile_layers
    from kunserve.shared.model.weights import load_model_source
    from kunserve.shared.process import DeviceError, pick_device, thread_share
    from kunserve.shared.profile_files import device_signature, write_profile

    console = Console(highlight=False)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    path = args.model if args.model is not None else (cfg.model.path or None)
    dtype = args.dtype or cfg.model.dtype
    try:
        device = pick_device(args.device or cfg.model.device)
        source = load_model_source(path, seed=cfg.model.seed, dtype=dtype)
    except DeviceError as exc:
        _fail(str(exc))
    except (OSError, ValueError) as exc:
        _fail(f"cannot load model {path or '<embedded>'}: {exc}")
    mcfg = source.config
    layers = args.layers or (0, mcfg.num_layers)
    if layers[1] > mcfg.num_layers:
        _fail(f"--layers {layers[0]}-{layers[1]}: the model has {mcfg.num_layers} layers")
    threads = args.threads if args.threads is not None else thread_share(cfg)
    if threads < 1:
        _fail("--threads must be >= 1")
    torch.set_num_threads(threads)
    sig = device_signature(device, threads)
    n_points = len(profile_grid(min(mcfg.max_position_embeddings, args.max_len), quick=args.quick))
    repeats = args.repeats or (3 if args.quick else 7)
    console.print(f"[bold]Profiling[/] {source.name} ({mcfg.dtype}) layers [{layers[0]}, {layers[1]}) on {sig}: "
                  f"{n_points} batch shapes x {repeats} runs")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("measuring", total=n_points)

        def step(i: int, n: int, point) -> None:
            phase, chunks = point
            progress.update(task, completed=i, description=f"{phase:<15} {len(chunks):>3} chunk(s)")

        try:
            run = profile_layers(mcfg, source.load_weights(layers), model=source.name, layers=layers, device=device,
                                 device_sig=sig, block_size=cfg.engine.block_size, max_len=args.max_len,
                                 quick=args.quick, repeats=repeats, progress=step)
        except (OSError, ValueError, RuntimeError) as exc:
            _fail(f"cannot profile the model: {exc}")
    prof = run.profile
    write_profile(args.out, prof)

    t = Table(title=f"cost-model fit: {len(run.train)} training points, error on {len(run.heldout)} held-out points")
    for col in ("model", "phase", "held-out points", "mean rel. error", "max rel. error"):
        t.add_column(col, justify="left" if col in ("model", "phase") else "right")
    for name in ("kunserve", "conserve"):
        h = prof.fit[name]["heldout"]
        t.add_row(name, "all", str(h["points"]), f"{100 * h['mean_rel_err']:.1f}%", f"{100 * h['max_rel_err']:.1f}%")
        for phase, v in sorted(h["per_phase"].items()):
            t.add_row("", phase, str(v["points"]), f"{100 * v['mean_rel_err']:.1f}%", f"{100 * v['max_rel_err']:.1f}%")
    console.print(t)
    k = prof.kunserve
    c = prof.conserve
    console.print(f"KunServe Eq. 1-3: alpha={k.alpha:.4g} s/pair, beta={k.beta:.4g} s/token, gamma={k.gamma:.4g} s, "
                  f"lambda={k.lam:.4g} s")
    console.print(f"ConServe: k1={c.k1:.4g}, k2={c.k2:.4g}, k3={c.k3:.4g} (not identifiable on one device), "
                  f"k4={c.k4:.4g}, k5={c.k5:.4g} s")
    if prof.loop.points:
        console.print(f"engine loop beyond the forward pass: {1e3 * prof.loop.iteration_s:.3g} ms per iteration + "
                      f"{1e3 * prof.loop.per_sequence_s:.3g} ms per sequence ({prof.loop.points} decode iterations)")
    hint = escape(f'[engine] profile = "{args.out}"')
    console.print(f"wrote [bold]{escape(args.out)}[/] ({escape(prof.key)}); use it with [bold]{hint}[/] "
                  "in the cluster config")


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile the model on this device and fit the cost models (writes a profile file)")
    p.add_argument("--model", help="local Hugging Face-format model directory (default: the config's, else embedded)")
    p.add_argument("--layers", type=_layers, help="layer range START-END, half-open [START, END) (default: all)")
    p.add_argument("--out", default="kunserve-profile.json", help="profile file to add this profile to")
    p.add_argument("--threads", type=int, help="torch threads (default: the worker's share of the cores)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: the config's model.device")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the config's model.dtype")
    p.add_argument("--quick", action="store_true", help="a smaller grid and 3 runs per shape (seconds on CPU)")
    p.add_argument("--repeats", type=int, help="timed runs per shape; the median is kept (default 7, quick 3)")
    p.add_argument("--max-len", type=int, default=2048, help="longest prefix + chunk in the grid")
    p.set_defaults(func=cmd_profile)
