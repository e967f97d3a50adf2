"""The full-size configs validate with their stated settings (no model is built)."""

from __future__ import annotations

import json
import os

import pytest

from dvp_jax.model.config import ModelConfig
from dvp_jax.plan import aot
from dvp_jax.pyfile import load_file
from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_VOCAB = 151_936


@pytest.mark.parametrize("method", ["rloo", "tis", "mis", "dvp", "mis_dvp"])
def test_paper_config_validates_with_the_papers_settings(method):
    module = load_file(os.path.join(REPO, "configs/paper_qwen3_14b.py"))
    # Its checkpoint lives on the pod: checked here from the preset, unread (what aot does).
    cfg = ExperimentConfig.from_config_dict(
        module.get_config(method), HF_VOCAB, read_checkpoint=False
    )
    assert cfg.init_hf_path == module.get_config(method).model.hf_path
    assert cfg.method == method
    assert (
        cfg.model.n_layers == 40 and cfg.model.d_model == 5120 and cfg.model.vocab_size == HF_VOCAB
    )
    assert cfg.train.prompts_per_step == 32 and cfg.train.group_size == 16
    assert cfg.train.updates_per_batch == 1 and cfg.loss.ppo_clip_eps is None
    assert cfg.rollout.max_decode_length == 16_384 and cfg.loss.log_rho == -13.0
    assert cfg.eval.k == 16 and cfg.data.task == "math" and cfg.data.path
    assert cfg.mesh.shape(32) == (1, 8, 4)
    default = ExperimentConfig.from_config_dict(
        module.get_config(), HF_VOCAB, read_checkpoint=False
    )
    assert default.method == "mis_dvp"


def test_paper_config_reads_its_checkpoint_where_the_run_reads_it(tmp_path):
    """A run reads model.hf_path's config.json: missing is one line, present is checked."""
    module = load_file(os.path.join(REPO, "configs/paper_qwen3_14b.py"))
    cd = module.get_config()
    with pytest.raises(ValueError, match="config.model.hf_path=.*neither a local") as e:
        ExperimentConfig.from_config_dict(cd, HF_VOCAB)
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.preset("qwen3_14b").to_hf()))
    cd.model.hf_path = str(tmp_path)
    cfg = ExperimentConfig.from_config_dict(cd, HF_VOCAB)
    assert cfg.model == ModelConfig.preset("qwen3_14b") and cfg.init_hf_path == str(tmp_path)
    # Without a preset an unreadable checkpoint cannot give aot the architecture.
    cd.model.hf_path, cd.model.preset = "/nonexistent/Qwen3-14B", ""
    with pytest.raises(ValueError, match="set config.model.preset"):
        aot.check_architecture_source(cd)
    cd.model.preset = "qwen3_14b"
    aot.check_architecture_source(cd)


def test_gpu_mid_config_validates():
    module = load_file(os.path.join(REPO, "configs/gpu_mid.py"))
    for method in ("rloo", "mis_dvp"):
        cfg = ExperimentConfig.from_config_dict(
            module.get_config(method), CharTokenizer().vocab_size
        )
        assert cfg.method == method and cfg.mesh.shape(1) == (1, 1, 1)


def test_rejection_baselines_are_methods_and_their_bands_are_validated():
    """config.method takes the E7b presets; a bad band names its field and the allowed range."""
    from dvp_jax.train.config import default_config

    for method, correction in (
        ("icepop", "token_icepop"), ("geo_rs", "seq_geo_rs"), ("k3_rs", "seq_k3_rs"),
    ):  # fmt: skip
        cd = default_config(method)
        cfg = ExperimentConfig.from_config_dict(cd, 512)
        assert cfg.method == method and cfg.loss.correction == correction
        assert not cfg.loss.prune
    cd = default_config("geo_rs")
    cd.loss.geo_lo = 1.2
    with pytest.raises(ValueError, match="config.loss.*geo_lo"):
        ExperimentConfig.from_config_dict(cd, 512)
    with pytest.raises(ValueError, match="method"):
        ExperimentConfig.from_config_dict(default_config("icepop_dvp"), 512)


def test_correction_stacks_are_methods_and_loss_rejection_overrides_the_preset():
    """config.method takes the peers' stacks (E14-E17); loss.rejection, a preset placeholder,
    overrides the preset's rules from the command line; a bad rule is one line naming
    config.loss.rejection."""
    from dvp_jax.train.config import default_config

    for method in ("skyrl_geo_tis", "verl_seq_is_rs", "opsm"):
        cfg = ExperimentConfig.from_config_dict(default_config(method), 512)
        assert cfg.method == method and cfg.loss.rules and not cfg.loss.prune
    cd = default_config("skyrl_geo_tis")
    assert cd.loss.rejection is None  # a placeholder: the preset's rules unless set
    cd.loss.rejection = "seq_mean_k1=0.9:1.1,seq_max_k2=0.5"
    cd.loss.batch_normalise_weights = True
    cfg = ExperimentConfig.from_config_dict(cd, 512)
    assert [r.kind for r in cfg.loss.rules] == ["seq_mean_k1", "seq_max_k2"]
    assert cfg.loss.correction == "token_tis" and cfg.loss.batch_normalise_weights
    cd = default_config("dvp")
    cd.loss.rejection = "seq_max_k2"
    with pytest.raises(ValueError, match="config.loss: LossConfig.rejection entry 'seq_max_k2'"):
        ExperimentConfig.from_config_dict(cd, 512)
