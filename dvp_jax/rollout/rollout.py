"""`Rollout`: what the trainer sees of the rollout side, built once per run.

It owns the rollout engine (and the evaluation engine when `eval.dtype` asks for another
precision), their precision and layout (`EngineConfig.dtype`, `ROLLOUT_RULES`), where they sit
(`weights.engine_mesh`, decided once here) and the weight sync (`weights.WeightSync`). Its
interface is small:

- `generate(prompts, group_size, key, ...) -> RolloutBatch`: P prompts x G responses (E4);
- `update_weights(params)`: the trainer's new parameters into every engine;
- `eval_engine`: the engine the evaluation samples with;
- `engines`, `sync`: what `dvp_jax.aot` compiles (built with `abstract=True`, nothing allocated);
- `close()`: drops the engines' weights.

The engines are built abstract and filled by the first weight sync, so a run's engine weights
come from the trainer's parameters by the same path as every later sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from dvp_jax.model.config import ModelConfig
from dvp_jax.rollout import weights
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts


class Rollout:
    """A run's rollout engines, their placement and their weight sync (module docstring).

    Args:
      model_cfg: the architecture (the trainer's).
      config: the rollout engine's settings.
      tokenizer: a tokenizer spec or instance (`tokenizers.load_tokenizer`).
      params: the trainer's parameters (an `nnx.State` or a `Transformer`): the engines' first
        weights. Required unless `abstract`.
      trainer_mesh: the trainer's mesh (None: the engine takes this host's first devices).
      tensor_parallel: the engines' tensor-parallel degree.
      eval_config: the evaluation engine's settings; None or equal to `config`: the rollout
        engine evaluates too.
      process: the process whose engine this is (default this one; `dvp_jax.aot` names the
        first host of a topology).
      abstract: build the programs only (`RolloutEngine(abstract=True)`), for `dvp_jax.aot`.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: EngineConfig,
        *,
        tokenizer: Any = "char",
        params: Any = None,
        trainer_mesh: jax.sharding.Mesh | None = None,
        tensor_parallel: int = 1,
        eval_config: EngineConfig | None = None,
        process: int | None = None,
        abstract: bool = False,
    ):
        if params is None and not abstract:
            raise ValueError("Rollout: params (the trainer's) are required unless abstract")
        process = jax.process_index() if process is None else process
        self.mesh = weights.engine_mesh(trainer_mesh, tensor_parallel, process)

        def engine(c: EngineConfig) -> RolloutEngine:
            return RolloutEngine(model_cfg, c, tokenizer=tokenizer, mesh=self.mesh, abstract=True)

        self.engine = engine(config)
        self.eval_engine = self.engine
        if eval_config is not None and eval_config != config:
            self.eval_engine = engine(eval_config)
        self.sync = weights.WeightSync((self.engine, self.eval_engine), trainer_mesh)
        if not abstract:
            self.update_weights(params)

    @property
    def engines(self) -> tuple[RolloutEngine, ...]:
        """The distinct engines: the rollout engine, then the evaluation engine if another."""
        return self.sync.engines

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        group_size: int,
        key: jax.Array,
        *,
        prompt_len: int | None = None,
        first_prompt_index: int = 0,
        should_stop: Callable[[], bool] | None = None,
    ) -> RolloutBatch:
        """`group_size` responses per prompt from the rollout engine
        (`offline.generate_rollouts`, whose arguments these are)."""
        return generate_rollouts(
            self.engine,
            prompts,
            group_size,
            key,
            prompt_len=prompt_len,
            first_prompt_index=first_prompt_index,
            should_stop=should_stop,
        )

    def update_weights(self, params: Any) -> None:
        """The trainer's `params` (an `nnx.State` or a `Transformer`) into every engine, cast
        and laid out as each engine takes them (`weights.WeightSync`)."""
        self.sync(params)

    def close(self) -> None:
        """Drops the engines' weights (their device memory is freed once nothing else holds
        them); a later `update_weights` fills them again."""
        for e in self.engines:
            e.params = None
