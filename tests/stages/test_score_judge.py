"""The RULER-style judge inside the score stage: a real HTTP endpoint on 127.0.0.1, the response cache
in the workspace, and a fake API key that never reaches any file or log."""

from __future__ import annotations

import json
import logging
import re

from rewards.base import RewardSpec
from stages import score
from stages.common import StageContext
from tests.rewards.conftest import chat_reply, judge_server  # noqa: F401 - the judge_server fixture
from storage.schema import to_table
from tests.factories import tool_episode
from tests.storage.conftest import ws  # noqa: F401 - the ws fixture

KEY = "sk-test-FAKE-7d1e0c9a4b"


def _scores(body, headers):
    ids = re.findall(r'<trajectory id="([^"]+)">', body["messages"][1]["content"])
    scores = [{"id": i, "score": round(0.1 * n, 2), "explanation": f"rank {n}"} for n, i in enumerate(ids)]
    return chat_reply(json.dumps({"scores": scores}))


def test_judge_scores_groups_caches_and_never_records_the_key(ws, judge_server, monkeypatch, caplog, capsys):  # noqa: F811
    monkeypatch.setenv("RLOPS_TEST_JUDGE_KEY", KEY)
    judge_server.respond = _scores
    episodes = [tool_episode("ro-j", g, s, answer=f"{1987 + 10 * g + s}") for g in range(3) for s in range(4)]
    ws.write_part("rollouts", "ro-j", to_table(episodes), part="groups-00000")
    ws.catalog.complete_artifact("ro-j", "rollouts", "rollout", [], "cfg")
    ctx = StageContext(ws, run_name="judge")
    config = score.ScoreConfig(rewards=[
        RewardSpec(name="judge", fn="rewards.ruler.ruler_reward",
                   params={"model": "test-judge", "base_url": judge_server.url, "api_key_env": "RLOPS_TEST_JUDGE_KEY"}),
        RewardSpec(name="correct", fn="rewards.builtin.exact_match"),
    ])
    caplog.set_level(logging.DEBUG)
    ref = score.run(config, ctx, ["ro-j"])

    assert len(judge_server.requests) == 3  # one request per group
    assert all(r["headers"]["authorization"] == f"Bearer {KEY}" for r in judge_server.requests)
    rows = ws.query("SELECT value, details FROM rewards WHERE reward_name = 'judge'").to_pylist()
    assert len(rows) == 12 and sorted({r["value"] for r in rows}) == [0.0, 0.1, 0.2, 0.3]
    assert sum(r["value"] == 0.0 for r in rows) == 3  # one per group: the judge ranked each group
    assert all("explanation" in r["details"] for r in rows)
    assert any(ws.judge_cache_dir.rglob("*.json"))

    # the same group judged again (a forced rescore) is answered from the cache: no HTTP call
    score.run(config, StageContext(ws, run_name="judge", force=True), ["ro-j"])
    assert len(judge_server.requests) == 3

    leaked = [str(p) for p in ws.root.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []
    out = capsys.readouterr()
    assert KEY not in out.out + out.err and KEY not in caplog.text
    assert ws.catalog.get_artifact(ref.id) is not None
