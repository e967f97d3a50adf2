"""The gcloud commands that create, set up, run on, inspect and delete a Cloud TPU VM slice.

`python -m experiments.launch ACTION --tpu NAME --zone Z [--project P] ... [--run]`, ACTION one of
  create  --accelerator v5p-64 [--version V] [--spot] [--queued [--best_effort]]
  setup   [--stage gs://BUCKET/PATH=/LOCAL/PATH ...] [--sync git --git_remote URL [--git_ref R]]
  run     EXPERIMENT --root gs://BUCKET/runs [--sweep NAME=VALUE ...] [--only 0,2] [--detach]
  status | delete  [--queued]
prints the commands, numbered; only `--run` executes them, in order, stopping at the first
failure. `launch.py EXPERIMENT --tpu NAME --zone Z ...` (the older form) is setup + run. Every
remote command runs on all workers (`ssh --worker=all`) and is POSIX sh.

- setup: (1) the project into ~/dvp_jax: a tarball of this working tree (tracked and untracked
  files git does not ignore), or with `--sync git` a checkout of a commit of `--git_remote`.
  (2) Python: TPU VM images carry their Ubuntu's Python (3.10 on 22.04), older than the
  project's `requires-python`. A pinned uv in ~/.local/bin (no shell profile edits) installs a
  standalone CPython of that version without root or PPAs, identically on every image (apt and
  deadsnakes depend on the Ubuntu release), and a venv ~/dvp_jax_venv (kept if its Python already
  has that version). (3) `uv pip install -e . "jax[tpu]"` into it (libtpu is on PyPI; the
  code-less seqio of packaging/seqio_standin first, as `make install` does), then an
  import check. (4) each `--stage SRC=DEST` copies a gs:// object or folder to DEST on the
  worker's disk, through DEST.partial and a rename (DEST is complete whenever it exists); an
  existing DEST is kept (remove it to stage again); a missing top directory such as /data is
  created with sudo and given to the user.
- run: one ssh per work unit, in turn (each uses the whole slice; `--detach`: all of them under
  nohup, returning at once). Each worker runs the trainer with `--distributed`
  (`jax.distributed.initialize()` finds the other hosts), shows its output and writes it to
  ~/dvp_jax/logs/EXPERIMENT/UNIT.HOSTNAME.log, then copies that to WORKDIR/logs/HOSTNAME.log
  (`gcloud storage cp` for gs://). The exit status is the trainer's, else the copy's. Multi-host
  checkpoints need storage every host sees: a gs:// root. The workers' service account needs
  read access to the staged objects and write access to the root.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Sequence

from experiments import launch

UV_VERSION = "0.6.12"  # pinned: the installer URL and the `uv` CLI used below
UV = '"$HOME"/.local/bin/uv'
SOURCE_TARBALL = "dvp_jax_src.tgz"
# The runtime image per TPU generation (Cloud TPU "TPU software versions" page, for JAX).
RUNTIME_VERSIONS = {
    "v6e": "v2-alpha-tpuv6e",
    "v5p": "v2-alpha-tpuv5",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v4": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v2": "tpu-ubuntu2204-base",
}

_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
_PROJECT = re.compile(r"([a-z0-9][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]")
_ACCELERATOR = re.compile(r"(v[0-9]+[a-z]*)-([0-9]+)")
_GS = re.compile(r"gs://([a-z0-9][-a-z0-9_.]{1,220}[a-z0-9])(/.*)?")


# ------------------------------------------------------------------------------------------------
# Checked inputs.
# ------------------------------------------------------------------------------------------------
def _want(ok: object, flag: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value!r}: want {want}")


def min_python() -> tuple[int, int]:
    """The lowest Python `pyproject.toml` accepts (`requires-python = ">=3.N"`)."""
    with open(os.path.join(launch.REPO, "pyproject.toml"), "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    _want(m, "pyproject.toml requires-python", spec, "the form '>=3.N'")
    return 3, int(m.group(1))


def check_accelerator(accelerator: str | None) -> str:
    """`v5p-64` and the like: the generation, then the size."""
    if not accelerator:
        raise ValueError("create needs --accelerator TYPE, e.g. --accelerator v5p-64")
    m = _ACCELERATOR.fullmatch(accelerator)
    want = "GENERATION-SIZE such as v5p-64, v6e-8, v5litepod-16 or v4-32 (`gcloud compute tpus "
    _want(
        m and int(m.group(2)) > 0, "--accelerator", accelerator, want + "accelerator-types list`)"
    )
    return accelerator


def runtime_version(accelerator: str, version: str | None) -> str:
    """`version`, else the JAX runtime image of the accelerator's generation."""
    generation = _ACCELERATOR.fullmatch(accelerator).group(1)
    if not version and generation not in RUNTIME_VERSIONS:
        raise ValueError(
            f"no default runtime version for {accelerator} (known: {', '.join(RUNTIME_VERSIONS)})"
            ": pass --version (`gcloud compute tpus tpu-vm versions list`)"
        )
    return version or RUNTIME_VERSIONS[generation]


def check_remote_path(flag: str, path: str) -> str:
    """A worker path, relative to the home directory or absolute: normalised, no '..'."""
    ok = path not in ("", ".", "/") and posixpath.normpath(path) == path
    _want(
        ok and ".." not in path.split("/"), flag, path, "a normalised path, not '.' or '/', no '..'"
    )
    return path


def check_gs(flag: str, url: str) -> str:
    ok = _GS.fullmatch(url) and not any(c in url for c in "*?[\n")
    _want(ok, flag, url, "gs://BUCKET/PATH (BUCKET: 3-63 of a-z 0-9 - _ .; no wildcards)")
    return url


def parse_stage(item: str) -> tuple[str, str]:
    """`gs://b/Qwen3=/data/Qwen3` -> ("gs://b/Qwen3", "/data/Qwen3"), both checked."""
    m = re.fullmatch(r"(gs://.+?)=(/.*)", item, flags=re.DOTALL)
    _want(m, "--stage", item, "gs://BUCKET/PATH=/ABSOLUTE/PATH, e.g. gs://b/Qwen3=/data/Qwen3")
    src, dest = m.group(1).rstrip("/"), m.group(2)
    check_gs("--stage", src)
    _want((_GS.fullmatch(src).group(2) or "").strip("/"), "--stage", item, "a path in the bucket")
    ok = posixpath.normpath(dest) == dest and dest.count("/") >= 2 and "\n" not in dest
    _want(ok, "--stage", item, "a normalised local path below a top directory, e.g. /data/NAME")
    return src, dest


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named TPU VM slice (`queued`: requested and deleted as a queued resource)."""

    name: str
    zone: str
    project: str | None = None
    queued: bool = False

    def __post_init__(self):
        if not self.name:
            raise ValueError("--tpu NAME is required: the slice's name, e.g. --tpu dvp-v5p")
        want = "1-63 lowercase letters, digits and '-', from a letter, not ending in '-'"
        _want(_NAME.fullmatch(self.name), "--tpu", self.name, want)
        if not self.zone:
            raise ValueError("--zone is required: the slice's zone, e.g. --zone us-east5-a")
        want = "a zone such as us-east5-a (a region, '-', a letter; a region is not a zone)"
        _want(_ZONE.fullmatch(self.zone), "--zone", self.zone, want)
        want = "a project ID (6-30 lowercase letters, digits and '-', from a letter)"
        _want(
            self.project is None or _PROJECT.fullmatch(self.project),
            "--project",
            self.project,
            want,
        )

    def gcloud(self, *words: str, alpha: bool = False) -> list[str]:
        """`gcloud [alpha] compute tpus WORDS... --zone Z [--project P]`."""
        argv = ["gcloud", *(["alpha"] if alpha else []), "compute", "tpus", *words]
        return argv + ["--zone", self.zone] + (["--project", self.project] if self.project else [])

    def ssh(self, script: str) -> list[str]:
        """Runs a shell command on every worker of the slice (in parallel; waits for all)."""
        return self.gcloud("tpu-vm", "ssh", self.name, "--worker=all", f"--command={script}")


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
        want = f"3.N with N >= {low[1]} (pyproject.toml: requires-python >= 3.{low[1]})"
        _want(m and int(m.group(1)) >= low[1], "--python_version", self.python_version, want)

    @property
    def dir(self) -> str:
        return home(self.remote_dir)

    @property
    def interpreter(self) -> str:
        """The shell word of the Python that installs and runs the project."""
        return shlex.quote(self.python) if self.python else home(f"{self.venv}/bin/python")


@dataclasses.dataclass(frozen=True)
class Step:
    """One printed (and with --run, executed) command.

    `cmd` is an argv, or a shell pipeline run here in the repository root (packing the tree).
    `unit` is the work-unit index of a run step (for the `--only` hint after a failure).
    """

    desc: str
    cmd: list[str] | str
    unit: int | None = None


# ------------------------------------------------------------------------------------------------
# Commands of each action.
# ------------------------------------------------------------------------------------------------
def create_steps(
    tpu: Slice,
    accelerator: str,
    version: str | None = None,
    spot: bool = False,
    best_effort: bool = False,
) -> list[Step]:
    """The slice, created at once (`tpu-vm create`) or requested as a queued resource."""
    check_accelerator(accelerator)
    version = runtime_version(accelerator, version)
    if best_effort and not tpu.queued:
        raise ValueError("--best_effort needs --queued (only queued resources are best-effort)")
    if best_effort and spot:
        raise ValueError("--spot and --best_effort exclude each other: choose one")
    if not tpu.queued:
        argv = tpu.gcloud(
            "tpu-vm", "create", tpu.name, "--accelerator-type", accelerator, "--version", version
        )
        if spot:
            argv[argv.index("--zone") : argv.index("--zone")] = ["--spot"]
        return [Step(f"create the {accelerator} slice {tpu.name} (waits until it is ready)", argv)]
    words = ["queued-resources", "create", tpu.name, "--node-id", tpu.name]
    words += ["--accelerator-type", accelerator, "--runtime-version", version]
    # --best-effort exists only in the alpha track of gcloud; --spot is GA.
    words += ["--spot"] if spot else (["--best-effort"] if best_effort else [])
    return [
        Step(
            f"request {tpu.name} ({accelerator}) as a queued resource; `status --queued` "
            "shows its state, ACTIVE once the slice exists",
            tpu.gcloud(*words, alpha=best_effort),
        )
    ]


def local_head() -> str:
    """This checkout's HEAD commit (what `--sync git` checks out on the workers by default)."""
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=launch.REPO, capture_output=True, text=True, check=False
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
        steps.append(
            Step(
                f"Python {layout.python_version} (uv {UV_VERSION}) and the venv "
                f"~/{layout.venv} on every worker",
                tpu.ssh(python_script(layout)),
            )
        )
    if install:
        steps.append(
            Step(
                "install the project and jax[tpu] on every worker", tpu.ssh(install_script(layout))
            )
        )
    dests = [dest for _, dest in stages]
    if len(set(dests)) != len(dests):
        raise ValueError(f"--stage: two sources staged to the same local path ({dests})")
    for src, dest in stages:
        steps.append(
            Step(f"stage {src} to {dest} on every worker", tpu.ssh(stage_script(src, dest)))
        )
    return steps


def unit_script(exp: launch.Experiment, unit: launch.WorkUnit, layout: Layout, root: str) -> str:
    """What every worker runs for one unit: the trainer, its log shown and kept in the workdir."""
    workdir = launch.join_path(root, exp.name, unit.name)
    argv = launch.unit_argv(exp.config_flag, unit.overrides, workdir, "python", ("--distributed",))
    train = f"{layout.interpreter} {shlex.join(argv[1:])}"
    log = shlex.quote(f"logs/{exp.name}/{unit.name}") + '."$(uname -n)".log'
    logs = launch.join_path(workdir, "logs")
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


def run_steps(
    exp: launch.Experiment, tpu: Slice, layout: Layout, root: str, detach: bool = False
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


def status_steps(tpu: Slice) -> list[Step]:
    if tpu.queued:
        return [
            Step(
                f"state of the queued resource {tpu.name} (WAITING_FOR_RESOURCES, "
                "PROVISIONING, ACTIVE, ...)",
                tpu.gcloud("queued-resources", "describe", tpu.name),
            )
        ]
    return [Step(f"state and health of {tpu.name}", tpu.gcloud("tpu-vm", "describe", tpu.name))]


def delete_steps(tpu: Slice) -> list[Step]:
    if tpu.queued:  # --force deletes the slice first, then the request
        argv = tpu.gcloud("queued-resources", "delete", tpu.name, "--force")
        return [Step(f"delete the queued resource {tpu.name} and its slice", argv)]
    return [Step(f"delete the slice {tpu.name}", tpu.gcloud("tpu-vm", "delete", tpu.name))]


# ------------------------------------------------------------------------------------------------
# Printing and running.
# ------------------------------------------------------------------------------------------------
def render(cmd: list[str] | str) -> str:
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


def execute(steps: Sequence[Step], run: bool) -> int:
    """Prints every step; with `run`, runs them in order and stops at the first failure."""
    n = len(steps)
    for i, step in enumerate(steps, 1):
        print(f"# [{i}/{n}] {step.desc}\n{render(step.cmd)}", flush=True)
        if not run:
            continue
        try:
            rc = subprocess.run(
                step.cmd, shell=isinstance(step.cmd, str), cwd=launch.REPO, check=False
            ).returncode
        except FileNotFoundError as e:
            print(
                f"[launch] {e.filename}: not found (install the Google Cloud CLI)", file=sys.stderr
            )
            rc = 127
        if rc:
            msg = f"[launch] step {i}/{n} failed with exit status {rc}: {step.desc}. "
            msg += f"Stopped; steps {i + 1}-{n} were not run." if i < n else "Stopped."
            units = [s.unit for s in steps[i - 1 :] if s.unit is not None]
            if units:
                msg += f" After fixing it, resume with --only {','.join(map(str, units))}."
            print(msg, file=sys.stderr, flush=True)
            return rc
    if not run:
        print("[launch] printed only: add --run to execute these commands", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------------------------
def add_slice_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, queued: bool) -> None:
    p.add_argument("--tpu", default=None, help="the slice's name, e.g. dvp-v5p")
    p.add_argument("--zone", default=None, help="e.g. us-east5-a")
    p.add_argument("--project", default=None, help="default: gcloud's configured project")
    p.add_argument("--run", action="store_true", help="execute the printed commands, in order")
    if queued:
        p.add_argument("--queued", action="store_true", help="a queued resource (create --queued)")


def add_layout_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--remote_dir", default="dvp_jax", help="project dir on workers (under ~)")
    p.add_argument("--venv", default="dvp_jax_venv", help="venv on workers (under ~)")
    p.add_argument("--remote_python", default=None, help="use this interpreter instead of the venv")


def add_setup_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--sync", default="scp", choices=("scp", "git"))
    p.add_argument("--git_remote", default=None)
    p.add_argument("--git_ref", default=None, help="default: this checkout's HEAD commit")
    p.add_argument("--python_version", default="", help="default: pyproject's lowest, e.g. 3.11")
    p.add_argument("--skip_install", action="store_true", help="sync only: no Python, no pip")
    p.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="gs://BUCKET/PATH=/LOCAL/PATH",
        help="copy a gs:// object or folder to this path on every worker (repeatable)",
    )


def slice_from(args: argparse.Namespace) -> Slice:
    return Slice(args.tpu or "", args.zone or "", args.project, getattr(args, "queued", False))


def layout_from(args: argparse.Namespace) -> Layout:
    return Layout(
        args.remote_dir, args.venv, getattr(args, "python_version", ""), args.remote_python
    )


def setup_from(args: argparse.Namespace, tpu: Slice, layout: Layout) -> list[Step]:
    return setup_steps(
        tpu,
        layout,
        sync=args.sync,
        git_remote=args.git_remote,
        git_ref=args.git_ref,
        install=not args.skip_install,
        stages=[parse_stage(s) for s in args.stage],
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.launch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create the slice (or queue a request for it)")
    add_slice_args(create, queued=True)
    create.add_argument("--accelerator", default=None, help="accelerator type, e.g. v5p-64")
    create.add_argument("--version", default=None, help="runtime image (default: per generation)")
    create.add_argument("--spot", action="store_true", help="Spot VMs (preemptible, cheaper)")
    create.add_argument("--best_effort", action="store_true", help="with --queued (gcloud alpha)")
    setup = sub.add_parser("setup", help="project, Python, jax[tpu] and data on every worker")
    add_slice_args(setup, queued=False)
    add_layout_args(setup)
    add_setup_args(setup)
    run = sub.add_parser("run", help="an experiment's work units on every worker")
    launch.add_experiment_args(run)
    add_slice_args(run, queued=False)
    add_layout_args(run)
    run.add_argument("--detach", action="store_true", help="start all units under nohup, return")
    for name, text in (("status", "the slice's state"), ("delete", "delete the slice")):
        add_slice_args(sub.add_parser(name, help=text), queued=True)
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """`python -m experiments.launch ACTION ...` (ACTION in `launch.TPU_ACTIONS`)."""
    args = parse_args(argv)
    try:
        tpu = slice_from(args)
        if args.action == "create":
            steps = create_steps(tpu, args.accelerator, args.version, args.spot, args.best_effort)
        elif args.action == "setup":
            steps = setup_from(args, tpu, layout_from(args))
        elif args.action == "run":
            layout = layout_from(args)
            exp = launch.experiment_from(args)
            steps = run_steps(exp, tpu, layout, args.root or launch.DEFAULT_ROOT, args.detach)
        elif args.action == "status":
            steps = status_steps(tpu)
        else:
            steps = delete_steps(tpu)
    except ValueError as e:
        raise SystemExit(f"[launch] {e}") from None
    return execute(steps, args.run)


def legacy_main(args: argparse.Namespace, exp: launch.Experiment) -> int:
    """`launch.py EXPERIMENT --tpu NAME --zone Z ...`: setup, then run."""
    try:
        tpu, layout = slice_from(args), layout_from(args)
        steps = setup_from(args, tpu, layout)
        steps += run_steps(exp, tpu, layout, args.root or launch.DEFAULT_ROOT, args.detach)
    except ValueError as e:
        raise SystemExit(f"[launch] {e}") from None
    return execute(steps, args.run)
