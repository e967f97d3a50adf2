"""Small shared builders for tests (tiny models, Hugging Face reference models)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dvp_jax.model import ModelConfig, Transformer


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", **overrides)


def tiny_model(seed: int = 0, policy=None, remat: bool | str = False, **overrides) -> Transformer:
    from dvp_jax.model import TRAIN_POLICY

    return Transformer(
        tiny_config(**overrides), policy or TRAIN_POLICY, rngs=nnx.Rngs(seed), remat=remat
    )


@functools.partial(nnx.jit, static_argnames="return_hidden")
def forward(model, tokens, positions, valid=None, return_hidden=False):
    """The model's forward as one compiled program per model graph and shapes (an eager call
    compiles and dispatches each operation on its own)."""
    return model(tokens, positions, valid, return_hidden=return_hidden)


def padded_batch(rng: np.random.Generator, vocab: int, lengths, total: int):
    """Right-padded token batch: (tokens [b, t], positions [b, t], valid [b, t])."""
    b = len(lengths)
    tokens = rng.integers(1, vocab, size=(b, total)).astype(np.int32)
    valid = np.arange(total)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(valid, tokens, 0)
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (b, total))
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid)


def hf_qwen3(tmp_path, tie: bool, seed: int = 0, **overrides):
    """A tiny random `transformers` Qwen3ForCausalLM saved with `save_pretrained`.

    Returns (torch model in eval mode, directory).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
        rope_theta=10_000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**kwargs)).eval()
    # HF initialises norms to ones; randomise them so the test sees the norm weights.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / f"hf_tie{int(tie)}")
    model.save_pretrained(path)
    return model, path
