"""Model configuration: a frozen `ModelConfig` with Qwen3 presets, and the dtype policy.

`ModelConfig` mirrors the fields of Hugging Face's `Qwen3Config` that change the computation;
`from_hf` / `to_hf` convert a `config.json` dict in both directions and refuse architectures this
model does not implement (MoE, sliding-window attention, attention biases, RoPE scaling);
`check_matches_checkpoint` checks a preset and explicit fields against a file's architecture.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
    """Which dtype each part of the model uses, and at which matmul precision.

    Attributes:
      param_dtype: dtype the parameters are stored in.
      compute_dtype: dtype of activations and matmul inputs (parameters are cast to it at use).
      cache_dtype: dtype of the KV cache (may be lower than compute, e.g. float8_e4m3fn).
      precision: the `jax.lax.Precision` (or `jax.lax.DotAlgorithmPreset`) of every matmul of
        the model (projections, attention q.k and p.v, MLP, unembedding); a string
        ('default', 'high', 'highest') is converted.
        With float32 inputs it decides what "fp32" means on an accelerator: `HIGHEST` is true
        fp32 on every backend, `DEFAULT` is the backend's choice (exact on CPU, TF32 on recent
        GPUs, one bf16 pass on TPUs). With bf16 inputs there is one pass whatever the value.
        None defers to JAX's global `jax_default_matmul_precision`; the named policies never
        use None, so what they compute does not depend on a global flag.
      attention_impl: the kernel of the full-sequence attention (training forward and prefill;
        decode always runs the explicit path), one of `ATTENTION_IMPLS`: "xla" the explicit
        einsum softmax at `precision`; "dot_product" `jax.nn.dot_product_attention` on XLA, its
        matmuls at `precision`; "blockwise" query/key blocks with an online softmax in JAX
        (no T x T array; every dot at `precision`, `dvp_jax/model/blockwise.py`); "cudnn"
        cuDNN flash attention (NVIDIA GPU, 16-bit compute); "splash" the Pallas splash kernel
        (TPU, 16-bit compute); "auto" (default) picks per backend, compute dtype and shape
        (`dvp_jax.model.attention.select_attention_impl`): a fused kernel only for a 16-bit
        compute dtype on GPU / TPU, else "blockwise" from 2,048 tokens and the explicit path
        below, so a float32 policy is true fp32 on every backend. Part of the policy
        because the kernel decides the attention's numerics (which dtypes it takes, its
        accumulation order, whether `precision` reaches its matmuls).
      weight_quant: fake quantization of the decoder blocks' matmul kernels, one of
        `WEIGHT_QUANTS`, applied when trainer weights are synced into the rollout engine
        (`dvp_jax/rollout/quantize.py`): "none"; "fp8_channel" (float8_e4m3fn, one absmax scale
        per output channel); "int4_group32" (symmetric int4, one absmax scale per group of 32
        along the contraction dimension). The kernels are quantized, then dequantized to
        `param_dtype`, so the rollout computes exactly what a weight-quantized deployment
        computes with `compute_dtype` matmuls; a model built with this policy does not quantize
        by itself (only the weight sync does).
      attention_block: the query and key tile in tokens of splash (a multiple of 128 dividing
        T) and of "blockwise"; 0 (default) picks for splash the largest of 512, 256, 128
        dividing T (`dvp_jax.model.kernels.splash_block`), for blockwise 512. Changes speed
        and memory, not the mask or the math.
    Logits are always produced in float32 (matmul accumulates in fp32), and softmax / RMSNorm
    statistics always run in float32, whatever the policy.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    cache_dtype: Any = jnp.float32
    precision: jax.lax.Precision | str | None = None
    attention_impl: str = "auto"
    weight_quant: str = "none"
    attention_block: int = 0

    def __post_init__(self):
        if (
            not isinstance(self.attention_block, int)
            or self.attention_block < 0
            or (self.attention_block % 128)
        ):
            raise ValueError(
                f"DTypePolicy.attention_block must be 0 (choose) or a positive multiple of 128, "
                f"got {self.attention_block!r}"
            )
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(
                f"DTypePolicy.weight_quant {self.weight_quant!r} is unknown; allowed: "
                f"{WEIGHT_QUANTS}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"DTypePolicy.attention_impl {self.attention_impl!r} is unknown; allowed: "
                f"{ATTENTION_IMPLS}"
            )
        if isinstance(self.precision, str):
            try:
                precision = jax.lax.Precision(self.precision)
            except ValueError:
                raise ValueError(
                    f"DTypePolicy.precision {self.precision!r} is not a matmul precision; "
                    "allowed: 'default', 'high', 'highest' or a jax.lax.Precision"
                ) from None
            object.__setattr__(self, "precision", precision)

    def for_platform(self, platform: str) -> DTypePolicy:
        """This policy as programs on `platform` run it: the three-pass fp32 algorithm is
        bf16 x 3 on TPU (and CPU, which computes it exactly) and 3xTF32 on an NVIDIA GPU, the
        backend's own fp32-class three-pass matmul."""
        if self.precision == _X3 and platform in ("gpu", "cuda"):
            return dataclasses.replace(self, precision=_X3_GPU)
        return self

    @classmethod
    def named(
        cls, name: str, attention_impl: str = "auto", attention_block: int = 0
    ) -> DTypePolicy:
        """The policy called `name`, one of `POLICY_NAMES` (`PRECISIONS` + `TRAIN_PRECISIONS`),
        with the attention kernel `attention_impl` (one of `ATTENTION_IMPLS`) and its tile."""
        if name not in _POLICIES:
            raise ValueError(
                f"unknown dtype policy {name!r}; allowed: rollout precisions {PRECISIONS}, "
                f"trainer precisions {TRAIN_PRECISIONS}"
            )
        param, compute, cache, precision, weight_quant = _POLICIES[name]
        return cls(param, compute, cache, precision, attention_impl, weight_quant, attention_block)


_HIGHEST, _DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
# fp32-class matmuls from three 16-bit passes: on TPU bf16 x 3 (a = hi + lo in bf16, the product
# hi.hi + hi.lo + lo.hi accumulated in f32; HIGHEST is 6 passes), on an NVIDIA GPU 3xTF32
# (`DTypePolicy.for_platform`); CPUs compute float32 exactly for either.
_X3 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
_X3_GPU = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3

# (param, compute, KV cache dtype, matmul precision, weight quantization) of each named policy
# (docs/design.md section 4). "float32" is the trainer and, as a rollout dtype, removes the
# precision mismatch: true fp32 matmuls on every backend. The bf16 policies take the backend's
# default precision (bf16 inputs: one pass, fp32 accumulation). "mixed_bf16" is a trainer
# policy only: fp32 master parameters cast to bf16 at use, bf16 activations, fp32 logits and
# loss statistics; in its backward pass the transposes of the two fp32-output matmuls
# (attention scores, logits) take the fp32 cotangent and run f32 x f32 at DEFAULT (TF32 on
# GPUs, one bf16 pass on TPUs).
# The deterministic mismatch ladder (no noise): "float32" (M0, none),
# "bfloat16_fp8kv" (M1), M1 + per-channel fp8 weights (M2, "bfloat16_fp8kv_fp8w"), M1 + int4
# weights in groups of 32 (M3, "bfloat16_fp8kv_int4w"); the weights are fake-quantized at
# weight sync (`dvp_jax/rollout/quantize.py`).
_FP8 = jnp.float8_e4m3fn
_POLICIES = {
    "float32": (jnp.float32, jnp.float32, jnp.float32, _HIGHEST, "none"),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, _DEFAULT, "none"),
    "bfloat16_fp8kv": (jnp.bfloat16, jnp.bfloat16, _FP8, _DEFAULT, "none"),
    "bfloat16_fp8kv_fp8w": (jnp.bfloat16, jnp.bfloat16, _FP8, _DEFAULT, "fp8_channel"),
    "bfloat16_fp8kv_int4w": (jnp.bfloat16, jnp.bfloat16, _FP8, _DEFAULT, "int4_group32"),
    "mixed_bf16": (jnp.float32, jnp.bfloat16, jnp.bfloat16, _DEFAULT, "none"),
    "float32_x3": (jnp.float32, jnp.float32, jnp.float32, _X3, "none"),
}
# Rollout precisions: the one list `config.rollout.dtype`, `EngineConfig.dtype` and the server's
# --dtype choose from. "mixed_bf16" is not one: as a rollout it would compute exactly what
# "bfloat16" computes (parameters rounded to bf16 at use) while holding fp32 weights, twice
# the memory for nothing.
PRECISIONS = (
    "float32",
    "bfloat16",
    "bfloat16_fp8kv",
    "bfloat16_fp8kv_fp8w",
    "bfloat16_fp8kv_int4w",
)
# Trainer precisions: what `config.train.precision` chooses from (reported as `train_precision`).
# "float32_x3" is fp32 parameters and activations with every matmul from three 16-bit passes
# (half of HIGHEST's six on a TPU; docs/model.md has their measured errors).
TRAIN_PRECISIONS = ("float32", "float32_x3", "mixed_bf16")
POLICY_NAMES = tuple(_POLICIES)
assert set(PRECISIONS) | set(TRAIN_PRECISIONS) == set(_POLICIES)

# Remat (rematerialisation) policies of the scanned decoder blocks in the training forward
# (`Transformer(remat=...)`): "none" keeps every block activation for the backward pass; "full"
# keeps only each block's input and recomputes the rest; "save_dots" also keeps every matmul
# output; "save_dots_no_batch" keeps the projection and MLP matmul outputs but recomputes the
# attention scores (dots with batch dimensions), MaxText's "minimal".
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch")

# Attention kernels of the full-sequence forward (`DTypePolicy.attention_impl`; the selection
# logic and each kernel's contract are in `dvp_jax/model/attention.py`).
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "blockwise", "cudnn", "splash")

# Weight quantizations of the rollout copy of the weights (`DTypePolicy.weight_quant`; the
# formats and which parameters they touch are in `dvp_jax/rollout/quantize.py`).
WEIGHT_QUANTS = ("none", "fp8_channel", "int4_group32")


TRAIN_POLICY = DTypePolicy.named("float32")
MIXED_TRAIN_POLICY = DTypePolicy.named("mixed_bf16")
ROLLOUT_POLICY = DTypePolicy.named("bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3-style decoder (dense, no biases, q/k RMSNorm, SwiGLU)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 40_960
    init_std: float = 0.02

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    # ----------------------------------------------------------------------------------------
    # Presets. Sizes follow the published Qwen3 config.json files.
    # ----------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    # ----------------------------------------------------------------------------------------
    # Hugging Face config.json conversion.
    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face Qwen3 `config.json` dict.

        Raises:
          ValueError: naming the field, for architectures this model does not implement.
        """
        model_type, archs = hf.get("model_type"), hf.get("architectures") or list(ARCHITECTURES)
        if model_type != "qwen3" or any(a not in ARCHITECTURES for a in archs):
            raise ValueError(
                f"config.json has model_type={model_type!r}, architectures={archs}; allowed: "
                f"model_type 'qwen3' (dense Qwen3; not MoE such as 'qwen3_moe') with "
                f"architectures {list(ARCHITECTURES)}"
            )
        unsupported = {
            "num_experts": lambda v: v not in (None, 0),
            "attention_bias": bool,
            "use_sliding_window": bool,
            "rope_scaling": lambda v: (
                v not in (None, {})
                and (not isinstance(v, dict) or v.get("rope_type", v.get("type")) != "default")
            ),
        }
        for field, is_bad in unsupported.items():
            if field in hf and is_bad(hf[field]):
                raise ValueError(f"config.json field {field!r}={hf[field]!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act'={hf['hidden_act']!r}: only 'silu'")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 1_000_000.0)
        if rope_params.get("rope_type", "default") != "default":
            raise ValueError(
                f"config.json field 'rope_parameters.rope_type'={rope_params['rope_type']!r} "
                "is not supported (only 'default')"
            )
        required = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        ]
        for field in required:
            if field not in hf:
                raise ValueError(f"config.json is missing required field {field!r}")
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            d_ff=hf["intermediate_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40_960)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this config (Qwen3ForCausalLM)."""
        return {
            "architectures": list(ARCHITECTURES),
            "model_type": "qwen3",
            **{hf: getattr(self, ours) for ours, hf in HF_FIELDS.items()},
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "torch_dtype": "float32",
        }


# The `architectures` of a config.json this model implements.
ARCHITECTURES = ("Qwen3ForCausalLM",)
# Each ModelConfig field and its name in a Hugging Face config.json (`to_hf`, and the messages
# of `check_matches_checkpoint`).
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings",
    "init_std": "initializer_range",
}
# The fields a checkpoint's weights depend on: all but the context length and the init scale,
# which a config may set to other values than its config.json's.
ARCHITECTURE_FIELDS = tuple(
    f for f in HF_FIELDS if f not in ("max_position_embeddings", "init_std")
)


def check_matches_checkpoint(
    found: ModelConfig, source: str, preset: str | None = None, given: dict | None = None
) -> None:
    """Checks what a config states against the architecture `found` in `source` (a config.json).

    Each of `ARCHITECTURE_FIELDS` stated by `given` (explicit model fields), else by the preset
    (all of them but `vocab_size`, which runs without a checkpoint take from the tokenizer),
    must equal the file's value.

    Raises:
      ValueError: one line naming each disagreeing field, the file's value and the given one.
    """
    stated = {}
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; allowed: {sorted(PRESETS)}")
        stated = {
            f: (getattr(PRESETS[preset], f), f"model.preset={preset!r} gives")
            for f in ARCHITECTURE_FIELDS
            if f != "vocab_size"
        }
    stated |= {f: (v, "config gives") for f, v in (given or {}).items() if f in ARCHITECTURE_FIELDS}
    diff = [
        f"{f}: {where} {value!r}, the file has {HF_FIELDS[f]}={getattr(found, f)!r}"
        for f, (value, where) in stated.items()
        if value != getattr(found, f)
    ]
    if diff:
        raise ValueError(
            f"config.model disagrees with {source}: {'; '.join(diff)} (the architecture comes "
            "from the file: drop model.preset and these model fields, or make them match)"
        )


def _qwen3(d_model: int, n_layers: int, n_heads: int, d_ff: int, tie: bool) -> ModelConfig:
    """A published Qwen3 dense size: vocabulary 151,936, 8 KV heads of 128 dimensions."""
    return ModelConfig(151_936, d_model, n_layers, n_heads, 8, 128, d_ff, tie_embeddings=tie)


PRESETS: dict[str, ModelConfig] = {
    # Test size: every dimension divisible by the (2, 2, 2) test mesh.
    "tiny": ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        rope_theta=10_000.0,
        tie_embeddings=True,
        max_position_embeddings=256,
    ),
    # Sizes of the published Qwen3 config.json files.
    "qwen3_0_6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3_1_7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3_4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3_8b": _qwen3(4096, 36, 32, 12_288, tie=False),
    "qwen3_14b": _qwen3(5120, 40, 40, 17_408, tie=False),
}
