"""Agreement, measured: a script labels the run from ground truth through the review server's HTTP API, and `rlops
review agreement` reports the programmatic `correct` reward at 1.0 and a deliberately wrong reward at 0; a second
reviewer who orders every group the wrong way round disagrees with the first, by pairs and by Kendall's tau; the run
page and SQL give the same numbers. On the views' shared run (tests/flows/views/conftest.py), its "tools" episodes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flows.views.agreement import agreement
from storage.workspace import Workspace
from tests.flows.views.conftest import _env, cli, soup

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]  # with the other readers of the shared run
ROOT = Path(__file__).resolve().parents[3]


def _score_wrong(ws: Workspace) -> None:
    """bench/review_rewards.py's `wrong` (numeric_match inverted) scored on the run, as any reward is."""
    from rewards.base import RewardSpec
    from stages import score
    from stages.common import StageContext

    spec = RewardSpec(name="wrong", fn=f"{ROOT / 'bench' / 'review_rewards.py'}:wrong")
    score.run(score.ScoreConfig(rewards=[spec], total=None), StageContext(ws, run_name="tools"), ["ro-tools"])


def _order_wrong_first(url: str, ws: Workspace, reviewer: str) -> None:
    """Order every group with the wrong answers first, through the API (the page's own call)."""
    for g in range(4):
        members = httpx.get(f"{url}/api/episodes/ro-tools-g{g}-s0", timeout=60).json()["group"]
        answers = {r: httpx.get(f"{url}/api/episodes/{r}", timeout=60).json()["messages"][-1]["content"] for r in members}
        order = sorted(members, key=lambda r: (answers[r] == "1987", r))
        saved = httpx.post(f"{url}/api/labels", json={"kind": "order", "workspace_id": ws.workspace_id,
                                                     "reviewer": reviewer, "order": order}, timeout=60)
        assert saved.status_code == 201, saved.text


def test_agreement_with_labels_from_ground_truth(run_ws: Workspace, review_url: str) -> None:
    _score_wrong(run_ws)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "label_by_answer.py"), "--url", review_url,
                          "--reviewer", "truth"], capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "graded 12 episodes of run tools: 6 good, 6 bad" in out.stdout  # (g + s) odd: "1987", right

    report = cli(run_ws.root, "review", "agreement", "tools", "--reviewer", "truth", "--json")
    assert report.returncode == 0, report.stderr[-3000:]
    lines = [json.loads(line) for line in report.stdout.splitlines()]
    rows = {r["judge"].split("@")[0]: r for r in lines if r["table"] == "rewards"}  # (other tests' reviewers: the rest)
    # 4 groups of 3 with 1 or 2 right answers: 2 preferences each
    assert rows["correct"]["accuracy"] == 1.0 and rows["correct"]["pairs"] == 8 and rows["correct"]["groups"] == 4
    assert rows["correct"]["accuracy_low"] == 1.0 and rows["wrong"]["accuracy"] == 0.0
    assert rows["wrong"]["accuracy_high"] == 0.0 and rows["wrong"]["discordant"] == 8
    assert rows["judged"]["accuracy"] == 0.5 and rows["judged"]["ties"] == 8  # len % 2: even for every answer here
    assert rows["total"]["accuracy"] == 1.0 and set(rows) == {"correct", "judged", "total", "wrong"}
    assert rows["correct"]["ranked_groups"] == 0 and rows["correct"]["mean_tau"] is None  # grades: no ordering

    # A second reviewer orders every group wrong answers first: tau -2/sqrt(6) per group against `correct`
    # (its two right or two wrong answers tie), and against the first reviewer's preferences, all backwards.
    _order_wrong_first(review_url, run_ws, "contrarian")
    second = agreement(run_ws, "tools", reviewer="contrarian")
    correct = next(a for a in second.rewards if a.judge.startswith("correct@"))
    assert correct.ranked_groups == 4 and correct.mean_tau == pytest.approx(-2 / math.sqrt(6))
    assert correct.accuracy == pytest.approx(1 / 6)  # per group: 2 discordant, 1 tie counting half, of 3
    assert correct.tau_low == correct.tau_high == pytest.approx(-2 / math.sqrt(6))
    between = {a.judge: a for a in second.between_reviewers}
    assert between["contrarian vs truth"].accuracy == 0.0 and between["contrarian vs truth"].pairs == 8
    assert between["truth vs contrarian"].pairs == 12 and between["truth vs contrarian"].mean_tau is not None
    # On the same episodes: contrarian's orderings put a right answer at 0.5 in groups with two right ones (g1, g3),
    # the only two of twelve episodes where the verdicts (>= 0.5: good) agree.
    both = next(o for o in second.same_episodes if o.reviewers == "contrarian and truth")
    assert both.episodes == 12 and both.same_verdict == pytest.approx(2 / 12) and both.low < both.same_verdict

    # The same numbers in SQL (the views `rlops sql` has) and on the run page (every reviewer's labels).
    by_sql = {r["reward_name"]: r["accuracy"] for r in run_ws.query(
        "SELECT reward_name, (sum(concordant) + sum(ties) / 2) / sum(pairs) AS accuracy FROM label_agreement_groups "
        "WHERE reviewer = 'truth' AND batch_id = 'ro-tools' GROUP BY 1").to_pylist()}
    assert by_sql == {name: rows[name]["accuracy"] for name in rows}
    from flows.views.runpage import write_run_page

    page = soup(write_run_page(run_ws, "tools"))
    shown = {tr["data-judge"]: float(tr["data-accuracy"]) for tr in page.select("table.agreement.rewards tr[data-judge]")}
    pooled = {f"{r['reward_name']}@{r['reward_version']}": r["pairwise_accuracy"]
              for r in run_ws.query("SELECT * FROM label_agreement").to_pylist()}  # only "tools" has labels
    assert shown == pytest.approx(pooled) and len(shown) == 4
    assert {tr["data-judge"] for tr in page.select("table.agreement.reviewers tr[data-judge]")} >= {"contrarian vs truth",
                                                                                        "truth vs contrarian"}
