"""Hugging Face parity: logits vs transformers, import/export round trip, presets' sizes."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dvp_jax.model import PRESETS, ModelConfig, Transformer
from dvp_jax.model.hf_import import load_hf, save_hf
from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, count_params, make_mesh
from tests.helpers import hf_qwen3

# Our fp32 logits vs transformers' fp32 logits. Both are float32 with different summation
# order; measured differences are ~1e-7, the stated tolerance is 1e-4.
HF_ATOL = 1e-4


def _padded_inputs():
    tokens = np.array([[1, 5, 9, 3, 4, 7, 2, 8], [2, 8, 6, 11, 0, 0, 0, 0]], np.int64)
    mask = np.array([[1] * 8, [1] * 4 + [0] * 4], np.int64)
    return tokens, mask


def _ours(model, tokens, mask):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(
        model(
            jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask.astype(bool))
        )
    )


def _theirs(hf_model, tokens, mask):
    with torch.no_grad():
        return hf_model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)
        ).logits.numpy()


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, tie):
    hf_model, path = hf_qwen3(tmp_path, tie)
    model = load_hf(path)
    assert model.cfg.tie_embeddings == tie
    tokens, mask = _padded_inputs()
    ours, theirs = _ours(model, tokens, mask), _theirs(hf_model, tokens, mask)
    real = mask.astype(bool)
    assert np.abs(ours - theirs)[real].max() <= HF_ATOL


@pytest.mark.parametrize("tie", [True, False])
def test_export_reimport_round_trip_and_transformers_loads_it(tmp_path, tie):
    from transformers import Qwen3ForCausalLM

    _, path = hf_qwen3(tmp_path, tie, seed=1)
    model = load_hf(path)
    out = str(tmp_path / "export")
    save_hf(model, out)
    again = load_hf(out)
    for (p1, v1), (p2, v2) in zip(
        jax.tree.leaves_with_path(jax.tree.map(np.asarray, _params(model))),
        jax.tree.leaves_with_path(jax.tree.map(np.asarray, _params(again))),
        strict=True,
    ):
        assert p1 == p2
        np.testing.assert_array_equal(v1, v2)
    hf_again = Qwen3ForCausalLM.from_pretrained(out).eval()
    tokens, mask = _padded_inputs()
    real = mask.astype(bool)
    assert (
        np.abs(_ours(model, tokens, mask) - _theirs(hf_again, tokens, mask))[real].max() <= HF_ATOL
    )


def test_sharded_load_stacks_layers_into_each_devices_shard(tmp_path):
    """Loading onto a (2, 2, 2) mesh places each device's shard of the stacked block parameters
    (read layer by layer); the values equal the single-device load exactly and layer i of a
    stack is Hugging Face's layer i."""
    _, path = hf_qwen3(tmp_path, tie=False, seed=5, num_hidden_layers=3)
    single = load_hf(path)
    sharder = Sharder(make_mesh(MeshConfig(2, 2, 2)), TRAIN_RULES)
    sharded = load_hf(path, sharder=sharder)
    q_proj = sharded.blocks.attn.q_proj[...]  # [L, d, n, h] = [3, 32, 4, 8]
    assert q_proj.shape == (3, 32, 4, 8)
    assert q_proj.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q_proj.addressable_shards[0].data.shape == (3, 16, 2, 8)
    for (p1, v1), (p2, v2) in zip(
        jax.tree.leaves_with_path(_params(single)),
        jax.tree.leaves_with_path(_params(sharded)),
        strict=True,
    ):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2), err_msg=str(p1))
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        up = f.get_tensor("model.layers.2.mlp.up_proj.weight")  # [f, d]
    np.testing.assert_array_equal(np.asarray(single.blocks.mlp.up[...])[2], up.T)


def test_sharded_export_with_index(tmp_path):
    from safetensors import safe_open
    from transformers import Qwen3ForCausalLM

    _, path = hf_qwen3(tmp_path, tie=False, seed=2)
    model = load_hf(path)
    out = str(tmp_path / "sharded")
    max_shard_bytes = 20_000  # Every tensor of this model is smaller: no shard may exceed it.
    save_hf(model, out, max_shard_bytes=max_shard_bytes)
    files = os.listdir(out)
    assert "model.safetensors" not in files
    with open(os.path.join(out, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 1
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for shard in shards:
        with safe_open(os.path.join(out, shard), framework="numpy") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert {index["weight_map"][k] for k in f.keys()} == {shard}
        assert sum(sizes) <= max_shard_bytes, shard
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    again = load_hf(out)
    tokens, mask = _padded_inputs()
    np.testing.assert_array_equal(_ours(model, tokens, mask), _ours(again, tokens, mask))
    hf_again = Qwen3ForCausalLM.from_pretrained(out).eval()
    real = mask.astype(bool)
    assert (
        np.abs(_ours(model, tokens, mask) - _theirs(hf_again, tokens, mask))[real].max() <= HF_ATOL
    )


def _params(model):
    from flax import nnx

    return nnx.state(model)


def _rewrite(path, drop=None, reshape=None):
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    _, path = hf_qwen3(tmp_path, tie=False, seed=3)
    key = "model.layers.1.mlp.up_proj.weight"
    _rewrite(path, drop=key)
    with pytest.raises(ValueError, match=f"{key}.*missing"):
        load_hf(path)
    _, path = hf_qwen3(tmp_path / "b", tie=False, seed=3)
    key = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, reshape=key)
    with pytest.raises(ValueError, match=f"{key}.*shape"):
        load_hf(path)


def test_unsupported_architectures_name_the_field(tmp_path):
    _, path = hf_qwen3(tmp_path, tie=True, seed=4)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as fh:
        cfg = json.load(fh)
    with pytest.raises(ValueError, match="model_type='qwen3_moe'.*allowed: model_type 'qwen3'"):
        ModelConfig.from_hf({**cfg, "model_type": "qwen3_moe", "num_experts": 8})
    with pytest.raises(ValueError, match=r"\['LlamaForCausalLM'\]; allowed.*Qwen3ForCausalLM"):
        ModelConfig.from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**cfg, "use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "hidden_size"})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_param_count_matches_transformers(name):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = PRESETS[name]
    from flax import nnx

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    ours = count_params(nnx.state(abstract))
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(Qwen3Config(**cfg.to_hf()))
    theirs = sum(p.numel() for p in hf.parameters())
    assert ours == theirs, (name, ours, theirs)
    # And the config round-trips through the Hugging Face dict.
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
