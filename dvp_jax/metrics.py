"""Metric names, declared once, and the run log `<workdir>/metrics.jsonl` that holds them.

Every scalar the trainer logs is declared in `METRICS` (name -> meaning). `check` rejects a row
with an undeclared key, and `declared` rejects an undeclared name where one is looked up (the
run summary, plots, experiment analysis), so a misspelt key fails loudly instead of vanishing.
The loss and diagnostics functions in `dvp_jax.dvp` produce most of these keys; their meanings
are in docs/design.md section 2.

`EventFiles` writes the same numbers as TensorBoard event files (and text, for sample tables).
`MetricsLog` writes one JSON row per step (`{"step": s, name: value, ...}`) through `JsonlLog`,
which also keeps `samples.jsonl` (`dvp_jax.trackers`); `read_metrics` is the one reader
(trainer summary, `plots.py`, `experiments/`). Paths go through `etils.epath`
(`dvp_jax/workdir.py`), so the log may live in a `gs://` workdir.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from absl import logging
from etils import epath

from dvp_jax.workdir import append_line, as_path, is_remote, write_atomic

# The E6 mismatch metrics (verl's definitions, `diagnostics.mismatch_metrics`). Each is logged
# on the pruned log-probs and, prefixed `full_`, on the unpruned ones.
_MISMATCH = {
    "training_ppl": "mean over responses of exp(-mean_t log pi(y_t))",
    "rollout_ppl": "mean over responses of exp(-mean_t log mu(y_t))",
    "ppl_gap": "mean over responses of |rollout_ppl - training_ppl|",
    "log_ppl_diff": "mean over responses of mean_t (log mu - log pi)",
    "kl_k1": "mean_t (log mu - log pi): k1 estimate of KL(mu || pi)",
    "kl_k3": "mean_t (exp(l_t) - l_t - 1): k3 estimate of KL(mu || pi)",
    "chi2_token": "mean_t exp(2 l_t) - 1",
    "chi2_seq": "mean over responses of exp(2 L) - 1",
}

# The same mismatch under the peers' metric names, computed as each peer computes it
# (`diagnostics.peer_metrics`; r_t = log pi - log mu, unpruned, over all response tokens;
# mt_i, mr_i the response's mean log pi, log mu; d_i = mr_i - mt_i).
_PEER = {
    "mismatch_kl": "verl: mean_t (log mu - log pi), = full_kl_k1",
    "mismatch_k3_kl": "verl: mean_t (exp r_t - r_t - 1), unclamped, = full_kl_k3 below +-20",
    "mismatch_training_ppl": "verl: mean over responses of exp(-mt_i), = full_training_ppl",
    "mismatch_training_log_ppl": "verl: mean over responses of -mt_i",
    "mismatch_rollout_ppl": "verl: mean over responses of exp(-mr_i), = full_rollout_ppl",
    "mismatch_rollout_log_ppl": "verl: mean over responses of -mr_i",
    "mismatch_log_ppl_diff": "verl: mean over responses of d_i, = full_log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "verl: mean over responses of |d_i|",
    "mismatch_log_ppl_diff_max": "verl: max over responses of d_i",
    "mismatch_log_ppl_diff_min": "verl: min over responses of d_i",
    "mismatch_ppl_ratio": "verl: mean over responses of exp(d_i) (training over rollout PPL)",
    "token_mult_prob_error": "NeMo-RL: mean_t exp(|r_t|) (1 = no mismatch)",
    "train_rollout_logprob_abs_diff": "slime: mean over responses of mean_t |r_t|",
}

METRICS: dict[str, str] = {
    # ----- loss (E5-E9, dvp.losses.dvp_loss)
    "loss": "the DVP-RLOO objective of the batch (E9)",
    "kept_tokens": "response tokens that enter the loss (E5, E7)",
    "kept_responses": "responses with at least one kept token",
    "frac_responses_excluded": (
        "responses with a sampled token outside the trainer safe set, or with decoupled PPO "
        "outside the old policy's (E5)"
    ),
    "frac_responses_masked": (
        "responses masked by seq_mis (E7), rejected by seq_geo_rs / seq_k3_rs (E7b) or by a "
        "sequence rule of loss.rejection (E15, E16)"
    ),
    "frac_tokens_masked": (
        "tokens masked by token_mis (E7), token_icepop (E7b) or a token rule of loss.rejection "
        "(E15)"
    ),
    "is_weight_mean": "mean applied importance weight (E7)",
    "is_weight_max": "max applied importance weight (E7)",
    "is_weight_ess": "normalised effective sample size of the weights, in (0, 1]",
    "ppo_clip_frac": "kept tokens whose PPO clip is active (updates_per_batch > 1, E9)",
    # ----- KL to the frozen reference and entropy bonus (E11, E12; only when their coef > 0)
    "kl_ref": "mean over E11's tokens of the loss.kl_estimator estimate of KL(pi_S || pi_ref_S)",
    "kl_ref_loss": "the KL term added to the loss, kl_coef (1/Z) sum_t k_t (E11)",
    "frac_tokens_outside_ref_safe": (
        "sampled response tokens outside the reference's safe set, left out of the KL (E11)"
    ),
    "entropy_bonus": "the entropy term added to the loss, -entropy_coef (1/Z) sum_t H_t (E12)",
    # ----- mismatch diagnostics (dvp.diagnostics.mismatch_diagnostics)
    **_MISMATCH,
    **{"full_" + k: v + ", unpruned" for k, v in _MISMATCH.items()},
    **_PEER,
    "pruned_mass_train_mean": "mean trainer pruned mass delta_S (E3)",
    "pruned_mass_train_max": "max trainer pruned mass delta_S (E3)",
    "safe_size_train_mean": "mean trainer safe-set size |V_S| (E1)",
    "safe_size_train_max": "max trainer safe-set size |V_S| (E1)",
    "pruned_mass_rollout_mean": "mean rollout pruned mass delta_S (E3, E4)",
    "pruned_mass_rollout_max": "max rollout pruned mass delta_S (E3, E4)",
    "safe_size_rollout_mean": "mean rollout safe-set size |V_S| (E1, E4)",
    "safe_size_rollout_max": "max rollout safe-set size |V_S| (E1, E4)",
    "frac_tokens_outside_train_safe": "sampled response tokens outside the trainer safe set (E5)",
    # ----- top-k / top-p truncation (E13, dvp.batch_stats.truncation_metrics; only when on)
    "truncated_mass_rollout_mean": "mean rollout mass removed by top-k / top-p (E13)",
    "truncated_mass_rollout_max": "max rollout mass removed by top-k / top-p (E13)",
    "frac_positions_truncated": "response positions where top-k / top-p removed mass (E13)",
    "kept_size_rollout_mean": "mean size |K| of the rollout's kept set where it truncated (E13)",
    # ----- entropy, tail and sequence log-ratio (dvp.diagnostics.tail_metrics). "The
    # trainer safe set" here is V_S at LossConfig.log_rho (E1) also when the objective does not
    # prune; l_t = log pi(y_t) - log mu(y_t) unpruned, L = sum_t l_t per response (E6).
    "entropy": "mean over response tokens of the trainer policy's entropy H(pi), full vocabulary",
    "frac_tokens_tail": (
        "sampled response tokens with trainer probability < 1e-3 and outside the trainer safe set"
    ),
    "seq_log_ratio": "E[L]: mean over responses of L = sum_t (log pi - log mu), unpruned",
    "seq_log_ratio_pruned": (
        "mean over E5-kept responses of sum_t (log pi_S - log mu_S), the pruned objective's L (E6)"
    ),
    "seq_log_ratio_outside": "E[L_out]: the part of E[L] from tokens outside the trainer safe set",
    "seq_log_ratio_outside_share": (
        "|E[L_out]| / (|E[L_in]| + |E[L_out]|): share of E[L] from outside the safe set, in [0, 1]"
    ),
    "frac_tokens_outside_safe": (
        "sampled response tokens outside the trainer safe set at loss.log_rho, whatever the method"
    ),
    "full_kl_k1_inside": "the part of full_kl_k1 from tokens inside the trainer safe set",
    "full_kl_k1_outside": "the part of full_kl_k1 from tokens outside the trainer safe set",
    "abs_log_ratio_outside_share": (
        "sum |log pi - log mu| over tokens outside the trainer safe set / over all response tokens"
    ),
    # ----- partial rollouts (rollout.partial; dvp.staleness; rollout.partial.Stats)
    "age_share_0": "response tokens sampled under this step's weights (age 0)",
    "age_share_1": "response tokens sampled one weight version ago",
    "age_share_2plus": "response tokens sampled two or more weight versions ago",
    "mismatch_abs_age0": "mean |log pi - log mu| over age-0 tokens (the precision mismatch)",
    "mismatch_abs_stale": "mean |log pi - log mu| over older tokens (precision + policy lag)",
    "kl_k1_age0": "mean (log mu - log pi) over age-0 tokens",
    "kl_k1_stale": "mean (log mu - log pi) over tokens of older weight versions",
    "partial_decode_steps": "decode steps of this step's partial rollout",
    "partial_groups_in_flight": "groups decoding or waiting in this step's rollout",
    "partial_carried_out": "responses left unfinished for the next step",
    "partial_stale_restarts": "responses decoded again, holding a token past max_staleness",
    "partial_groups_rejected": "complete groups dropped by train.skip_zero_advantage",
    "partial_groups_per_trained": "groups completed per group trained, since the run started",
    "partial_dropped_on_resume": "responses in flight lost when the run resumed (not checkpointed)",
    # ----- optimizer (train.step)
    "grad_norm": "global norm of the gradient",
    "update_norm": "global norm of the optax update",
    "skipped_updates": "updates skipped so far for a non-finite gradient",
    # ----- rollout and rewards (train.trainer)
    "reward_mean": "mean reward of the rollout batch",
    "zero_advantage_fraction": (
        "responses of groups whose G rewards are all equal (RLOO advantage 0; left out of the "
        "update with train.skip_zero_advantage)"
    ),
    "response_length": "mean response length in tokens",
    "frac_finished": "responses that ended with a stop token",
    "truncation_rate": "responses cut at max_decode_length (no stop token)",
    "rollout_s": "seconds spent generating the rollout batch",
    "train_s": "seconds spent in the jitted update(s)",
    "rollout_tok_s": "generated tokens per second",
    "train_precision": (
        "the trainer's dtype policy (a name: float32 is true fp32, float32_x3 three 16-bit "
        "passes per matmul, mixed_bf16)"
    ),
    # ----- evaluation (train.evaluation)
    "eval_accuracy": "held-out avg@k: mean reward of k samples per held-out prompt",
    "eval_pass_at_k": "held-out pass@k",
    "phase": "0 on the row before RL, 1 on the final evaluation row",
    # ----- supervised warm-up (train.sft)
    "sft_loss": "supervised warm-up loss (mean NLL of the answer tokens)",
    "phase_sft": "1 on supervised warm-up rows",
}

_FAMILIES = (
    # (1 - p)-binned token log-ratios (`diagnostics.lt_by_p_bins`): lt_bin{k}_{mean_signed,...}.
    re.compile(r"lt_bin\d+_(mean_signed|mean_abs|count)"),
    # Per rejection rule (`corrections.rejection`, E14-E16; seq_geo_rs / seq_k3_rs as
    # seq_mean_k1 / seq_mean_k3): rejected/<rule> the share of response tokens that rule alone
    # removes (a sequence rule: the tokens of the responses it rejects).
    re.compile(r"rejected/(token_k[123]|seq_(sum|mean)_k[123]|seq_max_k[23]|opsm)"),
    # Per reward term (`evaluation.reward_metrics`; <name> a built-in or "module.function"):
    # reward/<name> its unweighted mean over the rollout batch, reward_failures/<name> the
    # responses on which it raised or returned a non-finite value (scored 0).
    re.compile(r"reward(_failures)?/[\w.]+"),
    # Per named validation set (`eval.sets`, `evaluation.evaluate`): eval/<name>/accuracy its
    # avg@k (mean reward of k samples per prompt), eval/<name>/pass_at_k.
    re.compile(r"eval/[A-Za-z0-9_.-]+/(accuracy|pass_at_k)"),
)


def declared(name: str) -> str:
    """Returns `name` if it is a declared metric, else raises KeyError naming it."""
    if name in METRICS or any(f.fullmatch(name) for f in _FAMILIES):
        return name
    raise KeyError(
        f"metric {name!r} is not declared in dvp_jax.metrics.METRICS (misspelt, or a new metric "
        "that needs declaring)"
    )


def check(names: Iterable[str]) -> None:
    """Raises KeyError naming every undeclared metric in `names`."""
    unknown = sorted(n for n in names if n != "step" and not _is_declared(n))
    if unknown:
        raise KeyError(f"undeclared metrics {unknown}; declare them in dvp_jax.metrics.METRICS")


def _is_declared(name: str) -> bool:
    try:
        declared(name)
    except KeyError:
        return False
    return True


def _path(workdir_or_file: str | os.PathLike, name: str = "metrics.jsonl") -> epath.Path:
    path = as_path(workdir_or_file)
    return path / name if path.is_dir() else path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a run's jsonl file; [] if it does not exist.

    A torn last line (a run killed while writing it) is skipped with a warning; a bad line
    elsewhere is an error naming the file and the line.
    """
    path = as_path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                logging.warning("%s: skipping a torn last line (%s)", path, e)
                break
            raise ValueError(f"{path} line {i + 1} is not JSON: {e}") from None
    return rows


def read_metrics(workdir_or_file: str | os.PathLike) -> list[dict]:
    """The rows of `<workdir>/metrics.jsonl` (or of the given file); [] if it does not exist."""
    return read_jsonl(_path(workdir_or_file))


def series(rows: Iterable[Mapping], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one declared metric over the rows that have it."""
    declared(name)
    pairs = [(int(r["step"]), float(r[name])) for r in rows if name in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def tail_mean(rows: Iterable[Mapping], name: str, last: int = 5) -> float | None:
    """Mean of `name` over the last `last` RL rows (step > 0) that have it; None if none do."""
    declared(name)
    values = [float(r[name]) for r in rows if r["step"] > 0 and name in r][-last:]
    return sum(values) / len(values) if values else None


class JsonlLog:
    """Appends JSON rows to `<workdir>/<NAME>` (process 0 writes; others only check).

    The rows are also kept in memory, so a backend that cannot append (an object store) gets
    the whole log rewritten atomically instead.
    """

    NAME = ""

    def __init__(self, workdir: str | os.PathLike, write: bool = True):
        self.path = as_path(workdir) / self.NAME
        self.write = write
        self._rows: list[str] = []

    def _append(self, *rows: Mapping[str, Any]) -> None:
        if self.write and rows:
            lines = [json.dumps(row) + "\n" for row in rows]
            self._rows += lines
            append_line(self.path, "".join(lines), "".join(self._rows))  # one write for all

    def _redone(self, row: Mapping[str, Any]) -> bool:
        """Whether a row of the checkpoint's step is written after that checkpoint."""
        return False

    def truncate_after(self, step: int | None) -> list[dict]:
        """Resume at checkpoint `step`: keeps the rows written before that checkpoint, and
        returns the others (those a resumed run writes again).

        Those kept are the rows with `row["step"] <= step`, except the ones `_redone` names.
        `step=None` (a fresh start, no checkpoint) keeps nothing. The kept rows are written to a
        temporary file that replaces the log in one rename, so a kill during the rewrite leaves
        either the old or the new log, never a partial one.
        """
        if not self.write:
            return []
        try:
            rows = read_jsonl(self.path)
        except ValueError:  # a fresh start keeps nothing of a log it cannot read
            if step is not None:
                raise
            rows = []
        keep = lambda r: step is not None and r["step"] <= step and not self._redone(r)
        self._rows = [json.dumps(r) + "\n" for r in rows if keep(r)]
        if self.path.exists() or self._rows:
            write_atomic(self.path, "".join(self._rows))
        return [r for r in rows if not keep(r)]

    def read(self) -> list[dict]:
        return read_jsonl(self.path)

    @property
    def num_rows(self) -> int:
        """Rows in the log: those kept by `truncate_after` and those appended since."""
        return len(self._rows)


class MetricsLog(JsonlLog):
    """Checked rows `{"step": s, name: value, ...}` in `<workdir>/metrics.jsonl`.

    On resume the final-evaluation row (`phase` 1), which is written after the last checkpoint,
    is always redone.
    """

    NAME = "metrics.jsonl"

    def append(self, step: int, metrics: Mapping[str, float]) -> None:
        check(metrics)
        self._append({"step": step, **metrics})

    def _redone(self, row: Mapping[str, Any]) -> bool:
        return row.get("phase") == 1.0


_EVENT_FILES = itertools.count()  # event files opened by this process


class EventFiles:
    """The run's numbers as TensorBoard event files in the workdir, without TensorFlow:
    tensorboardX's event protos and record framing, written synchronously (a failed write
    raises here, in the trainer's thread), flushed every `FLUSH_S` seconds and on `close`.

    A remote workdir (`gs://...`) gets the file from a local staging directory, copied over on
    `flush` and `close`; only process 0 writes (the others pass `write=False`). A resumed run
    (`kept_through`: the checkpoint step; None for a fresh start) opens its file with a
    session-start record, on which TensorBoard drops the earlier attempts' points of later
    steps, as `MetricsLog.truncate_after` drops their rows.
    """

    FLUSH_S = 30.0
    _FIRST_STEP = -(2**62)  # below every warm-up step: a fresh start keeps nothing

    def __init__(
        self, workdir: str | os.PathLike, write: bool = True, kept_through: int | None = None
    ):
        self._records = None
        if not write:
            return
        from tensorboardX.proto import event_pb2, summary_pb2
        from tensorboardX.record_writer import RecordWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._target = as_path(workdir)
        self._stage = tempfile.mkdtemp(prefix="dvp_jax_events.") if is_remote(workdir) else None
        # The count keeps two files opened by one process within one second apart (a second
        # open of the same name would overwrite the first attempt's points) and in order.
        self._name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
            f".{next(_EVENT_FILES):06d}"
        )
        self._records = RecordWriter(
            os.path.join(self._stage or os.fspath(self._target), self._name)
        )
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))
        start = self._FIRST_STEP if kept_through is None else kept_through + 1
        session = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._write(self._event(wall_time=time.time(), step=start, session_log=session))
        self._flushed = time.time()

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._records is None:
            return
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        self._write(
            self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        )
        if time.time() - self._flushed > self.FLUSH_S:
            self.flush()

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A markdown text (TensorBoard's Text tab shows tables) under `tag`."""
        if self._records is None:
            return
        from tensorboardX.summary import text as text_summary

        self._write(self._event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))

    def flush(self) -> None:
        if self._records is None:
            return
        with self._naming_the_file():
            self._records.flush()
        self._flushed = time.time()
        if self._stage is not None:
            local = epath.Path(self._stage, self._name)
            (self._target / self._name).write_bytes(local.read_bytes())

    def close(self) -> None:
        if self._records is None:
            return
        try:
            self.flush()
        finally:
            self._records.close()
            self._records = None
            if self._stage is not None:
                shutil.rmtree(self._stage, ignore_errors=True)

    def _write(self, event) -> None:
        with self._naming_the_file():
            self._records.write(event.SerializeToString())

    @contextlib.contextmanager
    def _naming_the_file(self):
        """A failed write (a full disk) says which file, as the workdir's other writes do."""
        try:
            yield
        except OSError as e:
            path = os.path.join(self._stage or os.fspath(self._target), self._name)
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
