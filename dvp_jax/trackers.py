"""Where a run's numbers and sample generations go besides metrics.jsonl: the trackers named by
`train.trackers`, behind one fan-out, `Trackers`, and `<workdir>/samples.jsonl`.

"tensorboard" (the default): event files in the workdir (`metrics.EventFiles`), sample tables in
the Text tab. "wandb" (`pip install 'dvp_jax[wandb]'`): a Weights & Biases run with the resolved
config, the scalars against the run's `step` (the warm-up's negative steps included), sample
tables and the summary; its id is kept in `<workdir>/wandb_run.json`, so a resumed run
continues the same W&B run. Only process 0 writes.

Resume: samples.jsonl is cut after the checkpoint step as metrics.jsonl is. W&B cannot rewrite
its history, so what it already holds of the steps after the checkpoint (the rows the resumed
run writes again, identical but for timings) is kept and not sent twice. Not here: what is
measured (the trainer), the metric names (`metrics`), the plots (`plots`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dvp_jax.errors import ConfigError, one_line
from dvp_jax.metrics import EventFiles, JsonlLog
from dvp_jax.workdir import as_path, is_remote, write_atomic

TRACKERS = ("tensorboard", "wandb")
WANDB_MODES = ("", "online", "offline", "disabled")  # "": W&B's own (WANDB_MODE, else online)
# The package a tracker imports and the pip extra that installs it.
_PACKAGES = {"wandb": ("wandb", "dvp_jax[wandb]")}
# The samples name of the evaluation after the last step (written after the last checkpoint,
# so always redone on resume, like the metrics row of `phase` 1).
FINAL_EVAL = "final_eval"
_CELL_CHARS = 1000  # longest text cell of a TensorBoard sample table


def parse_trackers(spec: str) -> tuple[str, ...]:
    """ "tensorboard,wandb" -> ("tensorboard", "wandb"); "" -> () (metrics.jsonl only).

    Raises ValueError naming `config.train.trackers` for an unknown or repeated name.
    """
    names = tuple(n.strip() for n in str(spec).split(",") if n.strip())
    if any(n not in TRACKERS for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"config.train.trackers must be a comma-separated list of distinct names from "
            f"{TRACKERS} (or '' for metrics.jsonl only), got {spec!r}"
        )
    return names


def check_installed(names: Iterable[str]) -> None:
    """Raises `ConfigError`, one line naming the extra to install, for a tracker whose package
    cannot be imported."""
    for name in names:
        if name not in _PACKAGES:
            continue
        module, extra = _PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(
                f"config.train.trackers names {name!r}, but the {module!r} package is not "
                f"installed: pip install '{extra}' (from a checkout: pip install -e '.[{name}]')"
            ) from None


@dataclasses.dataclass(frozen=True)
class WandbOptions:
    """W&B run placement; "" leaves each to W&B (its WANDB_* variables), name to the workdir's."""

    project: str = "dvp_jax"
    entity: str = ""
    name: str = ""
    mode: str = ""


class SamplesLog(JsonlLog):
    """Sample generations in `<workdir>/samples.jsonl`: one row per response,
    `{"step": s, "name": "eval" | FINAL_EVAL, "set": ..., "prompt": ..., "response": ..., ...}`."""

    NAME = "samples.jsonl"

    def append(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        self._append(*({"step": step, "name": name, **_plain(row)} for row in rows))

    def _redone(self, row: Mapping[str, Any]) -> bool:
        return row.get("name") == FINAL_EVAL


class Trackers:
    """The fan-out the trainer logs through: `scalars`, `samples`, `summary`, `flush`, `close`.

    Args:
      workdir: the run's workdir (local or `gs://`).
      names: the trackers (`parse_trackers`); samples.jsonl is written whichever they are.
      write: False on every process but 0 (nothing is written or started).
      config: the resolved config (`resume.flat_fields`), given to W&B at start.
      resumed_step: the checkpoint step resumed from (None: a fresh start).
      kept_rows, redone_rows: the metrics.jsonl rows of earlier attempts that were kept and
        those `MetricsLog.truncate_after` dropped (which this attempt writes again).
      wandb: where the W&B run goes.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        names: Sequence[str] = ("tensorboard",),
        *,
        write: bool = True,
        config: Mapping[str, Any] | None = None,
        resumed_step: int | None = None,
        kept_rows: int = 0,
        redone_rows: Sequence[Mapping[str, Any]] = (),
        wandb: WandbOptions = WandbOptions(),
    ):
        self.names = tuple(names)
        self.samples_log = SamplesLog(workdir, write=write)
        self._backends: list = []
        if not write:
            return
        groups = lambda rows: {(r["step"], r["name"]) for r in rows}  # one tracker row each
        earlier_samples = groups(self.samples_log.read())
        redone_samples = groups(self.samples_log.truncate_after(resumed_step))
        try:
            if "tensorboard" in self.names:
                self._backends.append(_TensorBoard(workdir, resumed_step))
            if "wandb" in self.names:
                redone = {(r["step"], r.get("phase")) for r in redone_rows} | redone_samples
                sent_before = kept_rows + len(redone_rows) + len(earlier_samples)
                self._backends.append(
                    _Wandb(as_path(workdir), dict(config or {}), wandb, redone, sent_before)
                )
        except BaseException:
            self.close()
            raise

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One metrics row (its numbers; strings such as `train_precision` stay in the jsonl)."""
        numbers = {k: float(v) for k, v in metrics.items() if not isinstance(v, str)}
        for b in self._backends:
            b.scalars(step, numbers, key=(step, metrics.get("phase")))

    def samples(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Sample generations of one evaluation (`name`: "eval", or FINAL_EVAL after the last
        step): appended to samples.jsonl, and a table in each tracker."""
        if not rows:
            return
        self.samples_log.append(step, name, rows)
        rows = [_plain(r) for r in rows]
        for b in self._backends:
            b.samples(step, name, rows)

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (summary.json) at its end."""
        for b in self._backends:
            b.summary(_plain(summary))

    def flush(self) -> None:
        for b in self._backends:
            b.flush()

    def close(self) -> None:
        backends, self._backends = self._backends, []
        errors = []
        for b in backends:  # every backend is closed even if one fails
            try:
                b.close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    """`row` with numpy values as Python ones (JSON-serialisable)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        out[k] = v
    return out


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a markdown table (TensorBoard's Text tab renders it); long cells cut."""
    columns = _columns(rows)

    def cell(value: Any) -> str:
        text = _cell(value).replace("|", "\\|").replace("\n", "\\n")
        return text if len(text) <= _CELL_CHARS else text[:_CELL_CHARS] + "…"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


class _TensorBoard:
    def __init__(self, workdir, resumed_step: int | None):
        self.events = EventFiles(workdir, write=True, kept_through=resumed_step)

    def scalars(self, step: int, numbers: Mapping[str, float], key) -> None:
        self.events.write_scalars(step, numbers)

    def samples(self, step: int, name: str, rows) -> None:
        self.events.write_text(step, f"samples/{name}", markdown_table(rows))

    def summary(self, summary: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in summary.items())  # a code block
        self.events.write_text(int(summary.get("steps", 0)), "summary", text)
        self.events.flush()

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()


class _Wandb:
    """One W&B run per workdir. W&B's own step counts the rows sent (it must increase); the
    x-axis of every chart is the row's `step` metric."""

    ID_FILE = "wandb_run.json"

    def __init__(
        self, workdir, config: dict, options: WandbOptions, sent: set, next_step: int
    ) -> None:
        import wandb

        id_file = workdir / self.ID_FILE
        earlier = json.loads(id_file.read_text()) if id_file.exists() else None
        if earlier is None:
            run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits
            write_atomic(id_file, json.dumps({"id": run_id}))
        else:
            run_id = earlier["id"]
        # Rows an earlier attempt sent (none if it had no W&B run) are not sent again.
        self._sent = sent if earlier is not None else set()
        self._next = next_step
        # W&B's local files: WANDB_DIR, where set; else the workdir, or a temporary directory.
        # Read here, as the mode is: W&B reads its variables once per process.
        directory = os.environ.get("WANDB_DIR")
        if not directory:
            remote = is_remote(workdir)
            directory = tempfile.mkdtemp(prefix="dvp_jax_wandb.") if remote else os.fspath(workdir)
        self._wandb = wandb
        try:
            self.run = wandb.init(
                project=options.project or None,
                entity=options.entity or None,
                name=options.name or workdir.name,
                mode=options.mode or os.environ.get("WANDB_MODE") or None,
                id=run_id,
                resume="allow",
                dir=directory,
                config=config,
                settings=wandb.Settings(console="off"),  # absl's log lines stay on the console
            )
        except wandb.errors.Error as e:  # not logged in, no such entity, ...
            raise ConfigError(
                f"W&B could not start the run ({one_line(e)}): run `wandb login`, or pass "
                "--config.train.wandb_mode=offline (upload later with `wandb sync`)"
            ) from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _log(self, key, data: dict) -> None:
        if key in self._sent:
            return
        self.run.log(data, step=self._next)
        self._next += 1

    def scalars(self, step: int, numbers: Mapping[str, float], key) -> None:
        self._log(key, {**numbers, "step": step})

    def samples(self, step: int, name: str, rows) -> None:
        columns = _columns(rows)
        value = lambda v: _cell(v) if isinstance(v, list | dict) else v
        data = [[value(r.get(c)) for c in columns] for r in rows]
        table = self._wandb.Table(columns=columns, data=data)
        self._log((step, name), {f"samples/{name}": table, "step": step})

    def summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def flush(self) -> None:
        pass  # W&B sends in the background

    def close(self) -> None:
        self.run.finish()
