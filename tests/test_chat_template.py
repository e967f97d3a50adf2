# ruff: noqa: E501  (the chat templates keep the long lines their authors wrote)
"""Chat templates: our rendering equals transformers' `apply_chat_template` on real-shaped
templates (Qwen3, Llama-3, Gemma), ChatML is the fallback, and the data path uses the template.

The tokenizer is trained here (byte-level BPE on a few sentences): no downloads.
"""

import json

import pytest

from dvp_jax.data.chat import ChatTemplate, chat_renderer, render_messages
from dvp_jax.data.math_data import load_math_dataset
from dvp_jax.tokenizers import HFTokenizer

SPECIALS = [
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
]
CORPUS = [
    "You are a careful mathematician. Put the final answer in \\boxed{}.",
    "What is 12 plus 34? Let x = 1/2, so 2x = 1.",
    "Today Date: 26 Jul 2024 Cutting Knowledge think system user assistant model",
] * 10

# Qwen3's template, shortened (no tools): a namespace scan for the last user query, the
# assistant's reasoning split at </think>, dash-trimmed blocks.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.1's template, shortened (no tools): BOS written by the template, a default date.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma's template without dashes: its output depends on trim_blocks and lstrip_blocks; the
# system prompt is folded into the first user turn; roles must alternate (raise_exception).
GEMMA = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set first_user_prefix = "" %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
        {% set role = "model" %}
    {% else %}
        {% set role = message['role'] %}
    {% endif %}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim + '<end_of_turn>\\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<start_of_turn>model\\n' }}
{% endif %}
"""

# name -> (template, tokenizer_config.json special tokens); Llama and Gemma prepend BOS.
TEMPLATES = {
    "qwen3": (QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (
        LLAMA3,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True},
    ),
    "gemma": (
        GEMMA,
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True},
    ),
}
SYSTEM = {"role": "system", "content": "You are a careful mathematician."}
USER = {"role": "user", "content": "What is 12 plus 34?"}
CONVERSATIONS = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [
        SYSTEM,
        USER,
        {"role": "assistant", "content": "<think>\n12 + 34\n</think>\n\n\\boxed{46}"},
        {"role": "user", "content": "  And 1/2 plus 1/2?  "},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("chat_tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _tokenizer_dir(tokenizer_json, directory, template=None, tokens=None, jinja_file=False):
    """A tokenizer directory as a Hub repo has it: tokenizer_config.json [+ chat_template.jinja]."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json.read_text())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    config |= tokens or {}
    if template is not None and not jinja_file:
        config["chat_template"] = template
    if template is not None and jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _theirs(directory, messages, tokenize=False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    out = tok.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True)
    return out if not tokenize or isinstance(out, list) else list(out["input_ids"])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_does(name, tokenizer_json, tmp_path):
    template, tokens = TEMPLATES[name]
    directory = _tokenizer_dir(tokenizer_json, tmp_path / name, template, tokens)
    tok = HFTokenizer(directory)
    chat = chat_renderer("auto", tok)
    assert isinstance(chat, ChatTemplate)
    for conversation in CONVERSATIONS.values():
        theirs = _theirs(directory, conversation)
        assert chat.render(conversation) == theirs
        # The data path: the prompt text, and its ids as the pipeline encodes them (BOS from
        # the encoder, not the text) equal transformers' tokenized chat.
        prompt = render_messages(conversation, chat)
        ids = [tok.bos_id] * tok.add_bos + tok.encode_ids(prompt)
        assert ids == _theirs(directory, conversation, tokenize=True)
    if name == "gemma":  # the template's own refusal: one line, a ValueError (a row problem)
        with pytest.raises(ValueError, match="roles must alternate") as e:
            chat.render([USER, USER])
        assert "\n" not in str(e.value)


def test_expected_text_of_one_case_and_chatml_fallback(tokenizer_json, tmp_path):
    """One case written out by hand (Qwen3's template is ChatML for these turns), the fallback
    without a template, "chatml" forcing ChatML, and "plain"."""
    chatml = (
        "<|im_start|>system\nYou are a careful mathematician.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 plus 34?<|im_end|>\n<|im_start|>assistant\n"
    )
    qwen = HFTokenizer(_tokenizer_dir(tokenizer_json, tmp_path / "q", *TEMPLATES["qwen3"]))
    assert render_messages([SYSTEM, USER], chat_renderer("auto", qwen)) == chatml
    bare = HFTokenizer(_tokenizer_dir(tokenizer_json, tmp_path / "bare"))
    assert chat_renderer("auto", bare) == "chatml"
    assert render_messages([SYSTEM, USER], chat_renderer("auto", bare)) == chatml
    llama = HFTokenizer(_tokenizer_dir(tokenizer_json, tmp_path / "l", *TEMPLATES["llama3"]))
    assert render_messages([SYSTEM, USER], chat_renderer("chatml", llama)) == chatml
    assert render_messages([SYSTEM, USER], "plain") == f"{SYSTEM['content']}\n{USER['content']}"
    with pytest.raises(ValueError, match=r"chat_format must be one of \('auto', 'chatml'"):
        chat_renderer("llama", llama)


def test_jinja_file_wins_and_export_keeps_the_template(tokenizer_json, tmp_path):
    """A chat_template.jinja (transformers v5's layout) wins over tokenizer_config.json's, and
    `save_hf` writes the template back, so an exported policy renders the same prompts."""
    template, tokens = TEMPLATES["llama3"]
    directory = _tokenizer_dir(tokenizer_json, tmp_path / "j", template, tokens, jinja_file=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3  # the file must win over this one
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(directory)
    assert chat_renderer("auto", tok).render([USER]) == _theirs(directory, [USER])
    assert _theirs(directory, [USER]).startswith("<|begin_of_text|>")
    tok.save_hf(tmp_path / "export")
    again = HFTokenizer(tmp_path / "export")
    assert render_messages([SYSTEM, USER], chat_renderer("auto", again)) == render_messages(
        [SYSTEM, USER], chat_renderer("auto", tok)
    )


def test_math_file_prompts_use_the_template_and_a_refused_row_is_skipped(tokenizer_json, tmp_path):
    """`load_math_dataset` (chat_format "auto") renders chat rows with the tokenizer's template;
    a conversation the template refuses is a malformed row, not a failed load."""
    template, tokens = TEMPLATES["gemma"]
    directory = _tokenizer_dir(tokenizer_json, tmp_path / "g", template, tokens)
    rows = [
        {"prompt": [SYSTEM, USER], "answer": "46"},
        {"prompt": [USER, USER], "answer": "1"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = HFTokenizer(directory)
    examples, report = load_math_dataset(path, tok, max_prompt_tokens=512)
    assert [e.index for e in examples] == [0] and report.malformed_indices == [1]
    assert "roles must alternate" in report.malformed[0][1]
    assert "<bos>" + examples[0].prompt == _theirs(directory, [SYSTEM, USER])
