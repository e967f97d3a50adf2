"""`model.hf_path` as a local directory or a Hub repo id: the architecture from config.json.

A tiny transformers Qwen3 is saved here, once as a plain directory and once in the Hugging Face
cache layout (`models--org--name/snapshots/<commit>/`, `refs/main`), and every test runs with
`HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` pointing at that cache: nothing is downloaded. The import
math itself is tested against transformers in tests/test_hf_import.py; here the loaded weights
are compared with those of the local directory.
"""

import json
import shutil

import numpy as np
import pytest
from flax import nnx

from dvp_jax.errors import ConfigError
from dvp_jax.model import ModelConfig
from dvp_jax.model.hf_import import load_hf
from dvp_jax.model.hub import resolve_model_dir
from dvp_jax.sharding import Sharder
from dvp_jax.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer
from dvp_jax.train.build import build_model
from dvp_jax.train.config import ExperimentConfig, default_config
from tests.helpers import hf_qwen3

REPO = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
VOCAB = CharTokenizer().vocab_size  # 56 < the checkpoint's 96 rows
# What hf_qwen3 writes into config.json, as our config: the expected architecture.
FILE_CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    max_position_embeddings=128,
    init_std=0.02,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(torch model, local directory, cache directory, the snapshot directory in the cache)."""
    root = tmp_path_factory.mktemp("hub")
    hf_model, local = hf_qwen3(root, tie=True, seed=7)
    CharTokenizer().save_hf(local)  # the tokenizer files a Hub model repo carries too
    cache = root / "cache"
    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    shutil.copytree(local, snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return hf_model, local, cache, snapshot


@pytest.fixture(autouse=True)
def offline_cache(checkpoint, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(checkpoint[2]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read HF_HUB_OFFLINE at import; its HTTP session refuses every request
    # when this is set, so even a resolution bug cannot reach the network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _config(**model) -> ExperimentConfig:
    c = default_config()
    for key, value in model.items():
        c.model[key] = value
    return ExperimentConfig.from_config_dict(c, VOCAB)


def _one_line_error(match: str, **model) -> str:
    with pytest.raises(ValueError, match=match) as e:  # ConfigError is one
        _config(**model)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_hub_id_resolves_from_the_cache_to_the_files_architecture(checkpoint):
    _, local, _, snapshot = checkpoint
    assert resolve_model_dir(REPO) == str(snapshot)
    from_hub, from_dir = _config(hf_path=REPO), _config(hf_path=local)
    assert from_hub.model == from_dir.model == FILE_CONFIG  # no preset needed
    assert from_hub.init_hf_path == str(snapshot) and from_dir.init_hf_path == local
    # A preset that agrees is accepted; max_position_embeddings (no weight depends on it) may be
    # set to another value than the file's.
    agreeing = _config(hf_path=REPO, preset="tiny", max_position_embeddings=64)
    assert agreeing.model == ModelConfig(**{**vars(FILE_CONFIG), "max_position_embeddings": 64})
    # data.tokenizer may name the same repo: the tokenizer files of the same snapshot.
    tok = load_tokenizer(REPO)
    assert isinstance(tok, HFTokenizer) and tok.path == str(snapshot / "tokenizer.json")
    assert tok.vocab_size == VOCAB


def test_weights_loaded_from_a_hub_id_equal_the_local_directorys(checkpoint):
    hf_model, local, _, _ = checkpoint
    model = build_model(_config(hf_path=REPO), Sharder())  # the trainer's path
    reference = load_hf(local)  # == transformers' model: tests/test_hf_import.py
    ours, theirs = nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(reference))
    assert [k for k, _ in ours] == [k for k, _ in theirs]
    for (key, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), key)
    embed = hf_model.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.embed[...]), embed)


def test_bad_model_input_is_one_line_before_any_work(checkpoint, tmp_path):
    _, local, cache, _ = checkpoint
    msg = _one_line_error("not in the Hugging Face cache", hf_path="tiny-org/not-cached")
    assert "'tiny-org/not-cached'" in msg and "HF_HUB_OFFLINE=1" in msg and str(cache) in msg
    _one_line_error("neither a local Hugging Face model directory nor", hf_path="/no/such/dir")
    with pytest.raises(ConfigError, match="config.data.tokenizer='tiny-org/not-cached'"):
        load_tokenizer("tiny-org/not-cached")

    # Another architecture: what was found and what is allowed.
    llama = tmp_path / "llama"
    llama.mkdir()
    hf = {**FILE_CONFIG.to_hf(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (llama / "config.json").write_text(json.dumps(hf))
    msg = _one_line_error("model_type='llama'", hf_path=str(llama))
    assert "['LlamaForCausalLM']" in msg and "allowed: model_type 'qwen3'" in msg
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
        ModelConfig.from_hf(
            {**hf, "model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}
        )
    _one_line_error("no config.json", hf_path=str(tmp_path))

    # A preset or an explicit field that disagrees: the field, the file's value, the given one.
    msg = _one_line_error(
        "d_model: model.preset='qwen3_0_6b' gives 1024, the file has hidden_size=32",
        hf_path=REPO,
        preset="qwen3_0_6b",
    )
    assert "n_layers: model.preset='qwen3_0_6b' gives 28, the file has num_hidden_layers=2" in msg
    _one_line_error(
        "d_ff: config gives 128, the file has intermediate_size=64", hf_path=local, d_ff=128
    )
    _one_line_error("vocab_size: config gives 64", hf_path=REPO, vocab_size=64)
    _one_line_error(r"config.model.preset must be one of", hf_path=REPO, preset="qwen3_99b")
    # The file's vocabulary must hold the tokenizer's.
    c = default_config()
    c.model.hf_path = REPO
    with pytest.raises(ValueError, match=r"model.vocab_size must be >= the tokenizer's"):
        ExperimentConfig.from_config_dict(c, 100)
