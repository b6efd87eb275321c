"""Rollout stage on a real workspace with a tiny random model: batches, caching, resume, Ray workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from stages import rollout
from stages.common import StageContext, base_policy
from storage.schema import ROLLOUTS, Rollout, from_table
from storage.catalog import read_snapshot
from storage.workspace import Workspace
from tests.processes import kill, wait_until

TASK = rollout.TaskSpec(name="arithmetic", params={"n_train": 50, "n_test": 10})


def _config(**kw) -> rollout.RolloutConfig:
    defaults = dict(prompts_per_step=3, group_size=4, max_new_tokens=8, max_total_tokens=256, groups_per_shard=1)
    return rollout.RolloutConfig(**{**defaults, **kw})


def test_batch_has_one_row_per_episode_and_is_cached(tmp_path, tiny_model_dir):
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="t")
    policy = base_policy(ws, str(tiny_model_dir))
    ref = rollout.run(_config(), ctx, policy, TASK, step=0)
    table = ws.read_artifact(ref.id)
    assert table.schema.equals(ROLLOUTS, check_metadata=False)
    rows = from_table(table, Rollout)
    assert len(rows) == 12 and len({r.rollout_id for r in rows}) == 12
    assert len({r.group_id for r in rows}) == 3 and {r.sample_idx for r in rows} == {0, 1, 2, 3}
    for r in rows:
        assert len(r.token_ids) == len(r.loss_mask) == len(r.behavior_logprobs) == r.num_tokens
        assert 1 <= sum(r.loss_mask) <= 8 and r.metadata["answer"] > 0
        assert r.policy_id == policy and r.split == "train" and r.messages[-1].role == "assistant"
    # same prompts within a group, different prompts across groups
    assert len({(r.group_id, r.prompt_id) for r in rows}) == 3
    again = rollout.run(_config(), ctx, policy, TASK, step=0)
    assert again.id == ref.id and again.cached
    other_step = rollout.run(_config(), ctx, policy, TASK, step=1)
    assert other_step.id != ref.id
    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["rollouts"] == 12 and metrics["sampled_tokens"] > 0


KILLED = textwrap.dedent("""
    import sys
    import time
    from stages import rollout
    from storage.catalog import Catalog
    from stages.common import StageContext, base_policy
    from storage.workspace import Workspace
    from tests.stages.test_rollout import TASK, _config

    register, registered = Catalog.register_file, []

    def register_then_wait(self, *args, **kwargs):  # the batch stops after its second shard, to be killed there
        register(self, *args, **kwargs)
        registered.append(args)
        if len(registered) == 2:
            time.sleep(600)

    Catalog.register_file = register_then_wait
    ws = Workspace.open(sys.argv[1])
    ctx = StageContext(ws, run_name="t")
    print(rollout.run(_config(prompts_per_step=int(sys.argv[3])), ctx, base_policy(ws, sys.argv[2]), TASK).id)
""")


def test_batch_killed_midway_resumes_without_duplicates_or_gaps(tmp_path, tiny_model_dir):
    ws_dir = tmp_path / "ws"
    n = 8
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(ws_dir), str(tiny_model_dir), str(n)],
                            stdout=subprocess.PIPE, text=True)
    snapshot = ws_dir / "catalog" / "files.parquet"  # the registered shards, readable while the run writes

    def registered() -> int:
        return read_snapshot(snapshot).num_rows if snapshot.exists() else 0

    # Its shards take ~35 ms each on a quiet machine: the batch waits after its second (KILLED), so the kill
    # lands midway whatever the machine's speed.
    wait_until(lambda: registered() >= 2, proc, "two shards were registered")
    kill(proc, group=False)
    shards_before = registered()
    assert shards_before == 2

    ws = Workspace.open(ws_dir)
    ctx = StageContext(ws, run_name="t")
    ref = rollout.run(_config(prompts_per_step=n), ctx, base_policy(ws, str(tiny_model_dir)), TASK)
    rows = from_table(ws.read_artifact(ref.id), Rollout)
    assert len(rows) == n * 4 and len({r.rollout_id for r in rows}) == n * 4
    assert sorted({r.group_id for r in rows}) == [f"{ref.id}-g{g:05d}" for g in range(n)]
    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["resumed_shards"] == shards_before  # registered shards were kept, not regenerated
    assert ws.query("SELECT count(*) AS n, count(DISTINCT rollout_id) AS d FROM rollouts").to_pylist() == [{"n": n * 4, "d": n * 4}]


def test_two_ray_workers_match_one_worker(tmp_path, tiny_model_dir):
    results = {}
    for workers in (1, 2):
        ws = Workspace.open(tmp_path / f"ws{workers}")
        ctx = StageContext(ws, run_name="t")
        ref = rollout.run(_config(workers=workers, prompts_per_step=4), ctx, base_policy(ws, str(tiny_model_dir)), TASK)
        table = ws.read_artifact(ref.id)
        results[workers] = (ref.id, table.num_rows, table.schema,
                            sorted(zip(table["rollout_id"].to_pylist(), table["token_ids"].to_pylist())))
    assert results[1][0] == results[2][0]  # worker count is not part of the batch identity
    assert results[1][1] == results[2][1] == 16
    assert results[1][2].equals(results[2][2])
    assert results[1][3] == results[2][3]  # same seeds per shard: the same episodes, token for token


def test_sampling_in_bf16_is_its_own_batch_recorded_as_the_bf16_policy_sampled_it(tmp_path, tiny_model_dir):
    """`rollout.dtype: bfloat16` on a CPU: another batch id than fp32's, the same rows with or without a resident
    session, each row's behaviour log-probs those of the bf16 weights (not of the fp32 policy), recorded in `sampling`."""
    import pytest
    import torch
    from pydantic import ValidationError

    from stages.policy.load import load_policy
    from stages.policy.logprobs import token_logprobs
    from stages.policy.session import PolicySession

    ws = Workspace.open(tmp_path / "ws")
    policy = base_policy(ws, str(tiny_model_dir))
    fp32 = rollout.run(_config(), StageContext(ws, run_name="t"), policy, TASK, step=0)
    half = rollout.run(_config(dtype="bfloat16"), StageContext(ws, run_name="t"), policy, TASK, step=0)
    assert half.id != fp32.id
    rows = from_table(ws.read_artifact(half.id), Rollout)
    other = Workspace.open(tmp_path / "resident")  # the run's path: a resident bf16 model beside the fp32 one
    with PolicySession() as session:
        resident = rollout.run(_config(dtype="bfloat16"), StageContext(other, run_name="t", session=session),
                               base_policy(other, str(tiny_model_dir)), TASK, step=0)
        assert {k[2] for k in session.models} == {"bfloat16"}
    assert resident.id == half.id
    again = from_table(other.read_artifact(half.id), Rollout)
    assert [r.token_ids for r in again] == [r.token_ids for r in rows]
    assert rows and all(r.sampling["dtype"] == "bfloat16" for r in rows)
    models = {d: load_policy(str(tiny_model_dir), dtype=d)[0] for d in ("bfloat16", "float32")}
    gaps = {d: 0.0 for d in models}
    for r in rows:
        ids, mask = torch.tensor([r.token_ids]), torch.tensor([r.loss_mask])
        for d, m in models.items():
            with torch.no_grad():
                lp = token_logprobs(m, ids, torch.ones_like(ids), mask)[0][mask[0].bool()]
            gaps[d] = max(gaps[d], float((lp - torch.tensor(r.behavior_logprobs)[mask[0].bool()]).abs().max()))
    # sampled in fp32, the recorded log-probs would be the fp32 forward's to ~1e-6 (measured here: 0.0005 vs 0.0014)
    assert gaps["bfloat16"] < gaps["float32"] / 2
    with pytest.raises(ValidationError, match="vLLM chooses its own"):
        _config(dtype="bfloat16", backend="vllm")
