"""The light install: no TensorFlow (nor the real seqio) is imported by the trainer, the engine,
the server or the benchmarks, JetStream only by its adapter and the server, and the run's
TensorBoard event files are read by TensorBoard."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dvp_jax.metrics import EventFiles
from tests import child_env
from tests.train_utils import REPO

HEAVY = ("tensorflow", "tensorflow_text", "tensorflow_datasets", "seqio", "clu", "torch")


# Modules that define absl flags of the same names go to separate interpreters.
_IMPORTS = [
    "dvp_jax.main, dvp_jax.train.trainer, train_step, pruned_logprobs",
    "dvp_jax.serve.server, dvp_jax.rollout.engine, jetstream.core.orchestrator",
    "rollout_throughput",
]


_IMPORT_CHECK = """
import json, sys
sys.path.insert(0, "benchmarks")
import {modules}
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
seqio = sys.modules.get("seqio")
print(json.dumps({{"heavy": heavy, "seqio": seqio.__doc__ if seqio else None}}))
"""


# The only modules that import JetStream and its compatibility shim (serve/jetstream_compat.py).
JETSTREAM_USERS = (
    "dvp_jax.serve.jetstream",
    "dvp_jax.serve.server",
    "dvp_jax.serve.jetstream_compat",
)
# Named in the promise that they load no JetStream (docs/install.md, docs/design.md section 6).
JETSTREAM_FREE = (
    "dvp_jax.main",
    "dvp_jax.train.trainer",
    "dvp_jax.dvp.losses",
    "dvp_jax.model",
    "dvp_jax.aot",
    "dvp_jax.evaluate",
    "dvp_jax.rollout.engine",
    "dvp_jax.tokenizers",
)

# Every other dvp_jax module (each .py file: dvp_jax/train is a namespace package, which
# pkgutil does not walk), imported in one interpreter after a baseline of `import jax`.
_JETSTREAM_FREE_CHECK = """
import importlib, json, pathlib, sys
import jax
baseline, had_tree_map = set(sys.modules), hasattr(jax, "tree_map")
files = sorted(pathlib.Path("dvp_jax").rglob("*.py"))
names = [".".join(f.with_suffix("").parts).removesuffix(".__init__") for f in files]
names = [n for n in names if n not in {users!r} and not n.endswith(".__main__")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in set(sys.modules) - baseline if m.split(".")[0] in ("jetstream", "seqio"))
print(json.dumps({{"imported": names, "loaded": loaded, "had_tree_map": had_tree_map,
                  "tree_map": hasattr(jax, "tree_map")}}))
"""


def _libtpu_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS"))}
    env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
    return env


@pytest.fixture(scope="module")
def fresh_interpreters():
    """The fresh interpreters of this file, started at once: modules -> (returncode, stdout,
    stderr); "libtpu" -> the same for `import dvp_jax, jax` without JAX_PLATFORMS;
    "jetstream_free" -> the same for every dvp_jax module but `JETSTREAM_USERS`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    codes = {m: (_IMPORT_CHECK.format(modules=m, heavy=HEAVY), env) for m in _IMPORTS}
    codes["libtpu"] = ("import dvp_jax, jax; print(jax.default_backend())", _libtpu_env())
    codes["jetstream_free"] = (_JETSTREAM_FREE_CHECK.format(users=JETSTREAM_USERS), child_env())
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (code, env) in codes.items()
    }
    return {name: (p, *p.communicate(timeout=300)) for name, p in procs.items()}


@pytest.mark.parametrize("modules", _IMPORTS)
def test_no_tensorflow_is_imported_by_the_trainer_engine_server_or_benchmarks(
    modules, fresh_interpreters
):
    proc, stdout, stderr = fresh_interpreters[modules]
    assert proc.returncode == 0, stderr[-3000:]
    found = json.loads(stdout.strip().splitlines()[-1])
    # seqio may be in sys.modules (the server's set), but only as dvp_jax's stand-in.
    assert set(found["heavy"]) <= {"seqio"} and "torch" not in found["heavy"], found
    if found["seqio"] is not None:
        assert "stand-in" in found["seqio"]


def test_only_the_jetstream_adapter_and_the_server_load_jetstream_or_patch_jax(
    fresh_interpreters,
):
    """Every dvp_jax module but `JETSTREAM_USERS` (the trainer, the loss, the model, `aot`, the
    engine...) imports without loading a `jetstream` or `seqio` module and leaves `jax` as a
    plain `import jax` leaves it (no `jax.tree_map` of the shim's)."""
    proc, stdout, stderr = fresh_interpreters["jetstream_free"]
    assert proc.returncode == 0, stderr[-3000:]
    found = json.loads(stdout.strip().splitlines()[-1])
    assert set(JETSTREAM_FREE) <= set(found["imported"]), found["imported"]
    assert found["loaded"] == [], found["loaded"]
    assert found["tree_map"] == found["had_tree_map"]


def test_the_stand_in_refuses_sentencepiece_with_a_reason():
    from seqio.vocabularies import SentencePieceVocabulary

    with pytest.raises(NotImplementedError, match="not available in dvp_jax"):
        SentencePieceVocabulary("spm.model")


def test_event_files_are_read_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = EventFiles(tmp_path)
    for step in range(3):
        writer.write_scalars(step, {"loss": 1.0 / (step + 1), "reward_mean": 0.25 * step})
    writer.close()
    EventFiles(tmp_path / "other", write=False).write_scalars(0, {"loss": 1.0})  # not lead
    assert not (tmp_path / "other").exists()
    time.sleep(1.1)  # a second file name (it carries the second)
    # A resume from step 1: step 2 is redone with another value; the old point is dropped.
    writer = EventFiles(tmp_path, kept_through=1)
    writer.write_scalars(2, {"loss": 0.125, "reward_mean": 0.75})
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward_mean"]
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(0, 1.0), (1, 0.5), (2, 0.125)]


def test_the_installed_jax_and_libtpu_are_the_pinned_pair():
    """`make install` pins jax (JAX_VERSION) and the libtpu jax[tpu] of that version pins
    (LIBTPU_VERSION): the TPU compiler `dvp_jax.aot` uses must be the one that jaxlib
    expects."""
    import importlib.metadata
    import re

    makefile = (Path(REPO) / "Makefile").read_text()
    pins = dict(re.findall(r"^(JAX_VERSION|LIBTPU_VERSION) := (\S+)$", makefile, re.MULTILINE))
    assert importlib.metadata.version("jax") == pins["JAX_VERSION"]
    assert importlib.metadata.version("libtpu") == pins["LIBTPU_VERSION"]


def test_a_cpu_process_prints_no_libtpu_start_up_errors(fresh_interpreters):
    """With libtpu installed and no TPU, jax's backend search starts libtpu; importing dvp_jax
    first tells it there is no TPU to look for, so nothing is printed (without that, libtpu
    asks the metadata server and logs errors about TPU_WORKER_HOSTNAMES)."""
    proc, stdout, stderr = fresh_interpreters["libtpu"]
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.strip() == "cpu"
    assert stderr.strip() == "", stderr[-2000:]
