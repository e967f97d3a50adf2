"""End-to-end trainer tests: a short run, bad data rows, bad config values, other precisions
(mixed_bf16 in the bad-data-rows run, float32_x3 in the run from a Hugging Face checkpoint).

SIGTERM during the RL steps, kill -9 and resume: tests/test_faults.py; the command line's
messages for bad config values: tests/test_cli.py.
"""

import json
import os

import numpy as np
import pytest

from dvp_jax.metrics import read_metrics
from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.trainer import Trainer
from tests.train_utils import REPO, tiny_config_dict

VOCAB = CharTokenizer().vocab_size


def _metrics(workdir):
    return read_metrics(str(workdir))


def test_a_short_run_is_finite_and_compiles_once(tiny_run):
    summary, workdir = tiny_run.summary, tiny_run.workdir
    # One compiled train step for all six steps: no retrace after the first.
    assert tiny_run.update_compiles == 1
    rows = [r for r in tiny_run.rows() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows:
        for key in (
            "loss",
            "ppl_gap",
            "kl_k3",
            "grad_norm",
            "training_ppl",
            "rollout_ppl",
            "lt_bin0_mean_abs",
            "is_weight_ess",
        ):
            assert np.isfinite(row[key]), (key, row[key])
        assert row["skipped_updates"] == 0
    assert summary["eval_accuracy"] is not None and 0.0 <= summary["eval_accuracy"] <= 1.0
    # The paper's central diagnostic reaches the summary (dvp prunes, so it is logged).
    assert 0.0 <= summary["final_frac_tokens_outside_train_safe"] <= 1.0
    # The summary's figures are the mean of the last 5 RL rows.
    assert summary["final_ppl_gap"] == pytest.approx(np.mean([r["ppl_gap"] for r in rows[-5:]]))
    assert os.path.exists(os.path.join(workdir, "summary.json"))
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))


def test_malformed_data_rows_are_counted_and_skipped_in_a_mixed_bf16_ppo_run(tmp_path):
    """A math jsonl with four malformed rows trains (they are counted, with their indices, and
    skipped) in the mixed_bf16 precision (bf16 compute on fp32 master params), which is
    recorded by name, with two PPO mini-batch updates per rollout batch, each accumulating
    two micro-batches. Prompts fit the tiny run's prompt length, so the rollout and evaluation
    programs are the shared run's."""
    rows = []
    good = [
        ("2 plus 3 is", "5"),
        ("7 minus 4 is", "3"),
        ("4 plus 4 is", "8"),
        ("9 minus 1 is", "8"),
        ("1 plus 1 is", "2"),
        ("6 minus 2 is", "4"),
    ]
    for i, (q, a) in enumerate(good * 2):
        rows.append(
            json.dumps(
                {"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}}
            )
        )
        if i == 1:
            rows.append(json.dumps({"prompt": "no answer here"}))  # missing ground truth
        if i == 3:
            rows.append("{not json")  # undecodable
        if i == 5:
            rows.append(json.dumps({"prompt": 17, "answer": "3"}))  # wrong type
        if i == 7:
            rows.append(json.dumps({"prompt": "x" * 500, "answer": "1"}))  # over-long
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(rows) + "\n")
    precision = "mixed_bf16"
    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(
            **{
                "data.task": "math",
                "data.path": str(path),
                "data.chat_format": "plain",
                "train.steps": 1,
                "train.precision": precision,
                "sft.steps": 0,  # the warm-up is the shared run's; this run compiles no SFT step
                "data.eval_path": str(path),
                "train.updates_per_batch": 2,
                "loss.ppo_clip_eps": 0.2,
                "train.micro_batches": 2,
                "train.prompts_per_step": 8,
                "eval.num_prompts": 4,
            }
        ),
        VOCAB,
    )
    assert cfg.data.max_prompt_len == 16  # the tiny run's: every good prompt fits
    trainer = Trainer(cfg, str(tmp_path / "run"))
    try:
        summary = trainer.run()
        assert trainer.state.params["embed"].dtype == np.float32
    finally:
        trainer.close()
    assert trainer.data.report.num_malformed == 4
    assert summary["data_malformed_rows"] == 4
    assert len(trainer.data.report.malformed_indices) == 4
    rows = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 1 and np.isfinite(rows[0]["loss"]) and np.isfinite(rows[0]["grad_norm"])
    assert summary["train_precision"] == precision
    assert rows[0]["train_precision"] == precision
    with pytest.raises(ValueError, match=r"config\.train\.precision"):
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.precision": "fp16"}), VOCAB)


@pytest.mark.parametrize(
    "override, field",
    [
        ({"train.group_size": 1}, "config.train.group_size"),
        ({"loss.correction": "seq_magic"}, "correction"),
        ({"method": "ppo"}, "config.method"),
        ({"rollout.dtype": "float16"}, "config.rollout.dtype"),
        ({"train.micro_batches": 0}, "config.train.micro_batches"),
        ({"train.row_length": 3}, "config.train.row_length"),
    ],
)
def test_bad_config_values_fail_fast_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ExperimentConfig.from_config_dict(tiny_config_dict(**override), VOCAB)


def test_init_from_hf_checkpoint_trains_in_float32_x3_and_architecture_mismatch_is_named(
    tmp_path,
):
    """A run initialised from a Hugging Face checkpoint starts from its weights; it trains in
    float32_x3 (three-pass fp32-class matmuls; exact fp32 on this CPU), recorded by name (the
    other precision, mixed_bf16, is the malformed-rows run's)."""
    from flax import nnx

    from dvp_jax.model import Transformer
    from dvp_jax.model.hf_import import save_hf

    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(), VOCAB)
    source = Transformer(cfg.model, rngs=nnx.Rngs(123))
    save_hf(source, str(tmp_path / "hf"))
    precision = "float32_x3"
    over = {"model.hf_path": str(tmp_path / "hf"), "train.precision": precision}
    # No warm-up: the update in `precision` is what this run compiles.
    cfg_hf = ExperimentConfig.from_config_dict(
        tiny_config_dict(**over, **{"train.steps": 1, "sft.steps": 0}), VOCAB
    )
    trainer = Trainer(cfg_hf, str(tmp_path / "run"))
    try:
        np.testing.assert_array_equal(
            np.asarray(trainer.state.params["embed"]), np.asarray(source.embed[...])
        )
        summary = trainer.run()
        assert trainer.state.params["embed"].dtype == np.float32
    finally:
        trainer.close()
    assert summary["train_precision"] == precision
    rows = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert rows and all(r["train_precision"] == precision for r in rows)
    assert np.isfinite(rows[0]["loss"]) and np.isfinite(rows[0]["grad_norm"])
    # The architecture comes from the checkpoint's config.json: a disagreeing field is refused
    # when the config is built, before any trainer.
    wrong = tiny_config_dict(**{"model.hf_path": str(tmp_path / "hf"), "model.d_ff": 128})
    mismatch = "d_ff: config gives 128, the file has intermediate_size=64"
    with pytest.raises(ValueError, match=mismatch):
        ExperimentConfig.from_config_dict(wrong, VOCAB)


def test_every_config_field_exists_and_a_misspelt_one_fails():
    from dvp_jax.pyfile import load_file
    from dvp_jax.train import config as config_lib

    for name in ("tiny_cpu", "gpu_mid", "paper_qwen3_14b"):
        c = load_file(os.path.join(REPO, "configs", f"{name}.py")).get_config()
        for section, cls in config_lib._SECTIONS.items():
            for f in config_lib.dataclasses.fields(cls):
                assert f.name in c[section], (name, section, f.name)
        c.lock()
        with pytest.raises(AttributeError):
            c.train.stepz = 3


def test_metric_names_are_declared_once_and_typos_fail():
    from dvp_jax import metrics

    assert metrics.declared("frac_tokens_outside_train_safe")
    assert metrics.declared("lt_bin3_mean_abs")
    with pytest.raises(KeyError, match="frac_outside_train_safe"):
        metrics.declared("frac_outside_train_safe")
    with pytest.raises(KeyError, match="ppl_gapp"):
        metrics.check({"loss": 1.0, "ppl_gapp": 0.1})
    with pytest.raises(KeyError):
        metrics.tail_mean([{"step": 1, "loss": 1.0}], "los")


def test_eval_dtype_evaluates_with_an_fp32_engine_while_rollouts_stay_bf16(tmp_path):
    import jax

    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{"rollout.dtype": "bfloat16", "eval.dtype": "float32"}), VOCAB
    )
    trainer = Trainer(cfg, str(tmp_path))
    try:
        engine, eval_engine = trainer.rollout.engines
        assert trainer.rollout.eval_engine is eval_engine
        trainer._sync_weights()
        trained = jax.tree.leaves(jax.device_get(trainer.state.params))
        rollout = jax.tree.leaves(jax.device_get(engine.load_params()))
        evaluation = jax.tree.leaves(jax.device_get(eval_engine.load_params()))
        assert {x.dtype for x in rollout} == {np.dtype(jax.numpy.bfloat16)}
        for want, got in zip(trained, evaluation, strict=True):
            np.testing.assert_array_equal(got, want)  # fp32 weights, not a bf16 round trip
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="eval.dtype"):
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"eval.dtype": "fp16"}), VOCAB)
