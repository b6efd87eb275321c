"""The pipeline's visual episodes (stages/policy/vlm_episodes.py) on count_shapes' zoom variant: a multi-turn
episode with an image in the prompt and an image returned by the `zoom` tool, recorded token-exact, its
behaviour log-probs reproduced from the stored images.

The random tiny VLM never writes a `<tool_call>`, so the episode runs on a copy trained (a few seconds) until
greedy decoding reproduces one scripted zoom conversation, as tests/scripted_model.py does for text: the
call, then the count after the tool's picture. Everything around it (the loop, templates, tokens, images,
log-probs) is real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.policy.agent_loop import EpisodeSpec
from stages.policy.sampling import SamplingConfig
from stages.policy.vlm import VisualSample, VLMPolicy
from stages.policy.vlm_chat import VisualChatFormat, marked_content
from stages.policy.vlm_episodes import ResidentVLM
from storage.images import ImageStore, image_id
from storage.schema import Message
from tasks.count_shapes import draw_png, make_task, zoom, zoom_png
from tests.scripted_model import labelled_loss

CALL = {"name": "zoom", "arguments": {"region": "top-left"}}
TASK = {"size": 32, "n_train": 4, "n_test": 1, "zoom_turns": 2}


def scripted_turns(task, prompt, store: ImageStore) -> tuple[list[Message], list[Message]]:
    """(opening records, the scripted rest: the zoom call, the tool's picture, the count)."""
    opening = [Message(m["role"], marked_content(m["content"], store)) for m in task.messages(prompt)]
    rest = [Message("assistant", f"<tool_call>{json.dumps(CALL)}</tool_call>"),
            Message("tool", marked_content(zoom(prompt.metadata, "top-left"), store), tool_call_id="call_0_0",
                    name="zoom"),
            Message("assistant", str(prompt.metadata["answer"]))]
    return opening, rest


@pytest.fixture(scope="module")
def zoom_vlm_dir(tiny_vlm_dir, tmp_path_factory) -> Path:
    """The tiny VLM trained on the scripted zoom conversation of the task's first train prompt."""
    task = make_task(**TASK)
    store = ImageStore(tmp_path_factory.mktemp("script") / "images")
    policy = VLMPolicy.load(tiny_vlm_dir, store)
    chat = VisualChatFormat(policy.processor, store)
    opening, rest = scripted_turns(task, task.prompts("train")[0], store)
    ids, labels, history = [], [], list(opening)
    for m in rest:  # built as the loop builds an episode: the template's text, then the turn's own tokens
        if m.role == "tool":
            piece = chat.encode(chat.tool_turn(history, [m]))
            ids, labels = ids + piece, labels + [-100] * len(piece)
        else:
            if not ids:
                ids = chat.encode(chat.render(history, True))
                labels = [-100] * len(ids)
            turn = chat.encode(m.content + "<|im_end|>")
            newline = chat.encode("\n")
            ids, labels = ids + turn + newline, labels + turn + [-100] * len(newline)
        history.append(m)
    vision = policy.vision_inputs([image_id(draw_png(task.prompts("train")[0].metadata)),
                                   image_id(zoom_png(task.prompts("train")[0].metadata, "top-left"))])
    model = policy.model.train()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = labelled_loss(model, ids, labels, **vision.tensors)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("zoom-vlm")
    model.save_pretrained(out, safe_serialization=True)
    policy.processor.save_pretrained(out)
    return out


def test_a_zoom_episode_is_recorded_token_exact_with_the_tools_image(zoom_vlm_dir, tmp_path):
    task = make_task(**TASK)
    prompt = task.prompts("train")[0]
    vlm = ResidentVLM(str(zoom_vlm_dir), ImageStore(tmp_path / "images"))
    episodes = vlm.episodes("base", None, task, [EpisodeSpec(prompt, 0), EpisodeSpec(prompt, 1)], group_size=2,
                            sampling=SamplingConfig(temperature=0.0, max_new_tokens=40), max_total_tokens=512,
                            tool_timeout=10.0)
    opening, rest = scripted_turns(task, prompt, vlm.store)
    policy, chat = vlm.policy.vlm, vlm.policy.chat
    for ep in episodes:
        # The call, the tool's enlarged quarter, the count: two turns, one tool call, an answer.
        assert [m.role for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert [(m.role, m.content) for m in ep.messages] == [(m.role, m.content) for m in opening + rest]
        assert (ep.num_turns, ep.num_tool_calls, ep.num_tool_errors, ep.finish_reason) == (2, 1, 0, "answer")
        assert ep.image_ids == [image_id(draw_png(prompt.metadata)), image_id(zoom_png(prompt.metadata, "top-left"))]
        assert vlm.store.get(ep.image_ids[1]) == zoom_png(prompt.metadata, "top-left")
        # Token-exact: the tokens are the processor's rendering of the stored records, both images expanded.
        assert ep.token_ids == chat.encode(chat.render(ep.messages, False))
        image_token = policy.processor.tokenizer.convert_tokens_to_ids("<image>")
        assert ep.token_ids.count(image_token) == 2 * policy.processor.image_seq_len
        assert all(m == 0 for t, m in zip(ep.token_ids, ep.loss_mask) if t in policy.banned_ids)
        assert sum(ep.loss_mask) == len(chat.encode(rest[0].content + "<|im_end|>" + rest[2].content + "<|im_end|>"))
        # The behaviour log-probs (greedy: at temperature 1) recomputed from the stored images.
        sample = VisualSample(ep.token_ids, ep.loss_mask, ep.behavior_logprobs, ep.image_ids, policy.fingerprint, "", "")
        assert torch.allclose(policy.logprobs(sample), torch.tensor(ep.behavior_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_a_qwen_vl_group_runs_through_the_pipelines_episodes(tiny_vlm, architecture, tmp_path):
    """The pipeline's episodes with a random tiny Qwen2-VL / Qwen2.5-VL (it writes no tool call: one turn each): the
    prompt's picture expanded into `<|image_pad|>` tokens between its markers, masked 0, and the behaviour log-probs
    reproduced from the stored image."""
    task = make_task(**TASK)
    prompt = task.prompts("train")[0]
    vlm = ResidentVLM(str(tiny_vlm(architecture)), ImageStore(tmp_path / "images"))
    episodes = vlm.episodes("base", None, task, [EpisodeSpec(prompt, 0), EpisodeSpec(prompt, 1)], group_size=2,
                            sampling=SamplingConfig(temperature=1.0, max_new_tokens=8), max_total_tokens=512,
                            tool_timeout=10.0)
    policy = vlm.policy.vlm
    start, pad, end = policy.processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    for ep in episodes:
        assert ep.image_ids == [image_id(draw_png(prompt.metadata))] and sum(ep.loss_mask) > 0
        first, last = ep.token_ids.index(start), ep.token_ids.index(end)
        assert last - first > 1 and set(ep.token_ids[first + 1 : last]) == {pad}
        assert all(m == 0 for t, m in zip(ep.token_ids, ep.loss_mask) if t in policy.banned_ids)
        sample = VisualSample(ep.token_ids, ep.loss_mask, ep.behavior_logprobs, ep.image_ids, policy.fingerprint, "", "")
        assert torch.allclose(policy.logprobs(sample), torch.tensor(ep.behavior_logprobs), atol=1e-4, rtol=0)
