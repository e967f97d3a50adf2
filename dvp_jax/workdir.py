"""Paths of a run: every workdir and data file goes through `etils.epath`, so a `gs://` (or any
other epath backend) workdir works like a local one.

`as_path` is the one place a user's path string becomes a path: local paths are made absolute,
`scheme://` paths are kept as they are (`os.path.abspath` would turn `gs://bucket/run` into a
local `./gs:/bucket/run`). `write_atomic` and `append_line` are the two ways run records are
written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` names another epath backend (`gs://...`, `s3://...`)."""
    return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
    """An `epath.Path`: absolute for a local path, unchanged for a `scheme://` one."""
    return epath.Path(path if is_remote(path) else os.path.abspath(os.fspath(path)))


def check_writable(directory: epath.Path) -> None:
    """Creates `directory` if needed and proves it is writable (a probe file, removed again).

    Raises:
      OSError: naming the directory and the backend's reason (unreachable bucket, no
        permission, read-only file system...), before any work is done.
    """
    probe = directory / f".write_probe.{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # every backend has its own exception types
        raise OSError(
            f"workdir {directory} is not writable ({type(e).__name__}: {e}); check the path, "
            "its permissions or the bucket's credentials"
        ) from None


def write_atomic(path: epath.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary sibling and one rename: a reader (or a kill)
    sees the old file or the new one, never a partial one (on object stores the rename is a
    copy, so a kill can at worst leave the temporary file beside the old one)."""
    path = as_path(path)
    tmp = path.parent / f".tmp.{path.name}.{uuid.uuid4().hex}"
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


def append_line(path: epath.Path, line: str, rewrite: str) -> None:
    """Appends `line` to `path`; `rewrite` is the whole new content, written atomically where
    the backend cannot append (object stores)."""
    path = as_path(path)
    if is_remote(path):
        write_atomic(path, rewrite)
    else:
        with open(path, "a") as fh:
            fh.write(line)


@contextlib.contextmanager
def local_dir(path: epath.Path) -> Iterator[str]:
    """A local directory for writers that only know local files (safetensors, tokenizers).

    Yields `path` itself when it is local; for a remote `path`, a temporary local directory
    whose files are copied to `path` when the block ends without error.
    """
    path = as_path(path)
    if not is_remote(path):
        yield os.fspath(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp
        path.mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(tmp)):
            (path / name).write_bytes(epath.Path(tmp, name).read_bytes())
