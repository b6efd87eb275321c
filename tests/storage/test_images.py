"""The content-addressed image store: validation before storage, one file per distinct image, SQL joins."""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import replace

import pytest
from PIL import Image

from storage.images import ImageStore, data_url, image_bytes_from_url, image_ref, marked_parts
from storage.schema import Message, to_table
from storage.sql import Sandbox
from tests.factories import tool_episode


def encoded(color: tuple[int, int, int], size: tuple[int, int] = (12, 8), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def test_an_image_is_stored_once_under_the_sha256_of_its_bytes(tmp_path):
    store = ImageStore(tmp_path / "images")
    data = encoded((255, 0, 0))
    ref = store.put(data)
    again = store.put(data)
    assert ref == again and ref.image_id == hashlib.sha256(data).hexdigest()
    assert (ref.format, ref.width, ref.height) == ("png", 12, 8)
    assert store.get(ref.image_id) == data
    assert [p.name for p in (tmp_path / "images").rglob("*") if p.is_file()] == [f"{ref.image_id}.parquet"]
    jpeg = store.put(encoded((0, 0, 255), (5, 7), "JPEG"))
    assert (jpeg.format, jpeg.width, jpeg.height) == ("jpeg", 5, 7) and jpeg.image_id != ref.image_id


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "does not decode"),
    (encoded((1, 2, 3))[:50], "does not decode"),  # a truncated PNG: the header reads, the pixels do not
    (encoded((1, 2, 3), fmt="BMP"), "unsupported image format 'bmp'"),
    (encoded((1, 2, 3), fmt="TIFF"), "unsupported image format 'tiff'"),
], ids=["garbage", "truncated-png", "bmp", "tiff"])
def test_a_bad_image_is_refused_by_name_and_nothing_is_stored(tmp_path, data, message):
    store = ImageStore(tmp_path / "images")
    with pytest.raises(ValueError, match=message):
        store.put(data)
    assert not (tmp_path / "images").exists()


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "must be a base64 data URL"),
    ("data:text/plain;base64,aGk=", "data URL of an image"),
    ("data:image/png,rawbytes", "data URL of an image"),
    ("data:image/png;base64,@@@not base64", "does not decode"),
])
def test_only_base64_image_data_urls_are_taken(url, message):
    with pytest.raises(ValueError, match=message):
        image_bytes_from_url(url)


def test_data_url_round_trips():
    data = encoded((9, 9, 9))
    url = data_url(data)
    assert url.startswith("data:image/png;base64,") and image_bytes_from_url(url) == data
    assert base64.b64decode(url.split(",", 1)[1]) == data


def test_sql_counts_and_joins_the_images_of_episodes(tmp_path):
    from storage.workspace import Workspace

    ws = Workspace.open(tmp_path / "ws")
    store = ImageStore(ws.settings.images_dir)
    shared, crop_a, crop_b = (store.put(encoded(c)).image_id for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)])
    # A group of three sharing its prompt image; two episodes also got a tool's crop, one none.
    # Each image also stands as a marker where it was in the messages (storage/images.py).
    rollouts = [replace(tool_episode("ro-v", 0, s), image_ids=ids,
                        messages=[Message("user", "".join(f"look {image_ref(i)}" for i in ids))])
                for s, ids in enumerate([[shared, crop_a], [shared, crop_b], [shared]])]
    ws.write_part("rollouts", "ro-v", to_table(rollouts), part="group-00000")
    ws.catalog.complete_artifact("ro-v", "rollouts", "rollout", [], "cfg")
    sql = ("SELECT count(*) AS refs, count(DISTINCT i.image_id) AS distinct_images, sum(i.width * i.height) AS pixels "
           "FROM (SELECT unnest(image_ids) AS image_id FROM rollouts) r JOIN images i USING (image_id)")
    expected = {"refs": 5, "distinct_images": 3, "pixels": 5 * 12 * 8}
    assert ws.query(sql).to_pylist() == [expected]
    assert Sandbox(ws.settings).query(sql).to_pylist() == [expected]  # the locked-down `rlops sql` reads them too

    # The markers give the same images, in order, through SQL's regexp_extract_all.
    marked = ws.query(r"SELECT flatten(list_transform(messages, lambda m: regexp_extract_all(m.content, "
                      r"'<image:([0-9a-f]{64})>', 1))) AS ids FROM rollouts ORDER BY rollout_id").to_pylist()
    assert [r["ids"] for r in marked] == [r.image_ids for r in rollouts]


def test_image_refs_split_a_stored_message_in_order():
    a, b = "a" * 64, "0" * 63 + "f"
    text = f"{image_ref(a)}how many?{image_ref(b)} <image:not-an-id>"
    assert marked_parts(text) == [("image", a), ("text", "how many?"), ("image", b), ("text", " <image:not-an-id>")]
    assert marked_parts("") == marked_parts(None) == []
