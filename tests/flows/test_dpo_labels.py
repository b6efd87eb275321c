"""Labels as signal: `rlops stage dpo --labels` trains a DPO step on a person's orderings, through the `human` reward,
whose version names the labels (the same labels: the same checkpoint; a new label: a new one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from flows.run_config import from_dict
from flows.stage_calls import call_stage
from stages.common import StageContext
from storage.labels import EpisodeKey, append_labels, grade, ordering
from tests.flows.conftest import rlops_here, tiny_config
from tests.stages.test_dpo import make_workspace


@pytest.mark.slow
def test_a_dpo_step_trains_on_a_persons_orderings(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    ws, parent, batch = make_workspace(tmp_path, tiny_model_dir)  # 3 groups of 4 episodes sharing their prompt

    def key(i: int) -> EpisodeKey:
        return EpisodeKey(f"{batch}-{i}", batch, f"{batch}-g{i // 4}")

    wid = ws.workspace_id
    append_labels(ws, ordering(wid, "alice", [key(2), key(0), key(3), key(1)]))  # group 0, best first
    append_labels(ws, ordering(wid, "alice", [key(9), key(11)]))  # two episodes of group 2
    append_labels(ws, grade(wid, "bob", key(4), 1.0))  # another reviewer's grades: not alice's signal
    append_labels(ws, grade(wid, "bob", key(5), 0.0))
    cfg = tiny_config(tiny_model_dir, name="dpo-labels") | {
        "algorithm": "dpo", "dpo": {"pairing": "all", "lr": 1e-2, "pairs_per_step": 2, "micro_batch_size": 2,
                                    "lora": {"r": 8, "alpha": 16}}}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = rlops_here(capsys, "stage", "dpo", str(path), "--labels", "--reviewer", "alice", "--workspace", str(ws.root))
    policy = out.strip().splitlines()[-1]

    row = ws.catalog.get_checkpoint(policy)
    human = ws.query("SELECT DISTINCT reward_version AS v FROM rewards WHERE reward_name = 'human'").to_pylist()
    assert row["kind"] == "dpo" and row["parent_id"] == parent and len(human) == 1
    assert row["trained_on"] == {"batches": [batch], "reward": f"human@{human[0]['v']}"}
    state = json.loads((Path(row["adapter_uri"]) / "trainer_state.json").read_text())
    # every pair alice's orderings state, and nothing of bob's: 6 in group 0, 1 in group 2
    order0 = [f"{batch}-{i}" for i in (2, 0, 3, 1)]
    expected = {(a, b) for i, a in enumerate(order0) for b in order0[i + 1:]} | {(f"{batch}-9", f"{batch}-11")}
    assert {tuple(p) for p in state["pairs"]} == expected and state["metrics"]["optimizer_steps"] == 4
    weights = load_file(Path(row["adapter_uri"]) / "adapter_model.safetensors")
    assert any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k)  # trained: B starts at zero

    ctx = StageContext(ws, run_name="dpo-labels")
    again = call_stage("dpo", from_dict(cfg), ctx, labels=True, reviewer="alice")
    assert again.cached and again.id == policy  # the same labels: the same human version, the same checkpoint
    append_labels(ws, grade(wid, "alice", key(4), 1.0))  # a new label of alice's: a new version, a new checkpoint id
    from flows.stage_calls import from_labels

    batches, ref = from_labels(ctx, None, "alice")
    assert batches == [batch] and ref.version != human[0]["v"]
