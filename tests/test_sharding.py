"""Sharding: logical rules, sharded init, (2, 2, 2) mesh forward == single device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dvp_jax.model import Transformer
from dvp_jax.sharding import (
    ROLLOUT_RULES,
    TRAIN_RULES,
    MeshConfig,
    Sharder,
    init_sharded,
    make_mesh,
)
from tests.helpers import forward, padded_batch, tiny_config


def test_mesh_config_shapes():
    assert MeshConfig(2, 2, 2).shape(8) == (2, 2, 2)
    assert MeshConfig(data=2, fsdp=-1, tensor=1).shape(8) == (2, 4, 1)
    with pytest.raises(ValueError, match="needs 6 devices"):
        MeshConfig(1, 2, 3).shape(8)


def test_rules_map_logical_names():
    mesh = make_mesh(MeshConfig(2, 2, 2))
    train, rollout = Sharder(mesh, TRAIN_RULES), Sharder(mesh, ROLLOUT_RULES)
    assert train.spec(("vocab", "embed"), (64, 32)) == P("tensor", "fsdp")
    assert rollout.spec(("vocab", "embed"), (64, 32)) == P("tensor", None)
    assert train.spec(("act_batch", "act_seq", "act_embed"), (4, 8, 32)) == P(
        ("data", "fsdp"), None, None
    )
    # The stacked decoder-block parameters' layer axis is never sharded: each scan step slices
    # one layer locally (and, for training, gathers that layer's fsdp shards).
    q_proj = ("layers", "embed", "q_heads", "head_dim")
    assert train.spec(q_proj, (2, 32, 4, 8)) == P(None, "fsdp", "tensor", None)
    assert rollout.spec(q_proj, (2, 32, 4, 8)) == P(None, None, "tensor", None)
    # A mesh axis that does not divide the dimension is dropped, not an error.
    assert train.spec(("vocab", "embed"), (63, 32)) == P(None, "fsdp")
    with pytest.raises(KeyError, match="no rule"):
        train.spec(("nonsense",))


def test_sharded_init_places_params_and_forward_matches_single_device():
    cfg = tiny_config()
    mesh = make_mesh(MeshConfig(2, 2, 2))
    sharder = Sharder(mesh, TRAIN_RULES)
    sharded = init_sharded(lambda: Transformer(cfg, sharder=sharder, rngs=nnx.Rngs(0)), sharder)
    single = Transformer(cfg, rngs=nnx.Rngs(0))
    emb = sharded.embed[...]
    assert emb.sharding.spec == P("tensor", "fsdp")
    # Each device holds 1/4 of the embedding: never the full matrix.
    assert emb.addressable_shards[0].data.shape == (cfg.vocab_size // 2, cfg.d_model // 2)
    # Same values as eager init (jit may fuse the scale into the sampler: 1-ulp differences).
    np.testing.assert_allclose(np.asarray(emb), np.asarray(single.embed[...]), rtol=1e-6)
    gate = sharded.blocks.mlp.gate[...]  # [L, d, f]: one layer's shard is [d/2, f/2]
    assert gate.sharding.spec == P(None, "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (cfg.n_layers, cfg.d_model // 2, cfg.d_ff // 2)

    tokens, positions, valid = padded_batch(
        np.random.default_rng(0), cfg.vocab_size, [8, 5, 8, 2], 8
    )
    graphdef, state = nnx.split(sharded)

    @jax.jit
    def fwd(state, tokens, positions, valid):
        return nnx.merge(graphdef, state)(tokens, positions, valid)

    out = fwd(state, tokens, positions, valid)
    ref = forward(single, tokens, positions, valid)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    assert len(out.sharding.device_set) == 8
