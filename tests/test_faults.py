"""Faults found from outside: kills at any moment, reruns, torn logs, a workdir that belongs to
another config or is in use, SIGTERM in every phase, a full disk. Each test builds the faulty
state first; the uninterrupted run they compare with is the session's `tiny_run`
(tests/shared_runs.py). Processes are started only where the process boundary is the fault (a
signal, kill -9, a second process on the workdir, the command line's last line)."""

import json
import logging
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest

from dvp_jax.metrics import read_metrics
from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train.resume import WorkdirMismatchError
from dvp_jax.workdir import WorkdirInUseError, WorkdirLock
from tests.main_cases import run_cases
from tests.shared_runs import TINY_RUN, run_trainer, timeless, tiny_trainer
from tests.train_utils import REPO, main_command

_run = run_trainer
# The processes of tests that are not about the trackers log to metrics.jsonl only: the
# TensorBoard writer imports torch, seconds of each process's start. `train.trackers` may
# change on a resume and changes no metric row.
NO_TRACKERS = {"train.trackers": ""}


def _assert_one_row_per_step(workdir, steps=TINY_RUN["train.steps"], sft_steps=2):
    rows = read_metrics(str(workdir))
    # SFT rows (negative steps), the start row 0, one row per RL step, then the final eval row.
    expect = list(range(-sft_steps, 0)) + list(range(steps + 1)) + [steps]
    assert [r["step"] for r in rows] == expect
    assert [r.get("phase") for r in rows].count(1.0) == 1  # one final evaluation row


def test_rerunning_a_finished_run_or_one_with_a_torn_log_keeps_one_row_per_step(tmp_path, tiny_run):
    tmp_path = tiny_run.copy_to(tmp_path / "run")  # a finished run
    first = tiny_run.summary
    rows = read_metrics(str(tmp_path))
    _assert_one_row_per_step(tmp_path)
    # A kill while writing a row leaves a torn last line.
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 0.1')
    second = _run(tmp_path, **TINY_RUN)
    _assert_one_row_per_step(tmp_path)
    assert timeless(read_metrics(str(tmp_path))) == timeless(rows)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # no torn line left behind
    assert second["eval_accuracy"] == first["eval_accuracy"]
    # Wall time is summed over attempts: the rerun adds its own time to the first run's.
    assert second["wall_time_s"] > first["wall_time_s"] * 0.5


def _mtimes(workdir):
    return {p: os.stat(os.path.join(workdir, p)).st_mtime_ns for p in os.listdir(workdir)}


def test_a_workdir_with_another_config_is_refused_before_anything_is_written(tmp_path, tiny_run):
    workdir = tiny_run.copy_to(tmp_path / "run")  # finished: checkpoint at step 6
    before = _mtimes(workdir)
    model_config = (workdir / "model_config.json").read_bytes()
    other = {**TINY_RUN, "model.d_ff": 128, "train.learning_rate": 1e-3}
    with pytest.raises(WorkdirMismatchError) as e:
        tiny_trainer(str(workdir), **other)
    assert "model.d_ff: workdir 64, now 128" in str(e.value)
    assert "train.learning_rate" in str(e.value)
    # Fewer steps than the checkpoint holds: refused too (it used to evaluate the step-6 policy
    # and write it down as the step-1 result).
    trainer = tiny_trainer(str(workdir), **{"train.steps": 1})
    try:
        with pytest.raises(
            WorkdirMismatchError, match="checkpoint at step 6, past train.steps = 1"
        ):
            trainer.run()
    finally:
        trainer.close()
    # From the command line: test_sigterm_during_the_warm_up_..._are_refused (one interpreter
    # for every refusal).
    assert _mtimes(workdir) == before
    assert (workdir / "model_config.json").read_bytes() == model_config
    # Fields a resume may change (here: more steps) are accepted.
    _run(workdir, **{"train.steps": 7})
    _assert_one_row_per_step(workdir, steps=7)


def _written_before(workdir, *fields):
    """Rewrites `workdir`'s config.json as a commit from before `fields` existed wrote it."""
    path = workdir / "config.json"
    saved = json.loads(path.read_text())
    for field in fields:
        del saved[field]
    path.write_text(json.dumps(saved, indent=2))


def test_a_workdir_from_before_a_field_existed_resumes_at_the_value_that_reproduces_it(
    tmp_path, tiny_run
):
    """A workdir written by an earlier commit (emulated: fields deleted from its config.json)
    resumes when the run sets each new field to the value the old run behaved as: its default
    (rollout.kv_pages: None), or its `resume.LEGACY_VALUES` entry (train.packing: False, the
    unpacked update). Another value is refused in one line naming the field as new and how to
    continue, before anything is written."""
    workdir = tiny_run.copy_to(tmp_path / "run")
    _written_before(workdir, "rollout.kv_pages")
    before = _mtimes(workdir)
    with pytest.raises(WorkdirMismatchError) as e:
        tiny_trainer(str(workdir), **{"rollout.kv_pages": 64})
    assert "\n" not in str(e.value) and _mtimes(workdir) == before
    assert (
        "(rollout.kv_pages: new since the workdir was written, now 64 "
        "(leave config.rollout.kv_pages unset (None) to resume it))"
    ) in str(e.value)
    # At its default: resumed, and config.json now names the field.
    _run(workdir, **NO_TRACKERS, **{"train.steps": 7})
    _assert_one_row_per_step(workdir, steps=7)
    assert json.loads((workdir / "config.json").read_text())["rollout.kv_pages"] is None

    _written_before(workdir, "train.packing")
    with pytest.raises(WorkdirMismatchError) as e:
        tiny_trainer(str(workdir), **{"train.steps": 7})  # packing's default, True
    assert (
        "(train.packing: new since the workdir was written, now True "
        "(pass --config.train.packing=False to resume it))"
    ) in str(e.value)
    tiny_trainer(str(workdir), **{"train.steps": 7, "train.packing": False}).close()


def test_new_fields_compare_at_their_legacy_values():
    """`resume_mismatch` on a saved config without some fields: each compares equal at its
    legacy value (the default, None included, or `LEGACY_VALUES`'), and is named as new with the
    flag that continues otherwise; a field present in both still reads "workdir X, now Y"."""
    from dvp_jax.train import resume
    from dvp_jax.train.config import ExperimentConfig
    from tests.train_utils import tiny_config_dict

    vocab = CharTokenizer().vocab_size
    cfg = lambda **o: ExperimentConfig.from_config_dict(tiny_config_dict(**o), vocab)
    new = ("rollout.kv_pages", "rollout.decode_attention", "train.packing", "loss.k3_max")
    saved = {k: v for k, v in resume.flat_fields(cfg()).items() if k not in new}
    legacy = {"train.packing": False, "rollout.decode_attention": "dense"}
    assert resume.LEGACY_VALUES == legacy
    # Each entry names a real field and differs from its default (else it would be no entry).
    defaults = resume.flat_fields(cfg())
    assert all(defaults[k] != v for k, v in resume.LEGACY_VALUES.items())
    assert resume.resume_mismatch(saved, cfg(**legacy)) == []
    assert resume.resume_mismatch(saved, cfg()) == [
        "rollout.decode_attention: new since the workdir was written, now 'paged' "
        "(pass --config.rollout.decode_attention=dense to resume it)",
        "train.packing: new since the workdir was written, now True "
        "(pass --config.train.packing=False to resume it)",
    ]
    assert resume.resume_mismatch(saved, cfg(**legacy, **{"loss.k3_max": 0.01})) == [
        "loss.k3_max: new since the workdir was written, now 0.01 "
        "(pass --config.loss.k3_max=0.005 to resume it)"
    ]
    saved["train.packing"] = False
    assert resume.resume_mismatch(saved, cfg(**{"rollout.decode_attention": "dense"})) == [
        "train.packing: workdir False, now True"
    ]


def _wait_for(path, needle, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and needle in open(path).read():
            return True
        time.sleep(0.1)
    return False


def test_sigterm_during_the_warm_up_exits_75_and_second_trainers_meanwhile_are_refused(
    tmp_path, tiny_run
):
    workdir, log = tmp_path / "run", tmp_path / "log.txt"
    other = tiny_run.copy_to(tmp_path / "other")  # finished: checkpoint at step 6
    before, model_config = _mtimes(other), (other / "model_config.json").read_bytes()
    cmd, env = main_command(workdir, **{"sft.steps": 100_000, **NO_TRACKERS})
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            assert _wait_for(log, "supervised warm-up:", proc), open(log).read()[-3000:]
            # Paused (holding the workdir) while the second trainers run: its steps would only
            # take their CPU.
            proc.send_signal(signal.SIGSTOP)
            # From the command line, each refusal is one line and exit 2, no traceback (one
            # interpreter, three runs): a second trainer on the workdir in use (naming the
            # holder), and on a finished run's workdir another config, or fewer steps than its
            # checkpoint holds; neither writes anything there.
            mismatch, _ = main_command(other, **{**TINY_RUN, "model.d_ff": 128})
            short, _ = main_command(other, **{"train.steps": 1})
            results = run_cases(
                "dvp_jax.main", [cmd[2:], mismatch[2:], short[2:]], env=env, cwd=REPO
            )
            expected = (
                ("is in use by another trainer", f"pid {proc.pid}"),
                ("model.d_ff: workdir 64, now 128",),
                ("past train.steps = 1",),
            )
            for result, needles in zip(results, expected, strict=True):
                text = result["output"]
                assert result["status"] == 2, text[-3000:]
                last = text.strip().splitlines()[-1]
                assert all(n in last for n in needles), text[-3000:]
                assert "Traceback" not in text and "Event loop is closed" not in text
            assert _mtimes(other) == before
            assert (other / "model_config.json").read_bytes() == model_config
            # The Python API refuses too, before building anything.
            with pytest.raises(WorkdirInUseError, match=f"pid {proc.pid}"):
                WorkdirLock(workdir).acquire()
            proc.send_signal(signal.SIGCONT)
            time.sleep(1.0)  # inside the step loop
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)  # 100k steps would take hours: SIGTERM was honoured
        finally:
            proc.kill()
    out = open(log).read()
    assert proc.returncode == 75, out[-3000:]
    assert "preempted during the supervised warm-up" in out
    assert not os.path.exists(workdir / "checkpoints" / "0")


def _wait_for_dir(path, proc, timeout=600):
    deadline = time.time() + timeout
    while not path.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    return path.is_dir()


def test_sigterm_then_kill_9_at_random_moments_then_resume_equal_one_uninterrupted_run(
    tmp_path, tiny_run
):
    """One workdir: SIGTERM during the RL steps, kill -9 right after a checkpoint landed, kill -9
    twice at random moments, then a run to the end: it equals `tiny_run` exactly (the same
    programs on the same inputs), parameters and every metric row."""
    run_dir = tmp_path / "run"
    cmd, env = main_command(run_dir, "--export_hf", **TINY_RUN)
    # The first attempt with the trackers a run has by default (they close on a preemption),
    # the kills and the run to the end without.
    quiet, _ = main_command(run_dir, "--export_hf", **TINY_RUN, **NO_TRACKERS)
    start = lambda: subprocess.Popen(
        quiet, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # SIGTERM once the step-0 checkpoint is written: the step running then is dropped inside
    # its rollouts (or finished, if the signal came after them) and the last step done saved.
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert _wait_for_dir(run_dir / "checkpoints" / "0", proc), "no step-0 checkpoint"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 75, out[-3000:]  # "preempted, checkpoint saved"
    assert "preempted: checkpoint saved at step" in out
    saved = sorted(int(d.name) for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit())
    last_done = max((r["step"] for r in read_metrics(str(run_dir)) if "loss" in r), default=0)
    assert saved[-1] == last_done < TINY_RUN["train.steps"]
    assert not (run_dir / "summary.json").exists()
    # kill -9 right after the next checkpoint has landed.
    proc, ckpt = start(), run_dir / "checkpoints" / str(last_done // 2 * 2 + 2)
    assert _wait_for_dir(ckpt, proc), f"no {ckpt} before the run ended"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()
    # kill -9 leaves the lock file behind, naming a dead process: it does not block a rerun.
    assert f'"pid": {proc.pid}' in (run_dir / ".lock").read_text()
    with WorkdirLock(run_dir) as lock:
        assert f'"pid": {os.getpid()}' in lock.path.read_text()
    assert not (run_dir / ".lock").exists()  # released: removed
    rng = random.Random(13)
    for attempt in range(2):
        proc = start()
        # Anywhere from start-up to the last steps (a run takes ~10-30 s here).
        try:
            proc.wait(timeout=rng.uniform(4.0, 20.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode in (-signal.SIGKILL, 0), (attempt, proc.returncode)
    # The run to the end, unless the last attempt was it (it was not killed before the end).
    if proc.returncode != 0:
        final = subprocess.run(
            quiet, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]

    from safetensors.numpy import load_file

    ref = load_file(str(tiny_run.workdir / "hf_export" / "model.safetensors"))
    got = load_file(str(run_dir / "hf_export" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for key in ref:
        np.testing.assert_array_equal(ref[key], got[key], err_msg=key)
    # One row per step: every attempt resumed from its last checkpoint and redid only the rest.
    assert timeless(read_metrics(str(run_dir))) == timeless(tiny_run.rows())
    assert [r["step"] for r in read_metrics(str(run_dir)) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # The export carries the tokenizer too: transformers loads it with our ids.
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(run_dir / "hf_export"))
    assert hf_tok.encode("12+7=", add_special_tokens=False) == CharTokenizer().encode_ids("12+7=")


def test_sigterm_and_sigint_during_the_first_evaluation_stop_within_one_dispatch(tmp_path):
    # An evaluation of 8 prompts x 100,000 samples would take hours: the exit proves the stop
    # was honoured inside it. The warm-up is kept (checkpoint 0), the evaluation is not.
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        workdir = tmp_path / sig.name
        cmd, env = main_command(workdir, **{"eval.k": 100_000, **NO_TRACKERS})
        log = open(tmp_path / f"{sig.name}.txt", "w")
        runs[sig] = (workdir, log, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log))
    try:
        for _, log, proc in runs.values():
            assert _wait_for(log.name, "warm-up 2/2", proc), open(log.name).read()[-3000:]
        time.sleep(1.0)  # both inside their evaluations
        for sig, (workdir, _, proc) in runs.items():
            # Checkpoint 0 is written after the evaluation, so its absence means "evaluating".
            assert not (workdir / "checkpoints" / "0").exists()
            proc.send_signal(sig)
        for sig, (workdir, log, proc) in runs.items():
            proc.wait(timeout=120)
            out = open(log.name).read()
            assert proc.returncode == {signal.SIGTERM: 75, signal.SIGINT: 130}[sig], out[-3000:]
            assert f"{sig.name} received" in out and "checkpoint saved at step 0" in out
            assert "Traceback" not in out
            assert (workdir / "checkpoints" / "0").is_dir()
            assert [r["step"] for r in read_metrics(str(workdir))] == [-2, -1]  # no eval row
    finally:
        for _, log, proc in runs.values():
            proc.kill()
            log.close()


class _StopAfter:
    """Answers the trainer's "should I stop?" with True from the `n`-th question on, as a
    signal arriving at that moment would."""

    def __init__(self, n):
        self.n, self.asked = n, 0

    def __call__(self):
        self.asked += 1
        return self.asked >= self.n


def test_fresh_start_over_stale_rows_then_stops_inside_each_phase_resume_equal_one_run(
    tmp_path, tiny_run
):
    """The workdir holds what a kill during the first checkpoint write leaves: the warm-up and
    step-0 rows in the log, no checkpoint. The first trainer starts fresh (and must not keep
    those rows or append a second copy). Then three stops in one run, each between two
    dispatches of a phase, each resumed by a new trainer on the workdir: the interrupted phase
    is redone from the checkpoint it left, and the run ends exactly as one that was never
    stopped, row for row (same programs, same inputs: exact)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    stale = [{"step": -1, "sft_loss": 9.0, "phase_sft": 1.0}, {"step": 0, "phase": 0.0}]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    # (method, its step, the question the stop comes at, the checkpoint it leaves)
    stops = [
        ("evaluate", 0, 2, 0),  # the first evaluation, after its first dispatch
        ("rl_iteration", 2, 1, 1),  # step 2's rollouts, before any dispatch: step 2 dropped
        ("evaluate", 2, 2, 2),  # step 2 is done; its row waits for the evaluation
    ]
    for method, at_step, nth_question, checkpoint in stops:
        trainer = tiny_trainer(str(workdir), **TINY_RUN)
        original = getattr(trainer, method)

        def stop_inside(step, *args, _at=at_step, _n=nth_question, _f=original, _t=trainer, **kw):
            if step == _at:
                _t.preemption.requested = _StopAfter(_n)
            return _f(step, *args, **kw)

        setattr(trainer, method, stop_inside)
        try:
            assert trainer.run() == {"preempted_at": checkpoint}, (method, at_step)
        finally:
            trainer.close()
        assert (workdir / "checkpoints" / str(checkpoint)).is_dir()
    resumed = _run(workdir, **TINY_RUN)
    _assert_one_row_per_step(workdir)
    assert all(r.get("sft_loss") != 9.0 for r in read_metrics(str(workdir)))
    assert timeless(read_metrics(str(workdir))) == timeless(tiny_run.rows())
    untimed = lambda summary: {k: v for k, v in summary.items() if k != "wall_time_s"}
    assert untimed(resumed) == untimed(tiny_run.summary)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, so a disk can really fill (needs root, as CI and the dev machines run)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_stops_the_run_at_the_failing_write_and_the_rerun_resumes(small_disk, caplog):
    workdir, filler = small_disk / "run", small_disk / "filler"
    # Saves every 4 steps: the disk is full well before the next one starts (filling it takes
    # milliseconds, a step a fraction of a second). No evaluation between the first and the
    # last: the writes that fail are the step rows and the next checkpoint.
    every, steps = 4, 12
    run = {"train.steps": steps, "checkpoint.every": every, "eval.every": 0, **NO_TRACKERS}
    cmd, env = main_command(workdir, **run)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 300
        while not (workdir / "checkpoints" / str(every)).is_dir() and time.time() < deadline:
            time.sleep(0.05)
        with open(filler, "wb", buffering=0) as fh:  # fill the disk
            try:
                while fh.write(b"\0" * 65536):
                    pass
            except OSError:
                pass
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1, out[-3000:]
    assert last.startswith("error: ") and "No space left on device" in last, out[-3000:]
    assert str(workdir) in last
    assert "Traceback" not in out
    done = [r["step"] for r in read_metrics(str(workdir)) if "loss" in r]
    assert max(done) < steps  # it stopped, and did not train on to the next save
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert max(done) <= max(saved) + every  # not past the save that failed
    os.remove(filler)
    # The rerun (in this process: what is tested is the workdir the failed write left).
    with caplog.at_level(logging.INFO):
        assert _run(workdir, **run)["steps"] == steps
    assert f"resuming from step {max(saved)}" in caplog.text
    assert [r["step"] for r in read_metrics(str(workdir)) if "loss" in r] == list(
        range(1, steps + 1)
    )


def test_a_lease_on_an_object_store_refuses_while_renewed_and_is_taken_over_when_stale(tmp_path):
    # The lease path (used for gs:// workdirs, which have no flock), on a local directory.
    first = WorkdirLock(tmp_path)
    first._acquire_lease()
    try:
        with pytest.raises(WorkdirInUseError, match=r"pid \d+, lease renewed 0 s ago"):
            WorkdirLock(tmp_path)._acquire_lease()
    finally:
        first.release()
    assert not (tmp_path / ".lock").exists()
    # A lease its holder stopped renewing (a dead process) is taken over.
    stale = {"host": "gone", "pid": 1, "time": time.time() - 2 * WorkdirLock.STALE_S}
    (tmp_path / ".lock").write_text(json.dumps(stale))
    second = WorkdirLock(tmp_path)
    second._acquire_lease()
    try:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        second.release()
