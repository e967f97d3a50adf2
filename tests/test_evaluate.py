"""Validation sets: `eval.sets` in a run, and `python -m dvp_jax.evaluate` on the shared tiny run.

The command on the run's workdir (its checkpoint and config.json, in a process) and `evaluate.run`
on the run's exported Hugging Face directory with the same config (in this process) are the same
engine program on the same weights and prompts: their figures and sample responses agree
exactly.
"""

import json
import re
import subprocess

import pytest

from dvp_jax import evaluate, metrics
from dvp_jax.data.tasks import ArithmeticTask
from dvp_jax.errors import DataError, UserError
from tests.train_utils import main_command, tiny_config_dict

K = 2


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Files of arithmetic problems: the task's held-out split in the default layout, and train
    problems under other field names (question / meta.gold)."""
    cfg = tiny_config_dict()
    task = ArithmeticTask(seed=cfg.data.seed, **cfg.data.arithmetic.to_dict())
    root = tmp_path_factory.mktemp("evalsets")
    held = root / "held.jsonl"
    held.write_text(
        "".join(
            json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n"
            for e in task.heldout_examples(6)
        )
    )
    own = root / "own layout.jsonl"
    own.write_text(
        "".join(
            json.dumps({"question": e.prompt, "meta": {"gold": int(e.answer)}}) + "\n"
            for e in task.train_examples(5)
        )
    )
    return held, own


def test_cli_on_the_workdir_equals_the_hf_export(tiny_run, sets, tmp_path):
    _, own = sets
    out = tmp_path / "res.json"
    cmd, env = main_command(tiny_run.workdir)
    cmd = [cmd[0], "-m", "dvp_jax.evaluate", f"--workdir={tiny_run.workdir}"]
    cmd += [f"--data={own}", f"--data=own={own}", "--prompt_key=question"]
    cmd += ["--answer_key=meta.gold", f"--k={K}", "--dtype=fp32", f"--out={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = json.loads(out.read_text())
    assert (
        cli["model"] == {"workdir": str(tiny_run.workdir), "step": 6} and cli["dtype"] == "float32"
    )
    # One file as two sets: the stem's name and NAME=; each set is sampled with its own key.
    assert list(cli["sets"]) == ["own_layout", "own"]
    assert cli["sets"]["own_layout"]["prompts"] == cli["sets"]["own"]["prompts"] == 5
    for name, s in cli["sets"].items():
        assert s["k"] == K and s["reward"] == "exact_match"
        assert 0.0 <= s["avg_at_k"] <= s["pass_at_k"] <= 1.0
        assert f"{name}: avg@{K} {s['avg_at_k']:.4f}  pass@{K} {s['pass_at_k']:.4f}" in proc.stdout
    # Sample rows: the first prompts' responses, at most 8 per set.
    rows = cli["samples"]
    assert [r["set"] for r in rows] == ["own_layout"] * 8 + ["own"] * 8
    assert set(rows[0]) == {"set", "prompt", "response", "answer", "reward", "finished"}
    first = json.loads(own.read_text().splitlines()[0])
    assert rows[0]["prompt"] == rows[1]["prompt"] == first["question"] != rows[2]["prompt"]
    assert rows[0]["answer"] == str(first["meta"]["gold"])

    # The same policy from the exported HF directory, with the run's config, in this process.
    config = tiny_config_dict(**{"train.steps": 6})
    fields = {"prompt_key": "question", "answer_key": "meta.gold"}
    here = evaluate.run(
        hf_path=str(tiny_run.workdir / "hf_export"),
        data=[str(own), f"own={own}"],
        config=config,
        k=K,
        dtype="fp32",
        fields=fields,
        out=str(tmp_path / "hf.json"),
    )
    assert here["sets"] == cli["sets"] and here["samples"] == rows


def test_trainer_logs_each_named_set(tmp_path, sets):
    """A run's `eval.sets` are evaluated beside its held-out split, each under its declared
    metric names, with the set's own k and reward; sample rows name their set."""
    from tests.shared_runs import tiny_trainer

    held, own = sets
    eval_sets = (
        dict(name="held", path=str(held), k=3, reward="exact_match=0.5"),
        dict(name="own", path=str(own), prompt_key="question", answer_key="meta.gold"),
    )
    trainer = tiny_trainer(str(tmp_path / "run"), **{"eval.sets": eval_sets})
    try:
        rows = []
        got = trainer.evaluate(0, sample_rows=rows)
    finally:
        trainer.close()
    assert sorted(got) == sorted(
        ["eval_accuracy", "eval_pass_at_k"]
        + [f"eval/{n}/{m}" for n in ("held", "own") for m in ("accuracy", "pass_at_k")]
    )
    metrics.check(got)  # every name declared
    assert 0.0 <= got["eval/held/accuracy"] <= got["eval/held/pass_at_k"] <= 0.5  # weight 0.5
    assert [r["set"] for r in rows] == ["heldout"] * 2 * 4 + ["held"] * 8 + ["own"] * 8
    assert rows[8]["prompt"] == rows[10]["prompt"] != rows[11]["prompt"]  # k = 3 samples each


def test_bad_input_is_one_line(tiny_run, sets, tmp_path):
    held, _ = sets
    hf = str(tiny_run.workdir / "hf_export")
    with pytest.raises(DataError) as err:
        evaluate.run(workdir=str(tiny_run.workdir), data=[str(held)], fields={"prompt_key": "q"})
    assert str(err.value) == (
        f"--data {held}: prompt_key='q' is not a field of {held}; its fields: answer, prompt"
    )
    for kwargs, message in [
        (dict(), "give exactly one of --workdir and --hf_path"),
        (dict(hf_path=hf), "--hf_path needs --data FILE"),
        (dict(workdir=str(tiny_run.workdir), config=tiny_config_dict()), "--config goes with"),
        (dict(workdir=str(tiny_run.workdir), dtype="fp64"), "--dtype must be fp32, bf16"),
        (dict(workdir=str(tmp_path)), "no config.json (not a dvp_jax.main workdir)"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            evaluate.run(**kwargs)
    bad = tiny_config_dict(**{"eval.sets": (dict(name="x", path=str(held), answer_key="gold"),)})
    from dvp_jax.tokenizers import CharTokenizer
    from dvp_jax.train import evaluation
    from dvp_jax.train.config import ExperimentConfig

    cfg = ExperimentConfig.from_config_dict(bad, CharTokenizer().vocab_size)
    with pytest.raises(DataError, match=r"^config.eval.sets\[0\] \(x\): answer_key='gold' is not"):
        evaluation.heldout_sets(cfg.data, cfg.eval, cfg.data.make_task(), CharTokenizer())
