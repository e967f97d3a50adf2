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


# Figures computed on another machine (committed verdicts, README tables) are compared with a
# tolerance: only the same program on the same machine is bit-exact (docs/design.md, "Which
# outputs are bit-exact"). Double precision rounds at 1.1e-16 relative; the committed verdicts
# chain means, least-squares fits and bootstrap percentiles over at most a few thousand values,
# so another CPU's summation order, FMA contraction or BLAS kernel moves a figure by ~1e-15
# relative (9e-15 at most, measured with numpy's AVX-512 paths and OpenBLAS's SkylakeX kernels
# turned off: `make test`'s second pass). RESULT_RTOL leaves a million-fold margin over that,
# while a changed record or rule moves a figure by far more. RESULT_ATOL lets a figure that is
# zero here come out as a rounding residue elsewhere; it is about RESULT_RTOL times the smallest
# non-zero figure committed (9e-10, e006's fp32 mismatch), so even that figure is held to ~1e-9.
RESULT_RTOL = 1e-9
RESULT_ATOL = 1e-18


def assert_close_tree(actual, expected, rtol=RESULT_RTOL, atol=RESULT_ATOL, path="$") -> None:
    """Asserts that two JSON-like trees agree: the same keys, lengths and types; strings, bools,
    None and ints exactly; floats to |a - e| <= atol + rtol * |e| (NaN equals NaN, an infinity
    only itself). The message names the first path that differs."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__}, expected a dict"
        assert actual.keys() == expected.keys(), (
            f"{path}: keys {sorted(actual.keys() ^ expected.keys())} in only one of the two"
        )
        for key in expected:
            assert_close_tree(actual[key], expected[key], rtol, atol, f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple), f"{path}: {actual!r}, expected a list"
        assert len(actual) == len(expected), (
            f"{path}: {len(actual)} items, expected {len(expected)}"
        )
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close_tree(a, e, rtol, atol, f"{path}[{i}]")
    elif isinstance(expected, float) or isinstance(actual, float):
        # An int on one side is a float that printed without a fraction (json: 2.0 -> 2.0, but a
        # rule may return 0 where another machine's rounding gives 0.0); a bool never is a number.
        assert not isinstance(actual, bool) and not isinstance(expected, bool), (
            f"{path}: {actual!r} vs {expected!r}"
        )
        assert isinstance(actual, int | float) and isinstance(expected, int | float), (
            f"{path}: {actual!r} vs {expected!r}"
        )
        a, e = float(actual), float(expected)
        if np.isnan(e) or np.isinf(e):
            assert a == e or (np.isnan(a) and np.isnan(e)), f"{path}: {a!r}, expected {e!r}"
        else:
            assert abs(a - e) <= atol + rtol * abs(e), (
                f"{path}: {a!r}, expected {e!r} (rtol {rtol:g}, atol {atol:g})"
            )
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{path}: {actual!r}, expected {expected!r}"
        )
