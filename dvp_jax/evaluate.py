"""`python -m dvp_jax.evaluate`: avg@k and pass@k of a policy on validation sets, as one JSON file.

  python -m dvp_jax.evaluate --workdir DIR [--data [NAME=]FILE ...] [--k K] [--dtype fp32|bf16]
  python -m dvp_jax.evaluate --hf_path DIR_OR_HUB_ID --data FILE [--config FILE] [--out F.json]

The policy: a `dvp_jax.main` workdir's latest checkpoint with the run's config (its config.json),
or a Hugging Face model (`model.hf_path`: a directory or a Hub id; its tokenizer.json unless the
config names one) with `--config` (default: `default_config`) and its `--config.*` overrides.
The sets: each `--data` file (read at the data's fields, or `--prompt_key` / `--answer_key` /
`--system_key`), else the run's own (`evaluation.heldout_sets`). The engine: the rollout engine
at `--dtype` (default eval.dtype, else rollout.dtype), sampling as the trainer's evaluation
(`evaluation.evaluate`). Prints one line per set and writes --out (default DIR/evaluate.json or
./evaluate.json) with each set's figures and a few sample responses. Bad input: one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

from dvp_jax.cli import (
    COMPILATION_CACHE_HELP,
    DEFAULT_COMPILATION_CACHE,
    USAGE_EXIT_CODE,
    fail,
    parse_flags,
    use_compilation_cache,
)

# The command's flags, defined only when it runs as one: absl's registry is global, and the
# library's tests import this module beside others that define --out, --dtype, --config.
_FLAGS: dict = {}

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
_ALL_ROWS = 2**31 - 1


def workdir_config(workdir: str) -> dict:
    """The experiment config of a workdir (its config.json, "section.field" keys) as the
    nested dict `ExperimentConfig.from_config_dict` takes; fields this version does not have are
    dropped. The weights come from the checkpoint, so `model.hf_path` is cleared."""
    from dvp_jax.errors import UserError
    from dvp_jax.train.config import default_config
    from dvp_jax.workdir import as_path

    path = as_path(workdir) / "config.json"
    if not path.exists():
        raise UserError(f"--workdir {workdir}: no config.json (not a dvp_jax.main workdir)")
    saved = json.loads(path.read_text())
    known = _flatten(default_config().to_dict())
    nested: dict = {}
    for key, value in saved.items():
        if key not in known:
            continue
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = tuple(value) if isinstance(value, list) else value
    nested.setdefault("model", {})["hf_path"] = ""
    return nested


def _flatten(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def _data_sets(cfg, tokenizer, data, k, num_prompts, fields: dict) -> list:
    """The --data files as validation sets (their names: NAME= or the file's stem)."""
    from dvp_jax.data.math_data import RowFields
    from dvp_jax.errors import DataError
    from dvp_jax.train import evaluation

    fields = RowFields(
        fields.get("prompt_key") or cfg.data.prompt_key,
        fields.get("answer_key") or cfg.data.answer_key,
        fields.get("system_key") or cfg.data.system_key,
    )
    sets = []
    for spec in data:
        name, sep, path = spec.partition("=")
        if not sep:
            path = spec
            base = os.path.basename(os.path.normpath(spec))
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(base)[0])
        if name in {s.name for s in sets}:
            raise DataError(f"--data {spec}: a second set named {name!r}; use NAME=FILE")
        try:
            examples = evaluation.load_examples(
                path, tokenizer, cfg.data, fields, num_prompts or _ALL_ROWS
            )
        except (OSError, ValueError) as e:
            raise DataError(f"--data {path}: {e}") from e
        sets.append(evaluation.HeldoutSet(name, examples, k or cfg.eval.k, cfg.data.verifier))
    return sets


def _experiment_config(workdir, hf_path, config, data):
    """(ExperimentConfig, tokenizer) of the run, or of the HF model with `config` (None:
    `default_config` on the math task, the model's tokenizer.json)."""
    from dvp_jax.model.hub import resolve_model_dir
    from dvp_jax.train.build import load_run_tokenizer
    from dvp_jax.train.config import ExperimentConfig, default_config

    if workdir:
        d = workdir_config(workdir)
        tokenizer = load_run_tokenizer(d.get("data", {}).get("tokenizer", "char"))
    else:
        d = (config if config is not None else default_config()).to_dict()
        local = resolve_model_dir(hf_path, field="--hf_path")
        d["model"]["hf_path"] = local
        if config is None:  # math data (its reward) and the model's own tokenizer
            d["data"].update(task="math", path=data[0].partition("=")[2] or data[0])
            d["data"]["tokenizer"] = os.path.join(local, "tokenizer.json")
        tokenizer = load_run_tokenizer(d["data"]["tokenizer"])
    return ExperimentConfig.from_config_dict(d, tokenizer.vocab_size), tokenizer


def _engine(cfg, tokenizer, workdir, dtype: str):
    """The rollout engine at `dtype` with the checkpoint's or the HF directory's weights, read
    straight into that dtype on the first `rollout.tensor_parallel` devices."""
    import jax
    from flax import nnx

    from dvp_jax.model.config import DTypePolicy
    from dvp_jax.model.hf_import import load_hf
    from dvp_jax.rollout import loading
    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.sharding import ROLLOUT_RULES, MeshConfig, Sharder, make_mesh
    from dvp_jax.train.build import engine_config

    tp = cfg.rollout.tensor_parallel
    mesh = make_mesh(MeshConfig(1, 1, tp), jax.devices()[:tp])
    sharder, policy = Sharder(mesh, ROLLOUT_RULES), DTypePolicy.named(dtype)
    if workdir:
        params = loading.load_trainer_params(workdir, cfg.model, policy, sharder)
    else:
        params = nnx.state(load_hf(cfg.init_hf_path, policy, sharder, cfg.model))
    config = engine_config(cfg, dtype)
    return RolloutEngine(cfg.model, config, tokenizer=tokenizer, params=params, mesh=mesh)


def run(
    workdir: str | None = None,
    hf_path: str | None = None,
    data: list[str] = (),
    *,
    config=None,
    k: int | None = None,
    num_prompts: int | None = None,
    dtype: str = "",
    seed: int | None = None,
    fields: dict | None = None,
    out: str | None = None,
) -> dict:
    """Evaluates (the flags of the same names), prints one line per set, writes and returns the
    JSON result."""
    import jax

    from dvp_jax.errors import DataError, UserError
    from dvp_jax.model.config import PRECISIONS
    from dvp_jax.run_params import state_item_dir
    from dvp_jax.train import evaluation
    from dvp_jax.workdir import as_path, write_atomic

    if bool(workdir) == bool(hf_path):
        raise UserError("give exactly one of --workdir and --hf_path")
    if workdir and config is not None:
        raise UserError("--config goes with --hf_path; a workdir evaluates with its run's config")
    if hf_path and not data:
        raise UserError("--hf_path needs --data FILE (the validation set to evaluate on)")
    for name, value in (("k", k), ("num_prompts", num_prompts)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    cfg, tokenizer = _experiment_config(workdir, hf_path, config, data)
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype in ("", "rollout"):
        dtype = (dtype == "" and cfg.eval.dtype) or cfg.rollout.dtype
    if dtype not in PRECISIONS:
        raise UserError(
            f"--dtype must be fp32, bf16, rollout or one of {PRECISIONS}, got {dtype!r}"
        )
    if data:
        sets = _data_sets(cfg, tokenizer, data, k, num_prompts, fields or {})
    else:
        sets = evaluation.heldout_sets(cfg.data, cfg.eval, cfg.data.make_task(), tokenizer)
        if k:
            sets = [dataclasses.replace(s, k=k) for s in sets]
    if not sets:
        raise DataError("nothing to evaluate on: the run has no validation set; pass --data FILE")

    engine = _engine(cfg, tokenizer, workdir, dtype)
    sampling = None
    if not cfg.eval.with_rollout_noise:
        sampling = engine.config.sampling_params(noise_std=0.0)
    seed = cfg.train.seed if seed is None else seed
    samples: list[dict] = []
    metrics = evaluation.evaluate_sets(
        engine,
        sets,
        jax.random.key(seed),
        prompt_len=cfg.data.max_prompt_len,
        sampling=sampling,
        sample_rows=samples,
    )
    result = {
        "model": {"workdir": workdir} if workdir else {"hf_path": hf_path},
        "dtype": dtype,
        "seed": seed,
        "sets": {},
        "samples": samples,
    }
    if workdir:
        result["model"]["step"] = int(state_item_dir(workdir).parent.name)
    for s in sets:
        accuracy, pass_at_k = s.metric_names
        result["sets"][s.name] = {
            "prompts": len(s.examples),
            "k": s.k,
            "reward": s.reward,
            "avg_at_k": metrics[accuracy],
            "pass_at_k": metrics[pass_at_k],
        }
        print(
            f"{s.name}: avg@{s.k} {metrics[accuracy]:.4f}  pass@{s.k} {metrics[pass_at_k]:.4f}  "
            f"({len(s.examples)} prompts x {s.k}, {dtype}, reward {s.reward})"
        )
    out = out or (os.path.join(workdir, "evaluate.json") if workdir else "evaluate.json")
    write_atomic(as_path(out), json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def _define_flags() -> None:
    f = _FLAGS
    f["workdir"] = flags.DEFINE_string(
        "workdir", None, "A dvp_jax.main run directory: its latest step."
    )
    f["hf_path"] = flags.DEFINE_string(
        "hf_path", None, "A Hugging Face model directory or Hub repo id."
    )
    f["config"] = config_flags.DEFINE_config_file(
        "config", None, "With --hf_path: the experiment config (default: default_config)."
    )
    f["data"] = flags.DEFINE_multi_string(
        "data", [], "[NAME=]FILE: a validation set (jsonl, parquet or datasets dir); repeatable."
    )
    f["k"] = flags.DEFINE_integer("k", None, "Samples per prompt (default: each set's k, eval.k).")
    f["num_prompts"] = flags.DEFINE_integer(
        "num_prompts", None, "Prompts per --data set (default: all)."
    )
    f["dtype"] = flags.DEFINE_string("dtype", "", "fp32, bf16, rollout or a precision name.")
    f["out"] = flags.DEFINE_string(
        "out", None, "JSON output (default DIR/evaluate.json, ./evaluate.json)."
    )
    f["seed"] = flags.DEFINE_integer("seed", None, "Sampling seed (default: train.seed).")
    for name in ("prompt_key", "answer_key", "system_key"):
        f[name] = flags.DEFINE_string(
            name, "", f"The {name} of the --data files (default: data's)."
        )
    f["compilation_cache"] = flags.DEFINE_string(
        "compilation_cache", DEFAULT_COMPILATION_CACHE, COMPILATION_CACHE_HELP
    )
    flags.DEFINE_bool("verbose", False, "Tracebacks for every error.")


def _cli() -> None:
    _define_flags()
    app.run(main, flags_parser=parse_flags)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    use_compilation_cache(_FLAGS["compilation_cache"].value)
    from dvp_jax.errors import UserError

    try:
        # Inside: a --config file that fails to load raises when its value is first read.
        f = {name: flag.value for name, flag in _FLAGS.items()}
        run(
            f["workdir"],
            f["hf_path"],
            f["data"],
            config=f["config"],
            k=f["k"],
            num_prompts=f["num_prompts"],
            dtype=f["dtype"],
            seed=f["seed"],
            fields={name: f[name] for name in ("prompt_key", "answer_key", "system_key")},
            out=f["out"],
        )
    except (UserError, ValueError, OSError) as e:
        fail(" ".join(str(e).split()), USAGE_EXIT_CODE, e)
    sys.stdout.flush()


if __name__ == "__main__":
    _cli()
