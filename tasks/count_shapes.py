"""Count the shapes: a visual task, "How many shapes are in the image?" over a small synthetic picture.

A task that needs to look: the question is the same for every prompt, so only the image tells the
answer. Each picture is drawn locally with PIL from a seed: 1..`max_count` filled circles and squares
of a few colours, apart from each other, on a white background. The user message is OpenAI content
parts, the question's text then the image as a PNG data URL (`Task.images`); the answer is the count,
checked by `rewards.builtin.first_integer_match`.

    task = make_task(size=64, max_count=4)
    p = task.prompts("train")[0]
    task.messages(p)          # [system, user: [{"type": "text", ...}, {"type": "image_url", ...}]]
    p.metadata["answer"]      # 3
    draw_png(p.metadata)      # the PNG bytes the model sees
    caption(p.metadata)       # "3 shapes: a red circle, a blue square and a green circle."

The picture is drawn from `metadata` (its size and shapes), never stored in it, so rollouts.metadata
stays a few hundred bytes; the image itself is stored once per workspace when a policy sees it
(storage/images.py). PIL is imported inside the drawing functions.

With `zoom_turns=k` the task is multi-turn: the model may call `zoom(region)` up to k times, and the tool
returns OpenAI content parts, a text line and the chosen quarter of the picture enlarged to the full size
(`zoom_png`), before it answers.
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path
from typing import Any

from storage.ids import canonical_json
from tasks.base import Prompt, Task, write_chat_jsonl

SYSTEM_PROMPT = "Look at the image and count the shapes in it. Reply with the number only."
QUESTION = "How many shapes are in the image?"
SPLITS = ("train", "test")
# Saturated, far-apart colours on white: telling them apart never takes more than a few pixels.
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "orange": (240, 150, 20),
           "purple": (140, 50, 170)}
KINDS = ("circle", "square")
BACKGROUND = (255, 255, 255)
GAP = 2  # pixels kept free between two shapes' boxes, so touching shapes never read as one
MIN_SIZE = 16  # smaller pictures cannot hold several shapes of a few pixels each apart
# The pictures of task seed s are drawn from seeds s * SEED_BLOCK, s * SEED_BLOCK + 1, ...: test takes the
# first ones and train the next, so the splits never share a seed and a larger n_train leaves test unchanged.
SEED_BLOCK = 10_000_000
REGIONS = ("top-left", "top-right", "bottom-left", "bottom-right")
ZOOM_SPEC = {"type": "function", "function": {
    "name": "zoom", "description": "Show one quarter of the image enlarged to the full size.",
    "parameters": {"type": "object", "properties": {"region": {"type": "string", "enum": list(REGIONS)}},
                   "required": ["region"]}}}


def make_task(size: int = 64, max_count: int = 4, n_train: int = 1000, n_test: int = 100, seed: int = 0,
              zoom_turns: int = 0) -> Task:
    """Build the shape-counting task: `size` x `size` pictures holding 1..`max_count` shapes.

    Prompt i of a split is drawn from its own seed (`scene_seed`), so the same arguments always give the
    same pictures; the test split is drawn first and a picture the test split holds is never in train.
    `zoom_turns` > 0: the `zoom` tool may be called that many times before the answer (multi-turn).
    """
    if zoom_turns < 0:
        raise ValueError(f"zoom_turns must be >= 0, got {zoom_turns}")
    splits = generate(size=size, max_count=max_count, n_train=n_train, n_test=n_test, seed=seed)

    def prompts(split: str) -> list[Prompt]:
        if split not in splits:
            raise ValueError(f"count_shapes has splits {SPLITS}, not {split!r}")
        return list(splits[split])  # a copy: callers may shuffle or trim it

    return Task(name="count_shapes", system_prompt=SYSTEM_PROMPT, prompts=prompts, max_turns=1 + zoom_turns,
                images=lambda p: [draw_png(p.metadata)], tool_specs=[ZOOM_SPEC] if zoom_turns else [],
                prompt_tools=(lambda p: {"zoom": lambda region: zoom(p.metadata, region)}) if zoom_turns else None)


def zoom(metadata: dict[str, Any], region: str) -> list[dict[str, Any]]:
    """The `zoom` tool's result: OpenAI content parts, a line naming the region and its enlarged picture."""
    from storage.images import data_url

    if region not in REGIONS:
        raise ValueError(f"region must be one of {', '.join(REGIONS)}, got {region!r}")
    return [{"type": "text", "text": f"The {region} quarter, enlarged:"},
            {"type": "image_url", "image_url": {"url": data_url(zoom_png(metadata, region))}}]


def generate(*, size: int, max_count: int, n_train: int, n_test: int, seed: int) -> dict[str, list[Prompt]]:
    """`n_test` then `n_train` distinct pictures. Seeds run consecutively from `seed * SEED_BLOCK`; a
    picture equal to one already drawn (possible for small sizes) is skipped, so no two prompts, and no
    train and test prompt, show the same shapes in the same places."""
    if size < MIN_SIZE:
        raise ValueError(f"size must be >= {MIN_SIZE} pixels, got {size}")
    if not 1 <= max_count <= 9:
        raise ValueError(f"max_count must be in 1..9 (a one-digit answer), got {max_count}")
    if n_train < 0 or n_test < 0 or n_train + n_test >= SEED_BLOCK:
        raise ValueError(f"n_train and n_test must be >= 0 and together < {SEED_BLOCK}, got {n_train}, {n_test}")
    seen: set[str] = set()
    drawn: list[Prompt] = []
    scene_seed = seed * SEED_BLOCK
    while len(drawn) < n_test + n_train:
        metadata = scene(scene_seed, size=size, max_count=max_count)
        scene_seed += 1
        pid = prompt_id(metadata)
        if pid in seen:
            continue  # the same picture in both splits would leak test answers into training
        seen.add(pid)
        drawn.append(Prompt(pid, QUESTION, metadata))
    return {"test": drawn[:n_test], "train": drawn[n_test:]}


def scene(scene_seed: int, *, size: int, max_count: int) -> dict[str, Any]:
    """The picture of one seed as metadata: `answer` (the count), `size`, `seed` and `shapes`, each
    `[kind, colour, x0, y0, x1, y1]` (a box, inclusive; a circle is the disc inscribed in it)."""
    rng = random.Random(scene_seed)
    count = rng.randint(1, max_count)
    while True:  # a few placements fail when big shapes crowd a small picture: draw the whole scene again
        shapes = _place(rng, count, size)
        if shapes is not None:
            return {"answer": count, "size": size, "seed": scene_seed, "shapes": shapes}


def _place(rng: random.Random, count: int, size: int) -> list[list[Any]] | None:
    lo, hi = max(3, size // 8), max(4, size // 5)  # side length: 8..12 px at 64x64
    boxes: list[tuple[int, int, int, int]] = []
    shapes: list[list[Any]] = []
    for _ in range(count):
        for _attempt in range(100):
            side = rng.randint(lo, hi)
            x0, y0 = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
            box = (x0, y0, x0 + side - 1, y0 + side - 1)
            if all(_apart(box, other) for other in boxes):
                break
        else:
            return None
        boxes.append(box)
        shapes.append([rng.choice(KINDS), rng.choice(sorted(COLOURS)), *box])
    return shapes


def _apart(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[2] + GAP < b[0] or b[2] + GAP < a[0] or a[3] + GAP < b[1] or b[3] + GAP < a[1]


def draw_png(metadata: dict[str, Any]) -> bytes:
    """The picture of a prompt's metadata as PNG bytes (RGB, no antialiasing: the same bytes every time)."""
    from PIL import Image, ImageDraw

    size = int(metadata["size"])
    img = Image.new("RGB", (size, size), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for kind, colour, x0, y0, x1, y1 in metadata["shapes"]:
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            pen.rectangle((x0, y0, x1, y1), fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def zoom_png(metadata: dict[str, Any], region: str) -> bytes:
    """One quarter of the picture (`REGIONS`), enlarged back to the full size without smoothing, as PNG bytes."""
    from PIL import Image

    size = int(metadata["size"])
    half = size // 2
    left, top = (half if "right" in region else 0), (half if "bottom" in region else 0)
    with Image.open(io.BytesIO(draw_png(metadata))) as img:
        part = img.crop((left, top, left + half, top + half)).resize((size, size), Image.NEAREST)
    buf = io.BytesIO()
    part.save(buf, format="PNG")
    return buf.getvalue()


def caption(metadata: dict[str, Any]) -> str:
    """What the picture shows, in words, left to right: "3 shapes: a red circle, a blue square and a
    green circle." A richer target than the bare count, for teaching a vision encoder to see the shapes."""
    names = [f"a {colour} {kind}" for kind, colour, *_ in sorted(metadata["shapes"], key=lambda s: (s[2], s[3]))]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    noun = "shape" if len(names) == 1 else "shapes"
    return f"{len(names)} {noun}: {listed}."


def write_oracle_dataset(path: str | Path, split: str = "train", n: int | None = None, target: str = "answer",
                         **params: Any) -> int:
    """Write SFT demonstrations for the first `n` prompts of `split` (None: all) as JSONL lines
    {"messages": [system, user (question + image data URL), assistant], "tools": []}; returns how many.
    `target`: the assistant says the count (`answer`, what the reward checks) or the `caption`.
    `params` are the task's (`make_task`'s)."""
    if target not in ("answer", "caption"):
        raise ValueError(f"target must be 'answer' or 'caption', got {target!r}")
    task = make_task(**params)
    rows = (
        {"messages": task.messages(p) + [{"role": "assistant", "content": reply(p.metadata, target)}], "tools": []}
        for p in task.prompts(split)[:n]
    )
    return write_chat_jsonl(path, rows)


def reply(metadata: dict[str, Any], target: str = "answer") -> str:
    """The right assistant reply to a prompt: the count as digits, or the caption."""
    return caption(metadata) if target == "caption" else str(metadata["answer"])


def prompt_id(metadata: dict[str, Any]) -> str:
    """A stable id from the picture alone (size and shapes), so equal pictures get equal ids."""
    picture = canonical_json({"size": metadata["size"], "shapes": metadata["shapes"]})
    return "shapes-" + hashlib.sha1(picture.encode()).hexdigest()[:12]
