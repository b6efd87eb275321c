"""A learned reward model as a reward: `rlops stage rm` trains it (stages/rm.py), `learned` scores with it.

    score:
      rewards:
        - {name: rm, fn: rewards.rm.learned, params: {checkpoint: ck-...}}   # the id `rlops stage rm` printed

The checkpoint id is in the params, so it is the reward's version: another reward model is another version and
rescoring with it keeps both. The score stage gives the reward the workspace's checkpoint folder
(`checkpoints_dir`, filled in like the judge's cache). A rollout's score is the head's value at its last token,
the same quantity the Bradley-Terry loss trained (unbounded: GRPO's group normalisation makes its scale moot).
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from rewards.declare import reward
from storage.schema import Rollout, segment_bounds

_MODELS: dict[str, Any] = {}  # checkpoint folder -> (backbone, head), loaded once per process
_LOCK = threading.Lock()


def _load(folder: Path) -> Any:
    """The reward model in `folder` (adapter, head.pt, rm.json), in eval mode on the CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModel

    key = str(folder)
    with _LOCK:
        if key not in _MODELS:
            if not (folder / "rm.json").exists():
                raise FileNotFoundError(f"{folder} is not a reward model checkpoint (no rm.json): "
                                        "give `checkpoint` the id `rlops stage rm` printed")
            base = json.loads((folder / "rm.json").read_text())["base_model"]
            backbone = PeftModel.from_pretrained(AutoModel.from_pretrained(base, dtype=torch.float32), folder).eval()
            head = torch.nn.Linear(backbone.config.hidden_size, 1)
            head.load_state_dict(torch.load(folder / "head.pt", map_location="cpu", weights_only=True))
            _MODELS[key] = (backbone, head.eval())
        return _MODELS[key]


@reward(low=-math.inf, high=math.inf, tokens=True, unversioned=("checkpoints_dir",))
def learned(rollout: Rollout, checkpoint: str, checkpoints_dir: str = "") -> tuple[float, dict[str, Any]]:
    """The reward model `checkpoint`'s score of the episode: its value at the last token of the last segment."""
    import torch

    backbone, head = _load(Path(checkpoints_dir) / checkpoint)
    a, b = segment_bounds(rollout.segment_starts, len(rollout.token_ids))[-1]
    ids = torch.tensor([rollout.token_ids[a:b]])
    with torch.no_grad():
        h = backbone(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0, -1]
        value = float(head(h))
    return value, {"checkpoint": checkpoint, "tokens": b - a}
