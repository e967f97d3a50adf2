"""End-to-end trainer tests: a short run, SIGTERM, bad data rows, bad config values (kill -9 and
resume: tests/test_faults.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dvp_jax.metrics import read_metrics
from dvp_jax.rollout.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.trainer import Trainer
from tests.train_utils import REPO, TINY_CONFIG, main_command, tiny_config_dict

VOCAB = CharTokenizer().vocab_size


def _metrics(workdir):
    return read_metrics(str(workdir))


def test_three_step_run_is_finite_and_compiles_once(tmp_path):
    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(), VOCAB)
    trainer = Trainer(cfg, str(tmp_path))
    try:
        summary = trainer.run()
        # One compiled train step for all three steps: no retrace after the first.
        assert trainer.parts.update._cache_size() == 1
    finally:
        trainer.close()
    rows = [r for r in _metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
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
    assert summary["final_ppl_gap"] == pytest.approx(np.mean([r["ppl_gap"] for r in rows]))
    assert os.path.exists(os.path.join(tmp_path, "summary.json"))
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))


def _run_main(workdir, *extra, wait=True):
    cmd, env = main_command(workdir, "--export_hf", *extra, **{"train.steps": 6})
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    return proc


def test_malformed_data_rows_are_counted_and_skipped(tmp_path):
    rows = []
    good = [
        ("what is 2 plus 3?", "5"),
        ("what is 7 minus 4?", "3"),
        ("4 plus 4 is", "8"),
        ("what is 9 minus 1?", "8"),
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
    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(
            **{
                "data.task": "math",
                "data.path": str(path),
                "data.chat_format": "plain",
                "data.max_prompt_len": 32,
                "train.steps": 2,
                "data.eval_path": str(path),
                # Also exercises two PPO mini-batch updates per rollout batch, each with
                # gradient accumulation over two micro-batches.
                "train.updates_per_batch": 2,
                "loss.ppo_clip_eps": 0.2,
                "train.micro_batches": 2,
                "train.prompts_per_step": 8,
                "eval.num_prompts": 4,
            }
        ),
        VOCAB,
    )
    trainer = Trainer(cfg, str(tmp_path / "run"))
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert trainer.data.report.num_malformed == 4
    assert summary["data_malformed_rows"] == 4
    assert len(trainer.data.report.malformed_indices) == 4
    losses = [r["loss"] for r in _metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.parametrize(
    "override, field",
    [
        ({"train.group_size": 1}, "config.train.group_size"),
        ({"loss.correction": "seq_magic"}, "correction"),
        ({"method": "ppo"}, "config.method"),
        ({"rollout.dtype": "float16"}, "config.rollout.dtype"),
        ({"train.micro_batches": 3}, "config.train.micro_batches"),
    ],
)
def test_bad_config_values_fail_fast_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ExperimentConfig.from_config_dict(tiny_config_dict(**override), VOCAB)


def test_cli_bad_config_exits_nonzero_with_message(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dvp_jax.main",
        f"--config={TINY_CONFIG}",
        f"--workdir={tmp_path}",
        "--config.train.group_size=1",
    ]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    assert out.returncode != 0
    assert "config.train.group_size must be an int >= 2, got 1" in out.stderr + out.stdout


def test_init_from_hf_checkpoint_and_architecture_mismatch_is_named(tmp_path):
    from flax import nnx

    from dvp_jax.model import Transformer
    from dvp_jax.model.hf_import import save_hf

    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(), VOCAB)
    source = Transformer(cfg.model, rngs=nnx.Rngs(123))
    save_hf(source, str(tmp_path / "hf"))
    cfg_hf = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{"model.hf_path": str(tmp_path / "hf")}), VOCAB
    )
    trainer = Trainer(cfg_hf, str(tmp_path / "run"))
    try:
        np.testing.assert_array_equal(
            np.asarray(trainer.state.params["embed"]), np.asarray(source.embed[...])
        )
    finally:
        trainer.close()
    wrong = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{"model.hf_path": str(tmp_path / "hf"), "model.d_ff": 128}), VOCAB
    )
    with pytest.raises(ValueError, match="d_ff: config 128 vs checkpoint 64"):
        Trainer(wrong, str(tmp_path / "run2"))


def test_sigterm_checkpoints_the_current_step_and_exits_cleanly(tmp_path):
    workdir = str(tmp_path / "run")
    proc = _run_main(workdir, wait=False)
    start_ckpt = os.path.join(workdir, "checkpoints", "0")
    deadline = time.time() + 600
    while not os.path.isdir(start_ckpt) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert os.path.isdir(start_ckpt), "the run ended before its step-0 checkpoint"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 75, out[-3000:]  # "preempted, checkpoint saved"
    assert "preempted: checkpoint saved at step" in out
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    # The step running when SIGTERM arrived was dropped inside its rollouts (or finished, if
    # the signal came after them): the newest checkpoint is the last step done.
    last_done = max((r["step"] for r in _metrics(workdir) if "loss" in r), default=0)
    assert steps[-1] == last_done < 6
    assert not os.path.exists(os.path.join(workdir, "summary.json"))


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


def test_cli_overrides_any_field_and_rejects_a_misspelt_one(tmp_path):
    def main(*flags):
        cmd = [sys.executable, "-m", "dvp_jax.main", f"--config={TINY_CONFIG}", *flags]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)

    out = main(f"--workdir={tmp_path / 'a'}", "--config.train.stepz=3")
    assert out.returncode != 0 and "stepz" in out.stderr + out.stdout
    assert not os.path.exists(tmp_path / "a")
    # Fields the config file does not mention are still overridable (here: a bad value, so the
    # run stops at validation, naming the field the user set).
    out = main(
        f"--workdir={tmp_path / 'b'}",
        "--config.data.chat_format=plain",
        "--config.rollout.temperature=0",
    )
    assert out.returncode != 0
    assert "config.rollout.temperature must be a finite float > 0" in out.stderr + out.stdout


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


@pytest.mark.parametrize("precision", ["mixed_bf16", "float32_x3"])
def test_other_trainer_precisions_are_named_in_metrics_and_summary(tmp_path, precision):
    """mixed_bf16 (bf16 compute on fp32 master params) and float32_x3 (three-pass fp32-class
    matmuls; exact fp32 on this CPU) train and are recorded by name."""
    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{"train.precision": precision, "train.steps": 1}), VOCAB
    )
    trainer = Trainer(cfg, str(tmp_path))
    try:
        summary = trainer.run()
        assert trainer.state.params["embed"].dtype == np.float32
    finally:
        trainer.close()
    assert summary["train_precision"] == precision
    rows = [r for r in _metrics(tmp_path) if "loss" in r]
    assert rows and all(r["train_precision"] == precision for r in rows)
    assert np.isfinite(rows[0]["loss"]) and np.isfinite(rows[0]["grad_norm"])
    with pytest.raises(ValueError, match=r"config\.train\.precision"):
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.precision": "fp16"}), VOCAB)


def test_eval_dtype_evaluates_with_an_fp32_engine_while_rollouts_stay_bf16(tmp_path):
    import jax

    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{"rollout.dtype": "bfloat16", "eval.dtype": "float32"}), VOCAB
    )
    trainer = Trainer(cfg, str(tmp_path))
    try:
        assert trainer.eval_engine is not trainer.engine
        trainer._sync_weights()
        trained = jax.tree.leaves(jax.device_get(trainer.state.params))
        rollout = jax.tree.leaves(jax.device_get(trainer.engine.load_params()))
        evaluation = jax.tree.leaves(jax.device_get(trainer.eval_engine.load_params()))
        assert {x.dtype for x in rollout} == {np.dtype(jax.numpy.bfloat16)}
        for want, got in zip(trained, evaluation, strict=True):
            np.testing.assert_array_equal(got, want)  # fp32 weights, not a bf16 round trip
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="eval.dtype"):
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"eval.dtype": "fp16"}), VOCAB)
