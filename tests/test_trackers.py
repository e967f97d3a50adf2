"""The trackers (dvp_jax/trackers.py): TensorBoard and W&B (offline, read back from its run
files), samples.jsonl, a resume that writes no step twice, and the one-line errors.

W&B runs in offline mode with its directory in tmp_path: nothing is sent, no login.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys

import pytest

from dvp_jax.errors import ConfigError
from dvp_jax.metrics import MetricsLog
from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.trackers import FINAL_EVAL, Trackers, WandbOptions, check_installed, parse_trackers
from dvp_jax.train.config import ExperimentConfig
from tests.train_utils import tiny_config_dict


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "wandb_dir"


def wandb_records(wandb_dir) -> list[tuple[str, list]]:
    """(run id, records) of each offline run under `wandb_dir`, oldest first.

    A run file is W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of records
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) holding `Record` protos.
    """
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # W&B's service writes the run file in the background: until it stops
    out = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "*.wandb"))):
        data, pos, buf, records = open(path, "rb").read(), 7, b"", []
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(buf)
                records.append(record)
                buf = b""
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        out.append((run.start_time.ToNanoseconds(), run.run_id, records))
    # Oldest first by the run's start time: the directory names hold whole seconds only, so
    # two attempts started within one second sort by their random run id.
    return [(run_id, records) for _, run_id, records in sorted(out, key=lambda x: x[0])]


def history(records, name: str) -> list[tuple[float, object]]:
    """(the row's `step`, value of `name`) of every history row that has `name`."""
    out = []
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
        if name in items:
            out.append((json.loads(items["step"]), json.loads(items[name])))
    return out


def run_config(records) -> dict:
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    return {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}


def summary(records) -> dict:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            for u in r.summary.update:
                out["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    return out


SAMPLES = [
    {"set": "heldout", "prompt": "1+2=", "response": "3", "answer": "3", "reward": 1.0,
     "finished": True},
    {"set": "heldout", "prompt": "4|5\n", "response": "9", "answer": "1", "reward": 0.0,
     "finished": False},
]  # fmt: skip


def log_attempt(workdir, steps, *, resumed_step=None, final=False):
    """What a trainer logs: warm-up rows (fresh start), step rows with an evaluation (and its
    samples) at even steps, the final evaluation and the summary."""
    log = MetricsLog(workdir)
    redone = log.truncate_after(resumed_step)
    trackers = Trackers(
        workdir,
        ("tensorboard", "wandb"),
        config={"method": "dvp", "train.steps": 5},
        resumed_step=resumed_step,
        kept_rows=log.num_rows,
        redone_rows=redone,
        wandb=WandbOptions(project="test"),
    )
    try:
        for step in steps:
            row = {"sft_loss": 2.0 + step, "phase_sft": 1.0} if step < 0 else {"loss": 0.1 * step}
            if step >= 0 and step % 2 == 0:
                trackers.samples(step, "eval", SAMPLES)
                row["eval_accuracy"] = 0.1 * step
            if step == 0:
                row = {"eval_accuracy": 0.0, "phase": 0.0}
            log.append(step, row)
            trackers.scalars(step, row)
        if final:
            trackers.samples(5, FINAL_EVAL, SAMPLES)
            log.append(5, {"eval_accuracy": 0.7, "phase": 1.0})
            trackers.scalars(5, {"eval_accuracy": 0.7, "phase": 1.0})
            trackers.summary({"steps": 5, "method": "dvp", "eval_accuracy": 0.7})
    finally:
        trackers.close()


def test_config_scalars_samples_and_summary_reach_tensorboard_wandb_and_samples_jsonl(
    tmp_path, offline_wandb
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = tmp_path / "run"
    workdir.mkdir()
    log_attempt(workdir, [-2, -1, 0, 1, 2, 3, 4, 5], final=True)

    [(run_id, records)] = wandb_records(offline_wandb)
    assert json.loads((workdir / "wandb_run.json").read_text()) == {"id": run_id}
    assert run_config(records) == {"method": "dvp", "train.steps": 5}
    assert history(records, "loss") == [(s, pytest.approx(0.1 * s)) for s in range(1, 6)]
    assert history(records, "sft_loss") == [(-2, 0.0), (-1, 1.0)]  # before step 0
    assert [s for s, _ in history(records, "eval_accuracy")] == [0, 2, 4, 5]
    assert history(records, "samples/eval/_type") == [(s, "table-file") for s in (0, 2, 4)]
    assert len(history(records, f"samples/{FINAL_EVAL}/_type")) == 1
    [path] = history(records, "samples/eval/path")[:1]
    table = json.loads(open(glob.glob(f"{offline_wandb}/wandb/*/files/{path[1]}")[0]).read())
    assert table["columns"] == list(SAMPLES[0])
    assert table["data"] == [list(r.values()) for r in SAMPLES]
    assert summary(records)["eval_accuracy"] == 0.7 and summary(records)["method"] == "dvp"

    events = EventAccumulator(str(workdir), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("sft_loss")] == [(-2, 0.0), (-1, 1.0)]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    text = events.Tensors("samples/eval/text_summary")
    assert [e.step for e in text] == [0, 2, 4]
    table = text[0].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0] == "| set | prompt | response | answer | reward | finished |"
    assert "| heldout | 4\\|5\\n | 9 | 1 | 0.0 | false |" in table  # escaped, one line
    assert (
        "eval_accuracy: 0.7"
        in events.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    )  # noqa: E501

    rows = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["name"]) for r in rows] == [
        (s, n) for s, n in [(0, "eval"), (2, "eval"), (4, "eval"), (5, FINAL_EVAL)] for _ in SAMPLES
    ]
    assert rows[1] == {"step": 0, "name": "eval", **SAMPLES[1]}


def test_a_resumed_run_continues_its_wandb_run_and_writes_no_step_twice(tmp_path, offline_wandb):
    """Attempt 1 logs through step 4 and dies after the checkpoint at step 2; attempt 2 resumes
    from it and finishes. W&B keeps attempt 1's rows of steps 3-4 (the same values), the jsonl
    logs and TensorBoard attempt 2's; every step is there once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = tmp_path / "run"
    workdir.mkdir()
    log_attempt(workdir, [-2, -1, 0, 1, 2, 3, 4])
    log_attempt(workdir, [3, 4, 5], resumed_step=2, final=True)

    (first_id, first), (second_id, second) = wandb_records(offline_wandb)
    assert first_id == second_id
    assert history(first, "loss") == [(s, pytest.approx(0.1 * s)) for s in (1, 2, 3, 4)]
    assert history(second, "loss") == [(5, pytest.approx(0.5))]
    assert [s for s, _ in history(second, "eval_accuracy")] == [5]  # the final evaluation
    assert [s for s, _ in history(first + second, "samples/eval/_type")] == [0, 2, 4]
    assert len(history(second, f"samples/{FINAL_EVAL}/_type")) == 1
    wandb_steps = [r.history.step.num for r in first + second if r.HasField("history")]
    assert wandb_steps == sorted(set(wandb_steps))  # W&B's own step only increases

    metric_steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert metric_steps == [-2, -1, 0, 1, 2, 3, 4, 5, 5]
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert [(r["step"], r["name"]) for r in samples[:: len(SAMPLES)]] == [
        (0, "eval"), (2, "eval"), (4, "eval"), (5, FINAL_EVAL)
    ]  # fmt: skip
    events = EventAccumulator(str(workdir))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]


def test_tracker_names_and_a_missing_package_fail_in_one_line_before_any_work(
    tmp_path, monkeypatch
):
    assert parse_trackers("tensorboard, wandb") == ("tensorboard", "wandb")
    assert parse_trackers("") == ()
    vocab = CharTokenizer().vocab_size
    for bad in ("tensorbord", "wandb,wandb"):
        with pytest.raises(ValueError, match=r"^config.train.trackers must be .* got") as e:
            ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.trackers": bad}), vocab)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="config.train.wandb_mode must be one of"):
        ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.wandb_mode": "on"}), vocab)

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'dvp_jax\[wandb\]'") as e:
        check_installed(("tensorboard", "wandb"))
    assert "\n" not in str(e.value)
    from dvp_jax.train.trainer import Trainer

    cfg = tiny_config_dict(**{"train.trackers": "tensorboard,wandb"})
    with pytest.raises(ConfigError, match="not installed"):
        Trainer(ExperimentConfig.from_config_dict(cfg, vocab), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing was written


def test_the_trainer_logs_each_evaluation_s_samples_to_samples_jsonl_and_tensorboard(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dvp_jax.data.rewards import exact_match_reward

    rows = [json.loads(line) for line in open(tiny_run.workdir / "samples.jsonl")]
    groups = [(r["step"], r["name"]) for r in rows]
    assert list(dict.fromkeys(groups)) == [(0, "eval"), (2, "eval"), (4, "eval"), (6, FINAL_EVAL)]
    for r in rows:
        assert set(r) >= {"set", "prompt", "response", "answer", "reward", "finished"}
        reward = exact_match_reward(r["response"], r["answer"]) if r["finished"] else 0.0
        assert r["reward"] == reward
    events = EventAccumulator(str(tiny_run.workdir), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("samples/eval/text_summary")] == [0, 2, 4]
    [final] = events.Tensors(f"samples/{FINAL_EVAL}/text_summary")
    table = final.tensor_proto.string_val[0].decode().splitlines()
    assert len(table) == 2 + groups.count((6, FINAL_EVAL))  # header, rule, one line a sample


def test_a_training_run_sends_its_config_scalars_samples_and_summary_to_wandb(
    tmp_path, offline_wandb
):
    from dvp_jax.metrics import read_metrics
    from tests.shared_runs import run_trainer

    workdir = tmp_path / "run"
    result = run_trainer(workdir, **{"train.steps": 1, "train.trackers": "tensorboard,wandb"})
    [(run_id, records)] = wandb_records(offline_wandb)
    assert json.loads((workdir / "wandb_run.json").read_text()) == {"id": run_id}
    assert run_config(records) == json.loads((workdir / "config.json").read_text())
    rows = read_metrics(workdir)
    for name in ("sft_loss", "loss", "eval_accuracy"):
        expected = [(r["step"], pytest.approx(r[name])) for r in rows if name in r]
        assert history(records, name) == expected and expected
    got = summary(records)
    assert got["eval_accuracy"] == result["eval_accuracy"] and got["method"] == "dvp"
    assert [s for s, _ in history(records, "samples/eval/_type")] == [0]
    assert [s for s, _ in history(records, f"samples/{FINAL_EVAL}/_type")] == [1]


def test_a_resume_rewrites_samples_jsonl_as_the_uninterrupted_run_wrote_it(tiny_run, tmp_path):
    """A copy of the finished tiny run, its last checkpoint (6) gone and a torn sample line
    appended (a kill after step 6 was logged): the rerun resumes from step 4, redoes steps 5-6
    and the final evaluation, and samples.jsonl is the uninterrupted run's again."""
    import shutil

    from tests.shared_runs import TINY_RUN, run_trainer

    workdir = tiny_run.copy_to(tmp_path / "run")
    shutil.rmtree(workdir / "checkpoints" / "6")
    with open(workdir / "samples.jsonl", "a") as fh:
        fh.write('{"step": 6, "name": "final_eval", "set": "heldo')
    run_trainer(workdir, **TINY_RUN)
    assert (workdir / "samples.jsonl").read_text() == (
        tiny_run.workdir / "samples.jsonl"
    ).read_text()


def test_wandb_without_a_login_stops_in_one_line_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"No API key.*wandb login.*wandb_mode=offline") as e:
        Trackers(tmp_path, ("tensorboard", "wandb"), wandb=WandbOptions(mode="online"))
    assert "\n" not in str(e.value)


def test_a_resumed_run_may_change_its_trackers_but_not_its_results():
    """The trackers say where numbers go, not what they are: a rerun may turn W&B on."""
    from dvp_jax.train import resume

    vocab = CharTokenizer().vocab_size
    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(), vocab)
    saved = resume.flat_fields(cfg)
    now = ExperimentConfig.from_config_dict(
        tiny_config_dict(**{
            "train.trackers": "tensorboard,wandb",
            "train.wandb_mode": "offline",
            "train.wandb_name": "again",
        }),
        vocab,
    )  # fmt: skip
    assert saved["train.trackers"] != resume.flat_fields(now)["train.trackers"]
    assert resume.resume_mismatch(saved, now) == []
    seeded = ExperimentConfig.from_config_dict(tiny_config_dict(**{"train.seed": 7}), vocab)
    assert [m.split(":")[0] for m in resume.resume_mismatch(saved, seeded)] == ["train.seed"]
