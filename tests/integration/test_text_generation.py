"""Text in, text out through a real local cluster serving `kunserve export-model`'s directory: the model's
generation_config.json supplies the defaults a request leaves unset, streamed text pieces add up to the
tokenizer's decode of the tokens, and a stop string ends the output before it, finishes with STOP and frees
the request's KV on the worker."""

from __future__ import annotations

import json
import time

import pytest
from helpers import generate_many, make_config, run, worker_stats

from kunserve import client
from kunserve.cli.export_model import export_model
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.model.tokenizer import load_tokenizer
from kunserve.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.integration



def test_text_generation_with_defaults_stream_decoding_and_stop_strings(tmp_path):
    model = export_model(tmp_path / "model", seed=3, log=lambda *_: None)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 5}))
    tok = load_tokenizer(str(model))
    assert tok is not None
    cfg = make_config(1)
    cfg.model.path = str(model)
    c = LocalCluster(cfg, run_dir=tmp_path / "run")
    c.start(timeout_s=120)
    try:
        # max_tokens and temperature unset: generation_config's max_new_tokens (5) and greedy (do_sample false)
        bare = generation_pb2.GenerateRequest(text="KunServe keeps tail latency flat",
                                              sampling=common_pb2.SamplingParams(ignore_eos=True))
        full = client.make_request("KunServe keeps tail latency flat", max_tokens=24, temperature=None, top_k=None,
                                   top_p=None, ignore_eos=True)
        short, long = run(generate_many(cfg.dispatcher.address, [bare, full]))
        assert not isinstance(short, BaseException) and not isinstance(long, BaseException), (short, long)
        assert len(short.token_ids) == 5 and short.token_ids == long.token_ids[:5]
        assert long.text == tok.decode(long.token_ids), "streamed pieces must add up to the decode"

        text = long.text
        k = next(i for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i)
        stop = text[k:k + 2]
        # max_tokens far beyond the stop: only a cancellation on the worker ends it early
        stopped = run(generate_many(cfg.dispatcher.address, [client.make_request(
            "KunServe keeps tail latency flat", max_tokens=2000, ignore_eos=True, stop=[stop])]))[0]
        assert not isinstance(stopped, BaseException), stopped
        assert stopped.text == text[:k] and stopped.finish_reason == "stop"
        assert len(stopped.token_ids) < 24 and stopped.token_ids == long.token_ids[:len(stopped.token_ids)]
        deadline = time.monotonic() + 60
        while (stats := worker_stats(c)).kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats.kv_blocks_used == 0, f"{stats.kv_blocks_used} KV blocks still held after the stop string"
        generated_before = len(short.token_ids) + len(long.token_ids)
        assert stats.generated_tokens_total < generated_before + 100, "the worker kept generating after the stop"
    finally:
        c.stop()
