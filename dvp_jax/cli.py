"""What the command lines share (`dvp_jax.main`, `dvp_jax.serve.server`, `benchmarks/`): a
user's mistake ends the process with one line on stderr and exit status 2, with no traceback
and no usage dump (`--verbose` adds the traceback); `--backend` refuses the wrong jax."""

from __future__ import annotations

import os
import sys
import traceback

from absl import flags

USAGE_EXIT_CODE = 2
BACKENDS = ("cpu", "gpu", "tpu")  # the names of `jax.default_backend()`


def fail(message: str, status: int, error: BaseException | None = None) -> None:
    """Ends the process with one line on stderr (and `error`'s traceback under --verbose)."""
    verbose = "--verbose" in sys.argv
    if flags.FLAGS.is_parsed() and "verbose" in flags.FLAGS:
        verbose = flags.FLAGS.verbose
    if verbose and error is not None:
        traceback.print_exception(error)
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, each mistake reported as one line (no usage dump, exit 2): an
    unknown flag or bad value, a missing required flag, a config file that is missing or fails
    to load, a misspelt `--config.` field or a value of the wrong type. (A config file that
    does not load raises when its value is first read: `flag_error` words that too.)"""
    try:
        return flags.FLAGS(argv)
    except Exception as e:
        fail(flag_error(e, argv), USAGE_EXIT_CODE, e)


def flag_error(error: BaseException, argv: list[str]) -> str:
    """One line from a flag-parsing error; ml_collections nests and quotes its causes."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in chain:
        if isinstance(e, KeyError) and e.args and "\n" in str(e.args[0]):
            # A misspelt config field: "'stpes'\nDid you mean "steps" instead of "stpes"?"
            field, hint = str(e.args[0]).split("\n", 1)
            field = field.strip("'")
            names = [a.split("=")[0] for a in argv if a.startswith("--")]
            where = next((n for n in names if f".{field}" in n), "--config")
            hint = hint.strip()
            return f"{where}: no config field {field!r}; {hint[:1].lower()}{hint[1:]}"
    first = chain[0]
    lines = [line.strip() for line in str(first).splitlines() if line.strip()]
    if isinstance(first, flags.Error):
        return " ".join(lines) + " (see --help)"
    if "failure to load" in str(first) or isinstance(first, (OSError, SyntaxError)):
        detail = lines[-1] if lines else type(first).__name__
        if isinstance(first, SyntaxError):
            detail = f"SyntaxError: {first}"
        return f"--config: the config file does not load ({detail})"
    return f"{type(first).__name__}: {' '.join(lines)}"


def require_backend(wanted: str | None) -> None:
    """Exits (status 2, one line) unless jax's default backend is `wanted` (None: any).

    A machine whose jax lacks the accelerator plugin runs on the CPU without a word; a
    benchmark or run that asked for the accelerator says so instead.
    """
    if not wanted:
        return
    if wanted not in BACKENDS:
        fail(f"--backend={wanted}: not one of {', '.join(BACKENDS)}", USAGE_EXIT_CODE)
    import jax

    found = jax.default_backend()
    if found != wanted:
        fail(
            f"--backend={wanted} but jax runs on {found} ({jax.devices()[0].device_kind}): "
            f"install the jax for {wanted} (make install ACCEL={_ACCEL[wanted]}) or pass "
            f"--backend={found}",
            USAGE_EXIT_CODE,
        )


_ACCEL = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


# JAX's persistent compilation cache, on by default for every command (`--compilation_cache`).
DEFAULT_COMPILATION_CACHE = os.environ.get(
    "DVP_JAX_COMPILATION_CACHE",
    os.path.join(os.path.expanduser("~"), ".cache", "dvp_jax", "jax_compilation_cache"),
)
COMPILATION_CACHE_HELP = (
    "Directory of JAX's persistent compilation cache: a rerun, a resume or another run with "
    "the same programs loads them instead of compiling. Empty: off. Default: "
    "$DVP_JAX_COMPILATION_CACHE, else ~/.cache/dvp_jax/jax_compilation_cache."
)


def use_compilation_cache(path: str) -> None:
    """Keeps every compiled program in `path` (none when empty), however quick to compile: a
    resumed tiny run is mostly compilation, a restarted server mostly its buckets."""
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
