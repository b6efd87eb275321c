"""The policy service through the real `openai` client against uvicorn on 127.0.0.1: chat with tools
and n > 1, batching, hot-loaded checkpoints, token-exact recording, segments, and errors.

The model is the tiny one of tests/scripted_model.py, trained to answer the scripted question with a
`search` tool call and the tool's result with "1987", so tool calls are real model output.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from stages.policy.resident import ResidentPolicy
from stages.service.resolve import catalog_resolver
from stages.service.service import ServiceConfig
from storage.schema import segment_bounds
from storage.workspace import Workspace
from tests.scripted_model import ANSWER, CALL, QUESTION, SYSTEM, TOOL_RESULT, TOOLS, scripted_model_dir, script_messages  # noqa: F401
from tests.service_fixtures import broken_service, client_of, serving

pytestmark = pytest.mark.slow  # the scripted model (built once per run) and a service


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace.open(tmp_path_factory.mktemp("serve-ws"))


@pytest.fixture(scope="module")
def policy(scripted_model_dir: Path) -> ResidentPolicy:
    return ResidentPolicy.load(str(scripted_model_dir))


@pytest.fixture(scope="module")
def service(policy, ws, scripted_model_dir):
    resolver = catalog_resolver(ws.settings.snapshot_dir / "checkpoints.parquet", str(scripted_model_dir))
    # A wide window: on 2 busy cores 32 concurrent requests can take a few hundred ms to arrive.
    with serving(policy, resolver, ServiceConfig(batch_window_s=0.5, default_max_tokens=40)) as svc:
        yield svc


_client = client_of


def _opening() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def test_chat_with_tools_and_n(service):
    client = _client(service)
    r = client.chat.completions.create(model="base", messages=_opening(), tools=TOOLS, n=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == CALL["name"]
        assert json.loads(call.function.arguments) == CALL["arguments"]
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3  # ids are unique: results refer to them
    tok = service.policy.tokenizer
    turn = tok(script_messages()[2]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert r.usage.completion_tokens == 3 * len(turn)
    rendered = tok.apply_chat_template(script_messages()[:2], tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])

    sampled = client.chat.completions.create(model="base", messages=_opening(), n=4, temperature=1.0, max_tokens=3,
                                             logprobs=True)
    assert len(sampled.choices) == 4
    for c in sampled.choices:
        assert 1 <= len(c.logprobs.content) <= 3 and all(e.logprob <= 0 for e in c.logprobs.content)


def test_episode_reuses_sampled_tokens_and_matches_template_and_fresh_logprobs(service, scripted_model_dir):
    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs

    client = _client(service, "ep-tools")
    messages = _opening()
    first = client.chat.completions.create(model="base", messages=messages, tools=TOOLS, temperature=1.0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    second = client.chat.completions.create(model="base", messages=messages, tools=TOOLS, temperature=1.0)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"

    log = service.recorder.peek("ep-tools")
    c1, c2 = (c.choices[0] for c in log.calls)
    tok = service.policy.tokenizer
    script = script_messages(call.id)
    # The recorded prompts decode to exactly the chat template's rendering of the conversation, the
    # generated turn as the model wrote it (with its <tool_call> tags, which the client never saw).
    assert tok.decode(c1.prompt_ids) == tok.apply_chat_template(script[:2], tokenize=False, add_generation_prompt=True)
    assert tok.decode(c2.prompt_ids) == tok.apply_chat_template(script[:4], tokenize=False, add_generation_prompt=True)
    # ... and the second prompt holds the first call's sampled ids themselves, EOS included.
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.token_ids)] == c1.prompt_ids + c1.token_ids
    assert c1.token_ids[-1] in service.policy.eos_ids

    episode = httpx.get(f"{service.url}/rlops/episodes/ep-tools").json()
    ids, mask, blp = episode["token_ids"], episode["loss_mask"], episode["behavior_logprobs"]
    assert episode["segment_starts"] == [] and ids == c2.prompt_ids + c2.token_ids
    assert [t for t, m in zip(ids, mask) if m] == c1.token_ids + c2.token_ids
    assert [m["role"] for m in episode["messages"]] == ["system", "user", "assistant", "tool", "assistant"]

    # The behaviour log-probs equal a fresh forward pass over the recorded tokens.
    model, _ = load_policy(str(scripted_model_dir))
    with torch.no_grad():
        fresh = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                               torch.tensor([mask]))[0]
    on = torch.tensor(mask, dtype=torch.bool)
    assert torch.allclose(fresh[on], torch.tensor(blp)[on], atol=1e-4)


def test_history_rewriting_agent_gives_segments_with_correct_masks(service, scripted_model_dir):
    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs

    client = _client(service, "ep-rewrite")
    first = client.chat.completions.create(model="base", messages=_opening(), tools=TOOLS, max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    # The agent replaces its tool call and the result with a summary in the user message: the prompt
    # no longer extends what the model saw and sampled.
    rewritten = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"{QUESTION}\nA search returned: {TOOL_RESULT}"}]
    second = client.chat.completions.create(model="base", messages=rewritten, tools=TOOLS, max_tokens=8)
    # ... then continues that rewritten history normally: the same segment.
    third = client.chat.completions.create(
        model="base", tools=TOOLS, max_tokens=8,
        messages=rewritten + [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}])
    assert call.function.name == "search" and third.choices

    log = service.recorder.peek("ep-rewrite")
    sampled = [c.choices[0].token_ids for c in log.calls]
    t = httpx.get(f"{service.url}/rlops/episodes/ep-rewrite").json()
    ids, mask, blp = t["token_ids"], t["loss_mask"], t["behavior_logprobs"]
    bounds = segment_bounds(t["segment_starts"], len(ids))
    assert len(bounds) == 2
    (a0, b0), (a1, b1) = bounds
    # segment 1: call 1's prompt (mask 0) and sample (mask 1); segment 2: call 2's prompt, sample,
    # the template text in between, call 3's sample.
    p1, p2 = log.calls[0].choices[0].prompt_ids, log.calls[1].choices[0].prompt_ids
    assert ids[a0:b0] == p1 + sampled[0] and mask[a0:b0] == [0] * len(p1) + [1] * len(sampled[0])
    assert ids[a1 : a1 + len(p2)] == p2 and set(mask[a1 : a1 + len(p2)]) == {0}
    assert [x for x, m in zip(ids, mask) if m] == sampled[0] + sampled[1] + sampled[2]  # each sampled token once
    assert all(lp == 0.0 for lp, m in zip(blp, mask) if not m)

    # Each segment is its own sequence from position 0: the fresh log-probs match per segment.
    model, _ = load_policy(str(scripted_model_dir))
    for a, b in bounds:
        seg, seg_mask = ids[a:b], mask[a:b]
        with torch.no_grad():
            fresh = token_logprobs(model, torch.tensor([seg]), torch.ones(1, len(seg), dtype=torch.long),
                                   torch.tensor([seg_mask]))[0]
        on = torch.tensor(seg_mask, dtype=torch.bool)
        assert torch.allclose(fresh[on], torch.tensor(blp[a:b])[on], atol=1e-4)


def test_stop_strings_are_cut_from_the_text_but_kept_in_the_tokens(service):
    client = _client(service, "ep-stop")
    script = script_messages("call_x")
    messages = [{"role": "system", "content": SYSTEM}, *script[1:2],
                {"role": "assistant", "content": script[2]["content"]}, script[3]]
    r = client.chat.completions.create(model="base", messages=messages, tools=TOOLS, temperature=0, stop=["98"])
    assert r.choices[0].message.content == "1" and r.choices[0].finish_reason == "stop"  # "1987" cut before "98"
    (call,) = service.recorder.peek("ep-stop").calls
    raw = call.choices[0].message.content
    assert raw.startswith("1987"[: len(raw)]) and "98" in raw  # the model sampled through the stop string
    assert service.policy.tokenizer.decode(call.choices[0].token_ids) == raw
    # Sent back as the client saw it ("1"), the turn is still its sampled tokens in the next prompt.
    again = client.chat.completions.create(
        model="base", tools=TOOLS, max_tokens=2,
        messages=messages + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}])
    assert again.choices
    second = service.recorder.peek("ep-stop").calls[1].choices[0]
    first = call.choices[0]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == first.prompt_ids + first.token_ids


def test_32_concurrent_requests_share_generate_calls(service):
    client = openai.AsyncOpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)

    async def episode(i: int):
        return await client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": f"Question {i}?"}], max_tokens=2 + i % 4,
            temperature=1.0, extra_headers={"X-Episode-Id": f"many-{i}"})

    async def all_of_them():
        try:
            return await asyncio.gather(*(episode(i) for i in range(32)))
        finally:
            await client.close()

    before = service.generate_calls
    answers = asyncio.run(all_of_them())
    assert len(answers) == 32 and all(a.choices[0].message.content is not None for a in answers)
    assert service.generate_calls - before <= 4  # not 32: the queue batches them (usually into 1 call)
    # Different max_tokens share a call; each answer is cut to its own limit.
    assert all(a.usage.completion_tokens <= 2 + i % 4 for i, a in enumerate(answers))
    assert any(a.usage.completion_tokens == 5 for a in answers)
    assert all(service.recorder.peek(f"many-{i}").calls for i in range(32))


def test_a_new_checkpoint_changes_answers_without_restart(service, ws, scripted_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    client = _client(service)
    ask = dict(messages=_opening(), tools=TOOLS, temperature=0, max_tokens=12)
    base = client.chat.completions.create(model="base", **ask)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ck-new", **ask)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="run-a@latest", **ask)

    # A GRPO step lands while the server runs: an adapter folder, then its catalog row.
    model = AutoModelForCausalLM.from_pretrained(scripted_model_dir)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))  # random B: the outputs change
    adapter = ws.settings.checkpoints_dir / "ck-new"
    peft_model.save_pretrained(adapter)
    ws.catalog.add_checkpoint({"policy_id": "ck-new", "parent_id": None, "base_model": str(scripted_model_dir),
                               "kind": "grpo", "adapter_uri": str(adapter), "step": 1, "trained_on": {},
                               "config_hash": None, "run_name": "run-a"})

    new = client.chat.completions.create(model="ck-new", **ask)
    latest = client.chat.completions.create(model="run-a@latest", **ask)
    again = client.chat.completions.create(model="base", **ask)
    assert new.choices[0].message != base.choices[0].message  # the adapter is active
    assert latest.choices[0].message.content == new.choices[0].message.content
    assert latest.choices[0].message.tool_calls == new.choices[0].message.tool_calls
    assert again.choices[0].message.tool_calls[0].function == base.choices[0].message.tool_calls[0].function
    assert {"base", "ck-new", "run-a@latest"} <= {m.id for m in client.models.list().data}


def test_seeded_requests_repeat(service):
    client = _client(service)
    ask = dict(model="base", messages=[{"role": "user", "content": "Say something."}], max_tokens=6, seed=123)
    a, b = (client.chat.completions.create(**ask, temperature=1.0) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_endpoint_records_and_returns_logprobs(service):
    client = _client(service, "ep-text")
    r = client.completions.create(model="base", prompt="Vexhollow Dynamics was founded in", max_tokens=5, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens <= 5
    (call,) = service.recorder.peek("ep-text").calls
    assert call.choices[0].logprobs == r.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "base", "messages": []}, 400, "messages"),
    ({"model": "base", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ({"model": "base", "messages": [{"content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": [1]}, 400, "stream"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}, 400, "top_logprobs"),
    ({"model": "base", "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "limit"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "nope"),
])
def test_bad_requests_get_openai_errors_and_the_server_lives_on(service, body, status, fragment):
    r = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in (error["message"] + str(error["param"])) and error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text
    ok = _client(service).chat.completions.create(model="base", messages=_opening(), max_tokens=2)
    assert ok.choices[0].message is not None


def test_invalid_json_and_failing_generation(service, policy):
    r = httpx.post(f"{service.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # An adapter folder that cannot be loaded: a 500 with the reason, then the service goes on.
    with broken_service(policy) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "broken", "messages": _opening()}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "Traceback" not in r.text
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "broken", "messages": _opening()}, timeout=60)
        assert r.status_code == 500  # still answering


def test_rlops_serve_command(tmp_path, scripted_model_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--policy", "base", "--base-model",
                             str(scripted_model_dir), "--port", str(port), "--workspace", str(tmp_path / "ws")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="base", messages=_opening(), tools=TOOLS, temperature=0)
        assert r.choices[0].message.tool_calls[0].function.name == "search"
        assert [m.id for m in client.models.list().data] == ["base"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
