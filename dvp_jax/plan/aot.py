"""Compiles a run's programs for a TPU topology on any host, and says whether they fit.

  python -m dvp_jax.aot --config configs/paper_qwen3_14b.py --topology v5p:4x4x2 \
      [--config.train.precision=mixed_bf16 ...] [--all_buckets] [--json_out PATH]

Same config handling and overrides as `dvp_jax.main`. The programs are the ones a run jits,
built by the same code with the same shardings and the shapes the config implies: the RL update
(the accumulated step and one micro-batch of it), the SFT step when the config has a warm-up,
the weight sync, and one host's engine programs (`RolloutEngine.programs`: batched prefill,
insert and decode loop at the largest bucket; every bucket with `--all_buckets`). The real TPU
compiler (libtpu; no TPU needed) compiles each for the topology; `compiled` turns the results
into a table of per-chip bytes against HBM, FLOPs and compile seconds, then one JSON line. Exit
status 1, with one line naming the program and the reason, when a program does not compile or
its peak exceeds `--hbm_fraction` of HBM; 2 for a mistake in the input.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from dvp_jax.cli import USAGE_EXIT_CODE, fail, flag_error, parse_flags
from dvp_jax.errors import ConfigError
from dvp_jax.model.config import PRESETS as MODEL_PRESETS
from dvp_jax.plan.compiled import Program, compile_spec, failures, table
from dvp_jax.plan.length_mix import length_mixes
from dvp_jax.plan.reports import rollout_cost_report, step_lower_bound, update_cost_report
from dvp_jax.plan.specs import engine_specs, train_specs
from dvp_jax.plan.topology import CHIP_HBM_GIB, chip_of, topology_devices

# The command line's flags, defined when the module runs as a program (`_define_flags`): the
# library functions here are imported by tests next to other absl programs' flags.
_FLAGS: dict = {}


def compile_config(
    cfg,
    topology: str,
    all_buckets: bool = False,
    programs: tuple[str, ...] = (),
    log=print,
    skip: tuple[str, ...] = (),
) -> list[Program]:
    """Every program of `cfg` compiled for `topology` (`programs`: names or prefixes to keep;
    `skip`: exact names to leave out)."""
    devices = topology_devices(topology)
    keep = lambda name: (
        name not in skip and (not programs or any(name.startswith(p) for p in programs))
    )
    specs, trainer = train_specs(cfg, devices)
    engine, engine_weights = engine_specs(cfg, devices, trainer, all_buckets)
    for spec in specs:
        spec.resident = engine_weights
    specs += engine
    out = []
    for spec in specs:
        if not keep(spec.name):
            continue
        log(f"compiling {spec.name} ...")
        out.append(compile_spec(spec))
    return out


def check_oversample(values) -> None:
    """Each `--oversample` is a number >= 1 (ValueError in one line otherwise)."""
    for v in values:
        try:
            ok = float(v) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--oversample: {v!r} is not a number >= 1 (e.g. --oversample=1.5,2)")


def check_architecture_source(config) -> None:
    """Where `model.hf_path` is not a local directory here, `model.preset` must say the
    architecture (compiling "tiny" for someone's 14B checkpoint would report nothing useful)."""
    hf_path = config.model.get("hf_path") or ""
    if (
        hf_path
        and not os.path.isdir(os.path.expanduser(hf_path))
        and not config.model.get("preset")
    ):
        raise ConfigError(
            f"config.model.hf_path={hf_path!r} is not a local directory here, so its config.json "
            "cannot give the architecture: set config.model.preset (one of "
            f"{sorted(MODEL_PRESETS)}) to compile without the checkpoint"
        )


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    import jax

    jax.config.update("jax_platforms", "cpu")  # the host side; the programs are for TPU
    opts = {name: flag.value for name, flag in _FLAGS.items() if name != "config"}
    from dvp_jax.errors import UserError
    from dvp_jax.train.build import load_run_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    try:
        config = _FLAGS["config"].value
        config.data  # noqa: B018  (a config file that failed to load raises on first use)
    except Exception as e:
        fail(flag_error(e, sys.argv), USAGE_EXIT_CODE, e)
    try:
        vocab = config.model.get("vocab_size", -1)
        if vocab in (None, -1):
            vocab = load_run_tokenizer(config.data.tokenizer).vocab_size
        # aot never reads weights: a checkpoint that lives on the pod need not exist here.
        check_architecture_source(config)
        cfg = ExperimentConfig.from_config_dict(config, vocab, read_checkpoint=False)
        mixes = length_mixes(cfg, opts)
        check_oversample(opts.get("oversample", []))
    except (UserError, ValueError) as e:
        fail(str(e), USAGE_EXIT_CODE, e)
    programs = tuple(p for p in opts["programs"].split(",") if p)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        results = compile_config(cfg, opts["topology"], opts["all_buckets"], programs, log)
    except ValueError as e:  # a topology name, or a mesh / tensor_parallel it cannot hold
        fail(str(e), USAGE_EXIT_CODE, e)
    hbm = CHIP_HBM_GIB[chip_of(opts["topology"])]
    print(table(results, hbm), flush=True)
    bad = failures(results, hbm, opts["hbm_fraction"])
    report = {
        "topology": opts["topology"],
        "hbm_gib": hbm,
        "hbm_fraction_limit": opts["hbm_fraction"],
        "ok": not bad,
        "programs": [p.row(hbm) for p in results],
    }
    if mixes:
        update = report["update_at_real_lengths"] = update_cost_report(cfg, opts, results, mixes)
        rollout = report["rollout_at_real_lengths"] = rollout_cost_report(cfg, opts, mixes)
        report["step_lower_bound"] = step_lower_bound(update, rollout)
    line = json.dumps(report)
    print(line, flush=True)
    if opts["json_out"]:
        with open(opts["json_out"], "w") as f:
            f.write(line + "\n")
    if bad:
        fail(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""), 1)


def _define_flags() -> None:
    f = _FLAGS
    f["config"] = config_flags.DEFINE_config_file(
        "config", None, "Experiment config file (as for dvp_jax.main)."
    )
    f["topology"] = flags.DEFINE_string(
        "topology",
        None,
        "TPU topology, <chip>:<dims>, chip one of v4, v5e, v5p, v6e (v5p:4x4x2).",
    )
    f["all_buckets"] = flags.DEFINE_bool(
        "all_buckets", False, "Compile every prefill and KV-cache bucket, not only the largest."
    )
    f["programs"] = flags.DEFINE_string(
        "programs", "", "Comma-separated program names or prefixes to compile (default: all)."
    )
    f["hbm_fraction"] = flags.DEFINE_float(
        "hbm_fraction", 0.9, "A program fits when its peak is at most this fraction of HBM."
    )
    f["json_out"] = flags.DEFINE_string("json_out", "", "Also write the JSON line to this file.")
    f["response_length_mean"] = flags.DEFINE_list(
        "response_length_mean",
        [],
        "Price a step at real lengths: responses of this mean length, long-tailed "
        "(`dvp_jax.plan.length_mix`), at most rollout.max_decode_length; a comma-separated "
        "list prices each from the one compile.",
    )
    f["response_lengths"] = flags.DEFINE_string(
        "response_lengths",
        "",
        "Price a step at real lengths: a text file of response lengths (ints), in order, "
        "repeated to fill the step.",
    )
    f["prompt_length"] = flags.DEFINE_integer(
        "prompt_length",
        None,
        "With --response_length_mean / --response_lengths: every prompt's length in tokens "
        "(default data.max_prompt_len).",
    )
    f["oversample"] = flags.DEFINE_list(
        "oversample",
        ["1.25", "1.5", "2", "3"],
        "With --response_length_mean / --response_lengths: the over-samplings the partial "
        "rollout's cost is priced at, beside the synchronous rollout's (each >= 1).",
    )
    f["verbose"] = flags.DEFINE_bool("verbose", False, "Tracebacks for every error.")
    flags.mark_flags_as_required(["config", "topology"])


def run():
    _define_flags()
    parse_flags(sys.argv)
    app.run(main, argv=[sys.argv[0]])


if __name__ == "__main__":
    run()
