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
from dvp_jax.serve import jetstream_compat  # noqa: F401

# isort: split
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from dvp_jax.model.kv_cache import KVCache
from dvp_jax.rollout import decode
from dvp_jax.rollout.engine import RolloutEngine
from dvp_jax.rollout.scheduler import Limits, Scheduler
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
        cfg = engine.config
        short = cfg.paged and cfg.num_pages < cfg.max_concurrent_decodes * cfg.pages_per_slot
        self._pool = _ShortPool(engine) if short else None

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
        `fold_in(prefix key, sample_index)`. With a short page pool the request is queued for
        the slot instead and the scheduler places it (`generate`)."""
        b = self.engine.max_concurrent_decodes
        if not 0 <= int(slot) < b:
            raise ValueError(f"slot {slot} outside [0, max_concurrent_decodes={b})")
        if self._pool is not None:
            return self._pool.insert(prefix, decode_state, int(slot), int(sample_index))
        return self.engine.insert_batch(prefix, decode_state, [int(slot)], [0], [sample_index])

    def generate(
        self, params: nnx.State, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One token for every active slot over the whole cache (donates `decode_state`).

        The `ResultTokens` row of a slot is (token, valid, length): `valid` is 0 for a slot that
        had already finished, `length` counts the slot's generated tokens including this one.
        With a short page pool every live request still gets its next token per call: the
        scheduler runs what the pool holds, oldest first, and the slots that ran ahead hand
        their tokens out one per call (`_ShortPool`).
        """
        if self._pool is not None:
            state, data = self._pool.generate(params, decode_state)
        else:
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
        return Prefix(
            cache=KVCache(cache, cache), logits=rep, length=rep, key=rep, context=rep, tokens=rep
        )

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


class _ShortPool:
    """JetStream's slots on a page pool smaller than every slot at full length.

    JetStream inserts a request whenever it has a free slot and reads one token per live slot
    per `generate` call (a slot without a valid token counts as finished). So the requests go
    through the engine's scheduler (`scheduler.py`, resume mode: each request keeps its slot,
    an evicted one keeps its tokens and is prefilled again with them when the pool has room,
    oldest first; a request is placed by the same prefill, since JetStream frees its prefix
    once inserted), and `generate` runs device steps until every live request has a token to
    hand out; the slots that ran ahead hand theirs out one per call.
    """

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.sched = Scheduler(Limits.from_engine(engine, steps_per_sync=1), resume=True)
        b = engine.max_concurrent_decodes
        self.request = [None] * b  # the request JetStream put in each slot
        self.key = {}  # request -> its raw key (the slot's)
        self.prompt = {}  # request -> prompt token ids (host)
        self.tokens = {}  # request -> generated token ids so far (host)
        self.ready = [[] for _ in range(b)]  # (token, length) not yet handed to JetStream
        self.finished = set()  # requests the device finished
        self.peak = 0  # the most requests decoding at once

    def insert(self, prefix: Prefix, state: DecodeState, slot: int, sample_index: int):
        old = self.request[slot]
        if old is not None:  # JetStream reuses the slot: the old request is over for it
            if self.sched.cancel(old) >= 0:
                state = self.engine.evict(state, [slot])
            for table in (self.key, self.prompt, self.tokens):
                table.pop(old, None)
            self.finished.discard(old)
        # JetStream deletes the prefix after this call: keep its prompt and the slot's key
        # (`fold_in(prefix key, sample_index)`, as `insert_batch` makes it) on the host.
        length = int(jax.device_get(prefix.length)[0])
        r = self.sched.add(length, home=slot)
        self.request[slot], self.ready[slot] = r, []
        self.key[r] = np.asarray(
            jax.device_get(decode.fold_key(prefix.key[0], np.int32(sample_index)))
        )
        self.prompt[r] = np.asarray(jax.device_get(prefix.tokens)[0, :length], np.int32)
        self.tokens[r] = []
        return state

    def _waiting(self) -> bool:
        """A live request has no token to hand out yet."""
        return any(
            r is not None and r not in self.finished and not self.ready[s]
            for s, r in enumerate(self.request)
        )

    def generate(self, params, state):
        rounds = 0
        while self._waiting():
            rounds += 1
            if rounds > 10 * self.engine.max_decode_length * len(self.request) + 10:
                raise RuntimeError("the page pool made no progress (a scheduler bug)")
            dispatch = self.sched.plan()
            if dispatch.evict:
                state = self.engine.evict(state, dispatch.evict)
            if dispatch.admit:  # placed, or placed again: prompt + what it generated
                admit = dispatch.admit
                state = self.engine.resume_batch(
                    params,
                    state,
                    [slot for slot, _ in admit],
                    [np.concatenate([self.prompt[r], self.tokens[r]]) for _, r in admit],
                    [len(self.tokens[r]) for _, r in admit],
                    keys=np.stack([self.key[r] for _, r in admit]),
                )
            if dispatch.num_steps:
                self.peak = max(self.peak, int(self.sched.occupied.sum()))
                state, data = self.engine.generate_step(params, state, dispatch.span)
                rows, step, done = jax.device_get((data, state.step, state.done))
                for slot in np.flatnonzero(rows[:, 1]):
                    r = self.request[slot]
                    self.tokens[r].append(int(rows[slot, 0]))
                    self.ready[slot].append((int(rows[slot, 0]), int(rows[slot, 2])))
                for _, r in self.sched.observe(step, done):
                    self.finished.add(r)
        # One (token, valid, length) row per slot: the next token of each live request.
        out = np.zeros((len(self.request), 3), np.int32)
        for slot, ready in enumerate(self.ready):
            if ready:
                token, length = ready.pop(0)
                out[slot] = (token, 1, length)
        return state, jax.numpy.asarray(out)
