"""Hugging Face Qwen3 checkpoints <-> our parameters, by a pure key/shape mapping.

Reads a local model directory (`config.json` plus one `model.safetensors` or several shards with
`model.safetensors.index.json`) into sharded parameters, and writes parameters back in the same
layout so that `transformers` can load them (shards split by `huggingface_hub`, files written by
`safetensors`; the tokenizer files come from the tokenizer's own `save_hf`). Nothing is downloaded.

Layout differences are only transposes and head reshapes:

| Hugging Face key (torch Linear: [out, in])     | ours                        |
|------------------------------------------------|-----------------------------|
| model.embed_tokens.weight [v, d]               | embed [v, d]                |
| model.layers.i.self_attn.q_proj.weight [n*h, d] | layers.i.attn.q_proj [d, n, h] |
| ...k_proj / v_proj.weight [k*h, d]             | ...k_proj / v_proj [d, k, h] |
| ...o_proj.weight [d, n*h]                      | ...o_proj [n, h, d]         |
| ...q_norm / k_norm.weight [h]                  | ...q_norm / k_norm.weight   |
| ...input_layernorm / post_attention_layernorm  | ...input_norm / post_attn_norm |
| ...mlp.gate_proj / up_proj.weight [f, d]       | ...mlp.gate / up [d, f]     |
| ...mlp.down_proj.weight [d, f]                 | ...mlp.down [f, d]          |
| model.norm.weight [d]                          | final_norm.weight [d]       |
| lm_head.weight [v, d] (untied only)            | lm_head [d, v]              |
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from huggingface_hub import constants as hf_constants
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.numpy import save_file

from dvp_jax.model.config import TRAIN_POLICY, DTypePolicy, ModelConfig
from dvp_jax.model.transformer import Transformer
from dvp_jax.sharding import Sharder, state_shardings

# (to ours, to HF) for one tensor, given the config.
Transform = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _key_map(cfg: ModelConfig) -> dict[tuple, tuple[str, tuple[int, ...], Transform]]:
    """Our state path -> (HF key, HF shape, (hf_to_ours, ours_to_hf))."""
    d, n, k, h, f, v = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    same: Transform = (lambda x: x, lambda x: x)
    linear: Transform = (lambda x: x.T, lambda x: x.T)

    def heads_in(num):  # HF [num*h, d] <-> ours [d, num, h]
        return (
            lambda x: x.reshape(num, h, d).transpose(2, 0, 1),
            lambda x: x.transpose(1, 2, 0).reshape(num * h, d),
        )

    heads_out: Transform = (  # HF [d, n*h] <-> ours [n, h, d]
        lambda x: x.T.reshape(n, h, d),
        lambda x: x.reshape(n * h, d).T,
    )
    table = {
        ("embed",): ("model.embed_tokens.weight", (v, d), same),
        ("final_norm", "weight"): ("model.norm.weight", (d,), same),
    }
    if not cfg.tie_embeddings:
        table[("lm_head",)] = ("lm_head.weight", (v, d), linear)
    for i in range(cfg.n_layers):
        hf = f"model.layers.{i}."
        ours = ("layers", i)
        table.update(
            {
                ours + ("input_norm", "weight"): (hf + "input_layernorm.weight", (d,), same),
                ours + ("post_attn_norm", "weight"): (
                    hf + "post_attention_layernorm.weight",
                    (d,),
                    same,
                ),
                ours + ("attn", "q_proj"): (
                    hf + "self_attn.q_proj.weight",
                    (n * h, d),
                    heads_in(n),
                ),
                ours + ("attn", "k_proj"): (
                    hf + "self_attn.k_proj.weight",
                    (k * h, d),
                    heads_in(k),
                ),
                ours + ("attn", "v_proj"): (
                    hf + "self_attn.v_proj.weight",
                    (k * h, d),
                    heads_in(k),
                ),
                ours + ("attn", "o_proj"): (hf + "self_attn.o_proj.weight", (d, n * h), heads_out),
                ours + ("attn", "q_norm", "weight"): (hf + "self_attn.q_norm.weight", (h,), same),
                ours + ("attn", "k_norm", "weight"): (hf + "self_attn.k_norm.weight", (h,), same),
                ours + ("mlp", "gate"): (hf + "mlp.gate_proj.weight", (f, d), linear),
                ours + ("mlp", "up"): (hf + "mlp.up_proj.weight", (f, d), linear),
                ours + ("mlp", "down"): (hf + "mlp.down_proj.weight", (d, f), linear),
            }
        )
    return table


# Tensors a Hugging Face checkpoint may carry that carry no information for us.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(path: str) -> ModelConfig:
    """Reads `path/config.json` into a `ModelConfig` (errors name the unsupported field)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in Hugging Face model directory {path!r}")
    with open(cfg_path) as fh:
        return ModelConfig.from_hf(json.load(fh))


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, hf_constants.SAFETENSORS_INDEX_FILE)
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, hf_constants.SAFETENSORS_SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return [os.path.join(path, f) for f in found]


def load_hf(
    path: str,
    policy: DTypePolicy = TRAIN_POLICY,
    sharder: Sharder = Sharder(),
    cfg: ModelConfig | None = None,
    remat: bool = False,
) -> Transformer:
    """Loads a Hugging Face Qwen3 directory into a (sharded) `Transformer`.

    Each tensor is read on the host, transformed to our layout, cast to the policy's parameter
    dtype and placed with `jax.make_array_from_callback`, so each device receives only its shard.

    Raises:
      ValueError: naming the tensor that is missing, mis-shaped or unexpected, or the
        config field that is unsupported.
    """
    cfg = cfg or load_hf_config(path)
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg, policy, sharder, rngs=nnx.Rngs(0), remat=remat)
    )
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, sharder) if sharder.mesh is not None else None
    table = _key_map(cfg)
    by_hf = {hf_key: ours for ours, (hf_key, _, _) in table.items()}

    handles = {}
    for file in _safetensors_files(path):
        f = safe_open(file, framework="numpy")
        for key in f.keys():
            handles[key] = f
    unexpected = [
        key
        for key in handles
        if key not in by_hf
        and not key.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and key == "lm_head.weight")
    ]
    if unexpected:
        raise ValueError(
            f"unexpected tensors in {path!r} (unsupported architecture?): "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )

    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    values = {}
    for ours, (hf_key, hf_shape, (to_ours, _)) in table.items():
        if hf_key not in handles:
            raise ValueError(f"tensor {hf_key!r} is missing from {path!r}")
        raw = handles[hf_key].get_tensor(hf_key)
        if tuple(raw.shape) != hf_shape:
            raise ValueError(
                f"tensor {hf_key!r} has shape {tuple(raw.shape)}, expected {hf_shape} "
                f"for this config.json"
            )
        target = flat_abstract[ours].get_value()
        arr = np.ascontiguousarray(to_ours(raw.astype(np.float32)).astype(target.dtype))
        sharding = flat_shardings[ours].get_value() if ours in flat_shardings else None
        if sharding is None:
            values[ours] = jax.numpy.asarray(arr)
        else:
            values[ours] = jax.make_array_from_callback(
                arr.shape, sharding, lambda idx, a=arr: a[idx]
            )
    for ours, var in nnx.to_flat_state(abstract_state):
        var.set_value(values[ours])
    return nnx.merge(graphdef, abstract_state)


def save_hf(
    model: Transformer, path: str, dtype: Any = np.float32, max_shard_bytes: int = 2 << 30
) -> None:
    """Writes `model` as a Hugging Face Qwen3 directory (config.json + safetensors [+ index]).

    The directory is written under a temporary name and renamed at the end (replacing any
    existing `path`), so a crash never leaves a half-written checkpoint at `path`. The tokenizer
    files are written afterwards by the tokenizer itself: `tokenizer.save_hf(path)`
    (`dvp_jax.rollout.tokenizers`); then `transformers` loads both model and tokenizer.

    Args:
      model: the model to export.
      path: output directory.
      dtype: dtype of the stored tensors (float32, or `ml_dtypes.bfloat16`).
      max_shard_bytes: largest shard; a larger model is split into several
        `model-0000i-of-0000n.safetensors` files listed in `model.safetensors.index.json`.
    """
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    tensors: dict[str, np.ndarray] = {}
    for ours, (hf_key, hf_shape, (_, to_hf)) in _key_map(cfg).items():
        arr = np.asarray(jax.device_get(flat[ours].get_value())).astype(np.float32)
        out = np.ascontiguousarray(to_hf(arr)).astype(dtype)
        assert out.shape == hf_shape, (hf_key, out.shape, hf_shape)
        tensors[hf_key] = out

    tmp = path.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    # huggingface_hub's splitter groups tensors (in key order) into shards of at most
    # `max_shard_bytes` and names them as transformers expects (model-0000i-of-0000n.safetensors);
    # the index is written as its documentation shows for non-torch frameworks.
    split = split_state_dict_into_shards_factory(
        dict(sorted(tensors.items())),
        get_storage_size=lambda a: a.nbytes,
        filename_pattern=hf_constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_bytes,
    )
    for filename, keys in split.filename_to_tensors.items():
        shard = {key: tensors[key] for key in keys}
        save_file(shard, os.path.join(tmp, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(tmp, hf_constants.SAFETENSORS_INDEX_FILE), "w") as fh:
            json.dump(index, fh, indent=2)
    hf_config = cfg.to_hf()
    hf_config["torch_dtype"] = "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32"
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(hf_config, fh, indent=2)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
