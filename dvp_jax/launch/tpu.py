"""A Cloud TPU VM slice's gcloud commands: create, status, delete, ssh; printing and running them.

Every command is a `Step` (a description and an argv, or a shell pipeline run here); `execute`
prints the steps, numbered, and only with `run=True` runs them in order, stopping at the first
failure. Names, zones, projects, accelerator types and gs:// URLs are checked before anything is
printed; a placeholder left in a value (MY_PROJECT) is named in the error. What runs on the
workers (the project, Python, staged data, the trainer) is built in `workers.py`. Nothing here
knows the model or the trainer's flags.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

from dvp_jax.launch.sweep import REPO

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
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*(_[A-Z0-9]+)+\b")  # MY_PROJECT, MY_BUCKET


# ------------------------------------------------------------------------------------------------
# Checked inputs.
# ------------------------------------------------------------------------------------------------
def want(ok: object, flag: str, value: object, wanted: str) -> None:
    """Raises `ValueError("FLAG 'VALUE': want WANTED")` unless `ok`, naming a placeholder."""
    if ok:
        return
    placeholder = _PLACEHOLDER.search(str(value))
    hint = f" ({placeholder.group()} is a placeholder: put yours there)" if placeholder else ""
    raise ValueError(f"{flag} {value!r}: want {wanted}{hint}")


def check_accelerator(accelerator: str | None) -> str:
    """`v5p-64` and the like: the generation, then the size."""
    if not accelerator:
        raise ValueError("create needs --accelerator TYPE, e.g. --accelerator v5p-64")
    m = _ACCELERATOR.fullmatch(accelerator)
    wanted = "GENERATION-SIZE such as v5p-64, v6e-8, v5litepod-16 or v4-32 (`gcloud compute tpus "
    want(
        m and int(m.group(2)) > 0, "--accelerator", accelerator, wanted + "accelerator-types list`)"
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


def check_gs(flag: str, url: str) -> str:
    ok = _GS.fullmatch(url) and not any(c in url for c in "*?[\n")
    want(ok, flag, url, "gs://BUCKET/PATH (BUCKET: 3-63 of a-z 0-9 - _ .; no wildcards)")
    return url


def parse_stage(item: str) -> tuple[str, str]:
    """`gs://b/Qwen3=/data/Qwen3` -> ("gs://b/Qwen3", "/data/Qwen3"), both checked."""
    m = re.fullmatch(r"(gs://.+?)=(/.*)", item, flags=re.DOTALL)
    want(m, "--stage", item, "gs://BUCKET/PATH=/ABSOLUTE/PATH, e.g. gs://b/Qwen3=/data/Qwen3")
    src, dest = m.group(1).rstrip("/"), m.group(2)
    check_gs("--stage", src)
    want((_GS.fullmatch(src).group(2) or "").strip("/"), "--stage", item, "a path in the bucket")
    ok = posixpath.normpath(dest) == dest and dest.count("/") >= 2 and "\n" not in dest
    want(ok, "--stage", item, "a normalised local path below a top directory, e.g. /data/NAME")
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
        wanted = "1-63 lowercase letters, digits and '-', from a letter, not ending in '-'"
        want(_NAME.fullmatch(self.name), "--tpu", self.name, wanted)
        if not self.zone:
            raise ValueError("--zone is required: the slice's zone, e.g. --zone us-east5-a")
        wanted = "a zone such as us-east5-a (a region, '-', a letter; a region is not a zone)"
        want(_ZONE.fullmatch(self.zone), "--zone", self.zone, wanted)
        ok = self.project is None or _PROJECT.fullmatch(self.project)
        wanted = "a project ID (6-30 lowercase letters, digits and '-', from a letter)"
        want(ok, "--project", self.project, wanted)

    def gcloud(self, *words: str, alpha: bool = False) -> list[str]:
        """`gcloud [alpha] compute tpus WORDS... --zone Z [--project P]`."""
        argv = ["gcloud", *(["alpha"] if alpha else []), "compute", "tpus", *words]
        return argv + ["--zone", self.zone] + (["--project", self.project] if self.project else [])

    def ssh(self, script: str) -> list[str]:
        """Runs a shell command on every worker of the slice (in parallel; waits for all)."""
        return self.gcloud("tpu-vm", "ssh", self.name, "--worker=all", f"--command={script}")


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
# The slice's lifecycle.
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
    desc = (
        f"request {tpu.name} ({accelerator}) as a queued resource; `status --queued` shows its "
        "state, ACTIVE once the slice exists"
    )
    return [Step(desc, tpu.gcloud(*words, alpha=best_effort))]


def status_steps(tpu: Slice) -> list[Step]:
    if tpu.queued:
        desc = (
            f"state of the queued resource {tpu.name} (WAITING_FOR_RESOURCES, PROVISIONING, "
            "ACTIVE, ...)"
        )
        return [Step(desc, tpu.gcloud("queued-resources", "describe", tpu.name))]
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
            shell = isinstance(step.cmd, str)
            rc = subprocess.run(step.cmd, shell=shell, cwd=REPO, check=False).returncode
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
