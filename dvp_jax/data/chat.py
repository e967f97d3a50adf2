"""Chat prompts: a conversation rendered as the text the model was tuned on.

`chat_renderer(chat_format, tokenizer)` picks once per dataset how messages become text:
"auto" (the default of `data.chat_format`) the tokenizer's own Jinja `chat_template` (its
`tokenizer_config.json`, or a `chat_template.jinja` next to it), else ChatML; "chatml" always
ChatML; "plain" the contents joined by newlines. `render_messages` renders one conversation with
`add_generation_prompt=True`, so the text ends where the assistant's answer starts. A template is
rendered as transformers' `apply_chat_template` renders it (a sandboxed Jinja environment with
trim_blocks / lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the
tokenizer's special tokens as variables). Not here: reading files (`math_data`), tokenisation.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

CHAT_FORMATS = ("auto", "chatml", "plain")
# The special-token variables transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
_TOKEN_VARIABLES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplate:
    """A tokenizer's Jinja chat template, compiled once.

    Args:
      source: the template text.
      tokens: the special-token variables (`bos_token`, `eos_token`, ...) it may read.
      bos_added: whether the tokenizer prepends BOS itself when encoding a prompt; a leading
        `bos_token` that the template writes is then left out of `prompt` (the encoder adds it
        back), so the prompt's ids are those of transformers' tokenized `apply_chat_template`.
      name: where the template came from, for error messages.

    Raises:
      ValueError: the template does not compile (a Jinja syntax error), naming `name`.
    """

    def __init__(
        self, source: str, tokens: dict[str, str], bos_added: bool = False, name: str = "template"
    ):
        self.source, self.tokens, self.name = source, dict(tokens), name
        self.bos_added = bos_added
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {name} does not compile: {e}") from None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The text of `messages`: transformers' `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)` for the same template and special tokens.

        Raises:
          ValueError: the template refused the conversation (`raise_exception`, e.g. roles that
            do not alternate) or failed on it; one line, naming the template's source.
        """
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokens,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.name}: {' '.join(str(e).split())}") from None

    def prompt(self, messages: Sequence[dict[str, Any]]) -> str:
        """`render(messages)` as the data pipeline encodes it: without the leading `bos_token`
        when the tokenizer prepends BOS itself (`bos_added`)."""
        text = self.render(messages)
        bos = self.tokens.get("bos_token")
        if self.bos_added and bos and text.startswith(bos):
            return text[len(bos) :]
        return text


def chatml(messages: Sequence[dict[str, str]]) -> str:
    """ChatML (Qwen's format): each turn `<|im_start|>role\\ncontent<|im_end|>\\n`, then the
    assistant's header."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def chat_template_of(tokenizer) -> ChatTemplate | None:
    """The tokenizer's own chat template (`HFTokenizer.hf_config`'s `chat_template`: a string,
    or named templates of which transformers uses "default"), or None when it has none."""
    config = getattr(tokenizer, "hf_config", None) or {}
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    if isinstance(source, dict):
        if "default" not in source:
            raise ValueError(
                f"{getattr(tokenizer, 'path', 'tokenizer')}: several chat templates "
                f"{sorted(map(str, source))} and none named 'default'"
            )
        source = source["default"]
    if not isinstance(source, str) or not source.strip():
        return None
    tokens = {}
    for key in _TOKEN_VARIABLES:  # a string, or {"content": ...} in older configs
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return ChatTemplate(
        source,
        tokens,
        bos_added=bool(getattr(tokenizer, "add_bos", False)),
        name=str(getattr(tokenizer, "path", "tokenizer")),
    )


def chat_renderer(chat_format: str, tokenizer=None) -> str | ChatTemplate:
    """How a dataset's conversations become text: the tokenizer's `ChatTemplate` for "auto"
    when it has one, else the format's name ("chatml", "plain"; "auto" without a template is
    "chatml"). Pass the result to `render_messages`.

    Raises:
      ValueError: an unknown `chat_format` (naming `CHAT_FORMATS`), or a template that does not
        compile.
    """
    if isinstance(chat_format, ChatTemplate):
        return chat_format
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
    if chat_format == "auto":
        return chat_template_of(tokenizer) or "chatml"
    return chat_format


def render_messages(
    messages: Sequence[dict[str, str]], chat_format: str | ChatTemplate = "chatml"
) -> str:
    """Chat messages -> prompt text ending where the assistant's answer starts.

    Args:
      messages: `{"role", "content"}` dicts (a system prompt is a first "system" message).
      chat_format: a `chat_renderer` result (a `ChatTemplate`, "chatml" or "plain"), or "auto"
        (without a tokenizer: ChatML).

    Raises:
      ValueError: an unknown format, or a template that refuses this conversation (a row
        problem: the loader skips that row).
    """
    if isinstance(chat_format, ChatTemplate):
        return chat_format.prompt(messages)
    chat_format = chat_renderer(chat_format)
    if chat_format == "plain":
        return "\n".join(m["content"] for m in messages)
    return chatml(messages)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks assistant text for
    its masks): here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> jinja2.Environment:
    """The Jinja environment transformers renders chat templates in (sandboxed, immutable)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
