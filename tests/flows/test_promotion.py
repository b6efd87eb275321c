"""Champion and challenger through the promotion gate, with scheduled-style runs on a model that really learns.

The base model is the tiny Llama taught (full fine-tuning, a few seconds) to answer "7" to an arithmetic question
about half the time and to end its turn at once the other half. Every question of the data file is 7, so greedy
decoding answers them all right, and with one-token answers each episode is right or wrong by one choice.
Run 1 trains on the right answers and becomes the first champion. Run 2 continues its lineage, as a scheduled
run does, with a reward that pays for wrong answers: its greedy answer stops being 7, the gate's paired
comparison shows it worse, and it stays the challenger. `rlops serve --policy nightly@champion` keeps serving
run 1's checkpoint; `rlops promote` and `rlops rollback` move the alias, and the running server follows at the
next request, while an episode in progress stays on the policy it started with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from mlflow.tracking import MlflowClient

from flows import pipeline
from flows.promotion import gate, history
from flows.run_config import from_dict
from stages.common import StageContext
from storage.registry import Registry
from storage.workspace import Workspace
from tests.built_once import built_once
from tests.rewards.conftest import judge_server  # noqa: F401 - the judge_server fixture
from tests.rewards.test_judge_modes import shown, top_reply
from tests.processes import free_port, start_run, stop, wait_until
from tests.scripted_model import train_scripted

NAME = "nightly"
WRONG = Path(__file__).parent / "promotion_rewards.py"
SYSTEM = "Solve the arithmetic problem. Reply with the number only, no words or working."  # tasks/arithmetic.py's


@pytest.fixture(scope="session")
def sevens_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 20 full fine-tuning steps on one conversation answered "7": P("7") ~ 0.53 and
    P(end of turn) ~ 0.41 as its first token, whatever the question (it barely reads it yet)."""
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 4?"},
               {"role": "assistant", "content": "7"}]
    return built_once(tmp_path_factory, "sevens",
                      lambda out: train_scripted(tiny_model_dir, out, steps=20, lr=1e-2, messages=opening))


def sevens_config(model_dir: Path, data: Path) -> dict[str, Any]:
    """Run 1's config: one GRPO step on the right answers (`correct`), one-token answers, a `promote:` section."""
    return {
        "name": NAME, "base_model": str(model_dir), "steps": 1,
        "task": {"name": "arithmetic", "params": {"data_file": str(data)}},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 1, "max_total_tokens": 128},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"},
                              {"name": "wrong", "fn": f"{WRONG}:wrong_answer", "weight": 0.0}]},
        "train_reward": "correct",
        "eval": {"n_prompts": 10, "metric": "correct"},
        "promote": {"metric": "accuracy", "min_gain": 0.0, "resamples": 2000},
    }


def scheduled(ws: Workspace, cfg_dict: dict[str, Any]) -> tuple[pipeline.TrainResult, dict[str, Any] | None]:
    """What a scheduled run does (flows.prefect_flows.scheduled_train_flow), without Prefect: continue the
    run's lineage from its newest checkpoint on an MLflow parent run, then the gate."""
    cfg = from_dict(cfg_dict)
    start, step = pipeline.lineage_end(ws, cfg.name)
    ctx = StageContext(ws, run_name=cfg.name, parent_run_id=ws.tracker.start_run(f"pipeline:{cfg.name}"))
    result = pipeline.train(cfg, ctx, start_policy=start, start_step=step, on_step=lambda row: None)
    return result, gate(cfg, ctx, result.final)


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory, sevens_model_dir: Path) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("promotion")
    rows = [{"question": f"What is {a} + {7 - a}?", "answer": 7, "split": "train"} for a in range(8)]
    rows += [{"question": f"What is {a + 7} - {a}?", "answer": 7, "split": "test"} for a in range(20, 30)]
    data = tmp / "sevens.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ws = Workspace.open(tmp / "ws")
    cfg = sevens_config(sevens_model_dir, data)
    first, first_decision = scheduled(ws, cfg)
    # The bad night: the same run, trained on the reward edit that pays for wrong answers (4 epochs on the batch
    # at a high rate, so one step moves the one-token choice).
    bad = {**cfg, "train_reward": "wrong", "grpo": {"lr": 0.05, "epochs": 4}}
    second, second_decision = scheduled(ws, bad)
    return SimpleNamespace(ws=ws, cfg=cfg, bad=bad, first=first, second=second,
                           decisions=[first_decision, second_decision],
                           questions=[r["question"] for r in rows if r["split"] == "test"])


def test_the_first_version_is_champion_and_a_wrong_reward_stays_challenger(gated):
    ws, first, second = gated.ws, gated.first.final, gated.second.final
    d1, d2 = gated.decisions
    assert d1["action"] == "first" and d1["promoted"] and d1["challenger"] == first and d1["challenger_version"] == "1"
    assert ws.catalog.get_checkpoint(second)["trained_on"]["reward"].startswith("wrong@")
    assert ws.catalog.get_checkpoint(second)["parent_id"] == first  # the lineage continued, as scheduled runs do

    # Both evaluated on the same ten held-out prompts with the `correct` reward: run 2 forgot the answer.
    assert gated.first.evals[first]["accuracy"] == 1.0 and gated.second.evals[second]["accuracy"] == 0.0
    assert (d2["action"], d2["promoted"], d2["champion"], d2["challenger"]) == ("gate", False, first, second)
    assert (d2["champion_value"], d2["challenger_value"], d2["difference"], d2["prompts"]) == (1.0, 0.0, -1.0, 10)
    assert d2["high"] < 0 and "worse than the champion" in d2["reason"]
    evals = {e: ws.catalog.get_artifact(e)["meta"] for e in (d2["champion_eval"], d2["challenger_eval"])}
    assert [m["policy_id"] for m in evals.values()] == [first, second]
    assert len({(m["split"], m["metric"], m["success_threshold"]) for m in evals.values()}) == 1  # same prompts, reward

    registry = Registry(ws.tracker.client)
    assert registry.get(NAME, alias="champion").policy_id == first
    challenger = registry.get(NAME, alias="challenger")
    assert (challenger.version, challenger.policy_id) == ("2", second)
    lineage = challenger.tags  # the version's lineage: run, reward name@version, batches, base model, data hash
    assert lineage["rlops.run_name"] == NAME and lineage["rlops.reward"].startswith("wrong@")
    assert lineage["rlops.trained_on_batches"] == ",".join(gated.second.batches)
    assert lineage["rlops.base_model"] == gated.cfg["base_model"] and len(lineage["rlops.base_fingerprint"]) == 16

    run = MlflowClient(ws.settings.mlflow_uri).get_run(d2["mlflow_run_id"])  # the decision on run 2's MLflow run
    assert run.data.tags["rlops.promotion.promoted"] == "False" and run.data.metrics["promotion/difference"] == -1.0
    assert run.data.tags["rlops.promotion.challenger_version"] == "2"

    # A rerun of the gate (a resumed run) finds its decision: no second row, no second version.
    again = gate(from_dict(gated.bad), StageContext(ws, run_name=NAME, parent_run_id=d2["mlflow_run_id"]), second)
    assert again["promotion_id"] == d2["promotion_id"] and len(ws.catalog.promotions(NAME)) == 2


def test_serving_follows_the_champion_between_episodes(gated, tmp_path, capsys):
    from flows.cli import main

    ws, first, second = gated.ws, gated.first.final, gated.second.final
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_run([sys.executable, "-m", "flows.cli", "serve", "--policy", f"{NAME}@champion", "--port", str(port),
                      "--batch-window", "0", "--workspace", str(ws.root)], log)
    try:
        wait_until(lambda: _answers(url), proc, "rlops serve answered", timeout=300, every=0.2, log=log)

        def ask(episode: str | None = None, history: list[dict[str, str]] = (), model: str = f"{NAME}@champion") -> str:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                   default_headers={"X-Episode-Id": episode} if episode else {})
            messages = [{"role": "system", "content": SYSTEM}, *history,
                        {"role": "user", "content": gated.questions[0]}]
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
            return reply.choices[0].message.content

        def serving() -> dict[str, Any]:
            return {m.id: m for m in openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data}

        assert ask() == "7" and ask("episode-a") == "7"  # run 1's checkpoint: the champion, after run 2's gate too
        champion = serving()[f"{NAME}@champion"]
        assert (champion.version, champion.policy_id) == ("1", first)
        assert serving()[f"{NAME}@challenger"].version == "2"

        assert main(["promote", NAME, "--policy", second, "--reason", "a person overrides the gate",
                     "--workspace", str(ws.root)]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == second
        assert ask() == "" and ask("episode-b") == ""  # the very next request: run 2's checkpoint ends its turn
        assert ask(model=f"models:/{NAME}@champion") == "" and ask(model=f"models:/{NAME}/1") == "7"
        assert serving()[f"{NAME}@champion"].version == "2"
        # The episode that began on version 1 finishes on it.
        earlier = [{"role": "user", "content": gated.questions[0]}, {"role": "assistant", "content": "7"}]
        assert ask("episode-a", earlier) == "7"

        assert main(["rollback", NAME, "--reason", "answers went missing", "--workspace", str(ws.root)]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == first
        assert ask() == "7"  # version 1 again, at once; episode-b began on version 2 and stays on it
        assert ask("episode-b", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]) == ""
        assert (serving()[f"{NAME}@champion"].version, ask("episode-c")) == ("1", "7")
    finally:
        stop(proc)
    said = log.read_text()
    assert f"{NAME}@champion serves version 1, policy {first}\n" in said
    assert f"{NAME}@champion serves version 2, policy {second} (was version 1)" in said
    assert f"{NAME}@champion serves version 1, policy {first} (was version 2)" in said

    capsys.readouterr()
    assert main(["sql", "SELECT action, promoted, champion_version, challenger_version, reason FROM promotions "
                 f"WHERE model_name = '{NAME}' ORDER BY decided_at", "--format", "json",
                 "--workspace", str(ws.root)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["action"], r["promoted"], r["champion_version"], r["challenger_version"]) for r in rows] == [
        ("first", True, None, "1"), ("gate", False, "1", "2"), ("manual", True, "1", "2"), ("rollback", True, "2", "1")]
    assert rows[2]["reason"] == "a person overrides the gate"


def test_a_judge_gate_without_labels_beats_the_baseline_then_guards_the_champion(gated, judge_server):  # noqa: F811
    """Served traffic has no labels: the judge compares greedy answers. A scripted judge that dislikes "7" prefers
    run 2's answers to those of the base model the loop served, so run 2 becomes the first champion of `judged`;
    run 1's checkpoint, which answers 7 again, then loses to it. The base model is never registered."""
    ws, base, first, second = gated.ws, gated.first.base, gated.first.final, gated.second.final

    def respond(body, headers):  # P("1") = 0.9 when only the first-shown answer is not 7
        a, b = (answer != "7" for answer in shown(body))
        return top_reply({"1": 0.5 + 0.4 * (a - b), "2": 0.5 - 0.4 * (a - b)})

    judge_server.respond = respond
    cfg = from_dict({**gated.bad, "promote": {"model_name": "judged", "resamples": 2000, "judge": {
        "model": "scripted-judge", "base_url": judge_server.url, "timeout": 5.0}}})
    ctx = StageContext(ws, run_name=NAME, parent_run_id=ws.tracker.start_run("pipeline:judged"))
    row = gate(cfg, ctx, second, baseline=base)
    assert (row["action"], row["promoted"], row["champion"], row["champion_version"]) == ("gate", True, base, None)
    assert (row["metric"], row["prompts"], row["challenger_value"], row["difference"]) == (
        "judge_win_rate", 10, pytest.approx(0.9), pytest.approx(0.4))
    assert row["low"] > 0.5 and "clears min_win_rate 0.5" in row["reason"] and "judged pairwise" in row["rule"]
    assert len(judge_server.requests) == 20  # both orders of ten held-out prompts
    registry = Registry(ws.tracker.client)
    assert registry.get("judged", alias="champion").policy_id == second
    assert registry.version_of("judged", base) is None
    # The decision's verdicts, through the promotions row (docs/PROMOTION.md, "A gate without labels").
    verdicts = ws.query("SELECT v.prompt_id, v.win, v.champion, v.judge_version FROM promotions p "
                        "JOIN verdicts v ON v.comparison_id = p.verdicts WHERE p.promotion_id = $id",
                        {"id": row["promotion_id"]}).to_pylist()
    assert len(verdicts) == 10 and {(v["champion"], v["judge_version"]) for v in verdicts} == {
        (base, row["judge_version"])}
    batches = [ws.catalog.get_artifact(row[k]) for k in ("champion_eval", "challenger_eval")]
    assert [(b["kind"], b["meta"]["policy_id"]) for b in batches] == [("rollouts", base), ("rollouts", second)]
    assert gate(cfg, ctx, second, baseline=base) is None  # a rerun: already the champion, nothing to decide

    back = gate(cfg, ctx, first, baseline=base)  # a champion now: the baseline is not used
    assert (back["action"], back["promoted"], back["champion"], back["champion_version"]) == (
        "gate", False, second, "1")
    assert back["challenger_value"] == pytest.approx(0.1) and "prefers the champion" in back["reason"]
    assert gate(cfg, ctx, first, baseline=base)["promotion_id"] == back["promotion_id"]  # a rerun finds its decision
    assert registry.get("judged", alias="champion").policy_id == second
    # Run 1 answers 7 as the base model does: the same pairs of answers, so the judge's cache answered them all.
    assert len(judge_server.requests) == 20
    assert len(ws.catalog.promotions("judged")) == 2


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("argv, message", [
    (["serve", "--policy", f"{NAME}@nope"], "has no alias 'nope'"),
    (["serve", "--policy", "ghost@champion"], "no registered model 'ghost'"),
    (["serve", "--policy", "models:/nightly/99"], "has no version 99"),
    (["promote", NAME, "--policy", "ck-0000000000000000", "--reason", "r"], "unknown model 'ck-0000000000000000'"),
    (["promote", "ghost", "--policy", f"{NAME}@challenger", "--reason", "r"], "no registered model 'ghost'"),
    (["rollback", "ghost"], "no registered model 'ghost'"),
    (["export", "ghost@champion", "--format", "hf", "out"], "no registered model 'ghost'"),
])
def test_unknown_aliases_policies_and_models_fail_before_any_work(gated, capsys, argv, message):
    from flows.cli import main

    before = len(gated.ws.catalog.promotions(NAME))
    capsys.readouterr()
    assert main([*argv, "--workspace", str(gated.ws.root)]) == 1
    assert message in capsys.readouterr().err
    assert len(gated.ws.catalog.promotions(NAME)) == before


@pytest.mark.parametrize("promote, message", [
    ({"metric": "pass@4"}, "'pass@4' is not a per-prompt metric the gate's evaluation produces (samples=1)"),
    ({"metric": "tool_call_validity"}, "one of accuracy, reward_mean"),
    ({"samples": 4}, "greedy samples are all alike"),
    ({"model_name": "no spaces"}, "promote.model_name"),
])
def test_a_gate_the_evaluation_cannot_feed_is_refused_before_any_work(gated, tmp_path, capsys, promote, message):
    from flows.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({**gated.cfg, "promote": promote}))  # JSON is YAML
    capsys.readouterr()
    assert main(["run", str(path), "--workspace", str(tmp_path / "never")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_rollback_history_is_a_stack_of_champions():
    rows = [{"action": "first", "promoted": True, "challenger": "a", "challenger_version": "1"},
            {"action": "gate", "promoted": False, "challenger": "b", "challenger_version": "2"},
            {"action": "gate", "promoted": True, "challenger": "c", "challenger_version": "3"},
            {"action": "manual", "promoted": True, "challenger": "b", "challenger_version": "2"}]
    assert history(rows) == [("a", "1"), ("c", "3"), ("b", "2")]
    rolled = rows + [{"action": "rollback", "promoted": True, "challenger": "c", "challenger_version": "3"}]
    assert history(rolled) == [("a", "1"), ("c", "3")]  # a second rollback would give "a" back, not "b"
