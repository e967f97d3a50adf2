"""The two kinds of failure a run reports without a traceback (`dvp_jax.main`).

`UserError`: something the user gave is wrong (a config field or value, a path, a data file, a
checkpoint, a workdir in use). Its message is one line naming what was wrong and what is
allowed; the command line prints it and exits 2.

`RunFailure`: the run could not go on for a reason outside the user's input (a checkpoint
write that failed: disk full, lost permissions). One line naming the path and the cause; exit 1.

Anything else is a bug and keeps its traceback. `--verbose` shows tracebacks for these two too.
"""


class UserError(Exception):
    """Wrong input from the user; the message says what and what is allowed."""


class ConfigError(UserError, ValueError):
    """A config value that does not fit (also a ValueError, as config checks raise)."""


class DataError(UserError, ValueError):
    """A data file that cannot be used: missing, empty, of an unknown format, no usable row."""


class RunFailure(Exception):
    """The run stopped for a reason outside the user's input; the message names the cause."""


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of `error`'s cause/context chain that is an OSError (a full disk
    deep inside a library's error), or `error` itself when there is none."""
    found, seen = error, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            found = error
        error = error.__cause__ or error.__context__
    return found


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (a multi-line library message joined with ' | ')."""
    text = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
