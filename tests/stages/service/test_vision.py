"""A vision-language policy served over HTTP (the real tiny Idefics3, and the tiny Qwen2-VL whose patches batch
concatenated and whose positions are M-RoPE's, on uvicorn at 127.0.0.1, the real `openai` client): a multi-turn
visual episode (an image in the prompt, an image returned by a tool) recorded token-exact into a rollout row with
its image ids, the behaviour log-probs recomputed from the stored images, streamed and Responses-API calls with
images, `rlops serve` on each base, and the 400s for bad images, before any compute."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
import torch

from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VisualSample
from stages.policy.vlm_chat import image_ref
from stages.policy.vlm_resident import VisualResidentPolicy, load_resident
from stages.service.external import run_agent_shard
from stages.service.resolve import fixed_resolver
from stages.service.service import ServiceConfig
from storage.images import ImageStore, data_url, image_id
from storage.schema import Message, Rollout, from_table
from tasks.base import AgentSpec, Prompt
from tests.service_fixtures import client_of, serving
from tests.stages.policy.test_vlm import image_part, image_tokens, png

SHOT, CROP = png((200, 0, 0)), png((0, 0, 200), (20, 50))
TOOLS = [{"type": "function", "function": {"name": "zoom", "parameters": {  # bounded: a random model closes it
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
    "additionalProperties": False}}}]
ZOOM = {"type": "function", "function": {"name": "zoom"}}


# The served architectures: one per layout of image tensors (Qwen2.5-VL batches as Qwen2-VL does).
SERVED = ("idefics3", "qwen2_vl")


@pytest.fixture(scope="module", params=SERVED)
def policy(request, tiny_vlm, tmp_path_factory) -> VisualResidentPolicy:
    resident = load_resident(str(tiny_vlm(request.param)), "hf", ImageStore(tmp_path_factory.mktemp("ws") / "images"))
    assert isinstance(resident, VisualResidentPolicy)  # recognised by its config
    return resident


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("screens")
    (root / "shot.png").write_bytes(SHOT)
    (root.parent / "outside.png").write_bytes(SHOT)
    return root


@pytest.fixture(scope="module")
def served(policy, image_root):
    config = ServiceConfig(batch_window_s=0.0, default_max_tokens=8, max_images=3, image_root=image_root)
    with serving(policy, fixed_resolver("base", None), config) as svc:
        yield svc


async def visual_agent(client: openai.AsyncOpenAI, model: str, question: str) -> dict:
    """Look at a screenshot, call `zoom` (forced: a random model writes no call by itself), read the tool's cropped
    image, answer."""
    messages = [{"role": "user", "content": [image_part(SHOT), {"type": "text", "text": question}]}]
    first = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=ZOOM,
                                                 max_tokens=40)
    turn = first.choices[0].message
    (call,) = turn.tool_calls
    messages += [turn.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "zoomed:"}, image_part(CROP)]}]
    final = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
    metadata = {"sampled": [first.usage.completion_tokens, final.usage.completion_tokens]}
    if question.startswith("Return"):  # the conversation as the agent holds it: images as data URLs
        return {"messages": messages + [final.choices[0].message.model_dump(exclude_none=True)], "metadata": metadata}
    return {"metadata": metadata}


def stored_messages_as_openai(messages, store: ImageStore) -> list[dict]:
    """Stored records (images as <image:ID> references) back as OpenAI messages with data URLs."""
    from stages.policy.vlm_chat import IMAGE_REF

    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content or ""}
        if m.role != "assistant" and IMAGE_REF.search(d["content"]):
            pieces = IMAGE_REF.split(d["content"])
            d["content"] = [{"type": "image_url", "image_url": {"url": data_url(store.get(p))}} if k % 2 else
                            {"type": "text", "text": p} for k, p in enumerate(pieces) if k % 2 or p]
        out.append(d)
    return out


@pytest.fixture(scope="module")
def episodes(policy) -> list[Rollout]:
    """Two of the visual agent's episodes through the policy service, as the rollout stage stores them: the second
    agent returns its conversation."""
    agent = AgentSpec(entry="test:visual_agent", fn=visual_agent, version="t", max_error_frac=0.0, episode_timeout=120)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=40)
    table = run_agent_shard(policy, agent, policy_id="base", adapter_dir=None, task_name="look", sampling=sampling,
                            group_size=1, max_total_tokens=1024, sampling_record={"temperature": 1.0}, batch_id="ro-vis",
                            split="train", base_seed=5, groups=[(0, Prompt("p0", "How many squares?", {})),
                                                                (1, Prompt("p1", "Return how many squares?", {}))])
    return from_table(table, Rollout)


@pytest.fixture(scope="module")
def episode(episodes) -> Rollout:
    return episodes[0]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the sampled turns."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_a_multi_turn_visual_episode_is_recorded_token_exact_with_its_images(policy, episode):
    vlm = policy.vlm
    assert episode.finish_reason != "error", episode.metadata
    assert episode.image_ids == [image_id(SHOT), image_id(CROP)] and episode.segment_starts == []
    assert episode.metadata["served_constraints"] == ["tool_choice=function:zoom", None]
    # Every sampled token once, mask 1; the two turns as the client saw them.
    turns = _runs(episode.loss_mask)
    assert [b - a for a, b in turns] == episode.metadata["sampled"]
    # The image placeholders (and every other image-structure token) are prompt tokens: mask 0.
    placeholder = vlm.processor.tokenizer.convert_tokens_to_ids(vlm.processor.image_token)
    assert episode.token_ids.count(placeholder) == image_tokens(vlm, SHOT) + image_tokens(vlm, CROP)
    assert all(m == 0 for t, m in zip(episode.token_ids, episode.loss_mask) if t in vlm.banned_ids)
    # The stored messages, rendered and tokenized by the processor itself (images from the store): the first prompt
    # token for token, and the whole conversation before the last turn as the same text (the first turn's tokens are
    # kept as sampled, however its text would re-tokenize).
    decode = vlm.processor.tokenizer.decode
    stored = stored_messages_as_openai(episode.messages, vlm.store)
    assert [m["role"] for m in stored] == ["system", "user", "assistant", "tool", "assistant"]
    first, first_images = vlm.prompt(stored[:2])
    assert episode.token_ids[: turns[0][0]] == first and first_images == episode.image_ids[:1]
    before_last, images = vlm.prompt(stored[:-1])
    assert decode(episode.token_ids[: turns[1][0]]) == decode(before_last) and images == episode.image_ids
    assert decode(episode.token_ids[turns[1][0]:]) == decode(vlm.processor.tokenizer(episode.messages[-1].content,
                                                                                      add_special_tokens=False)["input_ids"])


def test_the_stored_images_reproduce_the_behaviour_logprobs(policy, episode):
    vlm = policy.vlm
    sample = VisualSample(episode.token_ids, episode.loss_mask, episode.behavior_logprobs, episode.image_ids,
                          vlm.fingerprint, text="", finish_reason="stop")
    recomputed = vlm.logprobs(sample)  # (T,) from the tokens and the stored image bytes
    recorded = torch.tensor(episode.behavior_logprobs)
    (a, b), (c, d) = _runs(episode.loss_mask)
    # The free last turn: the policy's own distribution, to 1e-4.
    assert torch.allclose(recomputed[c:d], recorded[c:d], atol=1e-4, rtol=0)
    # The forced call was drawn from the masked, renormalised distribution (README): each of its tokens at least as
    # likely as under the full one, never less.
    assert bool((recorded[a:b] >= recomputed[a:b] - 1e-4).all()) and bool((recorded[a:b] < 0.0 + 1e-6).all())
    # The pixels enter: another prompt image changes the recomputed log-probs.
    other = vlm.store.put(png((0, 255, 0))).image_id
    swapped = vlm.logprobs(VisualSample(sample.token_ids, sample.loss_mask, sample.behavior_logprobs,
                                        [other, episode.image_ids[1]], vlm.fingerprint, "", "stop"))
    assert (swapped[c:d] - recorded[c:d]).abs().max() > 1e-3


def test_prompts_of_different_lengths_showing_one_image_sample_as_each_alone(policy):
    """One generate call left-pads its prompts (as the pipeline batches later turns that show the same images): each
    row's recorded log-probs are what its sequence scores alone, unpadded (Qwen2-VL's M-RoPE skips the padding)."""
    vlm, image = policy.vlm, policy.vlm.store.put(SHOT).image_id
    prompts = [policy.chat.encode(policy.chat.render([Message("user", image_ref(image) + text)], True))
               for text in ("Count.", "How many squares are there in this picture, and which colour is each one?")]
    assert len(prompts[0]) < len(prompts[1])
    samples = policy.generate("base", None, prompts, SamplingConfig(temperature=1.0, max_new_tokens=6), seed=3,
                              images=[image])
    for prompt, s in zip(prompts, samples):
        sample = VisualSample(prompt + s.token_ids, [0] * len(prompt) + [1] * len(s.token_ids),
                              [0.0] * len(prompt) + s.logprobs, [image], vlm.fingerprint, "", "stop")
        assert torch.allclose(vlm.logprobs(sample), torch.tensor(sample.behavior_logprobs), atol=1e-4, rtol=0)


def _recomputed_matches(policy, episode_json: dict) -> bool:
    vlm = policy.vlm
    sample = VisualSample(episode_json["token_ids"], episode_json["loss_mask"], episode_json["behavior_logprobs"],
                          episode_json["image_ids"], vlm.fingerprint, "", "stop")
    return torch.allclose(vlm.logprobs(sample), torch.tensor(sample.behavior_logprobs), atol=1e-4, rtol=0)


def test_a_streamed_call_with_a_local_file_is_recorded_with_its_image(policy, served, image_root):
    client = client_of(served, episode="ep-stream")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{image_root}/shot.png"}},
                                             {"type": "text", "text": "What is red?"}]}]
    chunks = list(client.chat.completions.create(model="base", messages=messages, max_tokens=6, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    recorded = httpx.get(f"{served.url}/rlops/episodes/ep-stream", timeout=60).json()
    assert recorded["image_ids"] == [image_id(SHOT)]
    (call,) = served.recorder.peek("ep-stream").calls
    assert text == call.choices[0].message.content and sum(recorded["loss_mask"]) == len(call.choices[0].token_ids)
    assert _recomputed_matches(policy, recorded)


def test_a_responses_call_with_input_image_is_recorded_with_its_image(policy, served):
    client = client_of(served, episode="ep-resp")
    r = client.responses.create(model="base", max_output_tokens=6, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe:"}, {"type": "input_image", "image_url": data_url(CROP)}]}])
    assert r.status in ("completed", "incomplete")
    recorded = httpx.get(f"{served.url}/rlops/episodes/ep-resp", timeout=60).json()
    assert recorded["image_ids"] == [image_id(CROP)] and "<image:" in recorded["messages"][0]["content"]
    assert _recomputed_matches(policy, recorded)


def _bad(kind: str, root) -> list[dict]:
    url = {"undecodable": "data:image/png;base64," + base64.b64encode(b"not a png").decode(),
           "outside": f"file://{root.parent}/outside.png", "traversal": "../outside.png",
           "remote": "https://example.com/x.png"}[kind]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize("kind, message", [
    ("undecodable", "image does not decode"), ("outside", "outside the image root"),
    ("traversal", "outside the image root"), ("remote", "base64 data URL"),
], ids=["undecodable", "outside-root", "traversal", "remote-url"])
def test_bad_images_are_400s_naming_the_problem_before_any_compute(served, image_root, kind, message):
    before = served.generate_calls
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "base", "messages": _bad(kind, image_root)},
                   timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert served.generate_calls == before


def test_too_many_images_is_a_400_before_any_compute(served):
    before = served.generate_calls
    content = [image_part(png((k, 0, 0))) for k in range(4)]
    with pytest.raises(openai.BadRequestError, match="holds 4 images; this service takes at most 3"):
        client_of(served).chat.completions.create(model="base", messages=[{"role": "user", "content": content}])
    r = httpx.post(f"{served.url}/v1/responses", timeout=60, json={"model": "base", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(png((k, 1, 0)))} for k in range(4)]}]})
    assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]
    assert served.generate_calls == before


def test_an_assistant_image_and_a_spelled_reference_are_refused(served):
    for messages, message in [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image_part(SHOT)]},
          {"role": "user", "content": "and?"}], "assistant message cannot hold image_url"),
        ([{"role": "user", "content": [{"type": "text", "text": f"<image:{image_id(SHOT)}>"}]}], "image reference"),
    ]:
        r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "base", "messages": messages}, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_text_only_base_loads_as_a_text_policy(tiny_model_dir, tmp_path):
    resident = load_resident(str(tiny_model_dir), "hf", ImageStore(tmp_path))
    assert not isinstance(resident, VisualResidentPolicy)


@pytest.mark.parametrize("architecture", SERVED)
def test_rlops_serve_serves_a_vision_language_base(tmp_path, tiny_vlm, architecture, image_root):
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}

    import psutil

    def start() -> tuple[subprocess.Popen, str] | None:
        """The server on a free port, once it answers; None when the port was taken meanwhile (another test's
        server got it between our probe and its bind: then what answers there is not ours, and ours exits)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--base-model", str(tiny_vlm(architecture)),
                                 "--port", str(port), "--workspace", str(tmp_path / "ws"), "--image-root",
                                 str(image_root), "--max-images", "1"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        listening = psutil.Process(proc.pid)
        for _ in range(600):  # until this process (not whatever else took the port) listens on it
            if proc.poll() is not None:
                out = proc.stdout.read().decode()
                assert "address already in use" in out.lower(), out
                return None
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in listening.net_connections("tcp")):
                return proc, f"http://127.0.0.1:{port}"
            time.sleep(0.2)
        raise AssertionError("the server did not listen within 120 s")

    started = start() or start() or start()
    assert started is not None, "three free ports were taken before the server bound them"
    proc, url = started
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        image = {"type": "image_url", "image_url": {"url": "shot.png"}}  # a path under the image root
        r = client.chat.completions.create(model="base", max_tokens=3, messages=[{"role": "user", "content": [image]}])
        assert r.usage.prompt_tokens > r.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError, match="at most 1"):
            client.chat.completions.create(model="base", messages=[{"role": "user", "content": [image, image]}])
        stored = list((tmp_path / "ws" / "images").rglob("*.parquet"))
        assert [p.stem for p in stored] == [image_id(SHOT)]  # in the workspace's image store
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_agents_returned_conversation_is_stored_with_image_references(policy, episodes):
    returned = episodes[1]
    assert "messages_note" not in returned.metadata, returned.metadata["messages_note"]
    user, call, tool, answer = returned.messages  # the agent's own (no system message: the service wrote that)
    assert user.content == f"<image:{image_id(SHOT)}>Return how many squares?" and tool.content == f"zoomed:<image:{image_id(CROP)}>"
    assert call.tool_calls and answer.role == "assistant"
    assert returned.image_ids == [image_id(SHOT), image_id(CROP)]
