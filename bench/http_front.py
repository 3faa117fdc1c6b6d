"""What the OpenAI-compatible HTTP front costs: the same requests through the gRPC API and through HTTP + SSE.

One local cluster (one worker, embedded model). Two measurements:

1. latency  — ``--requests`` requests (token-id prompts of ``--prompt`` tokens, ``--tokens`` greedy tokens each,
              ignore_eos), one at a time (the front's own cost, without batching noise) and then
              ``--concurrency`` at a time, in alternating blocks of each path with the same prompts (so both see
              the same engine states, and one path's requests never share a batch with the other's, which once
              skewed an interleaved run). TTFT and TPOT (client clock: from sending to the first token; mean
              gap between later tokens) p50 / p99 per path, and the difference HTTP - gRPC: the front's overhead.
2. capacity — tiny generations (``--tiny-prompt`` tokens in, 1 token out) with ``--tiny-concurrency`` in flight
              for ``--seconds``, through each path: sustained requests/s.

Clients: KunServe's gRPC client and aiohttp reading the SSE stream (what an OpenAI client does), both in this
process. The engine's compute dominates both paths; the difference is what the front adds.

    python bench/http_front.py --quick
    python bench/http_front.py --out bench/results/http_front.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from typing import Any

import harness

from kunserve import client
from kunserve.cli.launcher import LocalCluster


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def prompt_of(i: int, n: int) -> list[int]:
    return [300 + (i * 31 + j * 7) % 3000 for j in range(n)]


async def grpc_one(ch, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """(TTFT, token arrival times) on the client clock, from sending the request."""
    t0 = time.perf_counter()
    times: list[float] = []
    async for ev in client.stream(ch, client.make_request(prompt, max_tokens=tokens, ignore_eos=True), timeout=300):
        if ev.token_id >= 0:
            times.append(time.perf_counter() - t0)
    return times[0], times


async def http_one(session, url: str, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    body = {"model": "kunserve-tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    times.append(time.perf_counter() - t0)
    return times[0], times


BLOCKS = 4  # latency runs alternate the paths in this many blocks each


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


async def latency(c: LocalCluster, args, concurrency: int) -> dict[str, Any]:
    import aiohttp

    url = f"http://{c.cfg.dispatcher.http_address}/v1/completions"
    out: dict[str, dict[str, list[float]]] = {p: {"ttft": [], "tpot": []} for p in ("grpc", "http")}
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch, aiohttp.ClientSession() as session:
        await grpc_one(ch, prompt_of(0, args.prompt), 2)  # warm both paths
        await http_one(session, url, prompt_of(0, args.prompt), 2)

        async def block(path: str, first: int, n: int) -> None:
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int) -> None:
                async with sem:
                    prompt = prompt_of(i, args.prompt)
                    ttft, times = await (grpc_one(ch, prompt, args.tokens) if path == "grpc"
                                         else http_one(session, url, prompt, args.tokens))
                out[path]["ttft"].append(ttft)
                out[path]["tpot"].append(tpot(times))

            await asyncio.gather(*(one(i) for i in range(first, first + n)))

        # Blocks of each path in turn (gRPC, HTTP, HTTP, gRPC, ...), the same prompts both ways: each path sees the
        # same mix of engine states, and requests of one path never share a batch with the other's.
        size = max(1, args.requests // BLOCKS)
        for b in range(0, args.requests, size):
            n = min(size, args.requests - b)
            for path in (("grpc", "http") if (b // size) % 2 == 0 else ("http", "grpc")):
                await block(path, b, n)
    res: dict[str, Any] = {}
    for path, m in out.items():
        res[path] = {f"{k}_{q}_ms": pct(v, q) * 1000 for k, v in m.items() for q in (50, 99)}
        res[path]["requests"] = len(m["ttft"])
    res["overhead"] = {k: res["http"][k] - res["grpc"][k] for k in res["grpc"] if k.endswith("_ms")}
    return res


async def _sustain(send, seconds: float, concurrency: int, tiny_prompt: int) -> dict[str, Any]:
    """`concurrency` loops sending one tiny request after another through `send` for `seconds`."""
    done = errors = 0
    deadline = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done, errors
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            try:
                await send(prompt_of(k * 1000 + i, tiny_prompt))
                done += 1
            except Exception:  # a refusal under load counts against the path, and the loop goes on
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {"requests_per_s": done / elapsed, "completed": done, "errors": errors, "seconds": elapsed}


async def capacity(c: LocalCluster, args) -> dict[str, Any]:
    import aiohttp

    url = f"http://{c.cfg.dispatcher.http_address}/v1/completions"
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch, aiohttp.ClientSession() as session:
        return {"grpc": await _sustain(lambda p: grpc_one(ch, p, 1), args.seconds, args.tiny_concurrency, args.tiny_prompt),
                "http": await _sustain(lambda p: http_one(session, url, p, 1), args.seconds, args.tiny_concurrency,
                                       args.tiny_prompt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="requests per path in the latency run")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (latency run)")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request (latency run)")
    ap.add_argument("--tiny-prompt", type=int, default=8)
    ap.add_argument("--tiny-concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15.0, help="length of each capacity run")
    ap.add_argument("--quick", action="store_true", help="a small run (CI-sized)")
    ap.add_argument("--out", default="bench/results/http_front.json")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.tokens, args.seconds = 10, 16, 4.0
    if args.concurrency < 1 or args.requests < 1:
        ap.error("--concurrency and --requests must be >= 1")

    c = harness.bench_cluster("http-front", 1, 96)

    levels = sorted({1, args.concurrency})

    async def measure(c: LocalCluster) -> dict[str, Any]:
        return {"latency": {f"concurrency_{n}": await latency(c, args, n) for n in levels},
                "capacity": await capacity(c, args)}

    result = harness.run_on(c, measure)
    cap = result["capacity"]
    for n in levels:
        lat = result["latency"][f"concurrency_{n}"]
        print(f"\nHTTP front vs gRPC API — {args.requests} requests per path, {args.prompt} prompt + {args.tokens} "
              f"output tokens, {n} in flight")
        print(f"{'':10}{'TTFT p50':>11}{'TTFT p99':>11}{'TPOT p50':>11}{'TPOT p99':>11}   (ms)")
        for path in ("grpc", "http", "overhead"):
            r = lat[path]
            print(f"{path:10}" + "".join(f"{r[k]:11.3f}" for k in ("ttft_50_ms", "ttft_99_ms", "tpot_50_ms", "tpot_99_ms")))
    print(f"\nsustained requests/s, {args.tiny_prompt} tokens in / 1 out, {args.tiny_concurrency} in flight, "
          f"{args.seconds:g} s each")
    for path in ("grpc", "http"):
        r = cap[path]
        print(f"{path:10}{r['requests_per_s']:11.1f} req/s   ({r['completed']} completed, {r['errors']} errors)")
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
