"""`rlops review RUN`: what the review page reads and writes, without the web (the app is flows/views/review_app.py).

    review = Review(ws, "arithmetic-demo")
    review.queue(order="disagreement", reward=None, reviewer="alice")   # which episodes, in which order
    review.episode(rollout_id)                                        # one episode as `rlops inspect` shows it
    review.submit({"kind": "grade", "rollout_id": ..., "value": 1.0, ...})   # a label, checked, then appended

The run's episodes are all its rollout batches (`inspection.episode_batches`: training steps, then held-out
evaluations). The queue orders them by step, by a reward's value (highest or lowest first), or disagreements
first: where the judge (a reward whose rows carry an explanation, as RULER's do) and the programmatic reward
differ most. A label is checked (storage/labels.py builds and checks its rows; this module checks that it is for
this workspace and this run's episodes) and refused with a `ReviewError` naming the problem and an HTTP status,
before anything is written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import duckdb
from pydantic import BaseModel, ConfigDict, ValidationError

from flows.views.inspect_render import episode_body
from flows.views.inspection import episode_batches, episodes, image_store, run_config, train_reward
from stages.score import ScoreConfig
from storage.labels import EpisodeKey, LabelError, append_labels, grade, ordering
from storage.workspace import Workspace

ORDERS = ("step", "high", "low", "disagreement")
_LATEST = "QUALIFY row_number() OVER (PARTITION BY rollout_id, reward_name, reward_version ORDER BY scored_at DESC) = 1"


class ReviewError(Exception):
    """A request the review server refuses: `status` (4xx) and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GradeIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["grade"]
    workspace_id: str
    reviewer: str
    rollout_id: str
    value: float  # checked against [0, 1] by storage.labels.grade, which names the problem
    note: str | None = None


class OrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["order"]
    workspace_id: str
    reviewer: str
    order: list[str]  # rollout ids of one group, best first
    note: str | None = None


@dataclass(frozen=True)
class Judges:
    """What "disagreements first" compares: a judge reward and a programmatic one (names; each rollout's newest
    version of each), or None where the run has none."""

    judge: str | None
    programmatic: str | None


class Review:
    """One run of one workspace, as the review server serves it."""

    def __init__(self, ws: Workspace, run: str, judge: str | None = None, programmatic: str | None = None):
        self.ws, self.run = ws, run
        self.batches = episode_batches(ws, run)  # KeyError naming the run, before the server starts
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._stamp: tuple[Any, ...] | None = None
        self.judges = self._judges(judge, programmatic)

    @contextmanager
    def views(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The workspace's SQL views, held by one request at a time, and rebuilt when the catalog's snapshots have
        changed since (a label written by this server or another, a batch a running pipeline completed)."""
        snapshots = self.ws.settings.snapshot_dir
        stamp = tuple((s.st_mtime_ns, s.st_size) if (p := snapshots / f"{t}.parquet").exists() and (s := p.stat()) else None
                      for t in ("files", "artifacts"))
        with self._lock:
            if self._con is None or stamp != self._stamp:
                from storage.sql import open_views

                if self._con is not None:
                    self._con.close()
                self._con, self._stamp = open_views(self.ws.settings).con, stamp
            yield self._con

    def _judges(self, judge: str | None, programmatic: str | None) -> Judges:
        """The given names, else: the judge is the reward with the most rows carrying an explanation; the
        programmatic one the run's train reward's first component that is not the judge (else any other)."""
        with self.views() as con:
            names = [n for (n,) in con.execute("SELECT DISTINCT reward_name FROM rewards WHERE list_contains(?, batch_id) "
                                               "ORDER BY 1", [list(self.batches)]).fetchall()]
            explained = con.execute(
                "SELECT reward_name FROM rewards WHERE list_contains(?, batch_id) AND details->>'explanation' IS NOT NULL "
                "GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT 1", [list(self.batches)]).fetchall()
            config = run_config(con, self.run)
        for given in (judge, programmatic):
            if given is not None and given not in names:
                raise KeyError(f"no {given!r} rewards on run {self.run!r}; rewards there: {', '.join(names) or 'none'}")
        judge = judge or (explained[0][0] if explained else None)
        score = ScoreConfig.model_validate(config["score"]) if config.get("score") else None
        components = [s.name for s in score.rewards] if score else []
        total = score.total if score else "total"
        candidates = [n for n in components + names if n in names and n not in (judge, total)]
        return Judges(judge, programmatic or (candidates[0] if candidates and judge else None))

    # -- reading ---------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """What the page needs first: the workspace id its labels must carry, the run, the reward columns (newest
        first per name) and the judges."""
        with self.views() as con:
            refs = [r for (r,) in con.execute(
                "SELECT reward_name || '@' || reward_version FROM rewards WHERE list_contains(?, batch_id) "
                "GROUP BY reward_name, reward_version ORDER BY reward_name, max(scored_at) DESC", [list(self.batches)]).fetchall()]
            reward = train_reward(run_config(con, self.run))
        default = next((r for r in refs if r.split("@")[0] == reward), refs[0] if refs else None)
        return {"workspace_id": self.ws.workspace_id, "run": self.run, "rewards": refs, "default_reward": default,
                "judge": self.judges.judge, "programmatic": self.judges.programmatic, "orders": list(ORDERS),
                "episodes": self._count()}

    def _count(self) -> int:
        with self.views() as con:
            return con.execute("SELECT count(*) FROM rollouts WHERE list_contains(?, batch_id)", [list(self.batches)]).fetchall()[0][0]

    def queue(self, order: str = "step", reward: str | None = None, reviewer: str | None = None) -> list[dict[str, Any]]:
        """Every episode of the run, in `order`: "step" (training steps, then evaluations; group, sample), "high" or
        "low" (by `reward`, NAME@VERSION; unscored last), "disagreement" (|judge - programmatic|, largest first;
        episodes missing either last). Each with the `reviewer`'s current label value, if any."""
        if order not in ORDERS:
            raise ReviewError(400, f"order: one of {', '.join(ORDERS)}, got {order!r}")
        position = {b: i for i, b in enumerate(self.batches)}
        with self.views() as con:
            rows = con.sql(
                "SELECT rollout_id, batch_id, group_id, sample_idx, split, "
                "list_filter(messages, lambda m: m.role = 'assistant')[-1].content AS answer "
                "FROM rollouts WHERE list_contains(?, batch_id)", params=[list(self.batches)]).to_arrow_table().to_pylist()
            values: dict[str, dict[str, float | None]] = {}
            for rid, name, version, value, newest in con.execute(
                    "SELECT rollout_id, reward_name, reward_version, value, "
                    "max(scored_at) OVER (PARTITION BY reward_name, reward_version) AS newest FROM rewards "
                    f"WHERE list_contains(?, batch_id) {_LATEST} ORDER BY newest", [list(self.batches)]).fetchall():
                values.setdefault(rid, {})[f"{name}@{version}"] = value
                values[rid][name] = value  # ordered by scoring time: the newest version of each name wins
            mine = dict(con.execute("SELECT rollout_id, value FROM label_values WHERE reviewer = ? AND list_contains(?, batch_id)",
                                    [reviewer, list(self.batches)]).fetchall()) if reviewer else {}
        scored = {ref for v in values.values() for ref in v if "@" in ref}
        if order in ("high", "low") and reward not in scored:
            raise ReviewError(400, f"reward: a NAME@VERSION scored on run {self.run!r} ({', '.join(sorted(scored)) or 'none'}), "
                                   f"got {reward!r}")

        def key(r: dict[str, Any]) -> float | None:
            v = values.get(r["rollout_id"], {})
            if order in ("high", "low"):
                return v.get(reward or "")
            if order == "disagreement":
                j, p = v.get(self.judges.judge or ""), v.get(self.judges.programmatic or "")
                return None if j is None or p is None else abs(j - p)
            return None

        items = [{**r, "step": self.batches[r["batch_id"]], "key": key(r), "mine": mine.get(r["rollout_id"]),
                  "answer": (r["answer"] or "")[:160]} for r in rows]
        place = [(self.batches[i["batch_id"]] is None, self.batches[i["batch_id"]] or 0, position[i["batch_id"]],
                  i["group_id"], i["sample_idx"]) for i in items]
        sign = 1 if order == "low" else -1
        order_by = (lambda k: (0,)) if order == "step" else (lambda k: (k is None, sign * (k or 0.0)))
        return [item for _, item in sorted(zip(place, items), key=lambda pi: (order_by(pi[1]["key"]), pi[0]))]

    def _where(self, rollout_ids: list[str]) -> dict[str, EpisodeKey]:
        """rollout id -> its place, for those of the ids that are episodes of this run (ReviewError 404 naming the
        first that is not)."""
        with self.views() as con:
            found = {r: EpisodeKey(r, b, g) for r, b, g in con.execute(
                "SELECT rollout_id, batch_id, group_id FROM rollouts WHERE list_contains(?, rollout_id) "
                "AND list_contains(?, batch_id)", [rollout_ids, list(self.batches)]).fetchall()}
        unknown = [r for r in rollout_ids if r not in found]
        if unknown:
            raise ReviewError(404, f"unknown rollout id {unknown[0]!r}: not an episode of run {self.run!r} in this workspace")
        return found

    def episode(self, rollout_id: str) -> dict[str, Any]:
        """One episode as `rlops inspect` shows it (conversation, tool calls, images, every reward, token runs; the
        page's HTML), its task data, and its group's members in sample order."""
        where = self._where([rollout_id])[rollout_id]
        with self.views() as con:
            ep = episodes(con, [rollout_id], self.batches, image_store(self.ws))[rollout_id]
            members = [r for (r,) in con.execute("SELECT rollout_id FROM rollouts WHERE batch_id = ? AND group_id = ? "
                                                 "ORDER BY sample_idx, rollout_id", [where.batch_id, where.group_id]).fetchall()]
            served = self._served(con, ep.rollout.prompt_id) if ep.rollout.task == "traffic" else []
        r = ep.rollout
        return {"rollout_id": r.rollout_id, "batch_id": r.batch_id, "group_id": r.group_id, "sample_idx": r.sample_idx,
                "step": ep.step, "split": r.split, "task": r.task, "prompt_id": r.prompt_id, "metadata": r.metadata,
                "messages": [m.to_openai() for m in r.messages],
                "scores": [{"reward": s.ref, "value": s.value, "error": s.error} for s in ep.scores],
                "group": members, "served": served, "html": episode_body(ep) + _served_html(served)}

    @staticmethod
    def _served(con: duckdb.DuckDBPyConnection, scenario: str) -> list[dict[str, Any]]:
        """The served calls a traffic scenario came from (docs/LOOP.md): what the server answered then, and the
        feedback people gave on those episodes, newest first."""
        return con.sql(
            "SELECT t.served_at, t.policy_id, t.reply, list(struct_pack(key := f.key, score := f.score, label := f.label, "
            "comment := f.comment, who := f.who) ORDER BY f.created_at) FILTER (WHERE f.feedback_id IS NOT NULL) AS feedback "
            "FROM traffic t LEFT JOIN feedback f ON f.episode_id = t.episode_id "
            "WHERE ? IN (t.scenario_id, t.input_id) GROUP BY ALL ORDER BY t.served_at DESC LIMIT 20",
            params=[scenario]).to_arrow_table().to_pylist()

    def labels(self, reviewer: str) -> dict[str, Any]:
        """The reviewer's current labels on the run: grades by rollout id (value, note), orderings by group
        (`batch_id/group_id` -> rollout ids, best first): what the page shows again after a reload."""
        with self.views() as con:
            rows = con.sql("SELECT kind, rollout_id, batch_id, group_id, value, rank, note FROM labels "
                           "WHERE current AND reviewer = ? AND list_contains(?, batch_id) ORDER BY rank",
                           params=[reviewer, list(self.batches)]).to_arrow_table().to_pylist()
        grades = {r["rollout_id"]: {"value": r["value"], "note": r["note"]} for r in rows if r["kind"] == "grade"}
        orders: dict[str, list[str]] = {}
        for r in rows:
            if r["kind"] == "order":
                orders.setdefault(f"{r['batch_id']}/{r['group_id']}", []).append(r["rollout_id"])
        return {"reviewer": reviewer, "grades": grades, "orders": orders}

    # -- writing ---------------------------------------------------------------------------------

    def submit(self, body: Any) -> dict[str, Any]:
        """Check one label (a grade or an ordering) and append it; ReviewError (4xx) naming the problem, nothing
        written, when it is malformed, for another workspace, out of range or about an episode not in the run."""
        if not isinstance(body, dict) or body.get("kind") not in ("grade", "order"):
            raise ReviewError(400, "a label is a JSON object with kind 'grade' (rollout_id, value in [0, 1]) or "
                                   "'order' (order: rollout ids of one group, best first), workspace_id and reviewer")
        try:
            label = (GradeIn if body["kind"] == "grade" else OrderIn).model_validate(body)
        except ValidationError as e:
            raise ReviewError(400, "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                                             for err in e.errors())) from None
        if label.workspace_id != self.ws.workspace_id:
            raise ReviewError(409, f"label for workspace {label.workspace_id!r}, but this server writes workspace "
                                   f"{self.ws.workspace_id!r} ({self.ws.root}): reload the page")
        wid = self.ws.workspace_id
        try:
            if isinstance(label, GradeIn):
                rows = grade(wid, label.reviewer, self._where([label.rollout_id])[label.rollout_id], label.value, label.note)
            else:
                where = self._where(label.order)
                rows = ordering(wid, label.reviewer, [where[r] for r in label.order], label.note)
        except LabelError as e:
            raise ReviewError(400, str(e)) from None
        sid = append_labels(self.ws, rows)
        return {"submission_id": sid, "kind": label.kind, "reviewer": rows[0].reviewer,
                "rows": [{"rollout_id": r.rollout_id, "value": r.value, "rank": r.rank} for r in rows]}


def _served_html(served: list[dict[str, Any]]) -> str:
    """The served calls of a traffic scenario and their feedback, below the episode on the review page."""
    if not served:
        return ""
    from flows.views.pages import esc

    items = []
    for c in served:
        said = "; ".join(" ".join(esc(str(v)) for v in (f["key"], f["score"], f["label"], f["comment"], f["who"]) if v is not None)
                         for f in c["feedback"] or []) or "no feedback"
        items.append(f"<li><b>{esc(str(c['served_at'])[:19])}</b> {esc(c['policy_id'])}: <code>{esc(c['reply'])}</code> "
                     f"&mdash; {said}</li>")
    return f"<h3>Served for this scenario, and what people said</h3><ul>{''.join(items)}</ul>"
