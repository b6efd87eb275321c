"""The deployment loop, two nights (docs/LOOP.md): a served policy's traffic becomes the next night's training data,
judged without labels, gated by a pairwise judge, promoted; the server follows the champion.

The policy is the tiny Llama taught to answer any arithmetic question "8" (P ~0.49) or "7" (P ~0.34): greedy it is
wrong (every question's answer is 7), sampled it is sometimes right. The judge is a scripted one that does the sums
itself (tests/flows/arithmetic_judge.py), as RULER's ranking and as the gate's pairwise judge; nothing it is sent
holds a reference. Users ask through the real openai client; `rlops serve`'s pieces run in-process (its resolver
following `loop@champion`, `--fallback base` before the first champion, its traffic log).

Night 1 trains from the base model on its window's traffic, one GRPO step at a high rate, so the greedy answer turns
to 7: the gate's judge prefers it to the base on every held-out scenario, and it becomes the champion, which the
server answers with at the next request. Night 2 trains from that champion on the traffic since: both answer 7, the
judge ties every pair, and the challenger is held back.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from flows.serve_commands import recording_sink, with_fallback
from stages.common import base_policy
from stages.policy.resident import ResidentPolicy
from stages.service.app import ServerThread, build_app
from stages.service.resolve import catalog_resolver
from stages.service.service import PolicyService, ServiceConfig
from storage.registry import Registry
from storage.traces import search
from storage.traffic import TrafficLog, TrafficSettings
from storage.workspace import Workspace
from tests.built_once import built_once
from tests.flows.arithmetic_judge import arithmetic_judge
from tests.scripted_model import train_mixed

pytestmark = pytest.mark.slow  # a mixed tiny model (built once), two nights through the Prefect flow

SYSTEM = "Solve the arithmetic problem. Reply with the number only, no words or working."  # tasks/arithmetic.py's
NAME = "loop"


@pytest.fixture(scope="session")
def eights_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 30 steps on "7" (weight 0.4) and "8" (0.6) as the answer: P("8") ~0.49, P("7") ~0.34."""
    def conversation(answer: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": answer}]

    return built_once(tmp_path_factory, "eights", lambda out: train_mixed(
        tiny_model_dir, out, [(conversation("7"), 0.4), (conversation("8"), 0.6)], steps=30))


def loop_config(model_dir: Path, judge_url: str) -> dict[str, Any]:
    judge = {"model": "arithmetic", "base_url": judge_url}
    return {
        "name": NAME, "base_model": str(model_dir), "steps": 1,
        "task": {"name": "traffic", "params": {"test_fraction": 0.3}},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 1, "max_total_tokens": 128},
        "score": {"rewards": [{"name": "ruler", "fn": "rewards.ruler.ruler_reward", "params": judge}]},
        "grpo": {"lr": 0.05, "epochs": 4},
        "eval": {"n_prompts": 8, "every": 1},
        "promote": {"judge": judge, "resamples": 2000},
    }


def ask(url: str, users: range, offset: int) -> list[str]:
    """One question each from users in their own sessions (the sums are all 7), as a deployed agent's users ask."""
    answers = []
    for u in users:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"X-User-Id": f"user-{u}", "X-Session-Id": f"s-{offset}-{u}",
                                                "X-Episode-Id": f"ep-{offset}-{u}"})
        a = offset + u
        reply = client.chat.completions.create(model=f"{NAME}@champion", max_tokens=1, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a + 7} - {a}?"}])
        answers.append(reply.choices[0].message.content)
    return answers


@pytest.fixture(scope="module")
def loop(prefect_harness, eights_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    from flows.prefect_flows import traffic_night_flow

    ws = Workspace.open(tmp_path_factory.mktemp("loop") / "ws")
    log = TrafficLog(ws, TrafficSettings(flush_calls=1000, flush_seconds=3600))
    registry = Registry(ws.tracker.client)
    resolve, names = catalog_resolver(ws.settings.snapshot_dir / "checkpoints.parquet", str(eights_model_dir), registry)
    resolve = with_fallback(resolve, f"{NAME}@champion", "base", lambda line: None)
    sink = recording_sink(log, registry, 1.0, base_policy(ws, str(eights_model_dir)))  # as `rlops serve` makes it
    service = PolicyService(ResidentPolicy.load(str(eights_model_dir)), resolve, ServiceConfig(batch_window_s=0.0),
                            names, sink=sink)
    with arithmetic_judge() as judge:
        cfg = loop_config(eights_model_dir, judge.url)
        try:
            with ServerThread(build_app(service, log)) as url:
                before = ask(url, range(16), 0)
                said = httpx.post(f"{url}/rlops/episodes/ep-0-3/feedback", json={"score": 0, "comment": "it is 7",
                                                                                "who": "user-3"})
                assert said.status_code == 200, said.text
                log.flush()
                night1 = traffic_night_flow(cfg, str(ws.root))
                after = ask(url, range(16), 100)  # the next requests: the new champion answers
                log.flush()
                night2 = traffic_night_flow(cfg, str(ws.root))
        finally:
            service.close()
            log.close()
    return SimpleNamespace(ws=ws, before=before, after=after, nights=[night1, night2], judge=judge)


def test_two_nights_promote_once_and_hold_back_once(loop):
    ws = loop.ws
    assert loop.before == ["8"] * 16 and loop.after == ["7"] * 16  # the server followed the promotion
    n1, n2 = (n["night"] for n in loop.nights)
    assert (n1["status"], n1["promoted"], n2["status"], n2["promoted"]) == ("complete", True, "complete", False)
    assert n1["since"] is None and n2["since"] == n1["until"] and n1["calls"] == n2["calls"] == 16  # contiguous windows
    assert n1["scenarios_train"] + n1["scenarios_heldout"] == 16 and n1["scenarios_heldout"] >= 2
    d1, d2 = (n["promotion"] for n in loop.nights)
    base = n1["start_policy"]
    assert base.startswith("base") and (d1["action"], d1["champion"], d1["promoted"]) == ("gate", base, True)
    assert d1["challenger_value"] > 0.9 and d1["low"] > 0.5  # the judge preferred night 1's answers to the base's
    assert (d2["action"], d2["champion"], d2["promoted"]) == ("gate", n1["final_policy"], False)
    assert d2["challenger_value"] == 0.5 and "does not clear min_win_rate" in d2["reason"]  # ties: not better
    assert ws.catalog.get_checkpoint(n2["final_policy"])["parent_id"] == n1["final_policy"]  # from the champion
    assert Registry(ws.tracker.client).get(NAME, alias="champion").policy_id == n1["final_policy"]

    # Every per-scenario verdict is a row, with the judge's version; both orders were asked.
    rows = ws.query("SELECT p.promotion_id, v.prompt_id, v.win, v.p_challenger_first, v.p_challenger_second, "
                    "v.judge_version FROM promotions p JOIN verdicts v ON v.comparison_id = p.verdicts "
                    "ORDER BY p.decided_at").to_pylist()
    first = [r for r in rows if r["promotion_id"] == d1["promotion_id"]]
    assert len(first) == n1["scenarios_heldout"] and all(r["win"] > 0.9 for r in first)
    assert {r["judge_version"] for r in rows} == {d1["judge_version"]} == {d2["judge_version"]}
    assert all(r["win"] == 0.5 for r in rows if r["promotion_id"] == d2["promotion_id"])

    # The rollouts of each night are the scenarios of its window: a person's calls join to what was trained on them.
    trained = ws.query("SELECT DISTINCT user_id, policy_id FROM traffic_lineage WHERE how = 'trained'").to_pylist()
    assert {r["policy_id"] for r in trained} == {n1["final_policy"], n2["final_policy"]}
    # What each night served and trained on is in MLflow, as traces on its run.
    served, made = search(ws, {"rlops.kind": "served"}), search(ws, {"rlops.kind": "trained"})
    assert len(served) == 32 and len(made) == 2 * 4 * 4
    assert {t.info.tags["rlops.policy_id"] for t in served} == {base, n1["final_policy"]}


def test_the_review_page_shows_what_was_served_and_what_people_said(loop):
    from flows.views.review import Review

    ws = loop.ws
    scenario = ws.query("SELECT scenario_id FROM traffic WHERE episode_id = 'ep-0-3'").to_pylist()[0]["scenario_id"]
    (rollout,) = ws.query("SELECT rollout_id FROM rollouts WHERE prompt_id = ? LIMIT 1", [scenario]).to_pylist()
    shown = Review(ws, NAME).episode(rollout["rollout_id"])
    (served,) = shown["served"]
    assert served["reply"] == "8" and served["feedback"] == [
        {"key": "feedback", "score": 0.0, "label": None, "comment": "it is 7", "who": "user-3"}]
    assert "Served for this scenario" in shown["html"] and "it is 7" in shown["html"]


def test_a_scheduled_run_of_a_traffic_config_is_a_night_and_an_empty_window_is_skipped(prefect_harness, tmp_path,
                                                                                      tiny_model_dir):
    import yaml

    from flows.prefect_flows import scheduled_train_flow

    config = tmp_path / "loop.yaml"
    config.write_text(yaml.safe_dump(loop_config(tiny_model_dir, "http://127.0.0.1:9/v1")))  # no traffic: never asked
    ws = Workspace.open(tmp_path / "ws")
    first = scheduled_train_flow(str(config), str(ws.root))
    second = scheduled_train_flow(str(config), str(ws.root))
    assert (first["status"], first["calls"], first["scenarios_train"]) == ("skipped", 0, 0)
    nights = ws.query("SELECT status, since, until FROM nights ORDER BY started_at").to_pylist()
    assert [n["status"] for n in nights] == ["skipped", "skipped"] and second["night_id"] != first["night_id"]
    assert nights[1]["since"] is None  # a skipped night's traffic is still the next one's: no complete night yet
    assert ws.catalog.checkpoints() == []  # nothing trained
