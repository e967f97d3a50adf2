"""The evaluation section of an experiment config (`eval`: its schedule and its named validation
sets) as frozen, validated dataclasses, checked as `sections.py` checks the others."""

from __future__ import annotations

import dataclasses
import re

from dvp_jax.data import rewards as rewards_lib
from dvp_jax.data.math_data import RowFields
from dvp_jax.model.config import PRECISIONS
from dvp_jax.train.sections import DataConfig, check_field, check_int

# The run's own held-out set (data.eval_path or the task's split; eval_accuracy); the other
# validation sets are named (eval.sets, metrics eval/<name>/...).
HELDOUT = "heldout"
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One named validation set of `eval.sets`, logged as eval/<name>/accuracy (avg@k) and
    eval/<name>/pass_at_k. 0 or "": the run's value (eval.k, eval.num_prompts, the task's
    verifier `DataConfig.verifier`, data.prompt_key / answer_key / system_key)."""

    name: str
    path: str  # jsonl / parquet / datasets save_to_disk directory
    k: int = 0
    num_prompts: int = 0
    reward: str = ""  # a reward spec ("math_verify", "a=1,b=0.1": `rewards.parse_rewards`)
    prompt_key: str = ""
    answer_key: str = ""
    system_key: str = ""

    def check(self, where: str) -> None:
        check_field(
            isinstance(self.name, str)
            and EVAL_SET_NAME.fullmatch(self.name) is not None
            and self.name != HELDOUT,
            f"{where}.name",
            f"a name of letters, digits, '_', '.', '-' other than {HELDOUT!r}",
            self.name,
        )
        ok = isinstance(self.path, str) and bool(self.path)
        check_field(ok, f"{where}.path", "a file or directory path", self.path)
        check_int(f"{where}.k", self.k, 0)
        check_int(f"{where}.num_prompts", self.num_prompts, 0)
        for key in ("reward", "prompt_key", "answer_key", "system_key"):
            value = getattr(self, key)
            check_field(isinstance(value, str), f"{where}.{key}", "a string", value)
        if self.reward:
            try:  # user functions are imported here, before any work
                rewards_lib.parse_rewards(self.reward)
            except ValueError as e:
                raise ValueError(f"config.{where}.reward: {e}") from None

    def fields(self, data: DataConfig) -> RowFields:
        """This set's row fields, each "" taking `data`'s."""
        return RowFields(
            self.prompt_key or data.prompt_key,
            self.answer_key or data.answer_key,
            self.system_key or data.system_key,
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # 0: only at the start and the end of RL
    num_prompts: int = 128
    k: int = 4  # avg@k: k samples per held-out prompt
    # Sample the evaluation with rollout.noise_std too (False: the policy at rollout precision,
    # noise being a mismatch knob of the experiments rather than part of the policy).
    with_rollout_noise: bool = False
    # Precision of the evaluation engine: "" evaluates with the rollout engine (its precision);
    # one of PRECISIONS builds a second engine at that precision (e.g. "float32": held-out
    # accuracy of the policy itself, free of the rollout mismatch).
    dtype: str = ""
    # Named validation sets beside the run's held-out set (data.eval_path or the task's split):
    # dicts of `EvalSet` fields, e.g. (dict(name="aime25", path="/data/aime25.parquet", k=16),).
    sets: tuple = ()

    def __post_init__(self):
        check_field(
            self.dtype in ("",) + PRECISIONS, "eval.dtype", f"'' or one of {PRECISIONS}", self.dtype
        )
        check_field(
            isinstance(self.sets, (tuple, list)), "eval.sets", "a tuple of dicts", self.sets
        )
        sets = []
        for i, entry in enumerate(self.sets):
            where = f"eval.sets[{i}]"
            if isinstance(entry, EvalSet):
                entry = dataclasses.asdict(entry)
            check_field(isinstance(entry, dict), where, "a dict of EvalSet fields", entry)
            allowed = [f.name for f in dataclasses.fields(EvalSet)]
            unknown = sorted(set(entry) - set(allowed))
            missing = sorted({"name", "path"} - set(entry))
            check_field(not unknown, where, f"a dict of the fields {allowed}", entry)
            check_field(not missing, where, f"a dict with {missing}", entry)
            eval_set = EvalSet(**entry)
            eval_set.check(where)
            sets.append(eval_set)
        names = [s.name for s in sets]
        check_field(len(set(names)) == len(names), "eval.sets", "sets of distinct names", names)
        object.__setattr__(self, "sets", tuple(sets))
        check_int("eval.every", self.every, 0)
        check_int("eval.num_prompts", self.num_prompts, 1)
        check_int("eval.k", self.k, 1)
