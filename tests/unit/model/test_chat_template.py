"""Chat templates render exactly as transformers' apply_chat_template(add_generation_prompt=True,
tokenize=False), wherever the template is kept; a model without one refuses to chat, naming its directory."""

from __future__ import annotations

import json

import pytest

from kunserve.shared.model.chat_template import ChatTemplateError, chat_template_for
from kunserve.shared.model.tokenizer import ByteTokenizer, load_tokenizer

QWEN2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Today Date: " + strftime_now("%d %b %Y") %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("roles must be user or assistant, got " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 世界 🙂?"}],
]


def _model_dir(d, template: str | None, *, as_file: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
                "<|im_end|>"]
    tok.train_from_iterator(["hello world assistant user system"] * 10, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if template is not None and not as_file:
        conf["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    if template is not None and as_file:
        (d / "chat_template.jinja").write_text(template)
    return d


@pytest.mark.parametrize("name, template, as_file", [
    ("qwen2", QWEN2_CHATML, False), ("llama3", LLAMA3, False), ("llama3-jinja-file", LLAMA3, True)])
def test_render_equals_transformers(tmp_path, name, template, as_file):
    transformers = pytest.importorskip("transformers")
    d = _model_dir(tmp_path / name, template, as_file=as_file)
    tok = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    ct = chat_template_for(tok)
    for msgs in CONVERSATIONS:
        rendered = ct.render(msgs)
        assert rendered == theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.encode_chat(rendered) == theirs.apply_chat_template(msgs, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)
        assert ct.render(msgs, add_generation_prompt=False) == theirs.apply_chat_template(msgs, tokenize=False)


def test_raise_exception_and_bad_templates_are_clear_errors(tmp_path):
    d = _model_dir(tmp_path / "m", LLAMA3)
    ct = chat_template_for(load_tokenizer(str(d)))
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant, got tool"):
        ct.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages\\[0\\]"):
        ct.render(["not a message"])
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="bad.jinja"):
        chat_template_for(load_tokenizer(str(d)), override=bad)


def test_no_template_names_the_model_directory_and_override_file_works(tmp_path):
    d = _model_dir(tmp_path / "plain", None)
    tok = load_tokenizer(str(d))
    with pytest.raises(ChatTemplateError, match=f"{d}: the model has no chat template"):
        chat_template_for(tok)
    override = tmp_path / "t.jinja"
    override.write_text(QWEN2_CHATML)
    assert chat_template_for(tok, override=override).render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="does not exist"):
        chat_template_for(tok, override=tmp_path / "missing.jinja")
    # the embedded model chats in the format export-model writes into its tokenizer_config.json
    assert chat_template_for(ByteTokenizer()).render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
