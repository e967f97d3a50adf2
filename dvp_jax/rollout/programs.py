"""The rollout engine's device side: its jitted programs (`Programs`, what `dvp_jax.aot`
compiles for a TPU topology), the shardings of its parameters, cache and decode state, the
weight cast onto a trainer mesh, and abstract inputs for compiling without data.

`EngineDevice` is the part of `engine.RolloutEngine` that needs no host data: the engine's
constructor sets the attributes it reads (the model's shapes and paths, the sharder, the cache
layout and dtype policy, the stop tokens, the paged path) and calls `_jit_programs` once. The
host API (prefill, insert, generate, resume, evict, weights) is `engine.py`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dvp_jax.model.kv_cache import KVCache, cache_axes, cache_shape
from dvp_jax.model.paged import Pages, paged_cache_shape, paged_cache_sharding
from dvp_jax.rollout import decode
from dvp_jax.rollout.quantize import quantize_leaves
from dvp_jax.rollout.state import RECORD_FIELDS, DecodeState, Prefix
from dvp_jax.sharding import ROLLOUT_RULES, Sharder, state_shardings


@dataclasses.dataclass(frozen=True)
class Programs:
    """The engine's jitted programs (what `dvp_jax.aot` compiles for a TPU topology).

    Attributes:
      init_state: (SamplingParams) -> empty `DecodeState`.
      prefill: (params, tokens [rows, bucket], lengths [rows], raw keys [rows, 2]) -> `Prefix`.
      insert: (prefix, state (donated), slots [B], rows [B], sample indices [B]) -> state.
      step: (params, state (donated), span size (static)) -> (state, [B, 3] token/valid/length).
      loop: (params, state (donated), num_steps, span size (static), stop_at_finish) -> state;
        num_steps and the flag are traced, so one program serves every dispatch size.
      evict: (state (donated), slots [B] bool) -> state with those slots stopped, pages freed.
      resume: (prefix, state (donated), slots [B], rows [B], steps [B]) -> state: preempted
        responses (prompt + generated prefix, prefilled again) back in their slots.
      cast: (trainer parameter leaves) -> rollout leaves, where the trainer's arrays live.
    """

    init_state: Any
    prefill: Any
    insert: Any
    step: Any
    loop: Any
    evict: Any
    resume: Any
    cast: Any


def device_memory_bytes(device=None) -> int:
    """Memory one device can hold: the accelerator's allocator limit, or on CPU (which
    reports none) the host's physical memory."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class EngineDevice:
    """The engine's programs and shardings (the module docstring); `engine.RolloutEngine`
    sets the attributes and is the class to build."""

    def _jit_programs(self) -> Programs:
        cfg, model = self.config, lambda params: nnx.merge(self._graphdef, params)
        dtype, layout, stop = self.policy.cache_dtype, self.cache_layout, self.stop_tokens
        s, state_sh = cfg.cache_length, self.state_shardings
        paths, dtypes = self._param_paths, [a.dtype for a in self._abstract_leaves]
        pool = (cfg.num_pages, cfg.page_size) if cfg.paged else None
        impl = self.paged_impl

        def init_state(params):
            b, m = cfg.max_concurrent_decodes, cfg.max_decode_length
            return decode.empty_state(
                self.model_cfg, b, m, s, dtype, layout, params, pool, cfg.kept_width
            )

        def insert(prefix, state, slots, rows, sample_index):
            return decode.insert(prefix, state, slots, rows, sample_index, dtype, layout)

        def resume(prefix, state, slots, rows, steps):
            return decode.insert(prefix, state, slots, rows, steps, dtype, layout, steps)

        def cast(leaves):
            # The policy's weight quantization first (the mismatch ladder of e004; quantized
            # kernels come back in the param dtype), then the cast to the rollout dtype.
            quantized = quantize_leaves(leaves, paths, self.policy)
            return [x.astype(d) for x, d in zip(quantized, dtypes, strict=True)]

        self._cast = cast
        return Programs(
            init_state=jax.jit(init_state, out_shardings=state_sh),
            prefill=jax.jit(lambda p, *args: decode.prefill(model(p), *args)),
            insert=jax.jit(insert, donate_argnums=(1,), out_shardings=state_sh),
            step=jax.jit(
                lambda p, state, kv_len: decode.step(model(p), state, kv_len, stop, s, impl),
                static_argnums=(2,),
                donate_argnums=(1,),
                out_shardings=(state_sh, self.sharder.replicated()),
            ),
            loop=jax.jit(
                lambda p, state, k, kv_len, flag: decode.loop(
                    model(p), state, k, kv_len, flag, stop, s, impl
                ),
                static_argnums=(3,),
                donate_argnums=(1,),
                out_shardings=state_sh,
            ),
            evict=jax.jit(decode.evict, donate_argnums=(0,), out_shardings=state_sh),
            resume=jax.jit(resume, donate_argnums=(1,), out_shardings=state_sh),
            cast=jax.jit(cast),
        )

    def sync_shardings(self, mesh: jax.sharding.Mesh) -> list[NamedSharding]:
        """The rollout layout (`ROLLOUT_RULES`) of every parameter on the trainer's mesh."""
        return jax.tree.leaves(state_shardings(self._shapes, Sharder(mesh, ROLLOUT_RULES)))

    def sync_program(self, mesh: jax.sharding.Mesh):
        """`programs.cast` with outputs in the rollout layout on the trainer's `mesh` (split
        over tensor, replicated over data and fsdp: an all-gather over fsdp, each chip holding
        1/tensor of every parameter), jitted once per trainer mesh."""
        if mesh not in self._sync_jits:
            self._sync_jits[mesh] = jax.jit(self._cast, out_shardings=self.sync_shardings(mesh))
        return self._sync_jits[mesh]

    def cache_sharding(self, batch: int, length: int) -> NamedSharding:
        """The sharding of a `[L, batch, ., ., h]` KV cache of `length` positions."""
        shape = cache_shape(self.model_cfg, batch, length, self.cache_layout)
        return self.sharder.sharding(cache_axes(self.cache_layout), shape)

    def _decode_state_shardings(self) -> DecodeState:
        cfg, rep = self.config, self.sharder.replicated()
        pages = None
        if cfg.paged:
            shape = paged_cache_shape(self.model_cfg, cfg.num_pages, cfg.page_size)
            cache = paged_cache_sharding(self.sharder, shape, self.model_cfg.n_kv_heads)
            pages = Pages(rep, rep, rep)
        else:
            cache = self.cache_sharding(cfg.max_concurrent_decodes, cfg.cache_length)
        return DecodeState(
            cache=KVCache(cache, cache),
            **{f: rep for f in ("logits", "pos", "step", "done", "key", "context") + RECORD_FIELDS},
            sampling=jax.tree.map(lambda _: rep, self.config.sampling_params()),
            pages=pages,
        )

    def replicated_structs(self, tree):
        """`tree`'s shapes and dtypes as replicated `ShapeDtypeStruct`s on the engine's mesh."""
        rep = self.sharder.replicated()
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)

    def abstract_decode_state(self) -> DecodeState:
        """The decode state as sharded `ShapeDtypeStruct`s (nothing allocated)."""
        shapes = jax.eval_shape(self.programs.init_state, self.config.sampling_params())
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            self.state_shardings,
        )

    def abstract_prefix(self, rows: int, bucket: int) -> Prefix:
        """A `prefill_batch` result of `rows` x `bucket` as sharded structs, as insert takes it:
        the cache sharded like the decode state's, the rest replicated."""
        key = decode.raw_key_shape()
        args = self.replicated_structs(
            (
                jax.ShapeDtypeStruct((rows, bucket), np.int32),
                jax.ShapeDtypeStruct((rows,), np.int32),
                jax.ShapeDtypeStruct((rows,) + key, np.uint32),
            )
        )
        prefix = self.replicated_structs(jax.eval_shape(self.programs.prefill, self.params, *args))
        sharding = self.cache_sharding(rows, bucket)
        cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), prefix.cache
        )
        return prefix.replace(cache=cache)
