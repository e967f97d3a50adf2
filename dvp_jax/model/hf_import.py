"""Hugging Face Qwen3 checkpoints <-> our parameters, by a pure key/shape mapping.

Reads a local model directory (`config.json` plus one `model.safetensors` or several shards with
`model.safetensors.index.json`) into sharded parameters, and writes parameters back in the same
layout so that `transformers` can load them (shards split by `huggingface_hub`, files written by
`safetensors`; the tokenizer files come from the tokenizer's own `save_hf`). Nothing is downloaded.

Layout differences are transposes (torch Linear weights are `[out, in]`), head reshapes and
the layer stack: our decoder-block parameters carry a leading `[L]` axis (`blocks.*`,
docs/design.md section 3), so the L per-layer Hugging Face tensors of one kind are stacked on
load and unstacked on save. `_key_map` is the one table of keys, shapes and transforms.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple

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

# (to ours, to HF) for one tensor (one layer's, for the stacked block parameters).
Transform = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


class Entry(NamedTuple):
    """How one of our parameters maps to Hugging Face tensors.

    Attributes:
      hf_keys: the Hugging Face keys: one for a plain parameter, L (layer order) for a stacked
        block parameter.
      hf_shape: the shape of each Hugging Face tensor.
      transform: (hf_to_ours, ours_to_hf) for one tensor (one layer's slice when stacked).
      stacked: whether our parameter is the stack `[L, ...]` of the per-layer tensors.
    """

    hf_keys: tuple[str, ...]
    hf_shape: tuple[int, ...]
    transform: Transform
    stacked: bool


def _key_map(cfg: ModelConfig) -> dict[tuple, Entry]:
    """Our state path -> its `Entry` (Hugging Face keys, shape, transform, stacked or not)."""
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
        ("embed",): Entry(("model.embed_tokens.weight",), (v, d), same, False),
        ("final_norm", "weight"): Entry(("model.norm.weight",), (d,), same, False),
    }
    if not cfg.tie_embeddings:
        table[("lm_head",)] = Entry(("lm_head.weight",), (v, d), linear, False)
    # Our path under `blocks` -> (HF key after "model.layers.{i}.", HF shape, transform).
    per_layer = {
        ("input_norm", "weight"): ("input_layernorm.weight", (d,), same),
        ("post_attn_norm", "weight"): ("post_attention_layernorm.weight", (d,), same),
        ("attn", "q_proj"): ("self_attn.q_proj.weight", (n * h, d), heads_in(n)),
        ("attn", "k_proj"): ("self_attn.k_proj.weight", (k * h, d), heads_in(k)),
        ("attn", "v_proj"): ("self_attn.v_proj.weight", (k * h, d), heads_in(k)),
        ("attn", "o_proj"): ("self_attn.o_proj.weight", (d, n * h), heads_out),
        ("attn", "q_norm", "weight"): ("self_attn.q_norm.weight", (h,), same),
        ("attn", "k_norm", "weight"): ("self_attn.k_norm.weight", (h,), same),
        ("mlp", "gate"): ("mlp.gate_proj.weight", (f, d), linear),
        ("mlp", "up"): ("mlp.up_proj.weight", (f, d), linear),
        ("mlp", "down"): ("mlp.down_proj.weight", (d, f), linear),
    }
    for ours, (suffix, shape, transform) in per_layer.items():
        keys = tuple(f"model.layers.{i}.{suffix}" for i in range(cfg.n_layers))
        table[("blocks", *ours)] = Entry(keys, shape, transform, True)
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

    Each tensor is read on the host, transformed to our layout (per-layer tensors stacked on the
    leading `[L]` axis of the block parameters), cast to the policy's parameter dtype and placed
    with `jax.make_array_from_callback`, so each device receives only its shard. Every key and
    shape is checked from the file headers before any tensor is read.

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
    by_hf = {hf_key for entry in table.values() for hf_key in entry.hf_keys}

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
    # Every tensor is checked (from the file headers) before anything is read or placed.
    for entry in table.values():
        for hf_key in entry.hf_keys:
            if hf_key not in handles:
                raise ValueError(f"tensor {hf_key!r} is missing from {path!r}")
            shape = tuple(handles[hf_key].get_slice(hf_key).get_shape())
            if shape != entry.hf_shape:
                raise ValueError(
                    f"tensor {hf_key!r} has shape {shape}, expected {entry.hf_shape} "
                    f"for this config.json"
                )

    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    values = {}
    for ours, entry in table.items():
        dtype = flat_abstract[ours].get_value().dtype
        to_ours = entry.transform[0]

        def tensor(hf_key, to_ours=to_ours, dtype=dtype):  # one HF tensor in our layout
            return to_ours(handles[hf_key].get_tensor(hf_key).astype(np.float32)).astype(dtype)

        sharding = flat_shardings[ours].get_value() if ours in flat_shardings else None
        if sharding is None:
            parts = [tensor(key) for key in entry.hf_keys]
            arr = np.stack(parts) if entry.stacked else parts[0]
            values[ours] = jax.numpy.asarray(np.ascontiguousarray(arr))
            continue
        shape = flat_abstract[ours].get_value().shape
        shards = _host_shards(entry, tensor, shape, sharding)
        values[ours] = jax.make_array_from_callback(
            shape, sharding, lambda index, s=shards, n=shape: s[_index_key(index, n)]
        )
    for ours, var in nnx.to_flat_state(abstract_state):
        var.set_value(values[ours])
    return nnx.merge(graphdef, abstract_state)


def _index_key(index, shape) -> tuple:
    """A hashable form of a shard index (a tuple of slices, possibly shorter than `shape`)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


def _host_shards(entry: Entry, tensor: Callable[[str], np.ndarray], shape, sharding) -> dict:
    """This host's distinct shards of one parameter, keyed by `_index_key`.

    Each Hugging Face tensor is read once; a stacked parameter is assembled layer by layer, so
    host memory holds one layer's tensor plus this host's shards, never a second whole stack.
    """
    keys = {_index_key(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()}
    slices = {key: tuple(slice(*k) for k in key) for key in keys}
    if not entry.stacked:
        full = tensor(entry.hf_keys[0])
        return {key: np.ascontiguousarray(full[idx]) for key, idx in slices.items()}
    shards = {}
    for layer, hf_key in enumerate(entry.hf_keys):
        one = tensor(hf_key)
        for key, idx in slices.items():
            layers = range(shape[0])[idx[0]]
            if layer not in layers:
                continue
            if key not in shards:
                rest = one[idx[1:]]
                shards[key] = np.empty((len(layers), *rest.shape), rest.dtype)
            shards[key][layers.index(layer)] = one[idx[1:]]
    return shards


def save_hf(
    model: Transformer, path: str, dtype: Any = np.float32, max_shard_bytes: int = 2 << 30
) -> None:
    """Writes `model` as a Hugging Face Qwen3 directory (config.json + safetensors [+ index]).

    The directory is written under a temporary name and renamed at the end (replacing any
    existing `path`), so a crash never leaves a half-written checkpoint at `path`. The tokenizer
    files are written afterwards by the tokenizer itself: `tokenizer.save_hf(path)`
    (`dvp_jax.tokenizers`); then `transformers` loads both model and tokenizer.

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
    for ours, entry in _key_map(cfg).items():
        arr = np.asarray(jax.device_get(flat[ours].get_value())).astype(np.float32)
        parts = list(arr) if entry.stacked else [arr]  # unstack the [L] layer axis
        for hf_key, part in zip(entry.hf_keys, parts, strict=True):
            out = np.ascontiguousarray(entry.transform[1](part)).astype(dtype)
            assert out.shape == entry.hf_shape, (hf_key, out.shape, entry.hf_shape)
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
