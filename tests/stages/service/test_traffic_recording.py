"""What a served call becomes in the workspace (`rlops serve`'s sink: flows/serve_commands.py, stages/service/served.py,
storage/traffic.py): chat, streamed chat, Responses and Messages calls through their real clients are `traffic` rows
with who sent them and the exact tokens the recorder holds; feedback on a recorded episode is a `feedback` row, and
a bad one or an unknown episode writes nothing."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from flows.serve_commands import recording_sink
from stages.service.app import ServerThread, build_app
from stages.service.resolve import fixed_resolver
from stages.service.service import PolicyService, ServiceConfig
from storage.traffic import TrafficLog, TrafficSettings
from storage.workspace import Workspace
from tests.scripted_model import CALL, QUESTION, SYSTEM, TOOLS

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service


@pytest.fixture(scope="module")
def recorded(scripted_policy, tmp_path_factory):
    """A service keeping every call in a workspace; yields (service, its URL, the traffic log, the workspace)."""
    ws = Workspace.open(tmp_path_factory.mktemp("traffic-ws"))
    log = TrafficLog(ws, TrafficSettings(flush_calls=1000, flush_seconds=3600))
    resolve, names = fixed_resolver("base", None)
    service = PolicyService(scripted_policy, resolve, ServiceConfig(batch_window_s=0.0, default_max_tokens=40), names,
                            sink=recording_sink(log, None, 1.0))
    try:
        with ServerThread(build_app(service, log)) as url:
            yield service, url, log, ws
    finally:
        service.close()
        log.close()


def rows(ws: Workspace, sql: str, params: list | None = None) -> list[dict]:
    return ws.query(sql, params).to_pylist()


def test_each_api_is_kept_with_who_sent_it_and_the_recorded_tokens(recorded):
    service, url, log, ws = recorded
    headers = {"X-Episode-Id": "ep-chat", "X-User-Id": "alice", "X-Session-Id": "s-1", "X-Rlops-Tags": '{"app": "web"}'}
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", default_headers=headers, max_retries=0)
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply = chat.chat.completions.create(model="base", messages=opening, tools=TOOLS, temperature=0,
                                         metadata={"plan": "free"})
    streamed = openai.OpenAI(base_url=url + "/ep/ep-stream/v1", api_key="unused", max_retries=0)
    chunks = list(streamed.chat.completions.create(model="base", messages=opening, temperature=0, stream=True,
                                                   user="bob"))
    responses = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    responses.responses.create(model="base", instructions=SYSTEM, input=QUESTION, user="carol",
                               metadata={"session_id": "s-9"})
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    claude.messages.create(model="base", max_tokens=20, system=SYSTEM, metadata={"user_id": "dave"},
                           messages=[{"role": "user", "content": QUESTION}])
    log.flush()

    by_episode = {r["episode_id"]: r for r in rows(ws, "SELECT * FROM traffic")}
    c = by_episode["ep-chat"]
    assert (c["api"], c["stream"], c["user_id"], c["session_id"], c["policy_id"], c["model"]) == (
        "chat", False, "alice", "s-1", "base", "base")
    assert json.loads(c["tags"]) == {"plan": "free", "app": "web"} and json.loads(c["tools"]) == TOOLS
    assert c["call_id"] == reply.id and c["finish_reason"] == "tool_calls" and c["reply_tool_calls"] == 1
    assert json.loads(c["reply"].split("<tool_call>")[1].split("</tool_call>")[0]) == CALL
    assert c["messages"][0]["content"].startswith(SYSTEM) and "search" in c["messages"][0]["content"]  # tools rendered
    assert c["latency_s"] > 0 and c["completion_tokens"] == len(c["token_ids"]) == len(c["logprobs"])
    # The tokens are exactly what the recorder holds for the episode (the service's own record of it).
    episode = service.episode("ep-chat")
    sampled = [t for t, m in zip(episode["token_ids"], episode["loss_mask"]) if m]
    assert c["token_ids"] == sampled and c["prompt_token_ids"] == episode["token_ids"][: len(c["prompt_token_ids"])]

    s = by_episode["ep-stream"]  # the URL names the episode; `user` names the person
    assert (s["api"], s["stream"], s["user_id"], s["session_id"]) == ("chat", True, "bob", "ep-stream")
    assert s["reply"].startswith("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    r = by_episode["carol"]  # Responses: `user` is the episode (as recorded before) and the person
    assert (r["api"], r["user_id"], r["session_id"]) == ("responses", "carol", "s-9")
    m = by_episode["dave"]  # Messages: metadata.user_id
    assert (m["api"], m["user_id"]) == ("messages", "dave")
    # One scenario: the same opening, however it was sent (chat messages, Responses' instructions, Messages' system);
    # the chat call offered tools, which its system message holds: another scenario.
    assert len({s["scenario_id"], r["scenario_id"], m["scenario_id"]}) == 1 and c["scenario_id"] != s["scenario_id"]
    assert len(by_episode) == 4


def test_feedback_on_a_recorded_episode_is_a_row_and_bad_feedback_writes_nothing(recorded):
    service, url, log, ws = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", default_headers={"X-Episode-Id": "ep-fb"},
                           max_retries=0)
    reply = client.chat.completions.create(model="base", messages=[{"role": "user", "content": QUESTION}], max_tokens=5)
    before = len(rows(ws, "SELECT * FROM feedback"))
    ok = httpx.post(f"{url}/rlops/episodes/ep-fb/feedback",
                    json={"score": 0.0, "comment": "wrong year", "who": "alice", "key": "correctness"})
    assert ok.status_code == 200 and ok.json()["id"].startswith("fb-")
    langfuse = httpx.post(f"{url}/rlops/episodes/ep-fb/feedback",  # Langfuse's names: name, value
                          json={"name": "helpful", "value": 1, "call_id": reply.id})
    assert langfuse.status_code == 200
    for body, status, needle in [({"score": 2}, 400, "score: a number in [0, 1]"), ({}, 400, "give a score"),
                                 ({"score": 0.5, "stars": 5}, 400, "stars"), ({"score": "high"}, 400, "score"),
                                 ({"score": 1, "call_id": "chatcmpl-nope"}, 404, "has no recorded call")]:
        bad = httpx.post(f"{url}/rlops/episodes/ep-fb/feedback", json=body)
        assert bad.status_code == status and needle in bad.json()["error"]["message"], bad.text
    unknown = httpx.post(f"{url}/rlops/episodes/ep-never/feedback", json={"score": 1})
    assert unknown.status_code == 404 and "ep-never" in unknown.json()["error"]["message"]
    got = rows(ws, "SELECT key, score, comment, who, call_id FROM feedback WHERE episode_id = 'ep-fb' ORDER BY created_at")
    assert len(rows(ws, "SELECT * FROM feedback")) == before + 2
    assert [(g["key"], g["score"], g["who"], g["call_id"]) for g in got] == [
        ("correctness", 0.0, "alice", None), ("helpful", 1.0, None, reply.id)]
