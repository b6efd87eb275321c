"""`rlops inspect RUN`: read what the agent did before trusting a reward.

    view = inspect_run(ws, "arithmetic-demo", reward="total", step=3, top=5)   # best and worst episodes
    diff = diff_versions(ws, "arithmetic-demo", "short@ab12", "short@cd34")     # what an edit changed

`inspect_run` takes the run's training episodes (all steps, or one update step's batch: GRPO, DPO or PPO) and, for every
version of the reward scored on them, the top-N and the bottom-N by that version's value. `diff_versions`
takes the episodes whose score moved most between two reward versions: the check to run after editing a
reward and before retraining on it. Either way each episode comes back whole: its messages with tool
calls and tool results, its token stream cut into sampled (trained on) and masked (prompt, tool output)
runs, every reward row scored on it, and the judge's explanation where a reward gave one.

Rendering (terminal and static HTML) is in `flows/views/inspect_render.py`. Reads go through the same
in-memory DuckDB views as `rlops sql`, so this works while a pipeline is writing the catalog.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import duckdb

from stages.checkpoints import UPDATE_KINDS
from stages.reward_ref import RewardRef
from stages.score import ScoreConfig
from storage.images import ImageStore, data_url, marked_parts
from storage.schema import Message, Rollout, from_table
from storage.workspace import Workspace

# The latest row wins if a reward version was written twice for a rollout (a forced rescore).
_LATEST = "QUALIFY row_number() OVER (PARTITION BY rollout_id, reward_name, reward_version ORDER BY scored_at DESC) = 1"


@dataclass(frozen=True)
class Score:
    """One reward row of an episode."""

    name: str
    version: str
    value: float | None  # None: the reward failed on this episode (see `error`)
    details: dict[str, Any] | None
    error: str | None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def explanation(self) -> str | None:
        """The judge's explanation (RULER rewards keep it in details), if this reward gave one."""
        text = (self.details or {}).get("explanation")
        return str(text) if text else None


@dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens with the same loss mask, decoded."""

    sampled: bool  # True: sampled by the policy and trained on; False: prompt, template or tool output
    text: str
    tokens: int


@dataclass
class Episode:
    """One rollout as the inspect views show it."""

    rollout: Rollout
    step: int | None  # the update step (GRPO, DPO or PPO) that trained on its batch (None: not trained on yet)
    segments: list[Segment]
    scores: list[Score]  # every reward name and version scored on it, by name then scoring time
    # image id -> data URL of each image the episode saw that the workspace's image store holds (pages show
    # them inline where their `<image:SHA256>` references stand in the messages: storage/images.py)
    images: dict[str, str] = field(default_factory=dict)

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def messages(self) -> list[Message]:
        return self.rollout.messages

    def score(self, ref: str) -> Score | None:
        return next((s for s in self.scores if s.ref == ref), None)

    @property
    def env_steps(self) -> list[dict[str, Any]]:
        """An environment episode's steps (tasks/environment.py: turn, action, observation, reward, done,
        error); empty for any other episode."""
        return list(self.rollout.metadata.get("env_steps") or [])


@dataclass
class Ranking:
    """The best and worst episodes under one reward version."""

    reward: str  # name@version
    scored: int  # episodes with a value
    errors: int  # episodes where the reward failed (value null)
    mean: float | None
    top: list[Episode]  # best first
    bottom: list[Episode]  # worst first; never repeats an episode of `top`


@dataclass
class Inspection:
    run: str
    reward: str  # the reward name ranked by
    step: int | None
    batches: list[str]
    columns: list[str]  # every reward name@version scored on these batches: the views' reward columns
    rankings: list[Ranking] = field(default_factory=list)  # one per version, oldest first


@dataclass
class Change:
    episode: Episode
    before: float | None
    after: float | None

    @property
    def delta(self) -> float | None:
        return None if self.before is None or self.after is None else self.after - self.before


@dataclass
class Diff:
    run: str
    a: str  # name@version before
    b: str  # name@version after
    step: int | None
    compared: int  # episodes scored by both versions
    changed: int  # ... whose value differs (an error on one side counts as a change)
    columns: list[str]
    changes: list[Change] = field(default_factory=list)  # largest change first; errors first of all


def train_reward(config: dict[str, Any]) -> str | None:
    """The reward a run trains on, from its stored config (`ScoreConfig.default_reward` on its score
    section); None when the stored config has no score section."""
    if not config.get("score"):
        return None
    return ScoreConfig.model_validate(config["score"]).default_reward(config.get("train_reward"))


def parse_ref(ref: str) -> tuple[str, str | None]:
    """'name@version' -> (name, version); 'name' -> (name, None) (`RewardRef.parse`'s rules)."""
    parsed = RewardRef.parse(ref)
    return parsed.name, parsed.version


def run_batches(ws: Workspace, run: str, step: int | None = None) -> dict[str, int | None]:
    """Training rollout batch id -> the update step (a GRPO, DPO or PPO checkpoint) that trained on it (None:
    not trained on yet), in rollout order; only step `step`'s batch when given. A retrain branch inspects the batches it
    replayed, with its own steps. KeyError naming the run (or the step) when there are none.

    Steps are checkpoint steps, as on the run page and in MLflow: step k's checkpoint was trained on
    the batch its parent (step k-1) rolled out."""
    from flows.pipeline import run_batches as pipeline_batches  # the one home of "a run's training batches"
    from stages.common import StageContext

    with read_views(ws) as con:
        source = run_config(con, run).get("retrain_of") or run
        trained = {b: k for k, on in con.execute(
            "SELECT step, trained_on FROM checkpoints WHERE run_name = ? AND list_contains(?, kind)",
            [run, list(UPDATE_KINDS)]).fetchall()
            for b in json.loads(on or "{}").get("batches", [])}
    out = {b: trained.get(b) for b in pipeline_batches(StageContext(ws, run_name=source), source)}
    if step is not None:
        known = sorted(s for s in out.values() if s is not None)
        out = {b: s for b, s in out.items() if s == step}
        if not out:
            raise KeyError(f"run {run!r} has no training batch at update step {step} (steps: {known})")
    return out


def episode_batches(ws: Workspace, run: str) -> dict[str, int | None]:
    """Every rollout batch of `run`, for people to review and to measure rewards against their labels: its training
    batches (`run_batches`, with the update step that trained on each) and then the batches it generated
    otherwise (held-out evaluations), with step None. KeyError naming the run when it generated none."""
    try:
        out = run_batches(ws, run)
    except KeyError:  # a run without training batches (steps: 0) may still have evaluated
        out = {}
    with read_views(ws) as con:
        source = run_config(con, run).get("retrain_of") or run
        for (batch,) in con.execute(
                "SELECT s.artifact_id FROM stage_runs s JOIN artifacts a USING (artifact_id) WHERE s.stage = 'rollout' "
                "AND s.run_name = ? AND a.status = 'complete' GROUP BY 1 ORDER BY min(a.completed_at)", [source]).fetchall():
            out.setdefault(batch, None)
    if not out:
        raise KeyError(f"run {run!r} has no rollout batches in this workspace (see `rlops ls runs`)")
    return out


def inspect_run(ws: Workspace, run: str, reward: str | None = None, step: int | None = None, top: int = 5) -> Inspection:
    """The top-`top` and bottom-`top` episodes of `run` per version of `reward` (NAME or NAME@VERSION;
    default: the reward the run trains on), over all its training batches or those of update `step`."""
    if top < 1:
        raise ValueError(f"--top must be at least 1, got {top}")
    batches = run_batches(ws, run, step)
    with read_views(ws) as con:
        reward = reward or train_reward(run_config(con, run))
        if reward is None:
            raise KeyError(f"run {run!r} has no stored config naming its reward: pass --reward NAME")
        name, version = parse_ref(reward)
        versions = _versions(con, batches, name)
        if not versions:
            raise KeyError(f"no {name!r} rewards on run {run!r}'s batches; rewards there: {_names(con, batches)}")
        if version is not None and version not in versions:
            raise KeyError(f"{name}@{version} was not scored on run {run!r}'s batches; versions: {', '.join(versions)}")
        view = Inspection(run, name, step, list(batches), _columns(con, batches))
        picked: list[tuple[str, int, int, float | None, list[str], list[str]]] = []
        for v in [version] if version else versions:
            scored, errors, mean = con.execute(
                f"SELECT count(value), count(*) - count(value), avg(value) FROM (SELECT * FROM rewards "
                f"WHERE reward_name = ? AND reward_version = ? AND list_contains(?, batch_id) {_LATEST})",
                [name, v, list(batches)]).fetchone()
            # A total order (value, then rollout id), walked from both ends: the bottom list takes only
            # what the top list left, so a small run never shows an episode twice.
            order = ("SELECT rollout_id FROM rewards WHERE reward_name = ? AND reward_version = ? AND list_contains(?, batch_id) "
                     f"AND value IS NOT NULL {_LATEST} ORDER BY value {{}}, rollout_id {{}} LIMIT ?")
            best = [r for (r,) in con.execute(order.format("DESC", "ASC"), [name, v, list(batches), top]).fetchall()]
            worst = [r for (r,) in con.execute(order.format("ASC", "DESC"),
                                               [name, v, list(batches), min(top, scored - len(best))]).fetchall()]
            picked.append((f"{name}@{v}", scored, errors, mean, best, worst))
        found = episodes(con, [r for p in picked for r in p[4] + p[5]], batches, image_store(ws))
    view.rankings = [Ranking(ref, scored, errors, mean, [found[r] for r in best], [found[r] for r in worst])
                     for ref, scored, errors, mean, best, worst in picked]
    return view


def diff_versions(ws: Workspace, run: str, a: str, b: str, step: int | None = None, top: int = 10) -> Diff:
    """The `top` episodes of `run` whose score changed most from reward version `a` to `b` (both
    NAME@VERSION), largest absolute change first; a value that became (or stopped being) an error ranks
    above every numeric change, since a reward edit that breaks on some episodes is what to see first."""
    if top < 1:
        raise ValueError(f"--top must be at least 1, got {top}")
    refs = [parse_ref(a), parse_ref(b)]
    for ref, (name, version) in zip((a, b), refs):
        if version is None:
            raise ValueError(f"--diff takes two NAME@VERSION references, got {ref!r} (versions: `rlops rewards ls`)")
    batches = run_batches(ws, run, step)
    with read_views(ws) as con:
        for name, version in refs:
            versions = _versions(con, batches, name)
            if version not in versions:
                raise KeyError(f"{name}@{version} was not scored on run {run!r}'s batches; "
                               f"{name} versions there: {', '.join(versions) or 'none'}")
        (na, va), (nb, vb) = refs
        pairs = ("WITH a AS (SELECT * FROM rewards WHERE reward_name = ? AND reward_version = ? AND list_contains(?, batch_id) "
                 f"{_LATEST}), b AS (SELECT * FROM rewards WHERE reward_name = ? AND reward_version = ? "
                 f"AND list_contains(?, batch_id) {_LATEST}) "
                 "SELECT rollout_id, a.value AS before, b.value AS after FROM a JOIN b USING (rollout_id)")
        params = [na, va, list(batches), nb, vb, list(batches)]
        compared, changed = con.execute(
            f"SELECT count(*), count(*) FILTER (before IS DISTINCT FROM after) FROM ({pairs})", params).fetchone()
        rows = con.execute(
            f"SELECT * FROM ({pairs}) WHERE before IS DISTINCT FROM after "
            "ORDER BY (before IS NULL OR after IS NULL) DESC, abs(after - before) DESC, rollout_id LIMIT ?",
            params + [top]).fetchall()
        found = episodes(con, [r for r, _, _ in rows], batches, image_store(ws))
        columns = _columns(con, batches)
    return Diff(run, a, b, step, compared, changed, columns,
                [Change(found[r], before, after) for r, before, after in rows])


# -- reading -------------------------------------------------------------------------------


def run_config(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, Any]:
    """The stored config of `run` ({} when the run has no `runs` row)."""
    rows = con.execute("SELECT config FROM runs WHERE run_name = ?", [run]).fetchall()
    return json.loads(rows[0][0]) if rows and rows[0][0] else {}


@contextmanager
def read_views(ws: Workspace) -> Iterator[duckdb.DuckDBPyConnection]:
    """The workspace's SQL views (as `rlops sql` sees them) on a connection that takes parameters.
    Catalog tables come from their Parquet snapshots, so inspecting never opens catalog.duckdb,
    which a running pipeline holds for writing."""
    from storage.sql import open_views

    con = open_views(ws.settings).con
    try:
        yield con
    finally:
        con.close()


def _versions(con: duckdb.DuckDBPyConnection, batches: dict[str, int | None], name: str) -> list[str]:
    """Versions of reward `name` scored on `batches`, first scored first."""
    return [v for (v,) in con.execute(
        "SELECT reward_version FROM rewards WHERE reward_name = ? AND list_contains(?, batch_id) "
        "GROUP BY 1 ORDER BY min(scored_at), 1", [name, list(batches)]).fetchall()]


def _names(con: duckdb.DuckDBPyConnection, batches: dict[str, int | None]) -> str:
    names = [n for (n,) in con.execute("SELECT DISTINCT reward_name FROM rewards WHERE list_contains(?, batch_id) ORDER BY 1",
                                       [list(batches)]).fetchall()]
    return ", ".join(names) or "none (run the score stage first)"


def _columns(con: duckdb.DuckDBPyConnection, batches: dict[str, int | None]) -> list[str]:
    return [r for (r,) in con.execute(
        "SELECT reward_name || '@' || reward_version FROM rewards WHERE list_contains(?, batch_id) "
        "GROUP BY reward_name, reward_version ORDER BY reward_name, min(scored_at)", [list(batches)]).fetchall()]


def image_store(ws: Workspace) -> ImageStore:
    return ImageStore(ws.settings.images_dir)


def episodes(con: duckdb.DuckDBPyConnection, ids: list[str], batches: dict[str, int | None],
              images: ImageStore) -> dict[str, Episode]:
    """rollout id -> Episode, with its decoded token runs, all its reward rows and its stored images."""
    ids = list(dict.fromkeys(ids))
    if not ids:
        return {}
    rollouts = from_table(con.sql("SELECT * FROM rollouts WHERE list_contains(?, rollout_id)", params=[ids]).to_arrow_table(),
                          Rollout)
    scores: dict[str, list[Score]] = {}
    for rid, name, version, value, details, error in con.execute(
            "SELECT rollout_id, reward_name, reward_version, value, details, error FROM rewards "
            f"WHERE list_contains(?, rollout_id) {_LATEST} ORDER BY reward_name, scored_at", [ids]).fetchall():
        scores.setdefault(rid, []).append(Score(name, version, value, _json(details), error))
    base_of = dict(con.execute("SELECT policy_id, base_model FROM checkpoints WHERE list_contains(?, policy_id)",
                               [list({r.policy_id for r in rollouts})]).fetchall())
    unknown = sorted({r.policy_id for r in rollouts} - set(base_of))
    if unknown:
        raise KeyError(f"policies {unknown} are not in the catalog: no tokenizer to decode their episodes with")
    return {r.rollout_id: Episode(r, batches.get(r.batch_id), token_segments(_tokenizer(base_of[r.policy_id]), r),
                                  scores.get(r.rollout_id, []), image_urls(images, r)) for r in rollouts}


def image_urls(store: ImageStore, rollout: Rollout) -> dict[str, str]:
    """image id -> data URL for the images an episode saw (its `image_ids` and its messages' markers) that
    `store` holds; one missing from the store is left out (the page says so where its marker stands)."""
    ids = list(rollout.image_ids) + [i for m in rollout.messages if m.role != "assistant"
                                     for kind, i in marked_parts(m.content) if kind == "image"]
    out = {}
    for i in dict.fromkeys(ids):
        try:
            out[i] = data_url(store.get(i))
        except KeyError:
            continue
    return out


def _json(text: str | None) -> dict[str, Any] | None:
    value = json.loads(text) if text else None
    return value if isinstance(value, dict) else ({"value": value} if value is not None else None)


def token_segments(tokenizer: Any, rollout: Rollout) -> list[Segment]:
    """The episode's token stream cut where the loss mask changes, each run decoded as one piece of
    text (special tokens kept: the chat template is part of what the model saw)."""
    out, pos = [], 0
    for sampled, run in itertools.groupby(rollout.loss_mask):
        n = len(list(run))
        out.append(Segment(bool(sampled), tokenizer.decode(rollout.token_ids[pos:pos + n], skip_special_tokens=False), n))
        pos += n
    return out


@functools.lru_cache(maxsize=4)
def _tokenizer(base_model: str) -> Any:
    # The tokenizer of a policy's base model. The run page inspects every step: one load per base model.
    from transformers import AutoTokenizer

    from stages.policy.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(base_model))
