"""The data-parallel update's cost per step: 5 chained GRPO steps with `grpo.workers: 2` vs `grpo.workers: 1`, the
same work, on the real two-node local cluster (tests/ray_cluster.py: a head with no CPUs, a worker node with 2).

    nice -n 10 .venv/bin/python bench/bench_ddp.py [--model SmolLM2-135M-Instruct] [--steps 5] [--one-machine]

`--one-machine`: no cluster of its own; chain 2's workers run on the Ray that rlops starts on this machine (no
`ray.address`), beside the driver, as `grpo.workers: 2` on a laptop does.

One scored rollout batch is made once, in this process (the base policy on `--prompts` arithmetic prompts x
`--group` samples, 16 new tokens; reward: a length penalty, so nearly every group has signal). The workspace is
then copied, so both chains start from the same files and make the same ids: chain 1 trains with `grpo.workers:
1` (in this process, the driver, with every core's torch threads), chain 2 with `grpo.workers: 2` (the driver joins
the cluster; the workers run on the worker node, one thread each). Each chain is `steps` grpo.run calls on that
batch, each step's parent the previous checkpoint, in one PolicySession per chain, as a pipeline run calls them.
The chains' steps are interleaved (1, 2, 1, 2, ...) so that other jobs on a shared machine slow both alike.

Reported per step: the grpo.run wall time, and the update's own (`update_seconds`: `stages.update.workers.train`,
whatever starts the workers included) where the checkpoint's metrics record it; the ratios 2 workers / 1 worker;
the 2-worker step's training alone (the slowest rank's optimizer step, from its tokens/s) and the rest of its
update (starting workers, moving weights, waiting for the CPUs);
how many update worker groups chain 2 started (distinct worker pids over its steps, from each grpo stage run's
MLflow tag `rlops.ray_workers`; code that records no tag started one Ray Train `fit()` per step); and the largest
adapter difference between the chains' final checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(model: str, steps: int, prompts: int, group: int, one_machine: bool = False) -> None:
    import contextlib

    from tests.ray_cluster import LocalRayCluster

    # Ray starts its workers at niceness 15 unless told otherwise: give them this process's own, so that the
    # in-process update (chain 1) and the workers (chain 2) compete for a shared machine's CPUs on equal terms.
    os.environ["RAY_worker_niceness"] = str(os.nice(0))
    cluster_cm = contextlib.nullcontext() if one_machine else \
        LocalRayCluster(worker_cpus=2, env={"RAY_worker_niceness": str(os.nice(0))})
    with cluster_cm as cluster:
        if cluster is not None:  # before Ray is imported
            os.environ.update({k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})
        import ray

        from rewards.base import RewardSpec
        from stages import grpo, rollout, score
        from stages.cluster import RayConfig
        from stages.common import StageContext, base_policy
        from stages.policy.session import PolicySession
        from stages.reward_ref import RewardRef
        from stages.update.config import GRPOConfig
        from storage.workspace import Workspace

        root = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
        ws = Workspace.open(root / "w1")
        base = base_policy(ws, model)
        start = time.perf_counter()
        batch = rollout.run(rollout.RolloutConfig(prompts_per_step=prompts, group_size=group, max_new_tokens=16,
                                                  max_total_tokens=128),
                            StageContext(ws, run_name="bench"), base, rollout.TaskSpec(name="arithmetic")).id
        score.run(score.ScoreConfig(rewards=[RewardSpec(name="short", fn="rewards.builtin.length_penalty",
                                                        params={"limit": 16})], total=None),
                  StageContext(ws, run_name="bench"), [batch])
        print(f"one scored batch ({prompts} x {group}) made in {time.perf_counter() - start:.0f} s", flush=True)
        shutil.copytree(root / "w1", root / "w2")
        spaces = {1: ws, 2: Workspace.open(root / "w2")}
        sessions = {1: PolicySession(), 2: PolicySession()}
        lineage = {1: [base], 2: [base]}
        wall: dict[int, list[float]] = {1: [], 2: []}
        update: dict[int, list[float | None]] = {1: [], 2: []}
        train: dict[int, list[float]] = {1: [], 2: []}  # the optimizer step itself (the slowest rank's)
        breakdown: dict[int, dict[str, float]] = {}  # the 2-worker step's parts (stages/update/workers.py's timing)
        ray_cfg = RayConfig(address=None if cluster is None else cluster.address, placement_timeout_s=120)
        for step in range(steps):
            for workers in (1, 2):
                ctx = StageContext(spaces[workers], run_name=f"bench-w{workers}", ray=ray_cfg, session=sessions[workers])
                start = time.perf_counter()
                ref = grpo.run(GRPOConfig(workers=workers, lr=1e-4), ctx, parent_policy=lineage[workers][-1],
                               batches=[batch], reward=RewardRef("short"))
                wall[workers].append(time.perf_counter() - start)
                lineage[workers].append(ref.id)
                metrics = spaces[workers].catalog.get_artifact(ref.id)["meta"]["metrics"]
                update[workers].append(metrics.get("update_seconds"))
                train[workers].append(metrics["tokens"] / metrics["tokens_per_s"])  # one epoch
                shown = f", update {update[workers][-1]:.1f} s" if update[workers][-1] is not None else ""
                print(f"step {step + 1}, grpo.workers {workers}: grpo.run {wall[workers][-1]:.1f} s{shown}, "
                      f"training {train[workers][-1]:.1f} s, {metrics.get('trained_segments', 0):.0f} sequences, "
                      f"group start {metrics.get('update_group_start_seconds', float('nan')):.1f} s", flush=True)
                if workers == 2:
                    parts = {k[len("update_"):]: v for k, v in metrics.items()
                             if k.startswith("update_") and k.endswith("_s")}
                    breakdown[step] = parts
                    print("    " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()), flush=True)
        assert lineage[1] == lineage[2], "the chains made other ids"  # workers is operational
        starts = _group_starts(spaces[2], lineage[2][1:])
        drift = _max_difference(spaces[1], spaces[2], lineage[1][-1])
        for s in sessions.values():
            s.close()
        ray.shutdown()

    print(f"\nload average at the end: {os.getloadavg()}")
    print("| step | 1 worker: grpo.run | 2 workers: grpo.run | ratio | 1 worker: update | 2 workers: update | ratio "
          "| 2 workers: training | 2 workers: rest of the update |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i in range(steps):
        u1, u2 = update[1][i], update[2][i]
        u = f"{u1:.1f} s | {u2:.1f} s | {u2 / u1:.2f}x" if u1 and u2 else f"{_s(u1)} | {_s(u2)} | n/a"
        rest = f"{u2 - train[2][i]:.1f} s" if u2 else "-"
        print(f"| {i + 1} | {wall[1][i]:.1f} s | {wall[2][i]:.1f} s | {wall[2][i] / wall[1][i]:.2f}x | {u} "
              f"| {train[2][i]:.1f} s | {rest} |")
    for label, sl in (("all steps", slice(0, steps)), ("steps 2+", slice(1, steps))):
        w1, w2 = statistics.mean(wall[1][sl]), statistics.mean(wall[2][sl])
        line = f"mean over {label}: grpo.run {w1:.1f} s vs {w2:.1f} s = {w2 / w1:.2f}x"
        if all(update[1][sl]) and all(update[2][sl]):
            u1, u2 = statistics.mean(update[1][sl]), statistics.mean(update[2][sl])
            line += f"; update {u1:.1f} s vs {u2:.1f} s = {u2 / u1:.2f}x"
        print(line)
    if breakdown:
        later = [b for i, b in breakdown.items() if i > 0] or list(breakdown.values())
        keys = list(later[0])
        means = {k: statistics.mean(b.get(k, 0.0) for b in later) for k in keys}
        outside = statistics.mean(u - b["worker_train_s"] for u, b in zip(update[2][1:] or update[2], later)
                                  if u is not None)
        print("2 workers, mean over steps 2+: " + ", ".join(f"{k} {v:.3f} s" for k, v in means.items()))
        print(f"2 workers: the update outside rank 0's training (update_seconds - worker_train_s): {outside:.2f} s")
    print(f"update worker groups started by the 2-worker chain: {starts}")
    print(f"max |adapter difference| between the chains' final checkpoints: {drift:.2e}")


def _s(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "-"


def _group_starts(ws, policies: list[str]) -> str:
    """How many distinct update worker groups ran the steps: one set of worker pids per group."""
    groups = []
    for policy in policies:
        (run,) = [r for r in ws.catalog.stage_runs(policy) if r["status"] == "complete"]
        tag = ws.tracker.client.get_run(run["mlflow_run_id"]).data.tags.get("rlops.ray_workers")
        if tag is None:
            return f"not recorded (this code runs one Ray Train fit() per step: {len(policies)})"
        groups.append(frozenset(tag.split(",")))
    return f"{len(set(groups))} over {len(policies)} steps"


def _max_difference(ws1, ws2, policy: str) -> float:
    from safetensors.torch import load_file

    a, b = (load_file(str(Path(w.catalog.get_checkpoint(policy)["adapter_uri"]) / "adapter_model.safetensors"))
            for w in (ws1, ws2))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


if __name__ == "__main__":
    loopback.enter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--one-machine", action="store_true", help="workers on rlops' own local Ray, beside the driver")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    main(args.model, args.steps, args.prompts, args.group, args.one_machine)
