"""e007's gate read (not pre-registered; no outcome reads it): where the warm start's tail sits.

The gate failed on the CPU warm start (results/e007/gate.json). This reading asks why: are the
sampled tail words the ones the warm-up showed the model? It replays the warm-up's data (the SFT
stream's examples, `SFT_STEPS` x `SFT_BATCH`, a pure function of the task's seed), counts each tail
word's occurrences and last step, then samples RLOO's M3 responses as the gate does and splits the
sampled tail words by whether (and how recently) the warm-up showed them: their share, the median
log pi(y) / max pi of each group and the share of each outside the e^-13 safe set.
Writes results/e007/gate_reading.json.

Command: python -m experiments.e007_reading --init_hf /tmp/e007/root/e007_tail/_warm/hf_export
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter

import numpy as np

from dvp_jax.workdir import write_atomic
from experiments import e007_gate as gate_lib
from experiments import e007_tail as cpu
from experiments import e007_verdict as rules
from experiments.provenance import code_version, weights_hash

SFT_STEPS, SFT_BATCH = cpu.WARM_SFT_STEPS, 32  # configs/e007_tail_sum.py's warm-up
RECENT = 100  # "recently shown": in the warm-up's last RECENT steps


def warmup_tail_words(task, steps: int = SFT_STEPS, batch: int = SFT_BATCH):
    """(count, last step) of each tail word in the warm-up's examples."""
    from dvp_jax.data.pipeline import SFT_STREAM

    head, words = task._words[0], set(task._words[1:])
    count, last = Counter(), {}
    for step in range(steps):
        for ex in task.train_examples(batch, step * batch, SFT_STREAM):
            for w in ex.target.split():
                if w in words and w != head:
                    count[w] += 1
                    last[w] = step
    return count, last


def split_by_seen(words, log_rel, count, last, steps: int) -> dict:
    """The sampled tail words split into seen / recently seen / unseen in the warm-up."""
    log_rel = np.asarray(log_rel, float)
    seen = np.array([w in count for w in words], bool)
    recent = np.array([last.get(w, -1) >= steps - RECENT for w in words], bool)
    out = {"sampled_tail_words": len(words), "share_seen": float(seen.mean()) if words else 0.0}
    out["share_seen_recently"] = float(recent.mean()) if words else 0.0
    for name, m in (("seen", seen), ("unseen", ~seen), ("seen_recently", recent)):
        out[name] = {
            "median_log_rel": float(np.median(log_rel[m])) if m.any() else None,
            "frac_outside": float((log_rel[m] < gate_lib.LOG_RHO).mean()) if m.any() else None,
        }
    return out


def main(argv=None) -> int:
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.batch import from_rollouts
    from experiments.e005_setup import chunk_examples, sample

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init_hf", default="/tmp/e007/root/e007_tail/_warm/hf_export")
    p.add_argument("--out", default=gate_lib.OUT)
    args = p.parse_args(argv)
    cfg = gate_lib.config("rloo", rules.RUNG)
    task = cfg.data.make_task()
    count, last = warmup_tail_words(task)
    model = gate_lib.policy(cfg, args.init_hf)
    examples, first = chunk_examples(cfg, 0, rules.GATE_PROMPTS)
    _, batch = sample(cfg, model, examples, first, -math.inf, rules.GATE_SAMPLES)
    rl = from_rollouts(batch, np.zeros(batch.num_rows, np.float32))
    st = gate_lib.trainer_scores(cfg, model, rl)
    tok = load_tokenizer(cfg.data.tokenizer)
    head = tok.encode_ids(task._words[0])[0]
    targets = np.asarray(rl.tokens)[:, 1:]
    tail = np.asarray(rl.response_mask).astype(bool) & (targets > head)
    words = [tok.decode([int(t)]) for t in targets[tail]]
    rec = {
        "note": "not pre-registered: why the gate failed (issue 46)",
        "warmup_tail_draws": int(sum(count.values())),
        "warmup_distinct_tail_words": len(count),
        "tail_words": task.n_words - 1,
        **split_by_seen(words, st["log_rel"][tail], count, last, SFT_STEPS),
        "weights_sha256": weights_hash(args.init_hf),
        "code_version": code_version(),
    }
    write_atomic(os.path.join(args.out, "gate_reading.json"), json.dumps(rec, indent=1))
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
