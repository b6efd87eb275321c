"""Code RL through the Prefect flow `rlops run` uses, on the shipped configs/code.yaml with a tiny model: rollouts
whose programs run against their tests in the sandbox, a reward row with each program's outcome, a GRPO step."""

from __future__ import annotations

import json

from flows.run_config import load_run_config
from storage.workspace import Workspace


def test_a_grpo_step_from_code_rollouts_on_the_shipped_config(prefect_harness, tmp_path, tiny_model_dir):
    from flows.prefect_flows import train_flow

    rows = [{"prompt": f"Write a Python function `add_{k}(x)` that returns x plus {k}.",
             "tests": [f"assert add_{k}(0) == {k}", f"assert add_{k}(1) == {k + 1}"]} for k in range(8)]
    for split, part in (("train", rows[:6]), ("test", rows[6:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cfg = load_run_config("configs/code.yaml", [
        f"base_model={tiny_model_dir}", "name=code-flow", "steps=1",
        f"task.params.files={{train: {tmp_path}/train.jsonl, test: {tmp_path}/test.jsonl}}",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.n_prompts=2"])
    summary = train_flow(cfg.model_dump(mode="json"), str(tmp_path / "ws"))
    ws = Workspace.open(tmp_path / "ws")
    assert len(summary["policies"]) == 1 and ws.catalog.get_run("code-flow")["status"] == "complete"
    scored = ws.query("SELECT w.value, w.error, w.details->>'outcome' AS outcome, w.details->>'total' AS total "
                      "FROM rewards w JOIN rollouts r USING (rollout_id) WHERE w.reward_name = 'tests' "
                      "AND r.split = 'train'").to_pylist()
    # the tiny random model writes no function: each program ran, failed its tests, and says how
    assert len(scored) == 4 and all(r["error"] is None and r["value"] == 0.0 and r["total"] == "2" for r in scored)
    assert {r["outcome"] for r in scored} <= {"fail", "error"}
