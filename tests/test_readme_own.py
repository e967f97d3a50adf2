"""The commands of the README and the docs pages name real flags and valid config values as typed.

docs/data.md ("Your own model and data") has a command for every entry point and its config file
and reward module are written out and used. Each shell command of a page is split as a shell
would (a `...` standing for flags given above is dropped); a `python -m dvp_jax.<module>`
command's flags must be flags that module defines, and a `dvp_jax.main` command's `--config`
with its `--config.*` overrides is parsed by ml_collections' own flag and validated by
`ExperimentConfig.from_config_dict` (read_checkpoint=False: the model and data files the README
names are the user's). The section's Python config file and reward module are written out and
used. Running the commands is what the features' own tests do, on fixtures.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from dvp_jax.tokenizers import CharTokenizer
from dvp_jax.train.config import ExperimentConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = os.path.join("docs", "data.md")  # "Your own model and data"
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name)
    for name in os.listdir(os.path.join(REPO, "docs"))
    if name.endswith(".md")
)
# Its own tests check the launcher's commands (tests/test_launch.py: docs/tpu.md's slice block).
NOT_ABSL = ("dvp_jax.launch",)


def _section(page: str = OWN) -> str:
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def _blocks(lang: str, page: str = OWN) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(page), flags=re.S)


def _commands(page: str = OWN) -> list[list[str]]:
    """Each `python -m dvp_jax...` command of the page's bash blocks, as argv after the module
    (line continuations joined, environment assignments, comments and `...` dropped)."""
    out = []
    for block in _blocks("bash", page):
        for line in block.replace("\\\n", " ").splitlines():
            words = [w for w in shlex.split(line, comments=True) if w != "..."]
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words[:2] == ["python", "-m"] and words[2].startswith("dvp_jax."):
                out.append([words[2], *_joined(words[3:])])
    return out


def _every_command() -> list[tuple[str, list[str]]]:
    return [(page, argv) for page in PAGES for argv in _commands(page)]


def _joined(args: list[str]) -> list[str]:
    """`--flag value` as `--flag=value` (absl takes both)."""
    out = []
    for arg in args:
        if out and not arg.startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _defined_flags(module: str) -> set[str]:
    """The flag names `module` defines, read from its source with `ast` (main and evaluate both
    define --config and --workdir in absl's global registry, so both cannot be imported here):
    `flags.DEFINE_*("name", ...)`, or a name looped over a tuple of strings; an entry point
    that imports its `run` from another dvp_jax module (`dvp_jax.aot`) has that module's."""
    with open(os.path.join(REPO, *module.split(".")) + ".py") as f:
        tree = ast.parse(f.read())
    names = {"verbose", "help"}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "run" for a in node.names):
            names |= _defined_flags(node.module)
    for node in ast.walk(tree):
        loops = [*getattr(node, "generators", ()), *([node] if isinstance(node, ast.For) else [])]
        for loop in loops:  # for n in ("a", "b"): DEFINE_string(n, ...), or a comprehension
            if isinstance(loop.iter, ast.Tuple):
                names |= {e.value for e in loop.iter.elts if isinstance(e, ast.Constant)}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith("DEFINE_"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def _in_repo(arg: str) -> str:
    path = arg.split("=", 1)[1]
    shipped = os.path.join(REPO, path.split(":")[0])
    return f"--config={os.path.join(REPO, path)}" if os.path.exists(shipped) else arg


def _flag_name(arg: str) -> str:
    return arg[2:].split("=", 1)[0]


def test_the_section_has_commands_for_every_entry_point():
    modules = [argv[0] for argv in _commands()]
    for name in ("dvp_jax.main", "dvp_jax.evaluate", "dvp_jax.data.prepare"):
        assert name in modules, name
    assert len(_blocks("python")) == 1


@pytest.fixture
def own_files(tmp_path, monkeypatch):
    """The section's config file (my_qwen3.py) and reward module, written where it says."""
    (tmp_path / "my_qwen3.py").write_text(_blocks("python")[0])
    heredoc = re.search(r"cat > (\S+) <<'PY'\n(.*?)\nPY\n", _section(), flags=re.S)
    assert heredoc, "the section writes a reward module with a heredoc"
    module = tmp_path / os.path.basename(heredoc.group(1))
    module.write_text(heredoc.group(2) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop(module.stem, None)


@pytest.mark.parametrize("page, argv", _every_command(), ids=lambda x: str(x)[:60])
def test_each_command_is_valid_as_typed(page, argv, own_files):
    module, args = argv[0], argv[1:]
    if module in NOT_ABSL:
        return
    known = _defined_flags(module)
    for arg in args:
        assert arg.startswith("--"), (module, arg)
        name = _flag_name(arg)
        assert name in known or name.startswith("config."), (module, name)
    if module != "dvp_jax.main":
        return
    config_args = [a for a in args if _flag_name(a) == "config" or a.startswith("--config.")]
    # The shipped configs are the repository's; a file of the section's is where it was written.
    config_args = [_in_repo(a) if _flag_name(a) == "config" else a for a in config_args]
    fv = flags.FlagValues()  # ml_collections registers the overrides it sees in sys_argv
    config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=["prog", *config_args])
    fv(["prog", *config_args])
    cfg = ExperimentConfig.from_config_dict(
        fv.config, CharTokenizer().vocab_size, read_checkpoint=False
    )
    for arg in config_args:  # every override took effect
        if arg.startswith("--config.") and "=" in arg:
            field, value = arg[len("--config.") :].split("=", 1)
            section, _, name = field.partition(".")
            got = getattr(getattr(cfg, section), name.split(".")[0])
            if isinstance(got, (str, int, float)) and not isinstance(got, bool):
                assert str(got) == value or float(got) == float(value), (field, got, value)


def test_the_readme_links_every_docs_page_and_every_link_resolves():
    """The front page names each docs page, and every relative link of the README and the
    pages (files, images) points at a file of the repository."""
    readme = _section("README.md")
    for page in PAGES[1:]:
        assert f"]({page})" in readme, page
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _section(page)):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = os.path.normpath(os.path.join(REPO, os.path.dirname(page), target.split("#")[0]))
            assert os.path.exists(path), (page, target)
