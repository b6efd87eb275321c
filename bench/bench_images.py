"""Storage of visual episodes: bytes per episode and the image store's deduplication (issue 34).

    .ci/loopback .venv/bin/python bench/bench_images.py [--groups 16] [--group-size 8] [--size 256]

Synthetic screenshots drawn with PIL (a few random shapes on a light background, PNG), GRPO-shaped:
each group's G episodes share their prompt image, and each episode also gets one tool crop of its own
(a random quarter of the prompt image, zoomed 2x). The images go through the real `ImageStore`, the
rollouts (tool-episode records with their `image_ids`) through the real Parquet writer, and the numbers
come from the files on disk and an SQL query over the `images` view.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def screenshot(rng: random.Random, size: int) -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 7)):
        x, y, r = rng.randrange(size), rng.randrange(size), rng.randint(size // 20, size // 8)
        color = tuple(rng.randrange(200) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x - r, y - r, x + r, y + r], fill=color)
    return img


def png(img: "PIL.Image.Image") -> bytes:  # noqa: F821
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def main() -> None:
    from storage.images import ImageStore
    from storage.schema import to_table
    from storage.workspace import Workspace
    from tests.factories import tool_episode

    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()
    rng = random.Random(0)
    ws = Workspace.open(Path(tempfile.mkdtemp()) / "ws")
    store = ImageStore(ws.settings.images_dir)
    rollouts, sent, put_s = [], 0, 0.0
    for g in range(args.groups):
        prompt = screenshot(rng, args.size)
        prompt_png = png(prompt)
        for s in range(args.group_size):
            q = args.size // 2
            x, y = rng.randrange(q), rng.randrange(q)
            crop = png(prompt.crop((x, y, x + q, y + q)).resize((args.size, args.size)))
            start = time.perf_counter()
            ids = [store.put(prompt_png).image_id, store.put(crop).image_id]
            put_s += time.perf_counter() - start
            sent += len(prompt_png) + len(crop)
            rollouts.append(replace(tool_episode("ro-img", g, s), image_ids=ids))
    ws.write_part("rollouts", "ro-img", to_table(rollouts), part="part-00000")
    ws.catalog.complete_artifact("ro-img", "rollouts", "rollout", [], "bench")
    stored = sum(p.stat().st_size for p in store.root.rglob("*.parquet"))
    rollout_bytes = sum(Path(f["path"]).stat().st_size for f in ws.catalog.artifact_files("ro-img"))
    row = ws.query("SELECT count(*) AS refs, count(DISTINCT image_id) AS distinct_images "
                   "FROM (SELECT unnest(image_ids) AS image_id FROM rollouts) JOIN images USING (image_id)").to_pylist()[0]
    n = len(rollouts)
    print(f"{n} episodes ({args.groups} groups x {args.group_size}), {args.size}x{args.size} PNG screenshots, 2 images each")
    print(f"image references {row['refs']}, distinct images {row['distinct_images']}, "
          f"dedup rate {1 - row['distinct_images'] / row['refs']:.1%}")
    print(f"image bytes as sent {sent / n / 1024:.1f} KiB/episode, stored {stored / n / 1024:.1f} KiB/episode "
          f"({stored / sent:.2f}x of sent)")
    print(f"rollout rows {rollout_bytes / n / 1024:.2f} KiB/episode (tokens, messages, image ids)")
    print(f"ImageStore.put: {put_s / row['refs'] * 1e3:.2f} ms per image (validate by full decode, hash, write if new)")


if __name__ == "__main__":
    loopback.enter()
    main()
