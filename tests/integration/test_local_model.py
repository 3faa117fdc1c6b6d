"""`kunserve up --model DIR`: a local Hugging Face-format directory instead of the embedded model."""

from __future__ import annotations

import grpc
import pytest
from helpers import generate_many, make_config, run
from oracle import compare_greedy

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.weights import random_weights, save_checkpoint

pytestmark = pytest.mark.integration

QWEN = TINY_CONFIG.replace(num_layers=2, qkv_bias=True, model_type="qwen2", vocab_size=512, eos_token_id=None,
                           bos_token_id=None, name="qwen-mini")
WORDS = ["[UNK]", "hello", "world", "kun", "serve", "keeps", "tail", "latency", "flat"]


def word_level_tokenizer_json() -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), QWEN.vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return tok.to_str()


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
def test_serve_a_local_hf_directory(tmp_path, with_tokenizer):
    weights = random_weights(QWEN, seed=11)
    save_checkpoint(tmp_path / "model", QWEN, weights,
                    tokenizer_json=word_level_tokenizer_json() if with_tokenizer else None)
    cfg = make_config(1)
    cfg.model.path = str(tmp_path / "model")
    c = LocalCluster(cfg, run_dir=tmp_path / "run")
    c.start(timeout_s=120)
    try:
        prompt = [1, 2, 3, 4]
        res = run(generate_many(cfg.dispatcher.address, [client.make_request(prompt, max_tokens=6, ignore_eos=True)]))[0]
        assert not isinstance(res, BaseException), res
        ref, margins = reference_greedy(QWEN, weights, prompt, 6)
        compare_greedy(res.token_ids, ref, margins)
        text_req = client.make_request("hello world kun serve", max_tokens=3, ignore_eos=True)
        if with_tokenizer:
            out = run(generate_many(cfg.dispatcher.address, [text_req]))[0]
            assert not isinstance(out, BaseException), out
            assert out.num_prompt_tokens == 4 and len(out.token_ids) == 3 and out.text.strip()
        else:
            async def expect_error():
                async with client.insecure_channel(cfg.dispatcher.address) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await client.generate(ch, text_req, timeout=30)
                return e.value
            err = run(expect_error())
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer" in err.details()
    finally:
        c.stop()
