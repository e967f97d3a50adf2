"""The rollout engine's settings and state: `EngineConfig`, `Prefix`, `DecodeState`.

Data types only: `decode.py` computes with them, `engine.py` jits that and re-exports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct

from dvp_jax.dvp import pruning
from dvp_jax.model.config import PRECISIONS, DTypePolicy
from dvp_jax.model.kv_cache import KVCache
from dvp_jax.model.paged import Pages
from dvp_jax.rollout import sampling

# Decode attention of the engine (`EngineConfig.decode_attention`).
DECODE_ATTENTION = ("paged", "paged_xla", "dense")


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
      decode_attention: one of `DECODE_ATTENTION`: "paged" (the default: a paged KV cache and
        attention over each slot's own live pages, the Pallas kernel of
        `model/decode_kernels.py` on TPU, the ragged XLA path of `model/paged.py` elsewhere),
        "paged_xla" (the paged cache with the ragged XLA path on every backend) or "dense"
        (one `[B, S]` cache, attention over a length bucket shared by all slots).
      page_size: positions per KV page (paged decode).
      kv_pages: pages in the pool (paged decode); None: enough for every slot at full length
        (`B * ceil(S / page_size)`, never short). Fewer spends HBM on live tokens only: a
        response that finds the pool empty is preempted and decoded again later (its key fixes
        its tokens, so the result is the same). At least one slot's full length.
      top_k, top_p: default truncation (E13, `sampling.truncation`): keep the top_k highest
        tokens (0: off), then the smallest top set of probability >= top_p (1: off); off by
        default (the paper samples with min-p only). Either one on compiles the truncation in,
        with the kept set of every token recorded (`behaviour_kept_ids`, `kept_width` ids).
      max_kept: the most tokens a truncated position keeps (>= top_k): top-p chooses among the
        max_kept highest, and the trainer receives max_kept int32 ids per token.
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
    decode_attention: str = "paged"
    page_size: int = 64
    kv_pages: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    max_kept: int = 64

    def __post_init__(self):
        self.check_fields(self, "EngineConfig")
        self.check_kv_pages(self.kv_pages, self.cache_length, self.page_size, "EngineConfig")

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
        attention = get("decode_attention")
        if attention is not missing and attention not in DECODE_ATTENTION:
            raise ValueError(
                f"{where}.decode_attention must be one of {DECODE_ATTENTION}, got {attention!r}"
            )
        for name, allow_none in [("page_size", False), ("kv_pages", True)]:
            value = get(name)
            if value is missing or (value is None and allow_none):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                none = "None or " if allow_none else ""
                raise ValueError(f"{where}.{name} must be {none}an int >= 1, got {value!r}")
        numbers = ("temperature", "log_rho", "noise_std", "noise_tail_gap", "top_k", "top_p")
        for name in numbers:
            if get(name) is None:  # the sampler's check reads None as "not held here"
                raise ValueError(f"{where}.{name} must be a number, got None")
        value = lambda n: None if get(n) is missing else get(n)
        sampling.check_sampling_values(
            *[value(n) for n in numbers[:4]],
            owner=where,
            top_k=value("top_k"),
            top_p=value("top_p"),
        )
        max_kept = get("max_kept")
        if max_kept is not missing and (
            isinstance(max_kept, bool) or not isinstance(max_kept, int) or max_kept < 1
        ):
            raise ValueError(f"{where}.max_kept must be an int >= 1, got {max_kept!r}")
        top_k = value("top_k")
        if max_kept is not missing and top_k is not None and top_k > max_kept:
            raise ValueError(f"{where}.top_k must be <= {where}.max_kept ({max_kept}), got {top_k}")

    @staticmethod
    def check_kv_pages(kv_pages: int | None, cache_length: int, page_size: int, where: str):
        """A pool holds one slot at full length: None, or at least ceil(S / page_size) pages.
        Raises ValueError naming `where.kv_pages`. (A page larger than the cache is allowed,
        as the default 64 on a short cache is; a pool that will not fit the device is refused
        by `check_pool_fits`.)"""
        least = -(-cache_length // page_size)
        if kv_pages is not None and kv_pages < least:
            raise ValueError(
                f"{where}.kv_pages must be None or an int >= {least} (one slot at full length: "
                f"ceil({cache_length} / page_size {page_size})), got {kv_pages!r}"
            )

    def pool_bytes(self, model_cfg, tensor_parallel: int = 1) -> int:
        """Bytes of the KV cache per chip: the paged pool (k and v, every layer) or the dense
        `[B, S]` cache; kv heads split over `tensor_parallel` chips when it divides them."""
        positions = (
            self.num_pages * self.page_size
            if self.paged
            else (self.max_concurrent_decodes * self.cache_length)
        )
        itemsize = jax.numpy.dtype(DTypePolicy.named(self.dtype).cache_dtype).itemsize
        per_position = 2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim
        split = tensor_parallel if model_cfg.n_kv_heads % tensor_parallel == 0 else 1
        return positions * per_position * itemsize // split

    def check_pool_fits(self, model_cfg, tensor_parallel: int, device_bytes: int, where: str):
        """Refuses a KV cache larger than a chip's memory (`device_bytes`) before anything is
        allocated, in one line naming the fields and the bytes."""
        need = self.pool_bytes(model_cfg, tensor_parallel)
        if need > device_bytes:
            if self.paged:
                field, shape = "kv_pages", f"{self.num_pages} pages of {self.page_size} positions"
            else:
                field = "max_concurrent_decodes"
                shape = f"{self.max_concurrent_decodes} slots of {self.cache_length} positions"
            raise ValueError(
                f"{where}.{field}: the KV cache needs {need / 2**30:,.1f} GiB per chip ({shape}), "
                f"more than the device's {device_bytes / 2**30:,.1f} GiB; lower "
                f"{where}.kv_pages, page_size or max_concurrent_decodes"
            )

    @property
    def kept_width(self) -> int:
        """W, the kept ids recorded per token (`truncation_width` of this config)."""
        return self.truncation_width(self)

    @staticmethod
    def truncation_width(settings: Any) -> int:
        """W for `settings` (this config or a run's `rollout` section): `max_kept` when top-k
        or top-p is on, else 0 (no truncation compiled, zero-width records)."""
        on = settings.top_k > 0 or settings.top_p < 1.0
        return settings.max_kept if on else 0

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
    def paged(self) -> bool:
        """True when decode runs on a paged KV cache (`decode_attention` != "dense")."""
        return self.decode_attention != "dense"

    @property
    def pages_per_slot(self) -> int:
        """Pages one slot holds at full length: ceil(S / page_size)."""
        return -(-self.cache_length // self.page_size)

    @property
    def num_pages(self) -> int:
        """Pages in the pool: `kv_pages`, or every slot at full length."""
        return self.kv_pages or self.max_concurrent_decodes * self.pages_per_slot

    @property
    def page_buckets(self) -> tuple[int, ...]:
        """Live-page counts the ragged XLA decode is compiled for: powers of two from 8 below
        the pool, and the pool (a dispatch reads the smallest bucket above its live pages)."""
        p = self.num_pages
        return tuple(sorted({2**i for i in range(3, p.bit_length()) if 2**i < p} | {p}))

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
            top_k=self.top_k,
            top_p=self.top_p,
        )
        kwargs.update(overrides)
        return sampling.SamplingParams.create(**kwargs)


@struct.dataclass
class Prefix:
    """Prefilled prompts, one per row (JetStream's `Prefix`: one row per request).

    Attributes:
      cache: KVCache with k, v `[L, rows, k, bucket, h]` in the cache dtype (`[L, rows, bucket,
        k, h]` in a TPU engine: `kv_cache.cache_layout`).
      logits: `[rows, v]` float32 logits for the first generated token.
      length: `[rows]` int32 true prompt lengths (BOS included).
      key: `[rows, 2]` uint32 raw PRNG keys of the requests.
      context: `[rows]` uint32 `sampling.context_hash` of each prompt (its logit noise).
      tokens: `[rows, bucket]` int32 the prompts themselves (a server that preempts a request
        prefills them again with what it generated: `jetstream.JetStreamEngine`).
    """

    cache: KVCache
    logits: jax.Array
    length: jax.Array
    key: jax.Array
    context: jax.Array
    tokens: jax.Array | None = None


@struct.dataclass
class DecodeState:
    """Per-slot decode state (B slots, M = max_decode_length, S = cache length).

    Attributes:
      cache: KVCache with k, v `[L, B, k, S, h]` (`[L, B, S, k, h]` in a TPU engine:
        `kv_cache.cache_layout`) stored as `kv_cache.cache_storage` (the bits
        of a bfloat16 / float8 cache as uint16 / uint8, so every write is an in-place integer
        scatter on every backend; `kv_cache.from_storage` gives the values).
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
      behaviour_kept_ids: `[B, M, W]` int32 the truncation set K of each generated token (E13,
        `sampling.Truncation`; W = `EngineConfig.kept_width`, 0 without truncation).
      behaviour_truncated_mass: `[B, M]` float32 mass of mu outside K (0 without truncation).
      sampling: the sampling parameters (arrays, so changing them never recompiles).
      pages: the page pool of a paged cache (`paged.Pages`; None for dense decode): cache k, v
        are then `[L, P, page_size, k h]` pages (`model/paged.py`).
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
    behaviour_kept_ids: jax.Array
    behaviour_truncated_mass: jax.Array
    sampling: sampling.SamplingParams
    pages: Pages | None = None


# The per-generated-token record arrays of `DecodeState` (the names `RolloutBatch` keeps).
RECORD_FIELDS = (
    "tokens",
    "behaviour_logp",
    "behaviour_logp_full",
    "behaviour_pruned_mass",
    "behaviour_safe_size",
    "behaviour_kept_ids",
    "behaviour_truncated_mass",
)
