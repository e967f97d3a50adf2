"""Several command lines of one entry point (`dvp_jax.main`, `dvp_jax.serve.server`) run in one
interpreter, for the tests of what each one prints and its exit status.

Each case goes through the module's own `app.run(main, flags_parser=parse_flags)`, as
`python -m MODULE ARGS...` does, with every flag back at its default first and file descriptors
1 and 2 captured (absl's log lines and Python's prints alike). The cases share the interpreter's
state (loaded modules, jax's config): a case that needs a fresh process (a signal, a second
process on the same workdir, `--verbose`'s traceback) is started on its own.

  python -m tests.main_cases MODULE < cases.json   (a JSON list of argv lists)

prints one JSON list of {"status": int, "output": str}, in order, as its last line.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile


def _run_case(module, argv: list[str], defined: set[str]) -> dict:
    from absl import app, flags

    # A config file's override flags (`config.train.steps`) are defined by each parse; flags a
    # library defines on first import (grain's) stay.
    for name in {n for n in flags.FLAGS if "." in n} - defined:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    sys.argv = list(argv)  # `cli.fail` looks for --verbose there
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            app.run(module.main, argv=list(argv), flags_parser=module.parse_flags)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - what a real process would print and exit 1 with
            import traceback

            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return {"status": status, "output": out.read().decode(errors="replace")}


def run_cases(module: str, argvs: list[list[str]], env=None, cwd=None, timeout=300) -> list[dict]:
    """Runs `argvs` (each one `[program, *args]`) through `module`'s entry point in one fresh
    interpreter; returns each case's {"status", "output"}."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.main_cases", module],
        input=json.dumps(argvs),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from absl import app, flags

    module = importlib.import_module(sys.argv[1])
    argvs = json.load(sys.stdin)
    app.define_help_flags()  # what the first `app.run` defines, kept for every case
    defined = set(flags.FLAGS)
    results = [_run_case(module, argv, defined) for argv in argvs]
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
