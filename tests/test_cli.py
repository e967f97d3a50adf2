"""The command lines' contract for a user's mistake: the output ends with one line naming what
was wrong, exit status 2, no traceback, no usage dump, and no workdir left behind; `--verbose`
adds the traceback. One case per kind of mistake (flag, config field, value, file, data, path,
checkpoint, backend; the server's flags and port). The cases of each command run in one
interpreter through its own entry point (tests/main_cases.py), the two commands side by side;
`--verbose` is a real `python -m dvp_jax.main` process."""

import concurrent.futures
import os
import socket
import subprocess
import sys

import pytest

from tests import child_env
from tests.main_cases import run_cases
from tests.train_utils import REPO, TINY_CONFIG, main_command

TIMEOUT = 240


def _server(*flags):
    return ["dvp_jax.serve.server", *flags]


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def _cases(tmp, port):
    """name -> (argv, the text the last line must hold)."""

    damaged = tmp / "damaged" / "checkpoints" / "0"
    damaged.mkdir(parents=True)  # a step directory Orbax lists, with nothing inside
    (damaged / "_CHECKPOINT_METADATA").write_text("{}")
    runs = iter(range(100))
    run = lambda: str(tmp / "runs" / str(next(runs)))  # a workdir per case: one trainer each
    math = lambda path: main_command(
        run(), "--config.data.task=math", f"--config.data.path={path}"
    )[0]
    return {
        "bad value": (
            main_command(run(), **{"train.group_size": 1})[0],
            "config.train.group_size must be an int >= 2, got 1",
        ),
        # A field the config file does not set is still overridable (a bad value here, so the
        # run stops at validation naming it).
        "field not in the config file": (
            main_command(
                run(), "--config.data.chat_format=plain", "--config.rollout.temperature=0"
            )[0],
            "config.rollout.temperature must be a finite number > 0",
        ),
        "misspelt field": (
            main_command(run(), **{"train.stpes": 10})[0],
            "--config.train.stpes: no config field 'stpes'; did you mean \"steps\"",
        ),
        "negative steps": (main_command(run(), **{"train.steps": -3})[0], "config.train.steps"),
        "wrong type": (
            main_command(run(), **{"train.steps": "abc"})[0],
            "--config.train.steps=abc: invalid literal for int()",
        ),
        "unknown flag": (main_command(run(), "--bogus")[0], "Unknown command line flag 'bogus'"),
        "missing flag": (
            [sys.executable, "-m", "dvp_jax.main", f"--config={TINY_CONFIG}"],
            "--workdir must have a value",
        ),
        "missing config file": (
            [
                sys.executable,
                "-m",
                "dvp_jax.main",
                "--config=configs/nope.py",
                f"--workdir={run()}",
            ],
            "--config: the config file does not load ([Errno 2] No such file or directory",
        ),
        "empty data file": (
            math(_write(tmp / "empty.jsonl", b"")),
            "has none of the default prompt fields",
        ),
        "unwritable workdir": (
            main_command("/proc/dvp_jax_run")[0],
            "workdir /proc/dvp_jax_run is not writable",
        ),
        "no restorable checkpoint": (
            main_command(tmp / "damaged")[0],
            "no checkpoint under",
        ),
        "wrong backend": (
            main_command(run(), "--backend=tpu")[0],
            "--backend=tpu but jax runs on cpu",
        ),
        "server: no such trainer workdir": (
            _server(f"--trainer_checkpoint={tmp / 'nowhere'}", f"--port={port}"),
            "no such directory",
        ),
        "server: a trainer workdir as --hf_checkpoint": (
            _server(f"--hf_checkpoint={tmp / 'workdir_like'}", f"--port={port}"),
            "is a dvp_jax.main workdir",
        ),
        "server: unknown flag": (_server("--prot=9000"), "Unknown command line flag 'prot'"),
        "server: bad flag value": (
            _server("--random_init_preset=tiny", "--max_prefill_length=100", f"--port={port}"),
            "--max_prefill_length must be one of",
        ),
    }


def test_every_user_mistake_ends_with_one_line_and_exit_2(tmp_path):
    like = tmp_path / "workdir_like"
    (like / "checkpoints").mkdir(parents=True)
    (like / "config.json").write_text('{"method": "dvp"}')
    (like / "model_config.json").write_text("{}")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    cases = _cases(tmp_path, port)
    env = child_env()
    # argv[0] names the module: [python, -m, dvp_jax.main, ...] -> [dvp_jax.main, ...].
    argvs = {
        name: argv[2:] if argv[0] == sys.executable else argv for name, (argv, _) in cases.items()
    }
    by_module = {}
    for name, argv in argvs.items():
        by_module.setdefault(argv[0], []).append(name)
    help_case = {module: [module, "--help"] for module in by_module}
    with concurrent.futures.ThreadPoolExecutor(len(by_module)) as pool:
        futures = {
            module: pool.submit(
                run_cases,
                module,
                [argvs[n] for n in names] + [help_case[module]],
                env,
                REPO,
                TIMEOUT,
            )
            for module, names in by_module.items()
        }
        results = {}
        for module, names in by_module.items():
            *found, helped = futures[module].result()
            results.update(zip(names, found, strict=True))
            # --help still lists the flags (absl's own --help exits 1).
            assert helped["status"] in (0, 1), helped["output"][-2000:]
            assert "verbose" in helped["output"] and "error:" not in helped["output"], module
    failures = []
    for name, result in results.items():
        out = result["output"]
        lines = out.strip().splitlines()
        last = lines[-1] if lines else ""
        expected = cases[name][1]
        if (
            result["status"] != 2
            or not last.startswith("error: ")
            or expected not in last
            or "Traceback" in out
            or "USAGE" in out
        ):
            failures.append(f"{name}: rc {result['status']}, last line {last!r}\n{out[-1500:]}")
    assert not failures, "\n\n".join(failures)
    # Nothing was left behind by the runs that failed before any work.
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
    assert not os.path.exists("/proc/dvp_jax_run")


def test_verbose_adds_the_traceback(tmp_path):
    cmd, env = main_command(tmp_path / "run", "--verbose", **{"train.steps": -3})
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2
    assert "Traceback" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: config.train.steps")


_BAD_DATA = {  # file name, content, what the message must say
    # The fields are checked before any row is read; rows that have them but are all bad leave
    # nothing to read.
    "no prompt field": ("bad.jsonl", b'{"x": 1}\n{"y": 2}\n', "its fields: x, y"),
    "every row bad": (
        "bad.jsonl",
        b'{"prompt": 17, "answer": "3"}\n{"prompt": "' + b"x" * 500 + b'", "answer": "1"}\n',
        "no examples to read",
    ),
    "random bytes": ("rand.jsonl", bytes(range(256)) * 12, "its fields: none"),
    "fake parquet": ("fake.parquet", bytes(range(256)) * 12, "cannot read as parquet"),
    "txt extension": ("data.txt", b'{"prompt": "1+1=", "answer": "2"}\n', "unsupported extension"),
    "missing file": ("none.jsonl", None, "does not exist"),
}


@pytest.mark.parametrize("case", list(_BAD_DATA))
def test_a_bad_data_file_is_one_data_error_and_leaves_no_workdir(tmp_path, case):
    # The command line prints a DataError as its one line (the empty-file case above); here
    # the message of each kind of bad file, from the trainer itself, before any model is built.
    from dvp_jax.errors import DataError
    from dvp_jax.tokenizers import CharTokenizer
    from dvp_jax.train.config import ExperimentConfig
    from dvp_jax.train.trainer import Trainer
    from tests.train_utils import tiny_config_dict

    name, content, expected = _BAD_DATA[case]
    if content is not None:
        (tmp_path / name).write_bytes(content)
    overrides = {"data.task": "math", "data.path": str(tmp_path / name)}
    cfg = ExperimentConfig.from_config_dict(
        tiny_config_dict(**overrides), CharTokenizer().vocab_size
    )
    with pytest.raises(DataError, match=expected) as error:
        Trainer(cfg, str(tmp_path / "run"))
    assert str(error.value).startswith("config.data.path: ") and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()
