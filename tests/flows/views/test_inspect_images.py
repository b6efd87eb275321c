"""`rlops inspect` pages show the images of a visual episode where they stood in its messages, rendered by a
real headless Chromium (its screenshot holds the images' pixels), and say so where an image is missing."""

from __future__ import annotations

import io
import subprocess
from dataclasses import replace
from pathlib import Path

from flows.views.inspect_render import write_inspection_html
from flows.views.inspection import Episode, Inspection, Ranking, Score, Segment, image_urls
from storage.images import ImageStore, image_ref
from storage.schema import Message
from tests.factories import tool_episode
from tests.flows.views.conftest import CHROMIUM, needs_chromium, soup

MAGENTA, CYAN = (255, 0, 255), (0, 255, 255)


def png(color: tuple[int, int, int], size: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def visual_page(tmp_path: Path) -> tuple[Path, list[str], str]:
    """An inspect page of one episode: a prompt image (magenta), a tool's crop (cyan), and a marker whose
    image the store does not hold. Returns the page, the stored ids, and the missing id."""
    store = ImageStore(tmp_path / "images")
    shown = [store.put(png(MAGENTA)).image_id, store.put(png(CYAN, 8)).image_id]
    missing = "f" * 64
    ep = tool_episode("ro-vis", 0, 0)
    messages = [Message("user", f"How many squares? {image_ref(shown[0])}"),
                ep.messages[2], replace(ep.messages[3], content=f"zoomed: {image_ref(shown[1])} {image_ref(missing)}"),
                Message("assistant", "3")]
    rollout = replace(ep, messages=messages, image_ids=shown)
    episode = Episode(rollout, 1, [Segment(False, "prompt", 20), Segment(True, "3", 1)],
                      [Score("correct", "v1", 1.0, None, None)], image_urls(store, rollout))
    view = Inspection("vis", "correct", None, ["ro-vis"], ["correct@v1"],
                      [Ranking("correct@v1", 1, 0, 1.0, [episode], [])])
    return write_inspection_html(view, tmp_path / "inspect.html"), shown, missing


def test_the_page_places_each_stored_image_at_its_marker(tmp_path: Path) -> None:
    page, shown, missing = visual_page(tmp_path)
    html = soup(page)
    images = html.select("article.episode .msg img.image")
    assert [i["data-image-id"] for i in images] == shown
    assert images[0].find_parent(class_="msg")["class"] == ["msg", "role-user"]
    assert images[1].find_parent(class_="msg")["class"] == ["msg", "role-tool"]
    assert all(i["src"].startswith("data:image/png;base64,") for i in images)
    assert "<image:" not in html.select_one("article.episode .conversation").get_text()  # no raw references
    (gap,) = html.select(".missing-image")
    assert missing[:12] in gap.get_text() and "not in this workspace" in gap.get_text()


@needs_chromium
def test_chromium_renders_the_episode_images(tmp_path: Path) -> None:
    from PIL import Image

    page, _, _ = visual_page(tmp_path)
    shot = tmp_path / "shot.png"
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", "--hide-scrollbars", "--window-size=1000,3000", f"--screenshot={shot}",
                          page.as_uri()], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    counts = {color: n for n, color in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 24)}
    # Both images are drawn at least 96 px wide (the page's CSS), so each colour covers >= 96 x 96 pixels;
    # neither colour appears anywhere else on the page.
    assert counts.get(MAGENTA, 0) >= 96 * 96 and counts.get(CYAN, 0) >= 96 * 96
