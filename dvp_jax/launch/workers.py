"""What runs on every worker of a TPU VM slice: `setup` (project, Python, data) and `run` (units).

setup: (1) the project into ~/dvp_jax: a tarball of this working tree (tracked and untracked
files git does not ignore), or a checkout of a commit of `--git_remote`; (2) a pinned uv in
~/.local/bin installs the lowest CPython pyproject.toml accepts (TPU images carry an older one)
and a venv ~/dvp_jax_venv, without root; (3) the project (editable) and `jax[tpu]`, then an
import check; (4) each `--stage gs://SRC=/DEST` copied through DEST.partial and a rename, kept
where DEST exists. run: one ssh per work unit (`--detach`: all under nohup); each worker runs the
unit's trainer command with `--distributed`, shows and keeps its output in
~/dvp_jax/logs/EXPERIMENT/UNIT.HOSTNAME.log and copies that to WORKDIR/logs/HOSTNAME.log; the
exit status is the trainer's, else the copy's. Every remote command is POSIX sh. The trainer's
flags come from `sweep.py` verbatim: nothing here reads a config.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Sequence

from dvp_jax.launch.sweep import REPO, Experiment, WorkUnit, join_path
from dvp_jax.launch.tpu import Slice, Step, check_gs, want

UV_VERSION = "0.6.12"  # pinned: the installer URL and the `uv` CLI used below
UV = '"$HOME"/.local/bin/uv'
SOURCE_TARBALL = "dvp_jax_src.tgz"


def min_python() -> tuple[int, int]:
    """The lowest Python `pyproject.toml` accepts (`requires-python = ">=3.N"`)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    want(m, "pyproject.toml requires-python", spec, "the form '>=3.N'")
    return 3, int(m.group(1))


def check_remote_path(flag: str, path: str) -> str:
    """A worker path, relative to the home directory or absolute: normalised, no '..'."""
    ok = path not in ("", ".", "/") and posixpath.normpath(path) == path
    ok = ok and ".." not in path.split("/")
    want(ok, flag, path, "a normalised path, not '.' or '/', no '..'")
    return path


def home(path: str) -> str:
    """A shell word for a worker path: absolute as given, else under the home directory."""
    return shlex.quote(path) if path.startswith("/") else '"$HOME"/' + shlex.quote(path)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the project and its Python live on every worker.

    Attributes:
      remote_dir: the project (relative to the home directory unless absolute).
      venv: the virtual environment that setup creates and run uses.
      python_version: its Python, `3.N` (checked against pyproject.toml's requires-python).
      python: an interpreter to use instead of the venv (no uv, no venv; `pip` installs into it).
    """

    remote_dir: str = "dvp_jax"
    venv: str = "dvp_jax_venv"
    python_version: str = ""  # "": the lowest version pyproject.toml accepts
    python: str | None = None

    def __post_init__(self):
        check_remote_path("--remote_dir", self.remote_dir)
        check_remote_path("--venv", self.venv)
        low = min_python()
        if not self.python_version:
            object.__setattr__(self, "python_version", "{}.{}".format(*low))
        m = re.fullmatch(r"3\.(\d+)", self.python_version)
        wanted = f"3.N with N >= {low[1]} (pyproject.toml: requires-python >= 3.{low[1]})"
        want(m and int(m.group(1)) >= low[1], "--python_version", self.python_version, wanted)

    @property
    def dir(self) -> str:
        return home(self.remote_dir)

    @property
    def interpreter(self) -> str:
        """The shell word of the Python that installs and runs the project."""
        return shlex.quote(self.python) if self.python else home(f"{self.venv}/bin/python")


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------
def local_head() -> str:
    """This checkout's HEAD commit (what `--sync git` checks out on the workers by default)."""
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "HEAD"


def sync_steps(
    tpu: Slice, layout: Layout, sync: str, git_remote: str | None, git_ref: str | None
) -> list[Step]:
    """The project's files into `layout.remote_dir` on every worker."""
    d = layout.dir
    if sync == "scp":
        tarball, files = f"/tmp/{SOURCE_TARBALL}", f"/tmp/{SOURCE_TARBALL}.files"
        # `&&`, not a pipe: a failing `git ls-files` must not leave an empty tarball.
        pack = (
            f"git ls-files -z --cached --others --exclude-standard > {files} && "
            f"tar -czf {tarball} --null -T {files}"
        )
        scp = tpu.gcloud("tpu-vm", "scp", tarball, f"{tpu.name}:{SOURCE_TARBALL}", "--worker=all")
        unpack = f"mkdir -p {d} && tar -xzf {home(SOURCE_TARBALL)} -C {d}"
        return [
            Step("pack the working tree (tracked + untracked, not ignored)", pack),
            Step("copy it to every worker", scp),
            Step(f"unpack it into ~/{layout.remote_dir} on every worker", tpu.ssh(unpack)),
        ]
    if sync == "git":
        if not git_remote:
            raise ValueError("--sync git needs --git_remote URL (a remote every worker can fetch)")
        git_ref = git_ref or local_head()
        r, ref = shlex.quote(git_remote), shlex.quote(git_ref)
        fetch = (
            f"(test -d {d}/.git || git clone {r} {d}) && cd {d} && git fetch {r} {ref} && "
            "git checkout --force FETCH_HEAD"
        )
        return [Step(f"check out {git_ref} of {git_remote} on every worker", tpu.ssh(fetch))]
    raise ValueError(f"--sync must be 'scp' or 'git', got {sync!r}")


def python_script(layout: Layout) -> str:
    """Installs uv (pinned) and Python `layout.python_version`, and creates the venv."""
    v = layout.python_version
    venv, py = home(layout.venv), layout.interpreter
    same = f"sys.version_info[:2] != ({v.replace('.', ', ')})"
    return (
        f"(test -x {UV} || curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | "
        f'env UV_UNMANAGED_INSTALL="$HOME"/.local/bin sh) && {UV} python install {v} && '
        f'({py} -c "import sys; sys.exit({same})" 2> /dev/null || '
        f"(rm -rf {venv} && {UV} venv --python {v} {venv}))"
    )


def install_script(layout: Layout) -> str:
    """The project (editable) and `jax[tpu]` into the venv (or `layout.python`), then a check."""
    py = layout.interpreter
    pip = f"{UV} pip install --python {py}" if not layout.python else f"{py} -m pip install"
    check = f'{py} -c "import jax, dvp_jax; print(jax.__version__)"'
    # The code-less seqio first, so JetStream's requirement does not pull TensorFlow (Makefile).
    return f'cd {layout.dir} && {pip} ./packaging/seqio_standin && {pip} -e . "jax[tpu]" && {check}'


def stage_script(src: str, dest: str) -> str:
    """Copies gs:// object or folder `src` to `dest` (kept if present; see the module doc)."""
    q = shlex.quote
    top = "/" + dest.split("/")[1]
    partial = f"{dest}.partial"
    copied = f"{partial}/{posixpath.basename(src)}"  # `cp -r SRC DIR/` writes DIR/basename(SRC)
    return (
        f"if test -e {q(dest)}; then echo {q(dest)} exists, kept; else "
        f'(test -d {q(top)} || (sudo mkdir -p {q(top)} && sudo chown "$(id -u):$(id -g)" '
        f"{q(top)})) && mkdir -p {q(posixpath.dirname(dest))} && rm -rf {q(partial)} && "
        f"mkdir {q(partial)} && gcloud storage cp -r {q(src)} {q(partial)}/ && "
        f"mv {q(copied)} {q(dest)} && rmdir {q(partial)}; fi"
    )


def setup_steps(
    tpu: Slice,
    layout: Layout,
    *,
    sync: str = "scp",
    git_remote: str | None = None,
    git_ref: str | None = None,
    install: bool = True,
    stages: Sequence[tuple[str, str]] = (),
) -> list[Step]:
    """Project, Python, `jax[tpu]` and staged data on every worker, in that order."""
    steps = sync_steps(tpu, layout, sync, git_remote, git_ref)
    if install and not layout.python:
        desc = f"Python {layout.python_version} (uv {UV_VERSION}) and the venv ~/{layout.venv}"
        steps.append(Step(desc + " on every worker", tpu.ssh(python_script(layout))))
    if install:
        desc = "install the project and jax[tpu] on every worker"
        steps.append(Step(desc, tpu.ssh(install_script(layout))))
    dests = [dest for _, dest in stages]
    if len(set(dests)) != len(dests):
        raise ValueError(f"--stage: two sources staged to the same local path ({dests})")
    for src, dest in stages:
        desc = f"stage {src} to {dest} on every worker"
        steps.append(Step(desc, tpu.ssh(stage_script(src, dest))))
    return steps


# ------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------
def check_root(root: str) -> str:
    if "://" in root:
        check_gs("--root", root)
    else:
        print(
            f"[launch] warning: --root {root} is a local path on each worker; multi-host "
            "checkpoints and summaries need shared storage (gs://...)",
            file=sys.stderr,
        )
    return root


def unit_script(exp: Experiment, unit: WorkUnit, layout: Layout, root: str) -> str:
    """What every worker runs for one unit: the trainer, its log shown and kept in the workdir."""
    workdir = join_path(root, exp.name, unit.name)
    argv = exp.argv(unit, workdir, "python", ("--distributed",))
    train = f"{layout.interpreter} {shlex.join(argv[1:])}"
    log = shlex.quote(f"logs/{exp.name}/{unit.name}") + '."$(uname -n)".log'
    logs = join_path(workdir, "logs")
    dest = shlex.quote(logs) + '/"$(uname -n)".log'
    if workdir.startswith("gs://"):
        copy = f'gcloud storage cp "$log" {dest}'
    else:
        copy = f'mkdir -p {shlex.quote(logs)} && cp "$log" {dest}'
    # POSIX sh (no pipefail): the trainer's exit status travels through "$log.rc".
    return (
        f"cd {layout.dir} && mkdir -p {shlex.quote(f'logs/{exp.name}')} && log={log} && "
        f'{{ {train} ; echo $? > "$log.rc"; }} 2>&1 | tee "$log"; '
        f'rc=$(cat "$log.rc" 2> /dev/null || echo 1); {copy}; crc=$?; exit $((rc ? rc : crc))'
    )


def run_steps(
    exp: Experiment, tpu: Slice, layout: Layout, root: str, detach: bool = False
) -> list[Step]:
    """One ssh per work unit (or, detached, one that starts them all under nohup)."""
    check_root(root)
    units = [(u, unit_script(exp, u, layout, root)) for u in exp.units]
    if not detach:
        return [
            Step(f"work unit {u.name} on every worker", tpu.ssh(script), unit=u.index)
            for u, script in units
        ]
    # All units in sequence in one background script per worker; ssh returns at once. A failed
    # unit does not stop the next one (`;`), each unit's log still lands in its workdir.
    script = " ; ".join(f"( {s} )" for _, s in units)
    remote = (
        f"mkdir -p {layout.dir} && nohup sh -c {shlex.quote(script)} > "
        f"{home(f'{layout.remote_dir}/{exp.name}.launch.log')} 2>&1 < /dev/null &"
    )
    names = ", ".join(u.name for u, _ in units)
    return [Step(f"start all {len(units)} units in the background: {names}", tpu.ssh(remote))]
