"""Two CPU processes (gloo collectives on loopback) run the whole `main` loop, with a checkpoint
and a resume, and compute what one process with as many devices does (the session's `tiny_run`,
tests/shared_runs.py)."""

import subprocess

import numpy as np
import portpicker
from safetensors import safe_open

from dvp_jax.metrics import read_metrics
from tests.shared_runs import TIMING, TINY_RUN
from tests.train_utils import REPO, SESSION_DEVICES, main_command

# ----------------------------------------------------------------------------------------------
# The whole `main` loop: warm-up, rollouts, evaluation, checkpoint, resume, export.
# ----------------------------------------------------------------------------------------------
# Each process holds half the session's devices: the mesh (FSDP over all of them) is the one
# `tiny_run` trains on, its params and optimizer state sharded over both processes' devices, so
# every collective of the step crosses the process boundary.
LOCAL_DEVICES = SESSION_DEVICES // 2


def _main(workdir, *extra, **overrides):
    cmd, env = main_command(workdir, *extra, devices=None, **overrides)
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(*procs):
    for p in procs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-4000:]


def _rl_rows(workdir):
    """step -> that step's metrics (a step's RL row and final-evaluation row merged)."""
    merged = {}
    for row in read_metrics(str(workdir)):
        merged.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if k not in TIMING + ("phase",)}
        )
    return merged


def test_main_loop_two_processes_match_one_process(tmp_path, tiny_run):
    """2 processes x 4 CPU devices (gloo on loopback) run the warm-up and 2 RL steps, checkpoint,
    then resume to 6: metrics and exported parameters equal one process with 8 devices running
    6 steps (`tiny_run`)."""
    single, multi = tiny_run.workdir, tmp_path / "multi"
    steps = TINY_RUN["train.steps"]

    def two_processes(steps, **overrides):
        port = portpicker.pick_unused_port()
        return [
            _main(
                multi,
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={pid}",
                f"--cpu_devices={LOCAL_DEVICES}",
                **{"train.steps": steps, **overrides},
            )
            for pid in range(2)
        ]

    _finish(*two_processes(2))
    first_rows = _rl_rows(multi)
    assert max(first_rows) == 2 and (multi / "summary.json").exists()
    assert "eval_accuracy" in first_rows[2]
    # Resumes from the step-2 checkpoint. The first attempt had the trackers of a default run
    # (TensorBoard: process 0 writes), the resume logs to metrics.jsonl only: the TensorBoard
    # writer imports torch, seconds of each process's start. `train.trackers` may change on a
    # resume and changes no metric row.
    _finish(*two_processes(steps, **{"train.trackers": ""}))

    a, b = _rl_rows(single), _rl_rows(multi)
    assert sorted(a) == sorted(b) == list(range(-2, steps + 1))
    # Step 2 ended the first attempt: its final evaluation (redone by no one: the resumed run
    # drops that row) matches the one-process evaluation after step 2.
    assert set(a[2]) - set(b[2]) == {"eval_accuracy", "eval_pass_at_k"}
    b[2].update({k: first_rows[2][k] for k in ("eval_accuracy", "eval_pass_at_k")})
    for step in a:
        assert set(a[step]) == set(b[step]), step
        for name, value in a[step].items():
            # Different programs on the same mesh shape: the collectives differ (in-process vs
            # gloo) and each host's engine batches only its own prompts, which may reorder float
            # sums. Sampled tokens are discrete and agree exactly (so do rewards, lengths and
            # accuracies); float metrics agree to 1e-5 relative. A perplexity gap is a mean of
            # differences of two float32 perplexities (~55 here): its error is absolute, at their
            # ulp (3.8e-6; 1.7e-6 of a 0.0117 gap was seen), so it gets 2 ulp of the perplexity.
            ppl = np.float32(a[step].get("training_ppl", 0.0))
            atol = max(1e-6, 2 * float(np.spacing(ppl)) if name.endswith("ppl_gap") else 0.0)
            if isinstance(value, str):
                assert value == b[step][name], (step, name)
            else:
                np.testing.assert_allclose(
                    b[step][name], value, rtol=1e-5, atol=atol, err_msg=f"step {step} {name}"
                )
    for step in (-2, -1, 0, 1):  # the resumed attempt left the first attempt's rows alone
        assert first_rows[step] == b[step]
    for step in range(0, steps + 1, 2):  # every evaluation
        assert a[step]["eval_accuracy"] == b[step]["eval_accuracy"], step
    assert a[steps]["reward_mean"] == b[steps]["reward_mean"]

    with safe_open(str(single / "hf_export" / "model.safetensors"), "np") as fa:
        with safe_open(str(multi / "hf_export" / "model.safetensors"), "np") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())
            moved = 0
            for name in fa.keys():
                # Adam turns a ~1e-9 reordering difference of a near-zero gradient entry into
                # up to ~1e-7 of parameter per step.
                np.testing.assert_allclose(
                    fb.get_tensor(name), fa.get_tensor(name), rtol=1e-5, atol=1e-6, err_msg=name
                )
                moved += 1
            assert moved > 0
