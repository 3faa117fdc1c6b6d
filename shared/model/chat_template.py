"""Chat templates rendered the way `transformers`' `apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)` renders them, so a chat prompt reaches the model as the text its authors trained on.

Same jinja2 environment as transformers 5.x: a sandbox with trim_blocks / lstrip_blocks and loop controls,
`raise_exception`, `strftime_now`, a JSON `tojson` that does not escape HTML, `namespace`, and the named
special tokens (bos_token, eos_token, ...) as variables; messages keep only the keys whose value is not None.
The `{% generation %}` tag (assistant masks for training) renders its body unchanged.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that refuses the conversation."""


class _GenerationTag(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and the special-token variables it sees; `source` names where it came from."""

    def __init__(self, text: str, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = _environment().from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{source}: chat template line {exc.lineno}: {exc.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ChatTemplateError(f"messages[{i}]: expected an object with 'role' and 'content', got {m!r}")
            chat.append({k: v for k, v in m.items() if v is not None})
        try:
            return self._compiled.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: chat template refused the conversation: {exc}") from None


def chat_template_for(tokenizer: Any, override: str | pathlib.Path | None = None) -> ChatTemplate:
    """The template to chat with: the `override` file (`--chat-template FILE`) when given, else the model's own
    (inside tokenizer_config.json or chat_template.jinja). A model without one cannot chat: the error names
    its directory."""
    specials = dict(getattr(tokenizer, "special_tokens", {}) or {})
    if override is not None:
        path = pathlib.Path(override)
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {path} does not exist")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials)
    source = getattr(tokenizer, "source", "the model")
    text = getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not text:
        raise ChatTemplateError(
            f"{source}: the model has no chat template (no 'chat_template' in tokenizer_config.json and no "
            "chat_template.jinja); send a plain text prompt or pass --chat-template FILE")
    return ChatTemplate(text, f"{source}: chat_template", specials)
