"""Paths of a run: every workdir and data file goes through `etils.epath`, so a `gs://` (or any
other epath backend) workdir works like a local one.

`as_path` is the one place a user's path string becomes a path: local paths are made absolute,
`scheme://` paths are kept as they are (`os.path.abspath` would turn `gs://bucket/run` into a
local `./gs:/bucket/run`). `write_atomic` and `append_line` are the two ways run records are
written; `WorkdirLock` keeps a second trainer off a workdir in use.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

from etils import epath

from dvp_jax.errors import UserError


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


def remove_if_empty(directory: epath.Path) -> None:
    """Removes `directory` if it holds nothing but an empty `checkpoints/` (what a run that
    failed while being built leaves); anything else is kept."""
    try:
        entries = list(directory.iterdir())
        if all(p.name == "checkpoints" and not list(p.iterdir()) for p in entries):
            for p in entries:
                p.rmdir()
            directory.rmdir()
    except OSError:
        pass


def write_atomic(path: epath.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary sibling and one rename: a reader (or a kill)
    sees the old file or the new one, never a partial one (on object stores the rename is a
    copy, so a kill can at worst leave the temporary file beside the old one)."""
    path = as_path(path)
    tmp = path.parent / f".tmp.{path.name}.{uuid.uuid4().hex}"
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException as e:
        with contextlib.suppress(Exception):
            if tmp.exists():
                tmp.unlink()
        if isinstance(e, OSError) and not is_remote(path):
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
        raise


def append_line(path: epath.Path, line: str, rewrite: str) -> None:
    """Appends `line` to `path`; `rewrite` is the whole new content, written atomically where
    the backend cannot append (object stores)."""
    path = as_path(path)
    if is_remote(path):
        write_atomic(path, rewrite)
        return
    try:
        with open(path, "a") as fh:
            fh.write(line)
    except OSError as e:
        raise OSError(e.errno, f"cannot append to {path}: {e.strerror or e}") from e


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


class WorkdirInUseError(UserError):
    """Another trainer holds the workdir's lock."""


class WorkdirLock:
    """One trainer per workdir: `<workdir>/.lock`, naming its holder (host and pid).

    Local disk: an exclusive `flock` on the file, which the kernel drops when the holder dies
    (kill -9 included), so a stale file never blocks a rerun. A `scheme://` workdir (object
    stores have no locks): a lease, the holder rewriting the file every `HEARTBEAT_S` seconds
    from a daemon thread; a lease not renewed for `STALE_S` seconds belongs to a dead process
    and is taken over. Two trainers starting within the same moment on an object store can
    both take the lease (there is no atomic create-if-absent through epath): the lease stops a
    second trainer started while one runs, which is the mistake it is for.
    """

    NAME = ".lock"
    HEARTBEAT_S = 15.0
    STALE_S = 60.0

    def __init__(self, workdir: str | os.PathLike):
        self.path = as_path(workdir) / self.NAME
        self._fd: int | None = None
        self._stop: threading.Event | None = None
        self._renewer: threading.Thread | None = None
        self._holder = {"host": socket.gethostname(), "pid": os.getpid()}

    def acquire(self) -> None:
        """Takes the lock or raises `WorkdirInUseError` naming the holder."""
        if is_remote(self.path):
            self._acquire_lease()
        else:
            self._acquire_flock()

    def release(self) -> None:
        """Gives the lock up and removes the file; a no-op if not held."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        if self._stop is not None:
            self._stop.set()
            self._renewer.join(timeout=30)  # no renewal lands after the file is removed
            self._stop = self._renewer = None
            with contextlib.suppress(Exception):
                self.path.unlink()

    def _refuse(self, holder: str, detail: str = "") -> None:
        raise WorkdirInUseError(
            f"workdir {self.path.parent} is in use by another trainer ({holder}{detail}); wait "
            "for it to end or stop it, or pass another --workdir"
        )

    def _acquire_flock(self) -> None:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                self._refuse(_describe(holder))
            # The holder before us may have removed the file between our open and our lock:
            # then we hold a lock on a file nobody else can see; start again on the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self._holder).encode(), 0)
        self._fd = fd

    def _acquire_lease(self) -> None:
        lease, age = None, None
        with contextlib.suppress(Exception):  # no file, or an unreadable one: not held
            lease = self.path.read_text()
            age = time.time() - float(json.loads(lease)["time"])
        if age is not None and age < self.STALE_S:
            self._refuse(_describe(lease), f", lease renewed {age:.0f} s ago")
        self._write_lease()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, args=(self._stop,), daemon=True)
        self._renewer.start()

    def _write_lease(self) -> None:
        write_atomic(self.path, json.dumps({**self._holder, "time": time.time()}))

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self.HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed renewal is retried next time
                self._write_lease()

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(holder_json: str) -> str:
    try:
        holder = json.loads(holder_json)
        return f"host {holder['host']}, pid {holder['pid']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
