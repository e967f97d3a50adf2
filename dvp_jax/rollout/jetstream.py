"""`JetStreamEngine`: JetStream's `engine_api.Engine` on top of a `RolloutEngine`.

What JetStream's orchestrator (`server.py`) calls: single-request `prefill` / `insert` /
`generate`, the tokenizer protos and the static sizes. Each is the RL engine's batched program
with one row (so serving compiles nothing the RL path lacks, apart from the whole-cache step):
a request's `Prefix` is a `prefill_batch` result of one row, and the request's key is the
caller's `rng` or, when there is none (the orchestrator gives none), `fold_in(seed key, n)` for
the n-th such request, counted under a lock. The RL loop does not use this class: JetStream's
results carry no log-probs and its orchestrator cannot swap weights (`offline.py`).

With the server, this is the only module that imports JetStream; it applies JetStream's
compatibility shim (`jetstream_compat`) first.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax
import numpy as np
from flax import nnx

# First: JetStream 0.2.2 needs `jax.tree_map` and a `seqio` module before it is imported.
from dvp_jax.rollout import jetstream_compat  # noqa: F401

# isort: split
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from dvp_jax.model.attention import KVCache
from dvp_jax.rollout import decode
from dvp_jax.rollout.engine import RolloutEngine
from dvp_jax.rollout.state import DecodeState, Prefix
from dvp_jax.tokenizers import CharTokenizer, HFTokenizer

# Ours implement JetStream's tokenizer API without importing JetStream (the trainer uses them).
tokenizer_api.Tokenizer.register(CharTokenizer)
tokenizer_api.Tokenizer.register(HFTokenizer)  # and WordTokenizer, its subclass


class JetStreamEngine(engine_api.Engine):
    """JetStream's Engine API for `engine` (see the module docstring).

    Args:
      engine: the RL engine whose programs and weights serve the requests.
      tokenizer_path: what `get_tokenizer()` reports (the spec the engine's tokenizer was
        loaded from); `build_tokenizer` returns the engine's tokenizer whatever it says.
    """

    def __init__(self, engine: RolloutEngine, tokenizer_path: str | os.PathLike = "instance"):
        self.engine = engine
        self._tokenizer_path = os.fspath(tokenizer_path)
        self._base_key = jax.random.key_data(jax.random.key(engine.config.seed))
        self._requests = 0
        self._lock = threading.Lock()  # the counter stays exact if several threads prefill

    @property
    def params(self) -> nnx.State:
        return self.engine.params

    def load_params(self, *args, **kwargs) -> nnx.State:
        return self.engine.load_params(*args, **kwargs)

    def prefill(
        self,
        *,
        params: nnx.State,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
        rng: jax.Array | None = None,
    ) -> Prefix:
        """Runs one prompt: a one-row `Prefix` (`RolloutEngine.prefill_batch`).

        Args:
          params: rollout params.
          existing_prefix: unsupported (must be None).
          padded_tokens: `[T]` token ids, real on `[0, true_length)` (any padding after).
          true_length: the prompt length (BOS included), 1..max_prefill_length.
          rng: the request's PRNG key (typed or raw). None: `fold_in(seed key, n)` for the n-th
            such request (serving).
        """
        if existing_prefix is not None:
            raise NotImplementedError("JetStreamEngine.prefill does not support existing_prefix")
        true_length = int(true_length)
        self.engine.bucket(true_length)  # raises naming max_prefill_length
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        if rng is None:
            with self._lock:
                request = self._requests
                self._requests += 1
            rng = jax.random.fold_in(jax.random.wrap_key_data(self._base_key), request)
        key = np.asarray(jax.device_get(decode.key_data(rng)))
        return self.engine.prefill_batch(params, [tokens], key[None])

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sample_index: int = 0
    ) -> DecodeState:
        """Puts the one-row `prefix` into `slot` (donating `decode_state`); the slot's key is
        `fold_in(prefix key, sample_index)`."""
        b = self.engine.max_concurrent_decodes
        if not 0 <= int(slot) < b:
            raise ValueError(f"slot {slot} outside [0, max_concurrent_decodes={b})")
        return self.engine.insert_batch(prefix, decode_state, [int(slot)], [0], [sample_index])

    def generate(
        self, params: nnx.State, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One token for every active slot over the whole cache (donates `decode_state`).

        The `ResultTokens` row of a slot is (token, valid, length): `valid` is 0 for a slot that
        had already finished, `length` counts the slot's generated tokens including this one.
        """
        state, data = self.engine.generate_step(params, decode_state)
        return state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        return self.engine.init_decode_state(*args, **kwargs)

    def get_prefix_destination_sharding(self) -> Prefix:
        """A `Prefix` of shardings (JetStream device_puts prefixes to it between engines)."""
        rep = self.engine.sharder.replicated()
        cache = self.engine.cache_sharding(1, 1)
        return Prefix(cache=KVCache(cache, cache), logits=rep, length=rep, key=rep, context=rep)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self._tokenizer_path)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Any:
        """The engine's tokenizer (JetStream's default would build a SentencePiece one)."""
        del metadata
        return self.engine.tokenizer

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def max_decode_length(self) -> int:
        return self.engine.max_decode_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        """No colocated CPU devices are used."""
        return None
