"""The workspace's content-addressed image store: each distinct image once, named by the sha256 of its bytes.

    store = ImageStore(settings.images_dir)
    ref = store.put(png_bytes)            # ImageRef(image_id='3f2a...', format='png', width=64, height=48)
    store.get(ref.image_id)               # the same bytes
    image_bytes_from_url("data:image/png;base64,...")   # an OpenAI `image_url` part's bytes
    image_bytes_from_source("file:///data/shot.png", file_root=Path("/data"))  # or a local file under a root

Layout: `images/<id[:2]>/<id>.parquet`, one row `(image_id, format, width, height, bytes)` (`IMAGES`).
Why one small Parquet file per image rather than a table in the catalog or plain .png files:
- the image arrives where the episode is recorded (the policy service, a Ray worker), not in the one
  process that may write the catalog, and a content-addressed name makes the write idempotent without a
  lock: writing the same image twice writes the same file (atomic rename, `storage.atomic`);
- the files are a Parquet table, so SQL reads them as the `images` view and joins them to
  `rollouts.image_ids` (storage/sql.py), e.g. counting a batch's distinct images or bytes.
A group sharing its prompt image stores it once; that is the deduplication.

Images are validated before anything is stored: bytes that do not decode, or a format outside
`SUPPORTED_FORMATS`, raise a ValueError that names the problem. PIL is imported inside functions.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage.atomic import atomic_file

# What PIL decodes without extra codecs, and what OpenAI's and Anthropic's APIs accept.
SUPPORTED_FORMATS = ("png", "jpeg", "webp", "gif")
# Decompression-bomb guard: a 1x1 billion-pixel PNG is a few kB. Far above any screenshot.
MAX_PIXELS = 40_000_000

IMAGES = pa.schema([
    ("image_id", pa.string()),  # sha256 hex of `bytes`
    ("format", pa.string()),  # one of SUPPORTED_FORMATS
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("bytes", pa.binary()),  # the encoded image exactly as received
])


@dataclass(frozen=True)
class ImageRef:
    """A stored image: what an episode records about each image it saw."""

    image_id: str
    format: str
    width: int
    height: int


def image_id(data: bytes) -> str:
    """The content address of an encoded image: sha256 of its bytes (hex)."""
    return hashlib.sha256(data).hexdigest()


def inspect_image(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) of encoded image bytes, fully decoded once so that a truncated or corrupt
    file fails here, before any compute; ValueError naming the problem otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "").lower()
            if fmt not in SUPPORTED_FORMATS:
                raise ValueError(f"unsupported image format {fmt or 'unknown'!r}; supported: {', '.join(SUPPORTED_FORMATS)}")
            if img.width * img.height > MAX_PIXELS:
                raise ValueError(f"image of {img.width}x{img.height} pixels exceeds the limit of {MAX_PIXELS}")
            img.load()
            return fmt, img.width, img.height
    except UnidentifiedImageError:
        raise ValueError(f"image does not decode: {len(data)} bytes in no known image format") from None
    except (OSError, SyntaxError) as e:  # PIL's errors for truncated or corrupt data
        raise ValueError(f"image does not decode: {e}") from None


def image_bytes_from_url(url: str) -> bytes:
    """The encoded bytes of an OpenAI `image_url` (`data:image/<fmt>;base64,<data>`); ValueError for
    anything else. Remote http(s) URLs are refused: nothing leaves the machine to fetch an image."""
    if not url.startswith("data:"):
        raise ValueError(f"image_url must be a base64 data URL (data:image/png;base64,...), got {url[:40]!r}")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[len("data:"):].startswith("image/"):
        raise ValueError(f"image_url must be a base64 data URL of an image (data:image/<format>;base64,...), got {header[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url's base64 data does not decode") from None


def image_bytes_from_source(url: str, file_root: Path | None = None) -> bytes:
    """The encoded bytes an `image_url` names: a base64 data URL (`image_bytes_from_url`), or a local file, as
    a `file://` URL or a path, read only when `file_root` is given and the file (symlinks resolved) lies under
    it: whoever can send a request must not read the rest of the machine's files. ValueError otherwise,
    naming why. Remote http(s) URLs stay refused. Validate the bytes with `inspect_image` (ImageStore.put does)."""
    if url.startswith("data:") or ("://" in url and not url.startswith("file://")):
        return image_bytes_from_url(url)
    if file_root is None:
        raise ValueError(f"local image files are not enabled here (no image root is configured), got {url[:80]!r}: "
                         "send a base64 data URL")
    from urllib.parse import unquote, urlparse

    path = Path(unquote(urlparse(url).path)) if url.startswith("file://") else Path(url)
    root = Path(file_root).resolve()
    real = (root / path).resolve()  # an absolute path stays itself; a relative one is under the root
    if not real.is_relative_to(root):
        raise ValueError(f"image file {url[:200]!r} is outside the image root {root}")
    if not real.is_file():
        raise ValueError(f"image file {url[:200]!r} does not exist under the image root {root}")
    return real.read_bytes()


def data_url(data: bytes) -> str:
    """A base64 data URL of encoded image bytes (the inverse of `image_bytes_from_url`)."""
    fmt, _, _ = inspect_image(data)
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


class ImageStore:
    """Content-addressed images under one folder (the workspace's `images/`); see the module docstring."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, image_id: str) -> Path:
        return self.root / image_id[:2] / f"{image_id}.parquet"

    def put(self, data: bytes) -> ImageRef:
        """Validate and store an encoded image (once: a second put of the same bytes writes nothing)."""
        fmt, width, height = inspect_image(data)
        ref = ImageRef(image_id(data), fmt, width, height)
        path = self.path(ref.image_id)
        if not path.exists():
            row = pa.Table.from_pylist([{**ref.__dict__, "bytes": data}], schema=IMAGES)
            with atomic_file(path) as f:
                # No column statistics (they would hold the bytes' min and max: two more copies of the image,
                # 3x the file), no dictionary or compression (the encoded image is already compressed), no
                # Arrow schema blob: ~640 bytes of overhead per image (docs/BENCHMARKS.md).
                pq.write_table(row, f, write_statistics=False, use_dictionary=False, compression="none",
                               store_schema=False)
        return ref

    def get(self, image_id: str) -> bytes:
        """The encoded bytes of a stored image; KeyError if the workspace does not hold it."""
        path = self.path(image_id)
        if not path.exists():
            raise KeyError(f"image {image_id} is not in the store at {self.root}")
        return pq.read_table(path, columns=["bytes"])["bytes"][0].as_py()
