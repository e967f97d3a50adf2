"""The code version a record was made with: the git commit and whether the tree was dirty.

e006's records carried none, and the rollout engine changed (dense to paged decode) between its
seed 0 and seeds 1-2; every record written from now on says which code wrote it. Outside a git
checkout (a copied tree, no git) the commit is None and the reason is given instead.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_version(repo: str = REPO) -> dict:
    """{"commit": HEAD's hash or None, "dirty": whether tracked files differ from it (None when
    unknown)}, plus "error" when git could not say."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", repo, *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": None, "dirty": None, "error": f"git unavailable: {type(e).__name__}"}
    return {"commit": commit, "dirty": dirty}


def weights_hash(export: str) -> str | None:
    """sha256 over an hf_export's safetensors files (which weights a figure was measured on);
    None when there are none (a random init)."""
    if not export or not os.path.isdir(export):
        return None
    names = sorted(n for n in os.listdir(export) if n.endswith(".safetensors"))
    if not names:
        return None
    h = hashlib.sha256()
    for n in names:
        with open(os.path.join(export, n), "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
