"""Experiment infrastructure: sweep expansion, the local and TPU launchers, the scale plan, and
the paper / GPU configs. Fast (no trainer runs: a stand-in process plays the trainer)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from dvp_jax.pyfile import load_file
from dvp_jax.rollout.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig
from experiments import launch, scale_plan

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
# Cloud TPU VM mode.
# ------------------------------------------------------------------------------------------------
def _printed_commands(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def _remote(argv: list[str]) -> str:
    [cmd] = [a for a in argv if a.startswith("--command=")]
    return cmd[len("--command=") :]


def test_tpu_commands_quote_and_start_every_unit_on_every_worker(tricky_experiment, capsys):
    root = "gs://bucket/runs"
    rc = launch.main(
        [
            tricky_experiment,
            "--tpu",
            "my-v5p",
            "--zone",
            "us-east5-a",
            "--project",
            "proj",
            "--root",
            root,
        ]
    )
    assert rc == 0  # printed only
    commands = _printed_commands(capsys.readouterr().out)
    pack, scp, unpack, install, *units = commands
    assert "git ls-files" in " ".join(pack)
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
    assert "tar -xzf" in _remote(unpack) and "pip install" in _remote(install)
    exp = launch.load_experiment(tricky_experiment)
    assert len(units) == len(exp.units) == 2
    for argv, unit in zip(units, exp.units, strict=True):
        assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p"]
        assert "--worker=all" in argv
        assert argv[argv.index("--zone") + 1] == "us-east5-a"
        assert argv[argv.index("--project") + 1] == "proj"
        # What each worker's shell sees: split the remote command as the shell would.
        remote = shlex.split(_remote(argv))
        main_argv = remote[remote.index("-m") - 1 : remote.index(">")]
        assert main_argv[:4] == ["python3", "-m", "dvp_jax.main", "--config"]
        assert main_argv[main_argv.index("--workdir") + 1] == f"{root}/e999_quoting/{unit.name}"
        assert "--distributed" in main_argv
        path = dict(unit.overrides)["data.path"]
        assert f"--config.data.path={path}" in main_argv  # quotes, $ and ; survive intact
    assert "--config.loss.log_rho=-inf" in shlex.split(_remote(units[1]))


def test_tpu_detach_starts_all_units_in_one_background_ssh(tricky_experiment, capsys):
    rc = launch.main(
        [
            tricky_experiment,
            "--tpu",
            "t",
            "--zone",
            "z",
            "--root",
            "gs://b/r",
            "--detach",
            "--sync",
            "git",
            "--git_remote",
            "https://example.com/r.git",
            "--git_ref",
            "abc123",
            "--skip_install",
        ]
    )
    assert rc == 0
    fetch, start = _printed_commands(capsys.readouterr().out)
    assert "git fetch https://example.com/r.git abc123" in _remote(fetch)
    remote = shlex.split(_remote(start))
    assert "nohup" in remote and remote[-1] == "&"
    script = remote[remote.index("-c") + 1]
    for unit in launch.load_experiment(tricky_experiment).units:
        assert f"gs://b/r/e999_quoting/{unit.name}" in script
    assert script.count("dvp_jax.main") == 2


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


# ------------------------------------------------------------------------------------------------
# Scale plan.
# ------------------------------------------------------------------------------------------------
def test_scale_plan_shards_the_paper_config_on_v5p_64(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert scale_plan.main(["--out", str(out)]) == 0
    assert "KV cache" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["chips"] == 32 and plan["train_mesh"] == {"data": 1, "fsdp": 8, "tensor": 4}

    q = plan["parameter_layouts"]["layers.*.attn.q_proj"]  # [5120, 40, 128] fp32
    assert q["shape"] == [5120, 40, 128] and q["count"] == 40
    assert q["train_spec"] == "P('fsdp', 'tensor', None)"
    assert q["train_bytes_per_chip"] == 5120 * 40 * 128 * 4 // 32  # total / (8 x 4) shards
    assert q["rollout_bytes_per_chip"] == 5120 * 40 * 128 * 2 // 4  # bf16 / 4 tensor shards
    norm = plan["parameter_layouts"]["final_norm.weight"]
    assert norm["train_bytes_per_chip"] == 5120 * 4  # replicated

    rows = plan["per_chip_bytes"]
    params = rows["trainer params (fp32)"]
    assert params == pytest.approx(plan["num_params"] * 4 / 32, rel=1e-3)  # norms replicate
    # mu and nu shard like the params; the step counters (a few int32 scalars) replicate.
    assert 0 <= rows["optimizer state (AdamW mu + nu)"] - 2 * params < 64
    kv = next(v for k, v in rows.items() if k.startswith("KV cache"))
    assert kv == 2 * 40 * 64 * (2048 + 16_384) * 8 * 128 * 2 // 4


def test_scale_plan_overrides_only_declared_fields(tmp_path):
    cd = scale_plan.load_config(
        os.path.join(REPO, "configs/paper_qwen3_14b.py"), ["rollout.max_concurrent_decodes=32"]
    )
    assert cd.rollout.max_concurrent_decodes == 32
    with pytest.raises(KeyError, match="num_slots"):  # the old name is not a field any more
        scale_plan.main(["--set", "rollout.num_slots=32", "--out", str(tmp_path / "p.json")])
