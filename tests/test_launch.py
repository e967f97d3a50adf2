"""The launcher (dvp_jax.launch): sweep expansion, the local runner, the Cloud TPU commands and
docs/tpu.md's TPU commands. Fast: no trainer runs (a stand-in plays the trainer), no network; the
remote scripts run in a real shell with fake `gcloud`, `curl` and `uv` (sh scripts on PATH).
One test starts a fresh interpreter, for the `python -m dvp_jax.launch` entry point."""

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

from dvp_jax.launch import cli, sweep, xm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    units = sweep.expand_sweep(
        [
            {"method": "rloo", "train.seed": 0, "train.steps": 2},
            {"method": "dvp", "train.seed": 1, "train.steps": 2},
            {"_name": "custom", "method": "dvp", "train.seed": 2, "train.steps": 2},
        ]
    )
    assert [u.name for u in units] == ["00_method=rloo,seed=0", "01_method=dvp,seed=1", "02_custom"]
    assert units[2].overrides == (("method", "dvp"), ("train.seed", 2), ("train.steps", 2))
    # Clashing last components keep the full key.
    units = sweep.expand_sweep(
        [{"train.seed": 0, "data.seed": 0}, {"train.seed": 1, "data.seed": 1}]
    )
    assert units[1].name == "01_train.seed=1,data.seed=1"
    assert sweep.expand_sweep([{}])[0].name == "00_base"


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
        assert len({u.name for u in sweep.expand_sweep(bad)}) == 2
        return
    with pytest.raises(ValueError, match=match):
        sweep.expand_sweep(bad)


def test_format_value_round_trips_through_config_flags_syntax():
    assert sweep.format_value(True) == "true"
    assert sweep.format_value(-13.0) == "-13.0"
    assert sweep.format_value(-math.inf) == "-inf"
    assert sweep.format_value(1e-6) == "1e-06"
    assert sweep.format_value([1, 2]) == "(1, 2)"
    with pytest.raises(ValueError):
        sweep.format_value(None)


def test_parse_assignments_reads_python_literals_else_strings():
    got = sweep.parse_assignments(["seeds=3", "noise=0.5", "smoke=True", "init_hf=/a b/c"])
    assert got == {"seeds": 3, "noise": 0.5, "smoke": True, "init_hf": "/a b/c"}
    assert sweep.parse_assignments(["methods=('rloo', 'dvp')"]) == {"methods": ("rloo", "dvp")}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        sweep.parse_assignments(["seeds"])


def test_sweep_arguments_reach_get_sweep_and_unknown_ones_fail(tricky_experiment, capsys):
    exp = sweep.load_experiment(tricky_experiment, {"plots": True})
    assert exp.sweep_call == "get_sweep(plots=True)"
    assert all(dict(u.overrides)["plots"] is True for u in exp.units)
    with pytest.raises(ValueError, match="unexpected keyword argument 'seeds'"):
        sweep.load_experiment(tricky_experiment, {"seeds": 3})
    # From the command line: the dry run shows the call and its overrides.
    assert cli.main(["local", tricky_experiment, "--dry_run", "--sweep", "plots=True"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# e999_quoting.get_sweep(plots=True): 2 work units")
    assert out.count("--config.plots=true") == 2
    with pytest.raises(SystemExit, match="get_sweep"):
        cli.main(["local", tricky_experiment, "--dry_run", "--sweep", "seeds=3"])
    with pytest.raises(SystemExit, match="no such work units"):
        cli.main(["local", tricky_experiment, "--dry_run", "--only", "7"])


def test_e000_smoke_has_two_tiny_units():
    exp = sweep.load_experiment(E000)
    assert exp.config_flag == "configs/tiny_cpu.py:dvp"
    assert [dict(u.overrides)["method"] for u in exp.units] == ["rloo", "dvp"]
    for u in exp.units:
        ov = dict(u.overrides)
        assert ov["train.steps"] == 2 and ov["sft.steps"] == 2 and ov["eval.num_prompts"] == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["local"], "give an experiment file"),
        (["local", E000, "--config", "configs/tiny_cpu.py"], "give an experiment file"),
        (["local", "--config", "configs/nope.py"], "config 'configs/nope.py' does not exist"),
        (["local", "--config", "configs/tiny_cpu.py", "--sweep", "a=1"], "--sweep needs an"),
        (["local", E000, "--only", "x"], "--only 'x': want comma-separated"),
    ],
)
def test_the_experiment_or_config_is_checked(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(argv)


# ------------------------------------------------------------------------------------------------
# Local mode.
# ------------------------------------------------------------------------------------------------
def _commands(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]


def test_local_dry_run_prints_one_command_per_unit(tmp_path, capsys):
    assert cli.main(["local", E000, "--dry_run", "--root", str(tmp_path)]) == 0
    commands = _commands(capsys.readouterr().out)
    assert len(commands) == 2
    for argv, method in zip(commands, ("rloo", "dvp"), strict=True):
        assert argv[1:5] == ["-m", "dvp_jax.main", "--config", "configs/tiny_cpu.py:dvp"]
        workdir = argv[argv.index("--workdir") + 1]
        assert workdir.startswith(str(tmp_path / "e000_smoke"))
        assert f"--config.method={method}" in argv and "--config.train.steps=2" in argv
    assert not os.listdir(tmp_path)  # a dry run creates nothing


def test_flags_after_the_separator_reach_every_trainer_last(tmp_path, capsys):
    """The launcher forwards trainer flags verbatim, after the sweep's (absl keeps the last)."""
    forwarded = ["--config.train.steps=5", "--config.data.path=/a b/c.jsonl", "--verbose"]
    assert cli.main(["local", E000, "--dry_run", "--root", str(tmp_path), "--", *forwarded]) == 0
    for argv in _commands(capsys.readouterr().out):
        assert argv[-3:] == forwarded and "--config.train.steps=2" in argv[:-3]
    # --config instead of an experiment file: one unit, named after the config.
    assert cli.main(["local", "--config", "configs/tiny_cpu.py:rloo", "--dry_run", "--", "-x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# tiny_cpu.--config configs/tiny_cpu.py:rloo: 1 work units")
    [argv] = _commands(out)
    assert argv[1:5] == ["-m", "dvp_jax.main", "--config", "configs/tiny_cpu.py:rloo"]
    assert argv[argv.index("--workdir") + 1] == f"{sweep.DEFAULT_ROOT}/tiny_cpu/00_base"
    assert argv[-1] == "-x"
    with pytest.raises(SystemExit, match="flags after `--` go to local or run"):
        cli.main(["status", "--tpu", "t", "--zone", "us-east5-a", "--", "--config.a=1"])


def test_local_run_collects_summaries_and_fails_on_a_failed_unit(tmp_path, monkeypatch, capsys):
    """The real runner, with a stand-in trainer: unit `rloo` succeeds, unit `dvp` crashes."""

    def fake_argv(config_flag, overrides, workdir, python, extra_flags=()):
        method = dict(overrides)["method"]
        summary = '{"eval_accuracy": 0.5, "final_ppl_gap": 0.01, "wall_time_s": 1.0}'
        write = f"printf '%s' '{summary}' > {shlex.quote(os.path.join(workdir, 'summary.json'))}"
        return ["sh", "-c", "exit 3" if method == "dvp" else write]

    monkeypatch.setattr(sweep, "unit_argv", fake_argv)
    rc = cli.main(["local", E000, "--root", str(tmp_path), "--parallel", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    table = out[out.index("unit ") :].splitlines()
    assert table[1].split()[:4] == ["00_method=rloo", "ok", "-", "0.5"]  # ppl_gap <- final_ppl_gap
    assert table[1].split()[4] == "0.01"
    assert table[2].split()[:2] == ["01_method=dvp", "fail(3)"]
    results = json.loads((tmp_path / "e000_smoke" / "results.json").read_text())
    assert [r["returncode"] for r in results] == [0, 3]
    log = (tmp_path / "e000_smoke" / "01_method=dvp" / "launch.log").read_text()
    assert log.startswith("$ sh -c 'exit 3'\n")
    # --only reruns a subset.
    assert cli.main(["local", E000, "--root", str(tmp_path), "--only", "0"]) == 0


def test_the_module_entry_point_runs(tmp_path):
    """The one fresh interpreter: `python -m dvp_jax.launch` parses its flags and prints."""
    argv = [sys.executable, "-m", "dvp_jax.launch", "local", E000, "--dry_run", "--root"]
    out = subprocess.run(
        [*argv, str(tmp_path), "--", "--config.train.steps=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert [a[-1] for a in _commands(out.stdout)] == ["--config.train.steps=1"] * 2


# ------------------------------------------------------------------------------------------------
# Cloud TPU VM slices.
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
# The fakes are sh scripts (no interpreter start per call). Each records its arguments as one
# tab-separated line. gcloud plays `gcloud storage cp [-r] SRC DST`, with gs://BUCKET/PATH kept
# under $FAKE_GCS/BUCKET/PATH, and exits 1 without copying when $GCLOUD_FAIL is set.
RECORD = 'printf \'%s\\t\' "$@" >> "$CALLS"; echo >> "$CALLS"\n'
FAKE_GCLOUD = f"""#!/bin/sh
CALLS=$GCLOUD_CALLS; {RECORD}test -z "$GCLOUD_FAIL" || exit 1
test "$1 $2" = "storage cp" || exit 2
shift 2; test "$1" != -r || shift
src=$1; dst=$2
case $src in gs://*) src=$FAKE_GCS/${{src#gs://}};; esac
case $dst in gs://*) dst=$FAKE_GCS/${{dst#gs://}};; esac
case $dst in */) dst=$dst$(basename "$src");; esac
mkdir -p "$(dirname "$dst")" && cp -R "$src" "$dst"
"""
# uv: `uv venv ... DIR` makes DIR/bin/python, which exits 0 (the version check passes).
FAKE_UV = f"""#!/bin/sh
CALLS=$UV_CALLS; {RECORD}if test "$1" = venv; then
  for dir; do :; done
  mkdir -p "$dir/bin" && printf '#!/bin/sh\\nexit 0\\n' > "$dir/bin/python"
  chmod 755 "$dir/bin/python"
fi
"""
# The trainer: prints its arguments on one line, each in [], then a line on stderr; exits $TRAIN_RC.
FAKE_TRAINER = """#!/bin/sh
printf '[%s]' "$@"; echo; echo "a line on stderr" >&2; exit "$TRAIN_RC"
"""


def _calls(path) -> list[list[str]]:
    return [line.rstrip("\n").split("\t")[:-1] for line in open(path)]


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
    """`cli.main(argv)`'s printed commands (each after a `# [i/n] description` line); any
    attempt to execute one fails the test (gcloud may be installed where the tests run)."""
    with mock.patch.object(subprocess, "run", side_effect=AssertionError("executed")):
        assert cli.main(argv) == 0
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
    path.write_text(body)
    path.chmod(0o755)


def _fake_worker(tmp_path) -> dict[str, str]:
    """The environment of a pretend worker: $HOME, a fake gcloud and a fake bucket under tmp."""
    _executable(tmp_path / "bin" / "gcloud", FAKE_GCLOUD)
    return dict(
        os.environ,
        HOME=str(tmp_path / "home"),
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        FAKE_GCS=str(tmp_path / "gcs"),
        GCLOUD_CALLS=str(tmp_path / "gcloud_calls.tsv"),
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
    unit = sweep.load_experiment(tricky_experiment).units[0]
    env = _fake_worker(tmp_path)
    _executable(tmp_path / "home" / "dvp venv" / "bin" / "python", FAKE_TRAINER)
    (tmp_path / "home" / "dvp jax").mkdir()
    env.update(TRAIN_RC=str(train_rc), **({"GCLOUD_FAIL": "1"} if copy_fails else {}))

    out = _sh(shell, _remote(shlex.split(cmds[0])), env)
    assert out.returncode == expected_rc, out.stderr
    workdir = f"{root}/e999_quoting/{unit.name}"
    argv = sweep.unit_argv(
        "configs/tiny_cpu.py:mis_dvp", unit.overrides, workdir, "python", ("--distributed",)
    )
    shown = "".join(f"[{a}]" for a in argv[1:])
    assert out.stdout.splitlines()[0] == shown  # tee shows the output as well
    host = os.uname().nodename  # `uname -n` (POSIX); the worker's hostname on a TPU VM
    log = f"logs/e999_quoting/{unit.name}.{host}.log"
    text = (tmp_path / "home" / "dvp jax" / log).read_text()
    assert text.splitlines()[0] == out.stdout.splitlines()[0] and "a line on stderr" in text
    [call] = _calls(env["GCLOUD_CALLS"])
    assert call == ["storage", "cp", log, f"{workdir}/logs/{host}.log"]
    copied = tmp_path / "gcs" / "my-bucket" / "my runs" / "e999_quoting" / unit.name / "logs"
    assert (copied / f"{host}.log").exists() != copy_fails


def test_tpu_python_step_installs_uv_once_and_keeps_a_venv_of_the_right_version(tmp_path, capsys):
    """The Python step run by a real shell with fake curl and uv: the pinned installer runs only
    while ~/.local/bin/uv is missing; the venv is created, kept, and remade when its Python is
    another version (its `python -c "...sys.exit(version != 3.11)"` fails)."""
    script = _remote(shlex.split(_printed(["setup", *SLICE], capsys)[3]))
    env = _fake_worker(tmp_path)
    env.update(UV_CALLS=str(tmp_path / "uv_calls.tsv"), CURL_CALLS=str(tmp_path / "curl"))
    _executable(tmp_path / "fake_uv", FAKE_UV)
    (tmp_path / "bin" / "curl").write_text(  # prints an "installer" that copies the fake uv
        f'#!/bin/sh\necho "$@" >> "$CURL_CALLS"\necho \'mkdir -p "$UV_UNMANAGED_INSTALL" && '
        f'cp {tmp_path}/fake_uv "$UV_UNMANAGED_INSTALL"/uv\'\n'
    )
    (tmp_path / "bin" / "curl").chmod(0o755)
    venv = str(tmp_path / "home" / "dvp_jax_venv")

    def run_step() -> list[list[str]]:
        assert _sh("sh", script, env).returncode == 0
        calls = _calls(env["UV_CALLS"])
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
        (["run", E000, "--tpu", "t"], "--zone is required"),
        (["run", *SLICE, "--root", "gs://my-bucket/r"], "give an experiment file"),
        (  # a placeholder typed as written is named
            ["status", *SLICE[:4], "--project", "MY_PROJECT"],
            "want a project ID (6-30 lowercase letters, digits and '-', from a letter) "
            "(MY_PROJECT is a placeholder: put yours there)",
        ),
        (["run", E000, *SLICE, "--root", "gs://MY_BUCKET/runs"], "MY_BUCKET is a placeholder"),
    ],
)
def test_tpu_bad_input_is_named(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(argv)


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
    ):
        assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count("gcloud compute tpus") == 1 + 5 + 2 + 1 + 1 + 1
    assert err.count("add --run to execute") == 6


def test_tpu_run_flag_executes_in_order_and_stops_at_the_first_failure(
    tpu_experiment, monkeypatch, capsys
):
    calls, fail_at = [], [3]

    def fake_run(cmd, shell=False, cwd=None, check=False):
        calls.append((cmd, shell, cwd))
        return subprocess.CompletedProcess(cmd, 255 if len(calls) == fail_at[0] else 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert cli.main(["setup", *SLICE, "--stage", "gs://my-bucket/m=/data/m", "--run"]) == 255
    out, err = capsys.readouterr()
    printed = out.splitlines()[1::2]
    assert [c for c, _, _ in calls] == [printed[0], *map(shlex.split, printed[1:])]
    assert len(calls) == 3 and calls[0][1:] == (True, sweep.REPO)  # the local pack: a pipeline
    assert "step 3/6 failed with exit status 255: unpack" in err
    assert "steps 4-6 were not run" in err
    # A failed work unit stops the sweep and names the units to resume.
    calls.clear()
    fail_at[0] = 1
    gs = ["--root", "gs://my-bucket/runs"]
    assert cli.main(["run", tpu_experiment, *SLICE, *gs, "--run"]) == 255
    assert len(calls) == 1 and "resume with --only 0,1" in capsys.readouterr().err


def test_tpu_run_forwards_every_override_intact(tricky_experiment, capsys):
    """Each unit is one ssh to every worker; quotes, `$` and `;` in overrides and the flags after
    `--` reach the worker's trainer command as they were."""
    root = "gs://bucket/runs"
    commands = _printed(
        ["run", tricky_experiment, *SLICE, "--root", root, "--", "--config.plots=true"], capsys
    )
    units = [shlex.split(c) for c in commands]
    exp = sweep.load_experiment(tricky_experiment)
    assert len(units) == len(exp.units) == 2
    for argv, unit in zip(units, exp.units, strict=True):
        assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dvp-v5p"]
        assert "--worker=all" in argv and argv[-4:] == WHERE
        remote = shlex.split(_remote(argv))  # what each worker's shell sees
        main_argv = remote[remote.index("{") + 1 : remote.index(";")]
        assert main_argv[:4] == ["$HOME/dvp_jax_venv/bin/python", "-m", "dvp_jax.main", "--config"]
        assert main_argv[main_argv.index("--workdir") + 1] == f"{root}/e999_quoting/{unit.name}"
        assert "--distributed" in main_argv and main_argv[-1] == "--config.plots=true"
        path = dict(unit.overrides)["data.path"]
        assert f"--config.data.path={path}" in main_argv  # quotes, $ and ; survive intact
    assert "--config.loss.log_rho=-inf" in shlex.split(_remote(units[1]))


def test_tpu_git_sync_and_detach_starts_all_units_in_one_background_ssh(tricky_experiment, capsys):
    slice_ = ["--tpu", "t", "--zone", "us-central2-b"]
    [fetch] = _printed(
        ["setup", *slice_, "--sync", "git", "--git_remote", "https://example.com/r.git"]
        + ["--git_ref", "abc123", "--skip_install"],
        capsys,
    )
    assert "git fetch https://example.com/r.git abc123" in _remote(shlex.split(fetch))
    [start] = _printed(
        ["run", tricky_experiment, *slice_, "--root", "gs://bkt/r", "--detach"], capsys
    )
    remote = shlex.split(_remote(shlex.split(start)))
    assert "nohup" in remote and remote[-1] == "&"
    script = remote[remote.index("-c") + 1]
    for unit in sweep.load_experiment(tricky_experiment).units:
        assert f"gs://bkt/r/e999_quoting/{unit.name}" in script
        assert f"gs://bkt/r/e999_quoting/{unit.name}/logs/" in script
    assert script.count("dvp_jax.main") == 2
    assert subprocess.run(["sh", "-n", "-c", script], check=False).returncode == 0


def test_tpu_single_config_run_needs_no_experiment_file(capsys):
    """`run --config FILE:ARG -- FLAGS`: one unit, ROOT/CONFIG_STEM/00_base, flags forwarded."""
    [cmd] = _printed(
        ["run", "--config", "configs/paper_qwen3_14b.py:mis_dvp", *SLICE]
        + ["--root", "gs://my-bucket/runs", "--", "--config.train.steps=10"],
        capsys,
    )
    remote = shlex.split(_remote(shlex.split(cmd)))
    main_argv = remote[remote.index("{") + 1 : remote.index(";")]
    assert main_argv[1:] == [
        "-m", "dvp_jax.main", "--config", "configs/paper_qwen3_14b.py:mis_dvp",
        "--workdir", "gs://my-bucket/runs/paper_qwen3_14b/00_base", "--distributed",
        "--config.train.steps=10",
    ]  # fmt: skip


def _readme_tpu_commands() -> list[str]:
    """docs/tpu.md's Cloud TPU slice commands (its first bash block with `S=`), `$S` expanded."""
    text = open(os.path.join(REPO, "docs", "tpu.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    [block] = [b for b in blocks if b.startswith("S=")]
    lines = block.replace("\\\n", " ").splitlines()
    s = shlex.split(lines[0])[0].removeprefix("S=")
    return [line.split("#")[0].replace("$S", s) for line in lines[1:]]


def test_readme_tpu_commands_run_as_typed_in_print_mode(capsys):
    """Every docs/tpu.md slice command passes the launcher's checks as typed; without `--run`
    it prints the gcloud commands and executes nothing; with it, exactly those commands run."""
    commands = _readme_tpu_commands()
    actions = [shlex.split(c)[3] for c in commands]
    assert actions == ["create", "setup", "run", "status", "delete"]
    for command in commands:
        words = shlex.split(command)
        assert words[:3] == ["python", "-m", "dvp_jax.launch"] and "--run" in words
        printed = _printed([w for w in words[3:] if w != "--run"], capsys)
        assert printed and all(p.startswith(("gcloud ", "git ls-files")) for p in printed)
        ok = subprocess.CompletedProcess([], 0)
        with mock.patch.object(subprocess, "run", return_value=ok) as run:
            assert cli.main(words[3:]) == 0
        ran = [c.args[0] for c in run.call_args_list]
        assert [c if isinstance(c, str) else shlex.join(c) for c in ran] == printed
        capsys.readouterr()


def test_xm_needs_xmanager_only_when_run(monkeypatch):
    """The XManager launcher imports xmanager when it runs: without it, a clear usage error."""
    monkeypatch.setitem(sys.modules, "xmanager", None)  # makes `import xmanager` fail
    with pytest.raises(SystemExit, match="xmanager is not installed"):
        xm.main([E000])
