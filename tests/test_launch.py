"""Experiment infrastructure: sweep expansion, the local and TPU launchers, the scale plan, and
the paper / GPU configs. Fast (no trainer runs: a stand-in process plays the trainer)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from unittest import mock

import pytest

from dvp_jax.pyfile import load_file
from dvp_jax.rollout.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig
from experiments import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_VOCAB = 151_936
E000 = os.path.join(REPO, "experiments", "e000_smoke.py")


@pytest.fixture
def tricky_experiment(tmp_path):
    """An experiment whose overrides need shell quoting."""
    path = tmp_path / "e999_quoting.py"
    path.write_text(
        textwrap.dedent("""
        CONFIG = "configs/tiny_cpu.py"
        CONFIG_ARG = "mis_dvp"
        def get_sweep(plots=False):
            return [
                {"data.path": "/data/it's a file.jsonl", "loss.log_rho": -13.0, "plots": plots},
                {"data.path": "/data/$HOME;rm -rf x", "loss.log_rho": float("-inf"),
                 "plots": plots},
            ]
    """)
    )
    return str(path)


# ------------------------------------------------------------------------------------------------
# Sweeps.
# ------------------------------------------------------------------------------------------------
def test_expand_sweep_names_units_by_varying_overrides():
    units = launch.expand_sweep(
        [
            {"method": "rloo", "train.seed": 0, "train.steps": 2},
            {"method": "dvp", "train.seed": 1, "train.steps": 2},
            {"_name": "custom", "method": "dvp", "train.seed": 2, "train.steps": 2},
        ]
    )
    assert [u.name for u in units] == ["00_method=rloo,seed=0", "01_method=dvp,seed=1", "02_custom"]
    assert units[2].overrides == (("method", "dvp"), ("train.seed", 2), ("train.steps", 2))
    # Clashing last components keep the full key.
    units = launch.expand_sweep(
        [{"train.seed": 0, "data.seed": 0}, {"train.seed": 1, "data.seed": 1}]
    )
    assert units[1].name == "01_train.seed=1,data.seed=1"
    assert launch.expand_sweep([{}])[0].name == "00_base"


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "non-empty"),
        ([["method", "dvp"]], "not a dict"),
        ([{"train seed": 1}], "bad override key"),
        ([{"_name": "a"}, {"_name": "a"}], None),  # indices keep names unique
    ],
)
def test_expand_sweep_rejects_bad_sweeps(bad, match):
    if match is None:
        assert len({u.name for u in launch.expand_sweep(bad)}) == 2
        return
    with pytest.raises(ValueError, match=match):
        launch.expand_sweep(bad)


def test_format_value_round_trips_through_config_flags_syntax():
    assert launch.format_value(True) == "true"
    assert launch.format_value(-13.0) == "-13.0"
    assert launch.format_value(-math.inf) == "-inf"
    assert launch.format_value(1e-6) == "1e-06"
    assert launch.format_value([1, 2]) == "(1, 2)"
    with pytest.raises(ValueError):
        launch.format_value(None)


def test_parse_assignments_reads_python_literals_else_strings():
    got = launch.parse_assignments(["seeds=3", "noise=0.5", "smoke=True", "init_hf=/a b/c"])
    assert got == {"seeds": 3, "noise": 0.5, "smoke": True, "init_hf": "/a b/c"}
    assert launch.parse_assignments(["methods=('rloo', 'dvp')"]) == {"methods": ("rloo", "dvp")}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        launch.parse_assignments(["seeds"])


def test_sweep_arguments_reach_get_sweep_and_unknown_ones_fail(tricky_experiment, capsys):
    exp = launch.load_experiment(tricky_experiment, {"plots": True})
    assert exp.sweep_call == "get_sweep(plots=True)"
    assert all(dict(u.overrides)["plots"] is True for u in exp.units)
    with pytest.raises(ValueError, match="unexpected keyword argument 'seeds'"):
        launch.load_experiment(tricky_experiment, {"seeds": 3})
    # From the command line: the dry run shows the call and its overrides.
    assert launch.main([tricky_experiment, "--dry_run", "--sweep", "plots=True"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# e999_quoting.get_sweep(plots=True): 2 work units")
    assert out.count("--config.plots=true") == 2
    with pytest.raises(SystemExit, match="get_sweep"):
        launch.main([tricky_experiment, "--dry_run", "--sweep", "seeds=3"])
    with pytest.raises(SystemExit, match="no such work units"):
        launch.main([tricky_experiment, "--dry_run", "--only", "7"])


def test_e000_smoke_has_two_tiny_units():
    exp = launch.load_experiment(E000)
    assert exp.config_flag == "configs/tiny_cpu.py:dvp"
    assert [dict(u.overrides)["method"] for u in exp.units] == ["rloo", "dvp"]
    for u in exp.units:
        ov = dict(u.overrides)
        assert ov["train.steps"] == 2 and ov["sft.steps"] == 2 and ov["eval.num_prompts"] == 8


# ------------------------------------------------------------------------------------------------
# Local mode.
# ------------------------------------------------------------------------------------------------
def test_local_dry_run_prints_one_command_per_unit(tmp_path, capsys):
    assert launch.main([E000, "--dry_run", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    commands = [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    for argv, method in zip(commands, ("rloo", "dvp"), strict=True):
        assert argv[1:5] == ["-m", "dvp_jax.main", "--config", "configs/tiny_cpu.py:dvp"]
        workdir = argv[argv.index("--workdir") + 1]
        assert workdir.startswith(str(tmp_path / "e000_smoke"))
        assert f"--config.method={method}" in argv and "--config.train.steps=2" in argv
    assert not os.listdir(tmp_path)  # a dry run creates nothing


def test_local_run_collects_summaries_and_fails_on_a_failed_unit(tmp_path, monkeypatch, capsys):
    """The real runner, with a stand-in trainer: unit `rloo` succeeds, unit `dvp` crashes."""

    def fake_argv(config_flag, overrides, workdir, python, extra_flags=()):
        method = dict(overrides)["method"]
        code = (
            "import json, os, sys\n"
            f"if {method!r} == 'dvp': sys.exit(3)\n"
            f"json.dump({{'eval_accuracy': 0.5, 'final_ppl_gap': 0.01, 'wall_time_s': 1.0}}, "
            f"open(os.path.join({workdir!r}, 'summary.json'), 'w'))\n"
        )
        return [python, "-c", code]

    monkeypatch.setattr(launch, "unit_argv", fake_argv)
    rc = launch.main([E000, "--root", str(tmp_path), "--parallel", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    table = out[out.index("unit ") :].splitlines()
    assert table[1].split()[:4] == ["00_method=rloo", "ok", "-", "0.5"]  # ppl_gap <- final_ppl_gap
    assert table[1].split()[4] == "0.01"
    assert table[2].split()[:2] == ["01_method=dvp", "fail(3)"]
    results = json.loads((tmp_path / "e000_smoke" / "results.json").read_text())
    assert [r["returncode"] for r in results] == [0, 3]
    assert (tmp_path / "e000_smoke" / "01_method=dvp" / "launch.log").exists()
    # --only reruns a subset.
    assert launch.main([E000, "--root", str(tmp_path), "--only", "0"]) == 0


# ------------------------------------------------------------------------------------------------
# Cloud TPU VM slices (experiments/tpu.py, through `launch.py ACTION ...`).
# ------------------------------------------------------------------------------------------------
SLICE = ["--tpu", "dvp-v5p", "--zone", "us-east5-a", "--project", "my-proj"]
GCLOUD = ["gcloud", "compute", "tpus"]
WHERE = ["--zone", "us-east5-a", "--project", "my-proj"]
UV = '"$HOME"/.local/bin/uv'
VENV_PY = '"$HOME"/dvp_jax_venv/bin/python'
STAGE_QWEN = (
    "if test -e /data/Qwen3-14B-Base; then echo /data/Qwen3-14B-Base exists, kept; "
    'else (test -d /data || (sudo mkdir -p /data && sudo chown "$(id -u):$(id -g)" /data)) && '
    "mkdir -p /data && rm -rf /data/Qwen3-14B-Base.partial && mkdir /data/Qwen3-14B-Base.partial"
    " && gcloud storage cp -r gs://my-bucket/Qwen3-14B-Base /data/Qwen3-14B-Base.partial/ && "
    "mv /data/Qwen3-14B-Base.partial/Qwen3-14B-Base /data/Qwen3-14B-Base && "
    "rmdir /data/Qwen3-14B-Base.partial; fi"
)
# Plays `gcloud storage cp [-r] SRC DST` with gs://BUCKET/PATH kept under $FAKE_GCS/BUCKET/PATH,
# and records every call; exits 1 without copying when $GCLOUD_FAIL is set.
FAKE_GCLOUD = """
import json, os, shutil, sys
args = sys.argv[1:]
with open(os.environ["GCLOUD_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.environ.get("GCLOUD_FAIL"):
    sys.exit(1)
assert args[:2] == ["storage", "cp"], args
local = lambda p: os.path.join(os.environ["FAKE_GCS"], p[5:]) if p.startswith("gs://") else p
src, dst = local(args[-2]), local(args[-1])
dst = os.path.join(dst, os.path.basename(src)) if dst.endswith("/") else dst
os.makedirs(os.path.dirname(dst), exist_ok=True)
(shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
"""
# Plays uv: records its arguments; `uv venv ... DIR` makes DIR/bin/python, which exits 0 (the
# version check passes).
FAKE_UV = """
import json, os, sys
with open(os.environ["UV_CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "venv":
    os.makedirs(sys.argv[-1] + "/bin")
    with open(sys.argv[-1] + "/bin/python", "w") as f:
        f.write("#!/bin/sh\\nexit 0\\n")
    os.chmod(sys.argv[-1] + "/bin/python", 0o755)
"""
# Plays the trainer: prints its arguments (JSON) and a line on stderr, exits with $TRAIN_RC.
FAKE_TRAINER = """
import json, os, sys
print(json.dumps(sys.argv[1:]))
print("a line on stderr", file=sys.stderr)
sys.exit(int(os.environ["TRAIN_RC"]))
"""


@pytest.fixture
def tpu_experiment(tmp_path):
    """Two units of the paper config: `00_steps=2` and `01_steps=3`."""
    path = tmp_path / "e998_tpu.py"
    path.write_text(
        'CONFIG = "configs/paper_qwen3_14b.py"\nCONFIG_ARG = "mis_dvp"\n'
        'def get_sweep():\n    return [{"train.steps": 2}, {"train.steps": 3}]\n'
    )
    return str(path)


def _printed(argv: list[str], capsys) -> list[str]:
    """`launch.main(argv)`'s printed commands (each after a `# [i/n] description` line); any
    attempt to execute one fails the test (gcloud may be installed where the tests run)."""
    with mock.patch.object(subprocess, "run", side_effect=AssertionError("executed")):
        assert launch.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(re.fullmatch(r"# \[\d+/\d+\] .+", h) for h in lines[0::2]), lines
    return lines[1::2]


def _ssh(script: str, name: str = "dvp-v5p") -> list[str]:
    return GCLOUD + ["tpu-vm", "ssh", name, "--worker=all", f"--command={script}"] + WHERE


def _remote(argv: list[str]) -> str:
    [cmd] = [a for a in argv if a.startswith("--command=")]
    return cmd[len("--command=") :]


def _executable(path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)


def _fake_worker(tmp_path) -> dict[str, str]:
    """The environment of a pretend worker: $HOME, a fake gcloud and a fake bucket under tmp."""
    _executable(tmp_path / "bin" / "gcloud", FAKE_GCLOUD)
    return dict(
        os.environ,
        HOME=str(tmp_path / "home"),
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        FAKE_GCS=str(tmp_path / "gcs"),
        GCLOUD_CALLS=str(tmp_path / "gcloud_calls.jsonl"),
    )


def _sh(shell: str, script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shell, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            [],
            GCLOUD + ["tpu-vm", "create", "dvp-v5p", "--accelerator-type", "v5p-64"]
            + ["--version", "v2-alpha-tpuv5"] + WHERE,
        ),
        (
            ["--spot"],
            GCLOUD + ["tpu-vm", "create", "dvp-v5p", "--accelerator-type", "v5p-64"]
            + ["--version", "v2-alpha-tpuv5", "--spot"] + WHERE,
        ),
        (
            ["--queued", "--spot"],
            GCLOUD + ["queued-resources", "create", "dvp-v5p", "--node-id", "dvp-v5p"]
            + ["--accelerator-type", "v5p-64", "--runtime-version", "v2-alpha-tpuv5", "--spot"]
            + WHERE,
        ),
        (  # --best-effort exists only in gcloud's alpha track
            ["--queued", "--best_effort", "--version", "v2-alpha-tpuv5-custom"],
            ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create", "dvp-v5p"]
            + ["--node-id", "dvp-v5p", "--accelerator-type", "v5p-64"]
            + ["--runtime-version", "v2-alpha-tpuv5-custom", "--best-effort"] + WHERE,
        ),
    ],
)  # fmt: skip
def test_tpu_create_prints_the_v5p_64_slice(flags, expected, capsys):
    [cmd] = _printed(["create", *SLICE, "--accelerator", "v5p-64", *flags], capsys)
    assert shlex.split(cmd) == expected


@pytest.mark.parametrize(
    "action, queued, expected",
    [
        ("status", False, GCLOUD + ["tpu-vm", "describe", "dvp-v5p"] + WHERE),
        ("status", True, GCLOUD + ["queued-resources", "describe", "dvp-v5p"] + WHERE),
        ("delete", False, GCLOUD + ["tpu-vm", "delete", "dvp-v5p"] + WHERE),
        ("delete", True, GCLOUD + ["queued-resources", "delete", "dvp-v5p", "--force"] + WHERE),
    ],
)
def test_tpu_status_and_delete(action, queued, expected, capsys):
    [cmd] = _printed([action, *SLICE] + (["--queued"] if queued else []), capsys)
    assert shlex.split(cmd) == expected


def test_tpu_setup_installs_python_the_project_and_stages_data_on_every_worker(capsys):
    cmds = _printed(
        ["setup", *SLICE, "--stage", "gs://my-bucket/Qwen3-14B-Base/=/data/Qwen3-14B-Base"]
        + ["--stage", "gs://my-bucket/dapo.parquet=/data/dapo.parquet"],
        capsys,
    )
    pack, *remote = cmds
    assert pack == (
        "git ls-files -z --cached --others --exclude-standard > /tmp/dvp_jax_src.tgz.files && "
        "tar -czf /tmp/dvp_jax_src.tgz --null -T /tmp/dvp_jax_src.tgz.files"
    )
    scp, unpack, python, install, stage_qwen, stage_dapo = map(shlex.split, remote)
    assert (
        scp
        == GCLOUD
        + ["tpu-vm", "scp", "/tmp/dvp_jax_src.tgz", "dvp-v5p:dvp_jax_src.tgz"]
        + ["--worker=all"]
        + WHERE
    )
    assert unpack == _ssh(
        'mkdir -p "$HOME"/dvp_jax && tar -xzf "$HOME"/dvp_jax_src.tgz -C "$HOME"/dvp_jax'
    )
    # pyproject.toml: requires-python >= 3.11; uv installs it without root and makes the venv.
    assert python == _ssh(
        f"(test -x {UV} || curl -LsSf https://astral.sh/uv/0.6.12/install.sh | "
        f'env UV_UNMANAGED_INSTALL="$HOME"/.local/bin sh) && {UV} python install 3.11 && '
        f'({VENV_PY} -c "import sys; sys.exit(sys.version_info[:2] != (3, 11))" 2> /dev/null || '
        f'(rm -rf "$HOME"/dvp_jax_venv && {UV} venv --python 3.11 "$HOME"/dvp_jax_venv))'
    )
    assert install == _ssh(
        f'cd "$HOME"/dvp_jax && {UV} pip install --python {VENV_PY} ./packaging/seqio_standin && '
        f'{UV} pip install --python {VENV_PY} -e . "jax[tpu]" && '
        f'{VENV_PY} -c "import jax, dvp_jax; print(jax.__version__)"'
    )
    assert stage_qwen == _ssh(STAGE_QWEN)  # the trailing '/' of the source is dropped
    for argv in (unpack, python, install, stage_qwen, stage_dapo):  # POSIX sh syntax
        assert subprocess.run(["sh", "-n", "-c", _remote(argv)], check=False).returncode == 0
    assert "gcloud storage cp -r gs://my-bucket/dapo.parquet /data/dapo.parquet.partial/" in (
        _remote(stage_dapo)
    )


def test_tpu_run_starts_every_unit_on_every_worker_with_logs_in_the_workdir(tpu_experiment, capsys):
    cmds = _printed(["run", tpu_experiment, *SLICE, "--root", "gs://my-bucket/runs"], capsys)
    expected = []
    for unit, steps in (("00_steps=2", 2), ("01_steps=3", 3)):
        workdir = f"gs://my-bucket/runs/e998_tpu/{unit}"
        expected.append(
            _ssh(
                f'cd "$HOME"/dvp_jax && mkdir -p logs/e998_tpu && '
                f'log=logs/e998_tpu/{unit}."$(uname -n)".log && {{ {VENV_PY} -m dvp_jax.main '
                f"--config configs/paper_qwen3_14b.py:mis_dvp --workdir {workdir} --distributed "
                f'--config.train.steps={steps} ; echo $? > "$log.rc"; }} 2>&1 | tee "$log"; '
                f'rc=$(cat "$log.rc" 2> /dev/null || echo 1); '
                f'gcloud storage cp "$log" {workdir}/logs/"$(uname -n)".log; crc=$?; '
                "exit $((rc ? rc : crc))"
            )
        )
    assert [shlex.split(c) for c in cmds] == expected


@pytest.mark.parametrize("shell", ["sh", "bash"])  # sh is dash here; TPU VM login shells: bash
@pytest.mark.parametrize(
    "train_rc, copy_fails, expected_rc", [(0, False, 0), (3, False, 3), (0, True, 1)]
)
def test_tpu_unit_command_runs_the_exact_trainer_argv_and_keeps_its_log(
    tricky_experiment, tmp_path, capsys, shell, train_rc, copy_fails, expected_rc
):
    """The remote command of a unit, run by a real shell on a pretend worker (paths with spaces,
    overrides with quotes, `$` and `;`): the trainer gets exactly `unit_argv`, its output lands
    in the log, the log in WORKDIR/logs/HOSTNAME.log, and the exit status is the trainer's (or the
    copy's if only the copy failed)."""
    root = "gs://my-bucket/my runs"
    cmds = _printed(
        ["run", tricky_experiment, *SLICE, "--root", root, "--remote_dir", "dvp jax"]
        + ["--venv", "dvp venv"],
        capsys,
    )
    unit = launch.load_experiment(tricky_experiment).units[0]
    env = _fake_worker(tmp_path)
    _executable(tmp_path / "home" / "dvp venv" / "bin" / "python", FAKE_TRAINER)
    (tmp_path / "home" / "dvp jax").mkdir()
    env.update(TRAIN_RC=str(train_rc), **({"GCLOUD_FAIL": "1"} if copy_fails else {}))

    out = _sh(shell, _remote(shlex.split(cmds[0])), env)
    assert out.returncode == expected_rc, out.stderr
    workdir = f"{root}/e999_quoting/{unit.name}"
    argv = launch.unit_argv(
        "configs/tiny_cpu.py:mis_dvp", unit.overrides, workdir, "python", ("--distributed",)
    )
    assert json.loads(out.stdout.splitlines()[0]) == argv[1:]  # tee shows the output as well
    host = os.uname().nodename  # `uname -n` (POSIX); the worker's hostname on a TPU VM
    log = f"logs/e999_quoting/{unit.name}.{host}.log"
    text = (tmp_path / "home" / "dvp jax" / log).read_text()
    assert text.splitlines()[0] == out.stdout.splitlines()[0] and "a line on stderr" in text
    [call] = [json.loads(line) for line in open(env["GCLOUD_CALLS"])]
    assert call == ["storage", "cp", log, f"{workdir}/logs/{host}.log"]
    copied = tmp_path / "gcs" / "my-bucket" / "my runs" / "e999_quoting" / unit.name / "logs"
    assert (copied / f"{host}.log").exists() != copy_fails


def test_tpu_python_step_installs_uv_once_and_keeps_a_venv_of_the_right_version(tmp_path, capsys):
    """The Python step run by a real shell with fake curl and uv: the pinned installer runs only
    while ~/.local/bin/uv is missing; the venv is created, kept, and remade when its Python is
    another version (its `python -c "...sys.exit(version != 3.11)"` fails)."""
    script = _remote(shlex.split(_printed(["setup", *SLICE], capsys)[3]))
    env = _fake_worker(tmp_path)
    env.update(UV_CALLS=str(tmp_path / "uv_calls.jsonl"), CURL_CALLS=str(tmp_path / "curl"))
    _executable(tmp_path / "fake_uv", FAKE_UV)
    (tmp_path / "bin" / "curl").write_text(  # prints an "installer" that copies the fake uv
        f'#!/bin/sh\necho "$@" >> "$CURL_CALLS"\necho \'mkdir -p "$UV_UNMANAGED_INSTALL" && '
        f'cp {tmp_path}/fake_uv "$UV_UNMANAGED_INSTALL"/uv\'\n'
    )
    (tmp_path / "bin" / "curl").chmod(0o755)
    venv = str(tmp_path / "home" / "dvp_jax_venv")

    def run_step() -> list[list[str]]:
        assert _sh("sh", script, env).returncode == 0
        calls = [json.loads(line) for line in open(env["UV_CALLS"])]
        os.remove(env["UV_CALLS"])
        return calls

    assert run_step() == [["python", "install", "3.11"], ["venv", "--python", "3.11", venv]]
    assert open(env["CURL_CALLS"]).read() == "-LsSf https://astral.sh/uv/0.6.12/install.sh\n"
    assert run_step() == [["python", "install", "3.11"]]  # uv and the venv are kept
    (tmp_path / "home" / "dvp_jax_venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    assert run_step() == [["python", "install", "3.11"], ["venv", "--python", "3.11", venv]]
    assert len(open(env["CURL_CALLS"]).readlines()) == 1


def test_tpu_stage_copies_an_object_and_a_folder_once(tmp_path, capsys):
    """`--stage` scripts run by a real shell: a folder and an object (paths with spaces) land at
    their local paths; a rerun keeps them; a failed copy leaves no local path behind."""
    local = tmp_path / "local data"
    for rel in ("models/Qwen 3/config.json", "models/Qwen 3/model.safetensors", "d/x.parquet"):
        (tmp_path / "gcs" / "my-bucket" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "gcs" / "my-bucket" / rel).write_text(rel)
    stages = {
        "gs://my-bucket/models/Qwen 3": local / "Qwen3-14B-Base",
        "gs://my-bucket/d/x.parquet": local / "dapo.parquet",
        "gs://my-bucket/d/missing": local / "missing",
    }
    argv = ["setup", *SLICE, "--skip_install"]
    for src, dest in stages.items():
        argv += ["--stage", f"{src}={dest}"]
    qwen, dapo, missing = [_remote(shlex.split(c)) for c in _printed(argv, capsys)[-3:]]
    env = _fake_worker(tmp_path)
    for script in (qwen, dapo):
        assert _sh("sh", script, env).returncode == 0
    assert (local / "Qwen3-14B-Base" / "config.json").read_text() == "models/Qwen 3/config.json"
    assert sorted(os.listdir(local / "Qwen3-14B-Base")) == ["config.json", "model.safetensors"]
    assert (local / "dapo.parquet").read_text() == "d/x.parquet"
    (tmp_path / "gcs" / "my-bucket" / "d" / "x.parquet").write_text("changed")
    rerun = _sh("sh", dapo, env)
    assert rerun.returncode == 0 and "dapo.parquet exists, kept" in rerun.stdout
    assert (local / "dapo.parquet").read_text() == "d/x.parquet"
    assert sorted(os.listdir(local)) == ["Qwen3-14B-Base", "dapo.parquet"]  # no *.partial
    failed = _sh("sh", missing, env)  # the fake gcloud's copy raises: no such object
    assert failed.returncode != 0 and not (local / "missing").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["status", "--zone", "us-east5-a"], "--tpu NAME is required"),
        (["delete", "--tpu", "dvp-v5p"], "--zone is required"),
        (["status", "--tpu", "dvp-v5p", "--zone", "us-east5"], "--zone 'us-east5': want a zone"),
        (["delete", "--tpu", "DVP_v5p", "--zone", "us-east5-a"], "--tpu 'DVP_v5p': want 1-63"),
        (["status", *SLICE[:4], "--project", "p"], "--project 'p': want a project ID"),
        (["create", *SLICE], "create needs --accelerator"),
        (["create", *SLICE, "--accelerator", "v5p64"], "--accelerator 'v5p64': want"),
        (["create", *SLICE, "--accelerator", "v9z-8"], "no default runtime version for v9z-8"),
        (["create", *SLICE, "--accelerator", "v5p-64", "--best_effort"], "needs --queued"),
        (["setup", *SLICE, "--stage", "/models/x=/data/x"], "--stage '/models/x=/data/x': want"),
        (["setup", *SLICE, "--stage", "gs://my-bucket/x=data/x"], "=data/x': want gs://"),
        (["setup", *SLICE, "--stage", "gs://my-bucket/x=/data"], "below a top directory"),
        (["setup", *SLICE, "--stage", "gs://my-bucket=/data/x"], "a path in the bucket"),
        (["setup", *SLICE, "--stage", "gs://Bad_Bucket/x=/data/x"], "'gs://Bad_Bucket/x': want"),
        (["setup", *SLICE, "--python_version", "3.10"], "'3.10': want 3.N with N >= 11"),
        (["setup", *SLICE, "--remote_dir", "../x"], "--remote_dir '../x': want"),
        (["run", E000, *SLICE, "--root", "s3://b/r"], "--root 's3://b/r': want gs://"),
    ],
)
def test_tpu_bad_input_is_named(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        launch.main(argv)


def test_tpu_nothing_is_executed_without_run(tpu_experiment, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"executed without --run: {args}")

    for module, name in [(subprocess, "run"), (subprocess, "Popen"), (os, "system")]:
        monkeypatch.setattr(module, name, forbidden)
    gs = ["--root", "gs://my-bucket/runs"]
    for argv in (
        ["create", *SLICE, "--accelerator", "v5p-64", "--queued", "--spot"],
        ["setup", *SLICE, "--stage", "gs://my-bucket/Qwen3-14B-Base=/data/Qwen3-14B-Base"],
        ["run", tpu_experiment, *SLICE, *gs],
        ["run", tpu_experiment, *SLICE, *gs, "--detach"],
        ["status", *SLICE],
        ["delete", *SLICE, "--queued"],
        [tpu_experiment, *SLICE, *gs],  # the older form: setup + run
    ):
        assert launch.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count("gcloud compute tpus") == 1 + 5 + 2 + 1 + 1 + 1 + 6
    assert err.count("add --run to execute") == 7


def test_tpu_run_flag_executes_in_order_and_stops_at_the_first_failure(
    tpu_experiment, monkeypatch, capsys
):
    calls, fail_at = [], [3]

    def fake_run(cmd, shell=False, cwd=None, check=False):
        calls.append((cmd, shell, cwd))
        return subprocess.CompletedProcess(cmd, 255 if len(calls) == fail_at[0] else 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert launch.main(["setup", *SLICE, "--stage", "gs://my-bucket/m=/data/m", "--run"]) == 255
    out, err = capsys.readouterr()
    printed = out.splitlines()[1::2]
    assert [c for c, _, _ in calls] == [printed[0], *map(shlex.split, printed[1:])]
    assert len(calls) == 3 and calls[0][1:] == (True, launch.REPO)  # the local pack: a pipeline
    assert "step 3/6 failed with exit status 255: unpack" in err
    assert "steps 4-6 were not run" in err
    # A failed work unit stops the sweep and names the units to resume.
    calls.clear()
    fail_at[0] = 1
    gs = ["--root", "gs://my-bucket/runs"]
    assert launch.main(["run", tpu_experiment, *SLICE, *gs, "--run"]) == 255
    assert len(calls) == 1 and "resume with --only 0,1" in capsys.readouterr().err


def test_tpu_older_form_is_setup_then_run(tricky_experiment, capsys):
    """`launch.py EXPERIMENT --tpu NAME --zone Z` (no action): setup, then every unit."""
    root = "gs://bucket/runs"
    commands = _printed([tricky_experiment, *SLICE, "--root", root], capsys)
    pack, scp, unpack, python, install, *units = [shlex.split(c) for c in commands]
    assert pack[:2] == ["git", "ls-files"] and scp[3:5] == ["tpu-vm", "scp"]
    assert "tar -xzf" in _remote(unpack) and "python install 3.11" in _remote(python)
    assert '"jax[tpu]"' in _remote(install)
    exp = launch.load_experiment(tricky_experiment)
    assert len(units) == len(exp.units) == 2
    for argv, unit in zip(units, exp.units, strict=True):
        assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dvp-v5p"]
        assert "--worker=all" in argv and argv[-4:] == WHERE
        remote = shlex.split(_remote(argv))  # what each worker's shell sees
        main_argv = remote[remote.index("{") + 1 : remote.index(";")]
        assert main_argv[:4] == ["$HOME/dvp_jax_venv/bin/python", "-m", "dvp_jax.main", "--config"]
        assert main_argv[main_argv.index("--workdir") + 1] == f"{root}/e999_quoting/{unit.name}"
        assert "--distributed" in main_argv
        path = dict(unit.overrides)["data.path"]
        assert f"--config.data.path={path}" in main_argv  # quotes, $ and ; survive intact
    assert "--config.loss.log_rho=-inf" in shlex.split(_remote(units[1]))


def test_tpu_detach_starts_all_units_in_one_background_ssh(tricky_experiment, capsys):
    fetch, start = _printed(
        [tricky_experiment, "--tpu", "t", "--zone", "us-central2-b", "--root", "gs://bkt/r"]
        + ["--detach", "--sync", "git", "--git_remote", "https://example.com/r.git"]
        + ["--git_ref", "abc123", "--skip_install"],
        capsys,
    )
    assert "git fetch https://example.com/r.git abc123" in _remote(shlex.split(fetch))
    remote = shlex.split(_remote(shlex.split(start)))
    assert "nohup" in remote and remote[-1] == "&"
    script = remote[remote.index("-c") + 1]
    for unit in launch.load_experiment(tricky_experiment).units:
        assert f"gs://bkt/r/e999_quoting/{unit.name}" in script
        assert f"gs://bkt/r/e999_quoting/{unit.name}/logs/" in script
    assert script.count("dvp_jax.main") == 2
    assert subprocess.run(["sh", "-n", "-c", script], check=False).returncode == 0


def test_xm_launch_needs_xmanager_only_when_run():
    """xm_launch imports xmanager lazily: without it, a clear usage error (not an ImportError)."""
    # sys.modules[name] = None makes `import name` fail whether or not it is installed.
    code = (
        "import runpy, sys; sys.modules['xmanager'] = None; "
        f"sys.argv = ['xm_launch', '--experiment', {E000!r}]; "
        "runpy.run_module('experiments.xm_launch', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert "xmanager is not installed" in out.stderr + out.stdout


def test_tpu_mode_needs_a_zone(capsys):
    with pytest.raises(SystemExit):
        launch.main([E000, "--tpu", "t"])


# ------------------------------------------------------------------------------------------------
# Configs.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["rloo", "tis", "mis", "dvp", "mis_dvp"])
def test_paper_config_validates_with_the_papers_settings(method):
    module = load_file(os.path.join(REPO, "configs/paper_qwen3_14b.py"))
    cfg = ExperimentConfig.from_config_dict(module.get_config(method), HF_VOCAB)
    assert cfg.method == method
    assert (
        cfg.model.n_layers == 40 and cfg.model.d_model == 5120 and cfg.model.vocab_size == HF_VOCAB
    )
    assert cfg.train.prompts_per_step == 32 and cfg.train.group_size == 16
    assert cfg.train.updates_per_batch == 1 and cfg.loss.ppo_clip_eps is None
    assert cfg.rollout.max_decode_length == 16_384 and cfg.loss.log_rho == -13.0
    assert cfg.eval.k == 16 and cfg.data.task == "math" and cfg.data.path
    assert cfg.mesh.shape(32) == (1, 8, 4)
    assert ExperimentConfig.from_config_dict(module.get_config(), HF_VOCAB).method == "mis_dvp"


def test_gpu_mid_config_validates():
    module = load_file(os.path.join(REPO, "configs/gpu_mid.py"))
    for method in ("rloo", "mis_dvp"):
        cfg = ExperimentConfig.from_config_dict(
            module.get_config(method), CharTokenizer().vocab_size
        )
        assert cfg.method == method and cfg.mesh.shape(1) == (1, 1, 1)
