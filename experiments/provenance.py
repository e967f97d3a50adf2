"""The code version a record was made with: the git commit and whether the tree was dirty.

e006's records carried none, and the rollout engine changed (dense to paged decode) between its
seed 0 and seeds 1-2; every record written from now on says which code wrote it. Outside a git
checkout (a copied tree, no git) the commit is None and the reason is given instead.
"""

from __future__ import annotations

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
