"""Workdir paths through etils.epath: gs:// stays remote, a path with spaces keeps
everything inside the workdir, and an unwritable workdir fails by name before any work."""

import os

import pytest

from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.trainer import Trainer
from dvp_jax.workdir import as_path, is_remote, write_atomic
from tests.train_utils import tiny_config_dict

VOCAB = CharTokenizer().vocab_size


def test_remote_paths_are_not_made_local():
    assert os.fspath(as_path("gs://bucket/run")) == "gs://bucket/run"
    assert is_remote(as_path("gs://bucket/run")) and not is_remote(as_path("run"))
    # What os.path.abspath did to a gs:// workdir: a local directory named "gs:".
    assert os.fspath(as_path("run")) == os.path.join(os.getcwd(), "run")


def test_a_run_in_a_path_with_spaces_writes_only_inside_its_workdir(tiny_run):
    # The shared run trains in ".../my runs/run 1", started from the empty directory "cwd".
    assert tiny_run.workdir.name == "run 1" and tiny_run.workdir.parent.name == "my runs"
    assert tiny_run.summary["steps"] == 6
    assert os.listdir(tiny_run.root / "cwd") == []
    assert sorted(os.listdir(tiny_run.root)) == ["cwd", "my runs"]
    names = set(os.listdir(tiny_run.workdir))
    assert {"metrics.jsonl", "summary.json", "config.json", "checkpoints"} <= names
    assert not [n for n in names if n.startswith(".tmp.") or n.startswith(".write_probe")]


def test_an_unwritable_workdir_fails_by_name_before_any_work(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    cfg = ExperimentConfig.from_config_dict(tiny_config_dict(), VOCAB)
    with pytest.raises(OSError, match=r"workdir .*a file/run is not writable"):
        Trainer(cfg, str(blocker / "run"))


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["summary.json"]
