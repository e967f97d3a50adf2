"""The rollout engine's settings and state: `EngineConfig`, `Prefix`, `DecodeState`.

Data types only: `decode.py` computes with them, `engine.py` jits that and re-exports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct

from dvp_jax.dvp import pruning
from dvp_jax.model.attention import KVCache
from dvp_jax.model.config import PRECISIONS
from dvp_jax.rollout import sampling


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Rollout engine settings (static shapes, precision and default sampling).

    Attributes:
      dtype: rollout precision, one of `PRECISIONS`: 'float32' (no mismatch with the
        trainer), 'bfloat16' (params, activations and KV cache; the default) or
        'bfloat16_fp8kv' (bf16 with a float8_e4m3fn KV cache), 'bfloat16_fp8kv_fp8w' and
        'bfloat16_fp8kv_int4w' (that, with fp8 / int4 block kernels: `rollout/quantize.py`).
      noise_std: sigma of additive Gaussian noise on the rollout logits before pruning
        (0 = off), a fixed function of the context (`sampling.py`): a controlled, stronger
        systematic mismatch.
      noise_tail_gap: G >= 0; > 0 shapes that noise to the tail (a synthetic mismatch,
        `sampling.py`): 0 within G/2 of the row max, full strength from gap G on. 0: uniform.
      max_concurrent_decodes: decode slots (the decode batch).
      max_prefill_length: longest prompt in tokens (BOS included).
      prefill_buckets: prompt lengths prefill is compiled for; values above
        `max_prefill_length` are dropped and `max_prefill_length` is always added.
      max_decode_length: most tokens generated per request.
      temperature, log_rho, greedy: default sampling (see `sampling.SamplingParams`);
        `init_decode_state(sampling=...)` overrides them without recompiling.
      seed: base seed of the keys given to requests prefilled without an explicit `rng`.
      stop_tokens: token ids that end a response; None: the tokenizer's `stop_tokens`; () never
        stops early (benchmarks).
    """

    dtype: str = "bfloat16"
    noise_std: float = 0.0
    max_concurrent_decodes: int = 8
    max_prefill_length: int = 64
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    max_decode_length: int = 64
    temperature: float = pruning.DEFAULT_TEMPERATURE
    log_rho: float = pruning.DEFAULT_LOG_RHO
    greedy: bool = False
    seed: int = 0
    noise_tail_gap: float = 0.0
    stop_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        self.check_fields(self, "EngineConfig")

    @classmethod
    def check_fields(cls, settings: Any, where: str) -> None:
        """The one validation of every engine setting: each `EngineConfig` field that
        `settings` (this config, or a run's `rollout` section, which carries a subset of them
        under the same names) has. Raises ValueError naming `where.<field>` and what is
        allowed."""
        missing = object()
        get = lambda name: getattr(settings, name, missing)
        dtype = get("dtype")
        if dtype is not missing and dtype not in PRECISIONS:
            raise ValueError(f"{where}.dtype must be one of {PRECISIONS}, got {dtype!r}")
        for name in ("max_concurrent_decodes", "max_prefill_length", "max_decode_length"):
            value = get(name)
            if value is not missing and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{where}.{name} must be an int >= 1, got {value!r}")
        buckets = get("prefill_buckets")
        if buckets is not missing and any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"{where}.prefill_buckets must be positive ints, got {buckets}")
        sampling.check_sampling_values(
            *[
                None if get(n) is missing else get(n)
                for n in ("temperature", "log_rho", "noise_std", "noise_tail_gap")
            ],
            owner=where,
        )

    @property
    def buckets(self) -> tuple[int, ...]:
        """Sorted prefill lengths actually compiled for."""
        kept = {b for b in self.prefill_buckets if b < self.max_prefill_length}
        return tuple(sorted(kept | {self.max_prefill_length}))

    @property
    def cache_length(self) -> int:
        """S: every slot holds a full prompt plus a full response."""
        return self.max_prefill_length + self.max_decode_length

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        """Cache lengths decode attention is compiled for: powers of two from 32 below S, and S.

        A dispatch attends over the smallest bucket above every live slot's position, so the
        attention reads the live prefix (to within 2x) instead of the whole cache, with at most
        `len(kv_buckets)` compiled decode programs per step count.
        """
        s = self.cache_length
        return tuple(sorted({2**i for i in range(5, s.bit_length()) if 2**i < s} | {s}))

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Prompt counts batched prefill is compiled for: powers of two below the slot count,
        and the slot count."""
        b = self.max_concurrent_decodes
        return tuple(sorted({2**i for i in range(b.bit_length()) if 2**i < b} | {b}))

    def sampling_params(self, **overrides) -> sampling.SamplingParams:
        kwargs = dict(
            temperature=self.temperature,
            log_rho=self.log_rho,
            noise_std=self.noise_std,
            greedy=self.greedy,
            noise_tail_gap=self.noise_tail_gap,
        )
        kwargs.update(overrides)
        return sampling.SamplingParams.create(**kwargs)


@struct.dataclass
class Prefix:
    """Prefilled prompts, one per row (JetStream's `Prefix`: one row per request).

    Attributes:
      cache: KVCache with k, v `[L, rows, k, bucket, h]` in the cache dtype (`[L, rows, bucket,
        k, h]` in a TPU engine: `attention.cache_layout`).
      logits: `[rows, v]` float32 logits for the first generated token.
      length: `[rows]` int32 true prompt lengths (BOS included).
      key: `[rows, 2]` uint32 raw PRNG keys of the requests.
      context: `[rows]` uint32 `sampling.context_hash` of each prompt (its logit noise).
    """

    cache: KVCache
    logits: jax.Array
    length: jax.Array
    key: jax.Array
    context: jax.Array


@struct.dataclass
class DecodeState:
    """Per-slot decode state (B slots, M = max_decode_length, S = cache length).

    Attributes:
      cache: KVCache with k, v `[L, B, k, S, h]` (`[L, B, S, k, h]` in a TPU engine:
        `attention.cache_layout`) stored as `attention.cache_storage` (the bits
        of a bfloat16 / float8 cache as uint16 / uint8, so every write is an in-place integer
        scatter on every backend; `attention.from_storage` gives the values).
      logits: `[B, v]` float32 pending next-token logits of each slot.
      pos: `[B]` int32 position of the next token (= tokens in the slot's sequence so far).
      step: `[B]` int32 tokens generated so far.
      done: `[B]` bool, True once a slot finished (or was never filled).
      key: `[B, 2]` uint32 raw per-slot PRNG key.
      context: `[B]` uint32 `sampling.context_hash` of each slot's sequence so far (prompt and
        generated tokens): the key of its logit noise.
      tokens: `[B, M]` int32 generated token ids.
      behaviour_logp: `[B, M]` float32 log mu_S of each generated token (E4, pruned behaviour
        log-prob; `TokenLogprobs.logp` of the sampler).
      behaviour_logp_full: `[B, M]` float32 unpruned log mu.
      behaviour_pruned_mass: `[B, M]` float32 delta_S of the rollout safe set (E3).
      behaviour_safe_size: `[B, M]` int32 |V_S| of the rollout safe set (E1).
      sampling: the sampling parameters (arrays, so changing them never recompiles).
    """

    cache: KVCache
    logits: jax.Array
    pos: jax.Array
    step: jax.Array
    done: jax.Array
    key: jax.Array
    context: jax.Array
    tokens: jax.Array
    behaviour_logp: jax.Array
    behaviour_logp_full: jax.Array
    behaviour_pruned_mass: jax.Array
    behaviour_safe_size: jax.Array
    sampling: sampling.SamplingParams


# The per-generated-token record arrays of `DecodeState` (the names `RolloutBatch` keeps).
RECORD_FIELDS = (
    "tokens",
    "behaviour_logp",
    "behaviour_logp_full",
    "behaviour_pruned_mass",
    "behaviour_safe_size",
)
