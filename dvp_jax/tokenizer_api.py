"""The API every dvp_jax tokenizer shares (`BucketTokenizer`): JetStream's `encode` (ids padded to a
prefill bucket) and the Hugging Face export (`save_hf`). The tokenizers themselves (character,
Hugging Face file, word) and `load_tokenizer` are `tokenizers.py`; neither module imports
JetStream.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

# JetStream's default prefill buckets (jetstream.engine.token_utils.pad_tokens). Copied rather
# than imported: token_utils imports seqio and with it TensorFlow.
DEFAULT_PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def pad_to_bucket(
    ids: Sequence[int],
    *,
    bos_id: int,
    pad_id: int,
    is_bos: bool,
    prefill_lengths: Sequence[int] | None,
    max_prefill_length: int | None,
    jax_padding: bool,
) -> tuple[jnp.ndarray | np.ndarray, int]:
    """JetStream's `pad_tokens`, except that an over-long sequence is an error, not truncated."""
    tokens = np.asarray(([bos_id] if is_bos else []) + list(ids), dtype=np.int32)
    buckets = sorted(prefill_lengths or DEFAULT_PREFILL_LENGTHS)
    if max_prefill_length is not None:
        buckets = [b for b in buckets if b < max_prefill_length] + [max_prefill_length]
    true_length = int(tokens.shape[0])
    fitting = [b for b in buckets if b >= true_length]
    if not fitting:
        raise ValueError(
            f"prompt has {true_length} tokens (BOS included: {is_bos}), more than the largest "
            f"prefill length {buckets[-1]}; shorten the prompt or raise max_prefill_length"
        )
    padded = np.pad(tokens, (0, fitting[0] - true_length), constant_values=pad_id)
    return (jnp.asarray(padded) if jax_padding else padded), true_length


class BucketTokenizer:
    """JetStream's `encode` and the Hugging Face export, shared by every tokenizer here.

    - `encode(s, is_bos=<add_bos>, prefill_lengths=None, max_prefill_length=None,
      jax_padding=True) -> (tokens, true_length)`: JetStream's contract. Optionally prepends
      BOS, right-pads with `pad_id` to the smallest bucket of `prefill_lengths` (JetStream's
      default buckets 16, 32, ..., capped at `max_prefill_length`) that holds the sequence.
      Unlike JetStream's `pad_tokens`, a sequence longer than the largest bucket raises
      `ValueError` instead of being cut to its last tokens, and a `max_prefill_length` that is
      not one of the buckets is allowed.
    - `decode(token_ids, skip_special_tokens=True) -> str`: never raises on an out-of-range id
      (a model whose embedding is padded past the vocabulary can sample one, and JetStream's
      generate thread SIGKILLs the process on any exception): such ids decode to U+FFFD.
    - `encode_ids(s) -> list[int]`: the plain ids, no BOS, no padding.
    - `pad_id`, `eos_id`, `bos_id`, `stop_tokens` (eos, pad and any extra stop tokens),
      `vocab_size`, `add_bos` (whether `encode` prepends BOS by default).
    - `save_hf(directory)`: `tokenizer.json` and `tokenizer_config.json` such that
      `transformers.AutoTokenizer.from_pretrained(directory)` encodes text to the ids of
      `encode` (unpadded: BOS iff `add_bos`) and decodes like `decode`, and
      `HFTokenizer(directory)` reads back the same ids and special tokens.

    Subclasses provide `encode_ids`, `_hf_backend` (a `tokenizers.Tokenizer` with the same ids)
    and `_bos_token` (the BOS string, or None when there is none).
    """

    def encode(self, s: str, **kwargs: Any) -> tuple[jnp.ndarray | np.ndarray, int]:
        """JetStream's contract; see the class docstring."""
        return pad_to_bucket(
            self.encode_ids(s),
            bos_id=self.bos_id,
            pad_id=self.pad_id,
            is_bos=kwargs.pop("is_bos", self.add_bos),
            prefill_lengths=kwargs.pop("prefill_lengths", None),
            max_prefill_length=kwargs.pop("max_prefill_length", None),
            jax_padding=kwargs.pop("jax_padding", True),
        )

    def _hf_backend(self):
        """A fresh `tokenizers.Tokenizer` with this tokenizer's ids, decoder and special tokens."""
        raise NotImplementedError

    def _bos_token(self) -> str | None:
        """The BOS token string, or None when there is none."""
        raise NotImplementedError

    def save_hf(self, directory: str | os.PathLike) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` into `directory` (made if missing).

        `transformers.AutoTokenizer.from_pretrained(directory)` then gives a fast tokenizer whose
        `tokenizer(text).input_ids` are this tokenizer's ids (BOS first iff `add_bos`, no
        padding) and whose `decode` matches ours; `HFTokenizer(directory)` reads back the same
        ids, EOS, pad, BOS, `add_bos` and chat template. Extra `stop_tokens` are not stored.
        Call it after `hf_import.save_hf(model, directory)`, which replaces the directory."""
        from tokenizers import processors  # Local import: only the export needs the library.

        tok, bos = self._hf_backend(), self._bos_token()
        # BOS iff add_bos, nothing else: the template transformers (v5) itself builds from
        # `add_bos_token` / `add_eos_token`, stored in tokenizer.json too for versions that don't.
        if self.add_bos:
            single, pair = f"{bos}:0 $A:0", f"{bos}:0 $A:0 {bos}:1 $B:1"
            specials = [(bos, self.bos_id)]
        else:
            single, pair, specials = "$A:0", "$A:0 $B:1", []
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": tok.id_to_token(self.eos_id),
            "pad_token": tok.id_to_token(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            # transformers' default clean-up rewrites " ." as "." and so on: not our decode.
            "clean_up_tokenization_spaces": False,
        }
        if getattr(self, "hf_config", {}).get("chat_template"):  # the prompts' template, kept
            config["chat_template"] = self.hf_config["chat_template"]
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        tok.save(os.path.join(directory, "tokenizer.json"))
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
