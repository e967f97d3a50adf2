"""The accelerator check script at smoke sizes: every benchmark it runs works and reports."""

import os
import subprocess
import sys

from tests import child_env
from tests.train_utils import REPO


def test_accelerator_check_smoke_writes_one_table_of_every_check(tmp_path):
    out = tmp_path / "check.md"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/accelerator_check.py",
            "--smoke",
            "--jobs",  # the scripts at once: this checks that each works, it measures nothing
            "3",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=child_env(),  # one CPU device: the scripts measure one device
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = out.read_text()
    assert table.strip() == run.stdout.strip()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows[1:]]
    assert names == [
        "train step, float32_x3",
        "rollout vs HF generate",
        "rollout long tail, paged vs dense",
        "chunked vs naive loss",
    ]
    for row in rows[1:]:
        assert "failed" not in row and "timed out" not in row, row
    assert "tok_s" in rows[1] and "mfu" in rows[1]
    assert "ratio_vs_hf" in rows[2] and "frac_of_roofline" in rows[2]
    assert "paged_vs_dense" in rows[3] and "hf_tok_s" in rows[3]
    assert "time_ratio" in rows[4] and "mem_ratio" in rows[4]
    # The full run's commands: every trainer policy, the accelerator sizes.
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import accelerator_check

    full = accelerator_check.checks(smoke=False)
    assert [name for name, _ in full][:3] == [
        "train step, float32",
        "train step, float32_x3",
        "train step, mixed_bf16",
    ]
    assert all("qwen3_0_6b" in " ".join(command) for _, command in full[:4])
