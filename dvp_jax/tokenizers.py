"""Tokenizers with JetStream's tokenizer API (`jetstream.engine.tokenizer_api.Tokenizer`).

Three, each usable by the rollout engine, JetStream's orchestrator and the data pipeline:
`CharTokenizer` (the generated arithmetic task's fixed characters), `HFTokenizer` (a local
`tokenizer.json` with its `tokenizer_config.json` and chat template) and `WordTokenizer` (a word
vocabulary built in memory; `running_sum_tokenizer` is the running-sum task's).
`load_tokenizer(spec)` picks one from a config string (a Hub repo id: its cached snapshot, as
`model.hf_path`). The API they share (JetStream's `encode` / `decode`, plus `encode_ids`, the
special ids and `save_hf`) is documented on `tokenizer_api.BucketTokenizer`. Callers running
JetStream's orchestrator: `encode` raises `ValueError` on text it cannot tokenise (characters
outside the vocabulary, over-long prompts); validate requests before they reach the prefill
thread.

JetStream is not imported here (the trainer uses these tokenizers and loads no JetStream): the
classes implement its API without inheriting it, and `dvp_jax.serve.jetstream` registers them
as JetStream `Tokenizer`s.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dvp_jax.model import hub
from dvp_jax.tokenizer_api import BucketTokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
RUNNING_SUM = "running_sum"  # load_tokenizer spec of the running-sum task's word tokenizer
# Digits, space and operators, lowercase letters, punctuation the task templates use, newline.
# Append only: ids are positions in this string (offset by the specials).
CHAR_VOCAB = "0123456789 +-*/=()abcdefghijklmnopqrstuvwxyz.,?!:;'\n"

# Names tried, in order, for EOS when neither the arguments nor tokenizer_config.json give one.
_KNOWN_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_REPLACEMENT = "\ufffd"


class CharTokenizer(BucketTokenizer):
    """Character tokenizer for the generated arithmetic task (`data.tasks.ArithmeticTask`).

    Ids: 0 `<pad>`, 1 `<bos>`, 2 `<eos>`, then the characters of `CHAR_VOCAB` in order (digits,
    space, operators, lowercase letters, punctuation, newline). The order is part of the
    checkpoint format: never reorder, only append.
    """

    pad_id, bos_id, eos_id = 0, 1, 2  # the order of SPECIAL_TOKENS

    def __init__(self):
        self._itos: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHAR_VOCAB)
        self._stoi = {c: i for i, c in enumerate(self._itos) if i >= len(SPECIAL_TOKENS)}
        self.add_bos = True

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def stop_tokens(self) -> set[int]:
        return {self.eos_id, self.pad_id}

    def _hf_backend(self):
        """Character-level `tokenizers.Tokenizer` with our ids: a BPE model with no merges splits
        text into characters, `Fuse` joins them back without spaces. Unlike `encode_ids` it drops
        (rather than rejects) characters outside the vocabulary."""
        from tokenizers import AddedToken, Tokenizer, decoders, models

        vocab = {token: i for i, token in enumerate(self._itos)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
        return tok

    def _bos_token(self) -> str:
        return BOS

    def encode_ids(self, s: str) -> list[int]:
        """Plain ids of `s` (no BOS, no padding); `ValueError` naming any unknown character."""
        try:
            return [self._stoi[c] for c in s]
        except KeyError:
            pos, bad = next((i, c) for i, c in enumerate(s) if c not in self._stoi)
            raise ValueError(
                f"CharTokenizer cannot encode character {bad!r} (U+{ord(bad):04X}) at position "
                f"{pos} of {s[:40]!r}; allowed characters: {CHAR_VOCAB!r}"
            ) from None

    def decode(self, token_ids: Iterable[int], **kwargs: Any) -> str:
        """Text of `token_ids`; specials are dropped unless `skip_special_tokens=False`."""
        skip_special = kwargs.pop("skip_special_tokens", True)
        out = []
        for t in np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= t < len(self._itos):
                out.append(_REPLACEMENT)
            elif t < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(self._itos[t])
            else:
                out.append(self._itos[t])
        return "".join(out)


class HFTokenizer(BucketTokenizer):
    """A Hugging Face `tokenizer.json` read from a local file or directory (`tokenizers`).

    Special tokens (and `add_bos`) come from the arguments, else from a `tokenizer_config.json`
    next to the file, else (eos only) from a short list of well-known names (`_KNOWN_EOS`).

    Args:
      path: a `tokenizer.json` file, or a directory containing one (and optionally a
        `tokenizer_config.json` naming `eos_token`, `pad_token`, `bos_token`, `chat_template`;
        a `chat_template.jinja` replaces the last). `hf_config` keeps that dict.
      eos, pad, bos: token strings or ids; override the file. `pad` defaults to EOS when neither
        gives one. Without any BOS token, `bos_id` is EOS (the Qwen convention) and `add_bos` is
        False.
      add_bos: whether `encode` prepends BOS by default. Default: False without a BOS token,
        else `tokenizer_config.json`'s `add_bos_token` if it sets one, else True.
      stop_tokens: extra stop tokens (strings or ids), e.g. `<|im_end|>` for chat models.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        eos: str | int | None = None,
        pad: str | int | None = None,
        bos: str | int | None = None,
        add_bos: bool | None = None,
        stop_tokens: Sequence[str | int] = (),
    ):
        import tokenizers  # Local import: only this class needs the library.

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"no tokenizer.json at {path!r}; pass a local tokenizer.json file or a directory "
                "containing one (nothing is downloaded)"
            )
        config, folder = {}, pathlib.Path(file).parent
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if (folder / "chat_template.jinja").is_file():  # the file wins, as in transformers
            config["chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        tok = tokenizers.Tokenizer.from_file(file)
        self._setup(tok, file, config, eos, pad, bos, add_bos, stop_tokens)

    def _setup(self, tok, path: str, config: dict, eos, pad, bos, add_bos, stop_tokens) -> None:
        """Special tokens from the arguments (`__init__`'s), else from `config`."""
        self.path, self._tok = path, tok  # path: where the vocabulary came from, for messages
        self.hf_config = config  # tokenizer_config.json's (read by `data.chat`)

        def from_config(key: str) -> str | None:
            value = config.get(key)  # {"content": "...", ...} in older configs:
            value = value.get("content") if isinstance(value, dict) else value
            return value if isinstance(value, str) else None

        eos = eos if eos is not None else from_config("eos_token")
        if eos is None:
            eos = next((n for n in _KNOWN_EOS if self._tok.token_to_id(n) is not None), None)
        if eos is None:
            raise ValueError(
                f"{path}: cannot determine the EOS token (no tokenizer_config.json eos_token and "
                f"none of {_KNOWN_EOS} in the vocabulary); pass eos=<token or id>"
            )
        self._eos = self._to_id(eos, "eos")
        pad = pad if pad is not None else from_config("pad_token")
        self._pad = self._eos if pad is None else self._to_id(pad, "pad")
        bos = bos if bos is not None else from_config("bos_token")
        self._bos = None if bos is None else self._to_id(bos, "bos")
        if add_bos is None and self._bos is not None:
            # transformers' `add_bos_token` (written by `save_hf`); absent: prepend the BOS.
            add_bos = config.get("add_bos_token")
            add_bos = add_bos if isinstance(add_bos, bool) else True
        self.add_bos = bool(add_bos)
        if self.add_bos and self._bos is None:
            raise ValueError(f"{path}: add_bos=True but no BOS token is known; pass bos=...")
        self._stop = {self._eos, self._pad} | {self._to_id(t, "stop_tokens") for t in stop_tokens}
        added = self._tok.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special} | self._stop

    def _to_id(self, token: str | int, name: str) -> int:
        if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(f"{name} id {token} outside the vocabulary [0, {self.vocab_size})")
            return int(token)
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name} token {token!r} is not in the vocabulary of {self.path}")
        return token_id

    def _hf_backend(self):
        """A copy of our `tokenizers.Tokenizer` (vocabulary, normaliser, decoder unchanged)."""
        import tokenizers

        return tokenizers.Tokenizer.from_str(self._tok.to_str())

    def _bos_token(self) -> str | None:
        return None if self._bos is None else self._tok.id_to_token(self._bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return self._eos if self._bos is None else self._bos

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop)

    def encode_ids(self, s: str) -> list[int]:
        """Plain ids of `s` (no BOS, no padding, no post-processor specials)."""
        if not isinstance(s, str):
            raise ValueError(f"expected a str to encode, got {type(s).__name__}")
        return self._tok.encode(s, add_special_tokens=False).ids

    def decode(self, token_ids: Iterable[int], **kwargs: Any) -> str:
        """Text of `token_ids`; specials are dropped unless `skip_special_tokens=False`."""
        skip_special = kwargs.pop("skip_special_tokens", True)
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist()
        n = self.vocab_size
        # Decode runs of valid ids together (byte-level BPE needs whole runs), U+FFFD elsewhere.
        out, run = [], []
        for t in ids:
            if 0 <= t < n:
                if not (skip_special and t in self._special):
                    run.append(t)
            else:
                out.append(self._tok.decode(run, skip_special_tokens=skip_special) if run else "")
                out.append(_REPLACEMENT)
                run = []
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=skip_special))
        return "".join(out)


class WordTokenizer(HFTokenizer):
    """A word-level tokenizer built in memory (no file, no download): text is split on
    whitespace and each word is one token.

    Ids: 0 `<pad>`, 1 `<bos>`, 2 `<eos>`, 3 `<unk>`, then `words` in order; `add_bos` is True.
    It is an `HFTokenizer` over a `tokenizers` WordLevel model with a WhitespaceSplit
    pre-tokenizer, so `decode` joins words with single spaces and `save_hf` exports it like any
    other. `encode_ids` rejects a word outside the vocabulary (`ValueError` naming it); the
    exported tokenizer maps it to `<unk>` instead.

    Args:
      words: the vocabulary after the specials, distinct, none containing whitespace.
      name: what error messages call the vocabulary (e.g. the `load_tokenizer` spec).
    """

    def __init__(self, words: Sequence[str], *, name: str = "words"):
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

        specials = (*SPECIAL_TOKENS, UNK)
        vocab = {t: i for i, t in enumerate((*specials, *words))}
        if len(vocab) != len(specials) + len(words):
            raise ValueError(f"{name}: the words must be distinct and not special tokens")
        bad = next((w for w in words if not w or w.split() != [w]), None)
        if bad is not None:
            raise ValueError(f"{name}: word {bad!r} is empty or contains whitespace")
        tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
        self._setup(tok, name, {}, eos=EOS, pad=PAD, bos=BOS, add_bos=True, stop_tokens=())
        self._unk = vocab[UNK]

    def encode_ids(self, s: str) -> list[int]:
        """Plain ids of `s` (no BOS, no padding); `ValueError` naming any unknown word."""
        ids = super().encode_ids(s)
        if self._unk in ids:
            pos = ids.index(self._unk)
            bad = s.split()[pos] if pos < len(s.split()) else UNK
            raise ValueError(
                f"{self.path} tokenizer cannot encode word {bad!r} (word {pos} of {s[:60]!r}): "
                "not in its vocabulary"
            )
        return ids


def running_sum_tokenizer(n_words: int | None = None) -> WordTokenizer:
    """The word tokenizer of `dvp_jax.data.running_sum` with `n_words` thought words (default
    `running_sum.DEFAULT_N_WORDS`)."""
    from dvp_jax.data import running_sum  # Local import: the task defines its vocabulary.

    n = running_sum.DEFAULT_N_WORDS if n_words is None else n_words
    return WordTokenizer(running_sum.vocabulary(n), name=running_sum.tokenizer_spec(n))


def load_tokenizer(spec: str | os.PathLike | Any, **kwargs: Any):
    """A tokenizer from its spec: `"char"` -> `CharTokenizer()`; `"running_sum"` or
    `"running_sum:<n_words>"` -> `running_sum_tokenizer` (these names win over a path of the
    same name); a Hub repo id ('org/name', not an existing path) is resolved to its cached
    snapshot (`model.hub`); any other string or path is a path for `HFTokenizer(spec, **kwargs)`.
    Anything else (a tokenizer instance: ours or any JetStream `Tokenizer`) is returned
    unchanged."""
    if not isinstance(spec, str | os.PathLike):
        return spec
    builtin = spec == "char" or (isinstance(spec, str) and spec.split(":")[0] == RUNNING_SUM)
    if builtin and kwargs:
        raise ValueError(f"tokenizer {spec!r} takes no options, got {sorted(kwargs)}")
    if spec == "char":
        return CharTokenizer()
    if builtin:
        return running_sum_tokenizer(parse_running_sum_spec(spec))
    if isinstance(spec, str) and hub.is_repo_id(spec):  # its snapshot, as model.hf_path's
        spec = hub.resolve_model_dir(spec, "config.data.tokenizer")
    return HFTokenizer(spec, **kwargs)


def parse_running_sum_spec(spec: str) -> int | None:
    """`"running_sum"` -> None (the default word count); `"running_sum:<n>"` -> n.

    Raises:
      ValueError: a malformed spec, naming the accepted forms.
    """
    if spec == RUNNING_SUM:
        return None
    head, _, n = spec.partition(":")
    if head != RUNNING_SUM or not n.isdigit() or int(n) < 1:
        raise ValueError(
            f"tokenizer spec {spec!r}: expected {RUNNING_SUM!r} or '{RUNNING_SUM}:<n_words>' "
            "with n_words a positive integer"
        )
    return int(n)
