"""`RolloutEngine`: the RL rollout engine, batched prefill / insert / decode of our model.

What `offline.generate_rollouts` (so the trainer and the evaluation) drives: `prefill_batch`
runs the prompts of one length bucket in one call, `insert_batch` puts rows of the result into
decode slots (a prompt's G samples with sample indices 0..G-1), `generate_steps` runs up to k
decode steps in one compiled loop attending over a KV length bucket, and `update_params` casts
and reshards trainer weights (on the devices when the engine is a tensor row of the trainer's
mesh, as `weights.WeightSync` decides). The programs are `decode.py`'s pure functions, jitted
once with the engine's shardings (`programs.py`, the device side this host API builds on);
parameters are an argument (never closed over), so a weight sync never recompiles. A run's
engines belong to its `rollout.Rollout`.
JetStream's single-request API is `serve.jetstream.JetStreamEngine`, built on this class.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.model.config import DTypePolicy, ModelConfig
from dvp_jax.model.kv_cache import cache_layout
from dvp_jax.model.transformer import Transformer
from dvp_jax.rollout import decode, sampling, weights
from dvp_jax.rollout.programs import EngineDevice, Programs, device_memory_bytes
from dvp_jax.rollout.scheduler import Span
from dvp_jax.rollout.state import RECORD_FIELDS, DecodeState, EngineConfig, Prefix
from dvp_jax.sharding import (
    ROLLOUT_RULES,
    MeshConfig,
    Sharder,
    init_sharded,
    make_mesh,
    state_shardings,
)
from dvp_jax.tokenizers import load_tokenizer

__all__ = ["RECORD_FIELDS", "DecodeState", "EngineConfig", "Prefix", "Programs", "RolloutEngine"]

_DEFAULT_CONFIG = EngineConfig()


class RolloutEngine(EngineDevice):
    """The RL engine (see the module docstring); its programs and shardings are
    `programs.EngineDevice`'s.

    Args:
      model_cfg: the architecture.
      config: engine settings.
      tokenizer: a tokenizer spec for `tokenizers.load_tokenizer` ('char' or a local
        tokenizer.json path) or a tokenizer instance.
      params: initial weights: an `nnx.State` (any float dtype, any layout; cast and resharded
        like `update_params`) or a `Transformer`. None: random init from `config.seed`.
      mesh: the rollout mesh (axes data, fsdp, tensor; `ROLLOUT_RULES`). None: one device.
      abstract: build the programs only: `params` are `jax.ShapeDtypeStruct`s carrying the
        rollout shardings and nothing is allocated, so the mesh may hold devices this host
        cannot run (a TPU topology; `dvp_jax.aot` compiles `programs` from it).
      paged_impl: the paged decode's attention path, "kernel" or "xla"; None (the default):
        the Pallas kernel on TPU for "paged" with a 16- or 32-bit cache, XLA's elsewhere.
        "kernel" off TPU runs the kernel in Pallas's interpret mode (slow; measurements of the
        kernel's arithmetic on CPU, `rollout/invariance.py`).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: EngineConfig = _DEFAULT_CONFIG,
        tokenizer: Any = "char",
        params: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        abstract: bool = False,
        paged_impl: str | None = None,
    ):
        self.model_cfg, self.config = model_cfg, config
        if not abstract:  # before anything is allocated: a cache the chip cannot hold
            tp = dict(mesh.shape).get("tensor", 1) if mesh is not None else 1
            config.check_pool_fits(model_cfg, tp, device_memory_bytes(), "EngineConfig")
        self.max_concurrent_decodes = config.max_concurrent_decodes  # the static sizes
        self.max_prefill_length = config.max_prefill_length
        self.max_decode_length = config.max_decode_length
        self.tokenizer = load_tokenizer(tokenizer)
        self.mesh = mesh or make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        self.sharder = Sharder(self.mesh, ROLLOUT_RULES)
        # One KV-cache layout for every program of the engine (`kv_cache.cache_layout`).
        self.cache_layout = cache_layout(self.sharder.platform)
        self.policy = DTypePolicy.named(config.dtype)
        # Paged decode's attention path: the Pallas kernel on TPU for "paged", else XLA's.
        self.paged_impl = None
        if config.paged:
            # (an 8-bit cache runs XLA's: the kernel reads 16- and 32-bit pages)
            tpu = config.decode_attention == "paged" and self.sharder.platform == "tpu"
            wide = jnp.dtype(self.policy.cache_dtype).itemsize >= 2
            self.paged_impl = "kernel" if tpu and wide else "xla"
        if paged_impl is not None:
            if paged_impl not in ("kernel", "xla") or not config.paged:
                raise ValueError(
                    f"paged_impl must be None, 'kernel' or 'xla' on a paged cache, got "
                    f"{paged_impl!r} with decode_attention={config.decode_attention!r}"
                )
            self.paged_impl = paged_impl
        stop = self.tokenizer.stop_tokens if config.stop_tokens is None else config.stop_tokens
        self.stop_tokens = tuple(sorted(int(t) for t in stop))

        make = lambda seed: Transformer(model_cfg, self.policy, self.sharder, rngs=nnx.Rngs(seed))
        self._graphdef, self._shapes = nnx.split(nnx.eval_shape(lambda: make(0)))
        self._abstract_leaves, self._params_treedef = jax.tree.flatten(self._shapes)
        self._param_paths = [path for path, _ in nnx.to_flat_state(self._shapes)]
        self.param_shardings = jax.tree.leaves(state_shardings(self._shapes, self.sharder))
        self.state_shardings = self._decode_state_shardings()
        self._sync_jits = {}  # trainer mesh -> the cast with rollout out_shardings on it
        self.programs = self._jit_programs()

        if abstract:
            structs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                for a, sh in zip(self._abstract_leaves, self.param_shardings, strict=True)
            ]
            self.params = jax.tree.unflatten(self._params_treedef, structs)
            return
        if params is None:  # born sharded: full parameters never sit on one device
            params = nnx.state(init_sharded(lambda: make(config.seed), self.sharder))
        self.params = self.update_params(params)

    # ------------------------------------------------------------------------------------------
    # Weights.
    # ------------------------------------------------------------------------------------------
    def update_params(
        self, trainer_params: Any, trainer_mesh: jax.sharding.Mesh | None = None
    ) -> nnx.State:
        """Casts and reshards trainer weights into the rollout layout (no recompilation).

        Args:
          trainer_params: an `nnx.State` with the same paths and shapes as the rollout model's
            parameters (e.g. the fp32 trainer's `nnx.state(model)`), in any dtype and any
            sharding, or a `Transformer`.
          trainer_mesh: the trainer's mesh when this engine's devices are a tensor row of it
            and the params live on it (`weights.WeightSync` decides, once): the cast then runs
            there and the engine keeps the shards on its devices. None: the cast runs where
            the params live and the result is copied to the engine's devices.
        Returns:
          The new rollout params (also stored, so `load_params()` returns them).
        Raises:
          ValueError: naming the first missing, unexpected or mis-shaped parameter path.
        """
        leaves = weights.matching_leaves(trainer_params, self._param_paths, self._abstract_leaves)
        if trainer_mesh is not None:  # on the devices: the shards are already where ours go
            leaves = weights.local_arrays(
                self.sync_program(trainer_mesh)(leaves), self.param_shardings
            )
        else:
            # Cast where the trainer's arrays live (one compiled program per trainer layout),
            # then move to the rollout shardings (a copy through the devices' links, or the
            # host, when the device sets differ).
            leaves = self.programs.cast(leaves)
            leaves = [
                jax.device_put(x, s) for x, s in zip(leaves, self.param_shardings, strict=True)
            ]
        self.params = jax.tree.unflatten(self._params_treedef, leaves)
        return self.params

    def load_params(self, *args, **kwargs) -> nnx.State:
        """The current rollout params (set at construction or by `update_params`)."""
        del args, kwargs
        return self.params

    def model(self, params: nnx.State | None = None) -> Transformer:
        """The rollout-precision `Transformer` with `params` (default: the current ones)."""
        return nnx.merge(self._graphdef, self.params if params is None else params)

    # ------------------------------------------------------------------------------------------
    # Prefill, insert, generate.
    # ------------------------------------------------------------------------------------------
    def bucket(self, length: int) -> int:
        """The prefill length a prompt of `length` tokens is padded to."""
        buckets = self.config.buckets
        if not 1 <= length <= buckets[-1]:
            raise ValueError(
                f"prompt length {length} outside [1, max_prefill_length={buckets[-1]}]; shorten "
                "the prompt or raise EngineConfig.max_prefill_length"
            )
        return buckets[bisect.bisect_left(buckets, length)]

    def kv_bucket(self, length: int) -> int:
        """The smallest of `EngineConfig.kv_buckets` >= `length` (the cache length if none)."""
        buckets = self.config.kv_buckets
        return buckets[min(bisect.bisect_left(buckets, int(length)), len(buckets) - 1)]

    def prefill_batch(
        self, params: nnx.State, prompts: Sequence[Sequence[int]], keys: jax.Array | np.ndarray
    ) -> Prefix:
        """Prefills n prompts in one call (`insert_batch` takes the result).

        All rows are padded to the bucket of the longest prompt and the row count to the next
        of `EngineConfig.row_buckets` (padding rows are 1-token prompts, ignored), so this
        compiles at most `len(buckets) * len(row_buckets)` times. Callers batch prompts of
        one bucket together (`offline.generate_rollouts` does) to avoid padding work.

        Args:
          params: rollout params.
          prompts: n token-id sequences, each 1..max_prefill_length tokens (BOS included);
            1 <= n <= max_concurrent_decodes.
          keys: `[n, 2]` raw PRNG keys of the requests (row i is prompt i's key).
        Returns:
          A `Prefix` with a leading row axis: cache k, v `[L, rows, k, bucket, h]` (`[L, rows,
          bucket, k, h]` on TPU), logits `[rows, v]`, length, context `[rows]`, key `[rows, 2]`;
          rows `>= n`, row i is prompt i.
        Raises:
          ValueError: naming the limit, for no prompts, more prompts than slots, an empty or
            too long prompt, token ids outside the vocabulary, or keys of the wrong shape.
        """
        n, limit = len(prompts), self.config.max_concurrent_decodes
        if not 1 <= n <= limit:
            raise ValueError(
                f"prefill_batch: {n} prompts, allowed 1..max_concurrent_decodes={limit}; split "
                "the prompts into several calls"
            )
        if not isinstance(keys, np.ndarray):
            keys = np.asarray(jax.device_get(decode.key_data(keys)))
        key_shape = decode.raw_key_shape()
        if keys.shape != (n,) + key_shape:
            raise ValueError(
                f"prefill_batch: keys must have shape {(n,) + key_shape} (one raw key per "
                f"prompt), got {keys.shape}"
            )
        lengths = [len(p) for p in prompts]
        for i, length in enumerate(lengths):
            if length < 1:
                raise ValueError(f"prefill_batch: prompt {i} is empty (at least 1 token, e.g. BOS)")
        bucket = self.bucket(max(lengths))  # raises naming max_prefill_length
        rows = self.config.row_buckets[bisect.bisect_left(self.config.row_buckets, n)]
        tokens = np.zeros((rows, bucket), np.int32)
        vocab = self.model_cfg.vocab_size
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt, np.int64).reshape(-1)
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"prefill_batch: prompt {i} has token ids outside [0, {vocab})")
            tokens[i, : lengths[i]] = ids
        all_lengths = np.ones((rows,), np.int32)
        all_lengths[:n] = lengths
        all_keys = np.zeros((rows,) + key_shape, np.uint32)
        all_keys[:n] = keys
        return self.programs.prefill(params, tokens, all_lengths, all_keys)

    def init_decode_state(
        self, *args, sampling: sampling.SamplingParams | None = None, **kwargs
    ) -> DecodeState:
        """All slots empty (done). `sampling` overrides the config's sampling parameters."""
        del args, kwargs
        if sampling is not None and sampling.truncates and not self.config.kept_width:
            raise ValueError(
                "sampling asks for top_k / top_p but the engine was built without truncation: "
                "set EngineConfig.top_k or top_p (rollout.top_k / rollout.top_p)"
            )
        if sampling is not None and sampling.top_k is not None:
            if int(sampling.top_k) > self.config.kept_width:
                raise ValueError(
                    f"sampling.top_k must be <= EngineConfig.max_kept ({self.config.max_kept}) "
                    f"of a truncating engine, got {int(sampling.top_k)}"
                )
        return self.programs.init_state(sampling or self.config.sampling_params())

    def insert_batch(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slots: Sequence[int],
        rows: Sequence[int],
        sample_indices: Sequence[int],
    ) -> DecodeState:
        """Inserts rows of a `prefill_batch` result into slots in one call (donating the state).

        Insertion i puts prompt row `rows[i]` into slot `slots[i]` with the key
        `fold_in(prefix.key[rows[i]], sample_indices[i])`: e.g. a prompt's G samples into G
        slots at once. Compiles once per prefix shape (bucket, rows).

        Raises:
          ValueError: naming the limit, for more insertions than slots, unequal list lengths,
            a slot outside [0, max_concurrent_decodes) or used twice, or a row outside the
            prefix.
        """
        b, n_rows = self.config.max_concurrent_decodes, prefix.length.shape[0]
        n = len(slots)
        if not (len(rows) == len(sample_indices) == n):
            raise ValueError(
                f"insert_batch: slots, rows and sample_indices differ in length ({n}, "
                f"{len(rows)}, {len(sample_indices)})"
            )
        if n > b:
            raise ValueError(
                f"insert_batch: {n} insertions (e.g. G samples of a prompt), more than the "
                f"max_concurrent_decodes={b} slots; insert at most {b} at a time "
                "(generate_rollouts refills slots as they free up) or raise "
                "EngineConfig.max_concurrent_decodes"
            )
        if any(not 0 <= int(s) < b for s in slots) or len(set(map(int, slots))) != n:
            raise ValueError(
                f"insert_batch: slots {list(slots)} must be distinct and in [0, "
                f"max_concurrent_decodes={b})"
            )
        if any(not 0 <= int(r) < n_rows for r in rows):
            raise ValueError(f"insert_batch: rows {list(rows)} outside the prefix's [0, {n_rows})")
        pad = lambda v, fill: np.asarray(list(v) + [fill] * (b - n), np.int32)
        return self.programs.insert(
            prefix, decode_state, pad(slots, b), pad(rows, 0), pad(sample_indices, 0)
        )

    def page_bucket(self, live_pages: int | None) -> int:
        """The static bound of the ragged XLA path: the smallest of `page_buckets` >=
        `live_pages` (None: the pool); 0 for the kernel, which reads each slot's own pages."""
        if self.paged_impl == "kernel":
            return 0
        buckets = self.config.page_buckets
        if live_pages is None:
            return buckets[-1]
        return buckets[min(bisect.bisect_left(buckets, int(live_pages)), len(buckets) - 1)]

    def full_span(self) -> Span:
        """The span that reads everything: the whole cache (dense), the pool (ragged XLA
        path), or each slot's own pages (the kernel)."""
        if not self.config.paged:
            return Span("positions", self.config.cache_length)
        if self.paged_impl == "kernel":
            return Span("own", 0)
        return Span("pages", self.config.num_pages)

    def _span_size(self, span: Span | None) -> int:
        """The decode programs' static read bound, checked against this engine's cache."""
        span = self.full_span() if span is None else span
        want = self.full_span().kind
        if span.kind != want:
            raise ValueError(f"span of kind {span.kind!r} given to an engine that reads {want!r}")
        if span.kind == "positions":
            return self.kv_bucket(span.size)
        if span.kind == "pages":
            return self.page_bucket(span.size)
        return 0

    def generate_step(
        self, params: nnx.State, decode_state: DecodeState, span: Span | None = None
    ) -> tuple[DecodeState, jax.Array]:
        """One decode step (`decode.step`, donating the state) reading `span` (None: the whole
        cache or pool; see `generate_steps`); returns the state and the `[B, 3]` rows (token,
        valid, length)."""
        return self.programs.step(params, decode_state, self._span_size(span))

    def generate_steps(
        self,
        params: nnx.State,
        decode_state: DecodeState,
        num_steps: int,
        span: Span | None = None,
        stop_at_finish: bool = False,
    ) -> DecodeState:
        """Up to `num_steps` decode steps in one compiled loop (`decode.loop`; donates the
        state): the tokens of that many `generate_step` calls (keys depend on the step, not
        the call), log-probs to float rounding (another compiled program).

        Args:
          params: rollout params.
          decode_state: the state (donated).
          num_steps: at most this many steps (traced: one compiled loop for every count). The
            loop ends early once every slot is done.
          span: what attention reads (`scheduler.Span`, one compiled loop per size): on a
            dense cache the first `kv_bucket(size)` positions, which must exceed the last
            position any active slot writes, `max(pos) + num_steps`; on the ragged XLA path
            `page_bucket(size)` live pages, which must cover `sum ceil((pos + num_steps) /
            page_size)` over active slots; a smaller span gives those slots wrong logits (the
            scheduler sizes it). None: the whole cache or pool.
          stop_at_finish: end the loop after the step in which a slot active at the call
            finishes (a traced flag: both settings share one loop; read `pos`/`done`).
        """
        if int(num_steps) == 1:
            return self.generate_step(params, decode_state, span)[0]
        return self.programs.loop(
            params,
            decode_state,
            np.int32(num_steps),
            self._span_size(span),
            np.bool_(stop_at_finish),
        )

    def resume_batch(
        self,
        params: nnx.State,
        decode_state: DecodeState,
        slots: Sequence[int],
        sequences: Sequence[np.ndarray],
        steps: Sequence[int],
        keys: np.ndarray | None = None,
    ) -> DecodeState:
        """Puts preempted responses back (donates the state): slot `slots[i]` held a response
        whose prompt and first `steps[i]` generated tokens are `sequences[i]`; they are
        prefilled again (padded to a `kv_buckets` length: up to the cache, longer than any
        prompt; one prefill per bucket, so a short sequence is not padded to a long one's
        length) and the slot goes on from step `steps[i]` with its own key and records, as if
        never stopped (`decode.insert(resume_steps=)`). `keys`: `[n, 2]` the slots' raw keys
        (None: the ones they were stopped with, which `evict` keeps); records stay as they
        were stopped with."""
        n = len(slots)
        lengths = [len(x) for x in sequences]
        if not n or max(lengths) > self.config.cache_length - 1:
            raise ValueError(
                f"resume_batch: 1..{self.config.max_concurrent_decodes} sequences of at most "
                f"{self.config.cache_length - 1} tokens, got lengths {lengths}"
            )
        if keys is None:
            keys = np.asarray(jax.device_get(decode_state.key))[list(slots)]
        b = self.config.max_concurrent_decodes
        by_bucket = collections.defaultdict(list)
        for i, length in enumerate(lengths):
            by_bucket[self.kv_bucket(length)].append(i)
        for bucket, members in sorted(by_bucket.items()):  # one prefill and insert each
            n = len(members)
            rows = self.config.row_buckets[bisect.bisect_left(self.config.row_buckets, n)]
            tokens = np.zeros((rows, bucket), np.int32)
            all_lengths = np.ones((rows,), np.int32)
            all_keys = np.zeros((rows,) + keys.shape[1:], np.uint32)
            for row, i in enumerate(members):
                tokens[row, : lengths[i]] = sequences[i]
                all_lengths[row], all_keys[row] = lengths[i], keys[i]
            prefix = self.programs.prefill(params, tokens, all_lengths, all_keys)
            pad = lambda v, fill, n=n: np.asarray(list(v) + [fill] * (b - n), np.int32)
            decode_state = self.programs.resume(
                prefix,
                decode_state,
                pad([slots[i] for i in members], b),
                pad(range(n), 0),
                pad([steps[i] for i in members], 0),
            )
        return decode_state

    def evict(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Stops `slots` and returns their pages to the pool (donates the state)."""
        mask = np.zeros((self.config.max_concurrent_decodes,), bool)
        mask[list(slots)] = True
        return self.programs.evict(decode_state, mask)

    def compile_cache_sizes(self) -> dict[str, int]:
        """Compiled-program counts of the rollout programs (tests assert they stay put); the
        weight cast is left out: it compiles once per trainer layout."""
        names = [f.name for f in dataclasses.fields(Programs) if f.name != "cast"]
        return {name: getattr(self.programs, name)._cache_size() for name in names}
