"""The shape-counting task: deterministic pictures, disjoint splits, a count that the decoded picture
itself confirms (connected blobs of colour, counted independently of the metadata), content parts that
decode, the reward, and the SFT rows."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from rewards.base import RewardSpec, compute
from storage.images import image_bytes_from_url, inspect_image
from storage.schema import Message
from tasks.base import content_digest, load_task
from tasks.count_shapes import BACKGROUND, COLOURS, caption, draw_png, make_task, write_oracle_dataset
from tests.rewards.conftest import build_rollout


def blobs(png: bytes) -> list[tuple[tuple[int, int, int], int]]:
    """(colour, pixel count) of each 4-connected region of non-background pixels in a decoded picture."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = img.size
    px = img.load()
    seen: set[tuple[int, int]] = set()
    found = []
    for start in ((x, y) for y in range(h) for x in range(w)):
        if start in seen or px[start] == BACKGROUND:
            continue
        stack, size = [start], 0
        seen.add(start)
        while stack:
            x, y = stack.pop()
            size += 1
            for nb in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nb[0] < w and 0 <= nb[1] < h and nb not in seen and px[nb] != BACKGROUND:
                    seen.add(nb)
                    stack.append(nb)
        found.append((px[start], size))
    return found


def test_the_same_seed_draws_the_same_pictures_another_seed_others() -> None:
    a, b = make_task(n_train=30, n_test=10, seed=1), make_task(n_train=30, n_test=10, seed=1)
    for split in ("train", "test"):
        assert a.prompts(split) == b.prompts(split)
        assert [draw_png(p.metadata) for p in a.prompts(split)] == [draw_png(p.metadata) for p in b.prompts(split)]
    other = make_task(n_train=30, n_test=10, seed=2).prompts("train")
    assert {p.prompt_id for p in other}.isdisjoint(p.prompt_id for p in a.prompts("train"))


def test_splits_have_their_sizes_share_no_seed_or_picture_and_test_stays_put() -> None:
    task = make_task(n_train=400, n_test=50)
    train, test = task.prompts("train"), task.prompts("test")
    assert (len(train), len(test)) == (400, 50)
    assert {p.metadata["seed"] for p in train}.isdisjoint(p.metadata["seed"] for p in test)
    pictures = [draw_png(p.metadata) for p in train + test]
    assert len(set(pictures)) == len(pictures)  # no picture twice, within or across the splits
    assert make_task(n_train=5, n_test=50).prompts("test") == test
    with pytest.raises(ValueError, match="count_shapes has splits"):
        task.prompts("validation")


@pytest.mark.parametrize("size, max_count", [(64, 4), (32, 5), (96, 3)])
def test_the_answer_is_the_number_of_shapes_the_picture_shows(size: int, max_count: int) -> None:
    prompts = make_task(size=size, max_count=max_count, n_train=60, n_test=0).prompts("train")
    assert {p.metadata["answer"] for p in prompts} == set(range(1, max_count + 1))
    for p in prompts:
        png = draw_png(p.metadata)
        assert inspect_image(png) == ("png", size, size)
        found = blobs(png)
        assert len(found) == p.metadata["answer"]  # apart: no two shapes touch
        assert sorted(c for c, _ in found) == sorted(COLOURS[s[1]] for s in p.metadata["shapes"])
        assert all(n >= 9 for _, n in found)  # each shape is several pixels, not a speck


def test_the_user_message_is_the_question_then_the_picture_as_a_png_data_url() -> None:
    task = load_task("count_shapes", {"size": 48, "n_train": 10, "n_test": 1})
    p = next(q for q in task.prompts("train") if q.metadata["answer"] > 1)
    system, user = task.messages(p)
    assert system["role"] == "system" and "number only" in system["content"]
    text, image = user["content"]
    assert text == {"type": "text", "text": "How many shapes are in the image?"}
    assert image["type"] == "image_url"
    assert image_bytes_from_url(image["image_url"]["url"]) == draw_png(p.metadata)
    # The picture is part of the task content's digest: drawn otherwise, the rollouts would be new.
    redrawn = make_task(size=48, n_train=10, n_test=1)
    redrawn.images = lambda q: [draw_png({**q.metadata, "shapes": q.metadata["shapes"][:1]})]
    assert content_digest(task, [p]) == content_digest(make_task(size=48, n_train=10, n_test=1), [p])
    assert content_digest(task, [p]) != content_digest(redrawn, [p])


@pytest.mark.parametrize("reply_text, expected", [("{answer}", 1.0), ("{answer} shapes", 1.0), ("{wrong}", 0.0),
                                                  ("I see none", 0.0)])
def test_the_reward_checks_the_first_integer_against_the_count(reply_text: str, expected: float) -> None:
    p = make_task(n_train=1, n_test=0).prompts("train")[0]
    count = p.metadata["answer"]
    text = reply_text.format(answer=count, wrong=count % 4 + 1)
    rollout = build_rollout([Message("assistant", text)], p.metadata)
    [out] = compute(RewardSpec(fn="rewards.builtin.first_integer_match"), [rollout])
    assert out.value == expected


def test_bad_params_are_refused_before_drawing() -> None:
    with pytest.raises(ValueError, match="size must be >= 16"):
        make_task(size=8)
    with pytest.raises(ValueError, match="max_count must be in 1..9"):
        make_task(max_count=12)


def test_oracle_rows_teach_the_count_or_the_caption(tmp_path) -> None:
    path = tmp_path / "sft.jsonl"
    assert write_oracle_dataset(path, n=5, n_train=20, n_test=2) == 5
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = make_task(n_train=20, n_test=2).prompts("train")[:5]
    for row, p in zip(rows, prompts):
        system, user, assistant = row["messages"]
        assert image_bytes_from_url(user["content"][1]["image_url"]["url"]) == draw_png(p.metadata)
        assert assistant == {"role": "assistant", "content": str(p.metadata["answer"])}
    write_oracle_dataset(path, n=1, target="caption", n_train=20, n_test=2)
    assert json.loads(path.read_text())["messages"][-1]["content"] == caption(prompts[0].metadata)


def test_the_caption_names_each_shape_left_to_right() -> None:
    metadata = {"size": 64, "shapes": [["square", "blue", 40, 5, 50, 15], ["circle", "red", 3, 30, 12, 39]]}
    assert caption(metadata) == "2 shapes: a red circle and a blue square."
    assert caption({"size": 64, "shapes": [["circle", "green", 1, 1, 9, 9]]}) == "1 shape: a green circle."


def test_the_zoom_variant_is_multi_turn_and_its_tool_returns_the_enlarged_quarter_as_content_parts() -> None:
    task = make_task(size=32, n_train=20, n_test=2, zoom_turns=2)
    assert task.max_turns == 3 and [s["function"]["name"] for s in task.tool_specs] == ["zoom"]
    assert "zoom(region)" in task.messages(task.prompts("train")[0])[0]["content"]
    assert make_task(size=32, n_train=20, n_test=2).prompt_tools is None
    p = next(q for q in task.prompts("train") if q.metadata["answer"] > 1)
    whole = Image.open(io.BytesIO(draw_png(p.metadata))).convert("RGB")
    for region, (left, top) in {"top-left": (0, 0), "top-right": (16, 0), "bottom-left": (0, 16),
                                "bottom-right": (16, 16)}.items():
        text, image = task.episode_tools(p)["zoom"](region=region)
        assert text == {"type": "text", "text": f"The {region} quarter, enlarged:"}
        view = Image.open(io.BytesIO(image_bytes_from_url(image["image_url"]["url"]))).convert("RGB")
        assert view.size == (32, 32)
        for x in range(32):  # each enlarged pixel is the quarter's pixel it came from
            for y in range(32):
                assert view.getpixel((x, y)) == whole.getpixel((left + x // 2, top + y // 2))
    with pytest.raises(ValueError, match="region must be one of"):
        task.episode_tools(p)["zoom"](region="middle")
    # The tool and its turn limit are task content: zoom episodes are other rollouts than single-turn ones.
    assert content_digest(task, [p]) != content_digest(make_task(size=32, n_train=20, n_test=2), [p])
