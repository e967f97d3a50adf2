"""One accelerator check: the benchmarks' accelerator commands in one run, one markdown table.

  python benchmarks/accelerator_check.py --out check.md          # on a GPU or TPU, < 10 min
  python benchmarks/accelerator_check.py --smoke --out check.md  # tiny sizes, any machine (CI)
  python benchmarks/accelerator_check.py --only "long tail" [--paged_attention paged_xla]

Runs `train_step.py` (qwen3_0_6b, 8 x 4096 tokens, under each trainer policy),
`rollout_throughput.py` (qwen3_0_6b, 64 slots, 256 new tokens, against HF `generate`; and
`--long_tail`: 256 responses stopping at EOS through 64 slots, up to 2,048 tokens, paged decode
against dense, `--paged_attention` naming the paged path) and `pruned_logprobs.py` (chunked
vs naive, N 2048, d 512, V 151,936), each in its own process, and tabulates their JSON lines.
`--smoke` runs the same scripts at tiny sizes (the train step under `float32_x3` only; `--jobs
3` runs them at once). A failed check gets a row with its last error line and the exit status
is 1; the table is written either way. What each figure means
is in the docstring of the script that measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("float32", "float32_x3", "mixed_bf16")


def checks(smoke: bool, paged_attention: str = "paged") -> list[tuple[str, list[str]]]:
    """(name, command) of every check."""
    py = [sys.executable]
    train = ["--preset", "qwen3_0_6b", "--batch", "8", "--seq", "4096"]
    train += ["--remat", "save_dots_no_batch", "--quick"]
    rollout = ["--preset=qwen3_0_6b", "--batch=64", "--group=1", "--prompt_len=128"]
    rollout += ["--new_tokens=256", "--steps_per_sync=8", "--repeats=2"]
    tail = ["--preset=qwen3_0_6b", "--long_tail", "--batch=64", "--long_tail_rows=256"]
    tail += ["--prompt_len=128", "--new_tokens=2048", "--stop_tokens=96", "--repeats=1"]
    loss: list[str] = []
    policies = POLICIES
    if smoke:  # every script once at its smallest sizes; one trainer policy (the others
        # differ only in dtypes); ModelConfig's "tiny" test model
        train = ["--preset", "tiny", "--batch", "1", "--seq", "8", "--quick"]
        rollout = ["--preset=tiny", "--batch=2", "--group=2", "--prompt_len=4"]
        rollout += ["--new_tokens=4", "--repeats=1"]
        tail = ["--preset=tiny", "--long_tail", "--batch=2", "--long_tail_rows=4"]
        tail += ["--prompt_len=4", "--new_tokens=8", "--page_size=4", "--repeats=1"]
        loss = ["--n", "64", "--d", "32", "--v", "4096", "--runs", "1"]
        policies = ("float32_x3",)
    out = [
        (f"train step, {p}", py + [str(HERE / "train_step.py"), "--policy", p] + train)
        for p in policies
    ]
    out.append(("rollout vs HF generate", py + [str(HERE / "rollout_throughput.py")] + rollout))
    tail += [f"--decode_attention={paged_attention}"]
    out.append(
        ("rollout long tail, paged vs dense", py + [str(HERE / "rollout_throughput.py")] + tail)
    )
    out.append(("chunked vs naive loss", py + [str(HERE / "pruned_logprobs.py")] + loss))
    return out


def summary(name: str, result: dict) -> str:
    """The figures of one check's JSON line that the table shows."""

    def pick(*keys):
        return ", ".join(f"{k} {_fmt(result[k])}" for k in keys if k in result)

    if name.startswith("train step"):
        return pick("tok_s", "mfu", "peak_memory_gib", "temp_gib", "compile_s", "peak_source")
    if name.startswith("rollout long tail"):
        return pick("paged_tok_s", "dense_tok_s", "paged_vs_dense", "hf_tok_s", "paged_impl")
    if name.startswith("rollout"):
        return pick("engine_tok_s", "hf_tok_s", "ratio_vs_hf", "ms_per_step", "frac_of_roofline")
    return pick("time_ratio", "mem_ratio", "max_grad_rel_err", "naive_s", "chunked_s")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run(name: str, command: list[str], timeout: int) -> tuple[str, bool, float]:
    start = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, env=env
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s", False, time.time() - start
    seconds = time.time() - start
    lines = [line for line in out.stdout.strip().splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        errors = [line for line in out.stderr.strip().splitlines() if line.strip()]
        return f"failed (exit {out.returncode}): {errors[-1] if errors else ''}", False, seconds
    return summary(name, json.loads(lines[-1])), True, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, CI)")
    parser.add_argument("--out", default="", help="also write the markdown table here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per check")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="checks run at once (default 1: a measurement shares the machine with nothing; "
        "more only to see that each script works, e.g. with --smoke)",
    )
    parser.add_argument(
        "--only", default="", help="run only the checks whose name contains this, e.g. 'long tail'"
    )
    parser.add_argument(
        "--paged_attention",
        default="paged",
        choices=("paged", "paged_xla"),
        help="the long-tail check's paged decode (paged_xla: the XLA path, a fallback)",
    )
    args = parser.parse_args(argv)

    import jax  # the device this machine has, for the table's title

    device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    todo = [c for c in checks(args.smoke, args.paged_attention) if args.only in c[0]]

    def one(check):
        print(f"running {check[0]} ...", file=sys.stderr, flush=True)
        return run(*check, args.timeout)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, todo))  # in the order of `checks`
    rows, ok = [], True
    for (name, command), (figures, passed, seconds) in zip(todo, results, strict=True):
        ok &= passed
        shown = " ".join(Path(c).name if c.endswith(".py") else c for c in command[1:])
        rows.append(f"| {name} | `{shown}` | {figures} | {seconds:.0f} |")
    table = "\n".join(
        [
            f"Accelerator check on {device}{' (smoke sizes)' if args.smoke else ''}",
            "",
            "| check | command | figures | s |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
