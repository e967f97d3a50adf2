"""`RolloutEngine`: our Qwen3-style model behind JetStream's `engine_api.Engine`.

The same engine serves two drivers: the RL rollout loop (`offline.py`, which calls the Engine API
directly because JetStream's results carry no log-probs) and JetStream's own orchestrator
(`server.py`). Precision is a switch (`EngineConfig.dtype`, `noise_std`): the trainer stays fp32.

Data flow per request (b = slot, M = max_decode_length, S = max_prefill_length + M):

* `prefill(params, padded_tokens, true_length, rng=None) -> Prefix`: the prompt is re-padded to
  the smallest prefill bucket that holds it (so prefill compiles at most once per bucket) and run
  once; the `Prefix` holds its KV cache `[L, 1, k, bucket, h]`, the next-token logits `[v]`, the
  true length and the request's PRNG key (`rng`, or `fold_in(seed key, request counter)` when
  the caller gives none, as JetStream's orchestrator does).
* `insert(prefix, state, slot, sample_index=0)`: copies the prefix into slot `slot` and gives the
  slot the key `fold_in(prefix key, sample_index)`; RL rollouts insert one prefix into G slots
  with sample indices 0..G-1.
* `generate(params, state)`: for every slot, samples the next token from the slot's pending
  logits (E4, `sampling.sample` with key `fold_in(slot key, step)`), records per generated token
  its id and the sampler's `pruning.TokenLogprobs` under the `behaviour_` names (log mu_S,
  unpruned log mu, pruned mass, safe-set size; docs/design.md section 2), then runs one decode
  step to get the next pending logits. A slot finishes at a stop token (recorded, counted in the
  length) or after M tokens. Keys depend only on (request key, sample index, step), never on the
  slot or the schedule, so a fixed seed reproduces a rollout exactly.

The RL path (`offline.generate_rollouts`) uses the batched forms: `prefill_batch` runs many
prompts of one length bucket in one call (rows padded to `EngineConfig.row_buckets`),
`insert_batch` puts rows of it into many slots in one call (e.g. a prompt's G samples, with
sample indices 0..G-1: the same keys as G `insert` calls), and `generate_steps(..., kv_len)` runs
k decode steps in one compiled loop whose attention reads only the first `kv_bucket(kv_len)`
cache positions (`EngineConfig.kv_buckets`: powers of two from 32, and S), chosen on the host
from the slots' positions. `generate` (the orchestrator's) attends over the whole cache. The
decode state keeps a 16- or 8-bit KV cache as its bits (`attention.cache_storage`), so every
cache write is an in-place integer scatter (docs/design.md section 3).

Jitted functions take the parameters as an argument (never closed over), so `update_params`
(cast + reshard of trainer weights) never recompiles: tests assert the compile caches do not grow.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jetstream.engine import engine_api, tokenizer_pb2

from dvp_jax.model.attention import (
    KVCache,
    cache_axes,
    cache_layout,
    cache_shape,
    cache_storage,
    seq_axis,
    to_storage,
)
from dvp_jax.model.config import DTypePolicy, ModelConfig
from dvp_jax.model.transformer import Transformer
from dvp_jax.rollout import sampling
from dvp_jax.rollout.quantize import quantize_leaves
from dvp_jax.rollout.state import RECORD_FIELDS, DecodeState, EngineConfig, Prefix
from dvp_jax.rollout.tokenizers import load_tokenizer
from dvp_jax.sharding import (
    MESH_AXES,
    ROLLOUT_RULES,
    MeshConfig,
    Sharder,
    init_sharded,
    make_mesh,
    state_shardings,
)

_DEFAULT_CONFIG = EngineConfig()


def _key_data(key: jax.Array) -> jax.Array:
    """Raw uint32 key data of a typed key or of raw key data."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


class RolloutEngine(engine_api.Engine):
    """JetStream Engine for `Transformer` (see the module docstring).

    Args:
      model_cfg: the architecture.
      config: engine settings.
      tokenizer: a tokenizer spec for `tokenizers.load_tokenizer` ('char' or a local
        tokenizer.json path) or a JetStream tokenizer instance.
      params: initial weights: an `nnx.State` (any float dtype, any layout; cast and resharded
        like `update_params`) or a `Transformer`. None: random init from `config.seed`.
      mesh: the rollout mesh (axes data, fsdp, tensor; `ROLLOUT_RULES`). None: one device.
      abstract: build the programs only: `params` are `jax.ShapeDtypeStruct`s carrying the
        rollout shardings and nothing is allocated, so the mesh may hold devices this host
        cannot run (a TPU topology; `dvp_jax.aot` lowers the jitted programs from it).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: EngineConfig = _DEFAULT_CONFIG,
        tokenizer: Any = "char",
        params: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        abstract: bool = False,
    ):
        self.model_cfg = model_cfg
        self.config = config
        self.tokenizer = load_tokenizer(tokenizer)
        # What get_tokenizer() reports; build_tokenizer() returns the instance regardless.
        self._tokenizer_path = (
            os.fspath(tokenizer) if isinstance(tokenizer, str | os.PathLike) else "instance"
        )
        self._mesh = mesh or make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        self.sharder = Sharder(self._mesh, ROLLOUT_RULES)
        # One KV-cache layout for every program of the engine (`attention.cache_layout`).
        self.cache_layout = cache_layout(self.sharder.platform)
        self.policy = DTypePolicy.named(config.dtype)
        stop = self.tokenizer.stop_tokens if config.stop_tokens is None else config.stop_tokens
        self.stop_tokens = tuple(sorted(int(t) for t in stop))

        make = lambda seed: Transformer(model_cfg, self.policy, self.sharder, rngs=nnx.Rngs(seed))
        self._graphdef, shapes = nnx.split(nnx.eval_shape(lambda: make(0)))
        self._shapes = shapes
        self._abstract_leaves, self._params_treedef = jax.tree.flatten(shapes)
        self._param_paths = [path for path, _ in nnx.to_flat_state(shapes)]
        self._param_shardings = jax.tree.leaves(state_shardings(shapes, self.sharder))
        self._state_shardings = self._decode_state_shardings()
        self._prefix_shardings = self._make_prefix_shardings()

        # Host bookkeeping for requests without an explicit key (the orchestrator's prefill
        # thread); the lock keeps the counter exact if several threads prefill.
        self._base_key = jax.random.key_data(jax.random.key(config.seed))
        self._requests = 0
        self._lock = threading.Lock()

        self._prefill_jit = jax.jit(self._prefill_impl)
        self._prefill_batch_jit = jax.jit(self._prefill_batch_impl)
        self._insert_jit = jax.jit(
            self._insert_impl, donate_argnums=(1,), out_shardings=self._state_shardings
        )
        self._insert_batch_jit = jax.jit(
            self._insert_batch_impl, donate_argnums=(1,), out_shardings=self._state_shardings
        )
        self._generate_jit = jax.jit(
            self._generate_impl,
            static_argnums=(2,),
            donate_argnums=(1,),
            out_shardings=(self._state_shardings, self.sharder.replicated()),
        )
        self._generate_steps_jit = jax.jit(
            self._generate_steps_impl,
            static_argnums=(2, 3),
            donate_argnums=(1,),
            out_shardings=self._state_shardings,
        )
        self._init_state_jit = jax.jit(self._init_state_impl, out_shardings=self._state_shardings)
        dtypes = [a.dtype for a in self._abstract_leaves]
        paths, policy = self._param_paths, self.policy
        # The policy's weight quantization first (the mismatch ladder of e004; quantized kernels
        # come back in the param dtype), then the cast of every leaf to the rollout dtype.
        self._cast = lambda leaves: [
            x.astype(d) for x, d in zip(quantize_leaves(leaves, paths, policy), dtypes, strict=True)
        ]
        self._cast_jit = jax.jit(self._cast)
        self._sync_jits = {}  # trainer mesh -> the cast with rollout out_shardings on it

        if abstract:
            structs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                for a, sh in zip(self._abstract_leaves, self._param_shardings, strict=True)
            ]
            self.params = jax.tree.unflatten(self._params_treedef, structs)
            return
        if params is None:  # born sharded: full parameters never sit on one device
            params = nnx.state(init_sharded(lambda: make(config.seed), self.sharder))
        self.params = self.update_params(params)

    # ------------------------------------------------------------------------------------------
    # Weights.
    # ------------------------------------------------------------------------------------------
    def update_params(self, trainer_params: Any) -> nnx.State:
        """Casts and reshards trainer weights into the rollout layout (no recompilation).

        Args:
          trainer_params: an `nnx.State` with the same paths and shapes as the rollout model's
            parameters (e.g. the fp32 trainer's `nnx.state(model)`), in any dtype and any
            sharding, or a `Transformer`.
        Returns:
          The new rollout params (also stored, so `load_params()` returns them).
        Raises:
          ValueError: naming the first missing, unexpected or mis-shaped parameter path.
        """
        if isinstance(trainer_params, nnx.Module):
            trainer_params = nnx.state(trainer_params, nnx.Param)
        src = {}
        for path, var in nnx.to_flat_state(trainer_params):
            src[path] = var.get_value() if isinstance(var, nnx.Variable) else var
        missing = [p for p in self._param_paths if p not in src]
        extra = [p for p in src if p not in set(self._param_paths)]
        if missing or extra:
            raise ValueError(
                f"update_params: parameter paths differ from the rollout model's (missing "
                f"{missing[:3]}, unexpected {extra[:3]}); pass the trainer's nnx.state(model) "
                "for the same ModelConfig"
            )
        leaves = []
        for path, abstract in zip(self._param_paths, self._abstract_leaves, strict=True):
            value = src[path]
            if tuple(value.shape) != tuple(abstract.shape):
                raise ValueError(
                    f"update_params: parameter {'/'.join(map(str, path))} has shape "
                    f"{tuple(value.shape)}, the rollout model expects {tuple(abstract.shape)}"
                )
            leaves.append(value)
        trainer_mesh = self.trainer_row_mesh(leaves)
        if trainer_mesh is not None:
            leaves = self._sync_on_device(leaves, trainer_mesh)
        else:
            # Cast where the trainer's arrays live (one compiled program per trainer layout),
            # then move to the rollout shardings (a copy through the devices' links, or the
            # host, when the device sets differ).
            leaves = self._cast_jit(leaves)
            leaves = [
                jax.device_put(x, s) for x, s in zip(leaves, self._param_shardings, strict=True)
            ]
        self.params = jax.tree.unflatten(self._params_treedef, leaves)
        return self.params

    def trainer_row_mesh(self, leaves) -> jax.sharding.Mesh | None:
        """The trainer mesh whose tensor axis this engine's devices are one row of, or None.

        When the trainer's params live on a `(data, fsdp, tensor)` mesh with this engine's
        tensor-parallel degree and this engine's devices are, in order, one (data, fsdp) row
        of it, the weight sync needs no host and no whole-parameter copy per chip
        (`_sync_on_device`). Else (another layout, plain arrays) None.
        """
        shardings = [getattr(x, "sharding", None) for x in leaves]
        if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
            return None
        mesh = shardings[0].mesh
        if any(s.mesh != mesh for s in shardings) or tuple(mesh.axis_names) != MESH_AXES:
            return None
        tp = self._mesh.shape["tensor"]
        if mesh.shape["tensor"] != tp or self._mesh.size != tp:
            return None
        ours = list(self._mesh.devices.flat)
        rows = np.asarray(mesh.devices).reshape(-1, tp)
        return mesh if any(list(row) == ours for row in rows) else None

    def _sync_on_device(self, leaves, mesh: jax.sharding.Mesh) -> list[jax.Array]:
        """Cast + reshard on the trainer's devices: one jitted program whose outputs take the
        rollout layout on the trainer's mesh (split over tensor, replicated over data and
        fsdp: an all-gather over fsdp, each chip holding 1/tensor of every parameter); this
        engine's arrays are then the shards already on its devices (no copy)."""
        if mesh not in self._sync_jits:
            self._sync_jits[mesh] = jax.jit(self._cast, out_shardings=self._sync_shardings(mesh))
        cast = self._sync_jits[mesh](leaves)
        local = []
        for x, sharding in zip(cast, self._param_shardings, strict=True):
            by_device = {shard.device: shard.data for shard in x.addressable_shards}
            devices = sharding.addressable_devices_indices_map(x.shape)
            local.append(
                jax.make_array_from_single_device_arrays(
                    x.shape, sharding, [by_device[d] for d in devices]
                )
            )
        return local

    def _sync_shardings(self, mesh: jax.sharding.Mesh) -> list[NamedSharding]:
        """The rollout layout (`ROLLOUT_RULES`) of every parameter on the trainer's mesh."""
        return jax.tree.leaves(state_shardings(self._shapes, Sharder(mesh, ROLLOUT_RULES)))

    def load_params(self, *args, **kwargs) -> nnx.State:
        """The current rollout params (set at construction or by `update_params`)."""
        del args, kwargs
        return self.params

    def model(self, params: nnx.State | None = None) -> Transformer:
        """The rollout-precision `Transformer` with `params` (default: the current ones)."""
        return nnx.merge(self._graphdef, self.params if params is None else params)

    # ------------------------------------------------------------------------------------------
    # Shardings.
    # ------------------------------------------------------------------------------------------
    def _cache_sharding(self, batch: int, length: int) -> NamedSharding:
        shape = cache_shape(self.model_cfg, batch, length, self.cache_layout)
        return self.sharder.sharding(cache_axes(self.cache_layout), shape)

    def _decode_state_shardings(self) -> DecodeState:
        cache = self._cache_sharding(self.config.max_concurrent_decodes, self.config.cache_length)
        rep = self.sharder.replicated()
        return DecodeState(
            cache=KVCache(cache, cache),
            **{f: rep for f in ("logits", "pos", "step", "done", "key", "context") + RECORD_FIELDS},
            sampling=sampling.SamplingParams(rep, rep, rep, rep, rep),
        )

    def _make_prefix_shardings(self) -> Prefix:
        cache = self._cache_sharding(1, 1)
        rep = self.sharder.replicated()
        return Prefix(cache=KVCache(cache, cache), logits=rep, length=rep, key=rep, context=rep)

    def get_prefix_destination_sharding(self) -> Prefix:
        """A `Prefix` of shardings (JetStream device_puts prefixes to it between engines)."""
        return self._prefix_shardings

    # ------------------------------------------------------------------------------------------
    # Prefill.
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

    def _prefill_batch_impl(self, params, tokens, lengths, keys):
        model = nnx.merge(self._graphdef, params)
        logits, cache = model.prefill(tokens, lengths, cache_len=tokens.shape[1])
        context = sampling.context_hash(tokens, lengths)  # fixes the logit noise (sampling.py)
        return Prefix(cache=cache, logits=logits, length=lengths, key=keys, context=context)

    def _prefill_impl(self, params, tokens, length, key):
        out = self._prefill_batch_impl(params, tokens, length[None], key[None])
        return Prefix(
            cache=out.cache, logits=out.logits[0], length=length, key=key, context=out.context[0]
        )

    def prefill(
        self,
        *,
        params: nnx.State,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray | Sequence[int],
        true_length: int,
        rng: jax.Array | None = None,
    ) -> Prefix:
        """Runs one prompt and returns its `Prefix`.

        Args:
          params: rollout params.
          existing_prefix: unsupported (must be None).
          padded_tokens: `[T]` token ids, real on `[0, true_length)` (any padding after).
          true_length: the prompt length (BOS included), 1..max_prefill_length.
          rng: the request's PRNG key (typed or raw). None: `fold_in(seed key, n)` for the n-th
            such request (serving).
        """
        if existing_prefix is not None:
            raise NotImplementedError("RolloutEngine.prefill does not support existing_prefix")
        true_length = int(true_length)
        bucket = self.bucket(true_length)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :true_length] = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
        if rng is None:
            with self._lock:
                request = self._requests
                self._requests += 1
            rng = jax.random.fold_in(jax.random.wrap_key_data(self._base_key), request)
        return self._prefill_jit(params, tokens, np.int32(true_length), _key_data(rng))

    def prefill_batch(
        self, params: nnx.State, prompts: Sequence[Sequence[int]], keys: jax.Array | np.ndarray
    ) -> Prefix:
        """Prefills n prompts in one call (the RL path; `insert_batch` takes the result).

        All rows are padded to the bucket of the longest prompt and the row count to the next
        of `EngineConfig.row_buckets` (padding rows are 1-token prompts, ignored), so this
        compiles at most `len(buckets) * len(row_buckets)` times. Callers batch prompts of
        one bucket together (`offline.generate_rollouts` does) to avoid padding work.

        Args:
          params: rollout params.
          prompts: n token-id sequences, each 1..max_prefill_length tokens (BOS included);
            1 <= n <= max_concurrent_decodes.
          keys: `[n, 2]` uint32 raw PRNG keys of the requests (row i is prompt i's key).
        Returns:
          A `Prefix` with a leading row axis: cache k, v `[L, rows, k, bucket, h]`, logits
          `[rows, v]`, length `[rows]`, key `[rows, 2]`; rows `>= n`, row i is prompt i.
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
            keys = np.asarray(jax.device_get(_key_data(keys)))
        if keys.shape != (n,) + self._base_key.shape:
            raise ValueError(
                f"prefill_batch: keys must have shape {(n,) + self._base_key.shape} (one raw key "
                f"per prompt), got {keys.shape}"
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
        all_keys = np.zeros((rows,) + self._base_key.shape, np.uint32)
        all_keys[:n] = keys
        return self._prefill_batch_jit(params, tokens, all_lengths, all_keys)

    # ------------------------------------------------------------------------------------------
    # Decode state and insert.
    # ------------------------------------------------------------------------------------------
    def _init_state_impl(self, params: sampling.SamplingParams) -> DecodeState:
        cfg, b, m = self.config, self.config.max_concurrent_decodes, self.config.max_decode_length
        return DecodeState(
            cache=KVCache.zeros(
                self.model_cfg,
                b,
                cfg.cache_length,
                cache_storage(self.policy.cache_dtype),
                self.cache_layout,
            ),
            logits=jnp.zeros((b, self.model_cfg.vocab_size), jnp.float32),
            pos=jnp.zeros((b,), jnp.int32),
            step=jnp.zeros((b,), jnp.int32),
            done=jnp.ones((b,), bool),
            key=jnp.zeros((b,) + self._base_key.shape, jnp.uint32),
            context=jnp.zeros((b,), jnp.uint32),
            tokens=jnp.zeros((b, m), jnp.int32),
            behaviour_logp=jnp.zeros((b, m), jnp.float32),
            behaviour_logp_full=jnp.zeros((b, m), jnp.float32),
            behaviour_pruned_mass=jnp.zeros((b, m), jnp.float32),
            behaviour_safe_size=jnp.zeros((b, m), jnp.int32),
            sampling=params,
        )

    def init_decode_state(
        self, *args, sampling: sampling.SamplingParams | None = None, **kwargs
    ) -> DecodeState:
        """All slots empty (done). `sampling` overrides the config's sampling parameters."""
        del args, kwargs
        return self._init_state_jit(sampling or self.config.sampling_params())

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, sample_index):
        def put(buf, value):
            start = (0, slot) + (0,) * (buf.ndim - 2)
            return jax.lax.dynamic_update_slice(buf, to_storage(value, dtype), start)

        dtype = self.policy.cache_dtype
        row = lambda a: a.at[slot].set(jnp.zeros_like(a[slot]))
        key = jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(prefix.key), sample_index)
        )
        return state.replace(
            cache=KVCache(put(state.cache.k, prefix.cache.k), put(state.cache.v, prefix.cache.v)),
            logits=state.logits.at[slot].set(prefix.logits),
            pos=state.pos.at[slot].set(prefix.length),
            step=state.step.at[slot].set(0),
            done=state.done.at[slot].set(False),
            key=state.key.at[slot].set(key),
            context=state.context.at[slot].set(prefix.context),
            **{f: row(getattr(state, f)) for f in RECORD_FIELDS},
        )

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sample_index: int = 0
    ) -> DecodeState:
        """Puts `prefix` into `slot` (donating `decode_state`); the slot's key is
        `fold_in(prefix key, sample_index)` (RL: sample index g of the prompt's G samples)."""
        if not 0 <= int(slot) < self.config.max_concurrent_decodes:
            raise ValueError(
                f"slot {slot} outside [0, max_concurrent_decodes="
                f"{self.config.max_concurrent_decodes})"
            )
        return self._insert_jit(prefix, decode_state, np.int32(slot), np.int32(sample_index))

    def _insert_batch_impl(self, prefix: Prefix, state: DecodeState, slots, rows, sample_index):
        # slots [B]: target slot of each insertion, B (out of range, dropped) for padding.
        bucket = prefix.cache.k.shape[seq_axis(self.cache_layout)]
        # [:, slots, :, :bucket] heads first, [:, slots, :bucket] positions first.
        index = (slice(None), slots) + (slice(None),) * (seq_axis(self.cache_layout) - 2)

        def put(buf, value):  # buf in the cache storage dtype (`attention.cache_storage`)
            value = to_storage(value[:, rows], self.policy.cache_dtype)
            return buf.at[index + (slice(None, bucket),)].set(value, mode="drop")

        set_rows = lambda a, v: a.at[slots].set(v, mode="drop")
        fold = lambda k, g: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), g))
        keys = jax.vmap(fold)(prefix.key[rows], sample_index)
        return state.replace(
            cache=KVCache(put(state.cache.k, prefix.cache.k), put(state.cache.v, prefix.cache.v)),
            logits=set_rows(state.logits, prefix.logits[rows]),
            pos=set_rows(state.pos, prefix.length[rows]),
            step=set_rows(state.step, 0),
            done=set_rows(state.done, False),
            key=set_rows(state.key, keys),
            context=set_rows(state.context, prefix.context[rows]),
            **{f: set_rows(getattr(state, f), 0) for f in RECORD_FIELDS},
        )

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
        `fold_in(prefix.key[rows[i]], sample_indices[i])`: exactly what `insert` of that
        prompt's own prefix with `sample_index=sample_indices[i]` does, e.g. a prompt's G
        samples into G slots at once. Compiles once per prefix shape (bucket, rows).

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
        return self._insert_batch_jit(
            prefix, decode_state, pad(slots, b), pad(rows, 0), pad(sample_indices, 0)
        )

    # ------------------------------------------------------------------------------------------
    # Generate.
    # ------------------------------------------------------------------------------------------
    def _generate_impl(self, params, state: DecodeState, kv_len: int):
        model = nnx.merge(self._graphdef, params)
        b, m = self.config.max_concurrent_decodes, self.config.max_decode_length
        active = ~state.done
        keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(
            state.key, state.step
        )
        # tokens [B] and their pruning.TokenLogprobs (E2-E4) under the slot's mu_S.
        tokens, sampled = sampling.sample(keys, state.logits, state.sampling, state.context)

        rows, col = jnp.arange(b), jnp.minimum(state.step, m - 1)

        def record(buf, value):
            return buf.at[rows, col].set(jnp.where(active, value, buf[rows, col]).astype(buf.dtype))

        step = state.step + active.astype(jnp.int32)
        stop = jnp.isin(tokens, jnp.asarray(self.stop_tokens, jnp.int32))
        done = state.done | (active & (stop | (step >= m)))
        logits, cache = model.decode(tokens, state.pos, state.cache, kv_len)
        new_state = state.replace(
            cache=cache,
            logits=logits,
            pos=jnp.minimum(state.pos + active.astype(jnp.int32), self.config.cache_length - 1),
            step=step,
            done=done,
            context=jnp.where(
                active, sampling.extend_context(state.context, tokens), state.context
            ),
            tokens=record(state.tokens, tokens),
            behaviour_logp=record(state.behaviour_logp, sampled.logp),
            behaviour_logp_full=record(state.behaviour_logp_full, sampled.logp_full),
            behaviour_pruned_mass=record(state.behaviour_pruned_mass, sampled.pruned_mass),
            behaviour_safe_size=record(state.behaviour_safe_size, sampled.safe_size),
        )
        # JetStream's result layout: [tokens | valid | lengths], one speculation per slot.
        data = jnp.stack([tokens, active.astype(jnp.int32), step], axis=-1)
        return new_state, data

    def generate(
        self, params: nnx.State, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One token for every active slot (donates `decode_state`); see the module docstring.

        The `ResultTokens` row of a slot is (token, valid, length): `valid` is 0 for a slot that
        had already finished, `length` counts the slot's generated tokens including this one.
        """
        state, data = self._generate_jit(params, decode_state, self.config.cache_length)
        return state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )

    def _generate_steps_impl(
        self, params, state: DecodeState, num_steps: int, kv_len: int, stop_at_finish
    ):
        # A while loop, so a dispatch can end on the device the moment a slot finishes: the
        # host refills it at once instead of letting it idle for the rest of a fixed k steps.
        # Once every slot is done further steps change nothing, so the loop stops there too.
        was_done = state.done

        def cond(carry):
            i, st = carry
            finished = jnp.any(st.done & ~was_done)
            return (i < num_steps) & ~jnp.all(st.done) & ~(stop_at_finish & finished)

        def body(carry):
            i, st = carry
            return i + 1, self._generate_impl(params, st, kv_len)[0]

        return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]

    def kv_bucket(self, length: int) -> int:
        """The smallest of `EngineConfig.kv_buckets` >= `length` (the cache length if none)."""
        buckets = self.config.kv_buckets
        return buckets[min(bisect.bisect_left(buckets, int(length)), len(buckets) - 1)]

    def generate_steps(
        self,
        params: nnx.State,
        decode_state: DecodeState,
        num_steps: int,
        kv_len: int | None = None,
        stop_at_finish: bool = False,
    ) -> DecodeState:
        """Up to `num_steps` generate steps in one compiled loop (donates `decode_state`).

        Not part of JetStream's API: the RL loop uses it to dispatch and synchronise once per
        up to `num_steps` tokens. It computes what that many calls of `generate` compute
        (finished slots do not change; keys depend on the step, not on the call), so the
        sampled tokens are the same; recorded log-probs agree to float rounding (the loop is
        compiled separately, so XLA may fuse differently). The loop ends early once every
        slot is done, and with `stop_at_finish` after the first step in which a slot that was
        active at the call finishes (the caller reads `pos`/`done` to see how far it went).

        Args:
          params: rollout params.
          decode_state: the state (donated).
          num_steps: at most this many decode steps (static: one compiled loop per value).
          kv_len: attention reads the first `kv_bucket(kv_len)` cache positions (at most
            `len(kv_buckets)` compiled variants per `num_steps`). It must exceed the last
            position any active slot writes in these steps: `max(pos) + num_steps` over active
            slots (an upper bound is fine); a smaller value gives those slots wrong logits.
            None: the whole cache.
          stop_at_finish: end the loop after the step in which a slot finishes (a runtime
            flag: both settings share one compiled loop).
        """
        kv_len = self.config.cache_length if kv_len is None else self.kv_bucket(kv_len)
        if int(num_steps) == 1:
            return self._generate_jit(params, decode_state, kv_len)[0]
        return self._generate_steps_jit(
            params, decode_state, int(num_steps), kv_len, np.bool_(stop_at_finish)
        )

    # ------------------------------------------------------------------------------------------
    # Tokenizer and static properties.
    # ------------------------------------------------------------------------------------------
    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self._tokenizer_path)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Any:
        """Our tokenizer (JetStream's default would build a SentencePiece one)."""
        del metadata
        return self.tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def max_decode_length(self) -> int:
        return self.config.max_decode_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        """No colocated CPU devices are used."""
        return None

    def compile_cache_sizes(self) -> dict[str, int]:
        """Compiled-program counts of the jitted entry points (tests assert they stay put)."""
        return {
            name: getattr(self, f"_{name}_jit")._cache_size()
            for name in (
                "prefill",
                "prefill_batch",
                "insert",
                "insert_batch",
                "generate",
                "generate_steps",
                "init_state",
            )
        }
