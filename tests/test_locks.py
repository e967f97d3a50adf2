"""The locks (requirements/<ACCEL>.txt): exact versions for every ACCEL, the Makefile's jax,
libtpu and torch pins, pyproject.toml's ranges, no TensorFlow or seqio, and `make install`
installs from them. No network: the files are read, and make only prints or refuses."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.train_utils import REPO

ACCELS = ("cpu", "cuda", "tpu")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)")


def read_lock(accel: str) -> dict[str, str]:
    """requirements/<accel>.txt as {canonical name: version}; fails on any requirement line that
    is not `name==version` (a range, a URL, an editable, an option)."""
    pins = {}
    for line in (Path(REPO) / "requirements" / f"{accel}.txt").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _PIN.fullmatch(line.strip())
        assert match, f"requirements/{accel}.txt: not an exact pin: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"requirements/{accel}.txt pins {name} twice"
        pins[name] = match[2]
    return pins


def makefile_pins() -> dict[str, str]:
    makefile = (Path(REPO) / "Makefile").read_text()
    names = "JAX_VERSION|LIBTPU_VERSION|TORCH_VERSION"
    return dict(re.findall(rf"^({names}) := (\S+)$", makefile, re.MULTILINE))


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("accel", ACCELS)
def test_each_lock_pins_the_makefiles_versions_and_no_tensorflow(accel):
    lock, pins = read_lock(accel), makefile_pins()
    assert lock["jax"] == lock["jaxlib"] == pins["JAX_VERSION"]
    assert lock["libtpu"] == pins["LIBTPU_VERSION"]
    assert lock["torch"] == pins["TORCH_VERSION"]  # a version, no build label: pip picks it
    assert "pip" in lock and "setuptools" in lock  # `make install` installs the lock's pip first
    heavy = {n for n in lock if n == "seqio" or n.startswith(("tensorflow", "tf-"))}
    assert not heavy, heavy
    cuda_libraries = {n for n in lock if n.startswith(("cuda-", "nvidia-")) or n == "triton"}
    if accel == "cpu":  # torch's CPU build (requirements/cpu-excludes.txt)
        assert not cuda_libraries, cuda_libraries
    else:  # PyPI's torch, the CUDA build, with its libraries
        assert {"cuda-toolkit", "triton"} <= cuda_libraries
    if accel == "cuda":
        assert lock["jax-cuda12-plugin"] == lock["jax-cuda12-pjrt"] == pins["JAX_VERSION"]
    else:
        assert "jax-cuda12-plugin" not in lock


@pytest.mark.parametrize("accel", ACCELS)
def test_each_lock_meets_pyprojects_ranges(accel):
    """Every requirement of the project and its test extra is pinned, inside its range: a
    requirement added to pyproject.toml without `make lock` fails here."""
    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]
    lock = read_lock(accel)
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in lock, f"requirements/{accel}.txt lacks {req}: run make lock"
        assert req.specifier.contains(lock[name], prereleases=True), (accel, str(req), lock[name])


@pytest.mark.parametrize("accel", ACCELS)
def test_make_install_installs_the_lock_and_nothing_else(accel, tmp_path):
    """Besides the lock, only the project and the seqio stand-in (by path) are installed; the
    lock's pip installs them."""
    proc = _make("-n", "install", f"ACCEL={accel}", f"VENV={tmp_path}/venv")
    assert proc.returncode == 0, proc.stderr
    pip = f"{tmp_path}/venv/bin/python -m pip install"
    installs = [line for line in proc.stdout.splitlines() if line.startswith(pip)]
    assert installs == [
        f"{pip} \"$(grep -x 'pip==.*' requirements/{accel}.txt)\"",
        f"{pip} -r requirements/{accel}.txt ./packaging/seqio_standin -e '.[test]'",
    ]


def test_make_install_refuses_a_lock_that_disagrees_with_the_makefile(tmp_path):
    proc = _make("install", "JAX_VERSION=0.0.1", f"VENV={tmp_path}/venv")
    assert proc.returncode == 2
    assert (
        "requirements/cpu.txt does not pin jax==0.0.1, as the Makefile does: run make lock"
        in proc.stderr.splitlines()
    ), proc.stderr
    assert not (tmp_path / "venv").exists()  # refused before the venv is made


def test_the_venv_holds_its_locks_versions():
    """A venv made by `make install ACCEL=a` (its `.installed-a` marker) holds every package of
    requirements/a.txt at the locked version (torch: any build of it, e.g. 2.13.0+cpu)."""
    markers = sorted(Path(sys.prefix).glob(".installed-*"))
    if not markers:
        pytest.skip(f"{sys.prefix} was not made by `make install`")
    accel = markers[0].name.removeprefix(".installed-")
    wrong = {}
    for name, version in read_lock(accel).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not SpecifierSet(f"=={version}").contains(installed, True):
            wrong[name] = (version, installed)
    assert not wrong, f"locked vs installed: {wrong}; run make install"
