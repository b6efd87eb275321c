"""The data-parallel update's worker group: `grpo.workers` Ray actors joined by torch.distributed, started once.

    group = UpdateGroup.start(ray_config, base_model, workers=2)   # placed, base model loaded, process group joined
    stored, result = group.step(common, shards)                    # one update; rank 0's weights stay in the store
    group.stop()

A run's `PolicySession` keeps one group for the run (stages/update/workers.py starts it at the first update and the
session stops it when it closes); `rlops stage grpo` on its own starts one for its single update and stops it.

**Why Ray actors, not Ray Train.** A Ray Train `TorchTrainer.fit()` owns its worker group for exactly one call: it
starts the workers, runs the training function and tears the group down when the function returns, and nothing
can be handed to a group that is running. One `fit()` per step therefore started ~5 processes, imported torch and
loaded the model on every step (docs/BENCHMARKS.md, "Resident update workers"). Keeping one `fit()` open for the
whole run would need a training function that waits on a queue, a driver thread blocked in `fit()`, results
through a side channel, and Ray Train's own fault policy (restart the whole function from a Ray Train checkpoint)
in place of a step's. Plain actors (verl, OpenRLHF and NeMo-RL drive their trainers the same way) make each step
one method call per rank, whose result or error, naming the actor, comes back to the driver; torch.distributed
runs between them as it did under Ray Train: gloo on CPU, NCCL on GPUs, rendezvous over TCP at rank 0's address.

**What travels per step.** The driver's LoRA weights and optimizer state (one object in Ray's object store, read
by every rank), and each rank's shard of the samples (pixel inputs included for a VLM). Each worker copies the
weights into its resident model's adapter (reshaping the adapter when the LoRA shape changed), trains, and rank 0
returns the new weights as a separate object, which stays in the object store owned by the driver: the driver
copies it into its own model and writes the checkpoint once, and Ray rollout actors fetch the same object
(stages/policy/session.py `ShippedAdapter`, its sha256 checked on arrival).

**Placement.** The workers reserve no CPU while idle (a run's score tasks and rollouts share the cluster with
them, as with the resident rollout actors); on CPU each is pinned to a node with CPUs (`stages.cluster.spread`,
one torch thread per CPU it gets there), on GPUs each takes one GPU for the group's life. A step, and the group's
start, hold `workers` CPUs on the workers' nodes (`stages.cluster.held`), so other Ray work queues meanwhile and a
busy cluster fails after `ray.placement_timeout_s` naming the numbers.

**Faults.** A step waits for every rank. When one fails (its process killed, its node stopped: Ray reports the
actor dead; a rank whose peer died: its collective fails as the connection closes), the group is of no further
use: `step` waits a few seconds for the other ranks' outcome, so that the message names the worker that died and
not one that lost its peer, kills every worker and raises `GroupFailure`. Nothing of a failed step reaches the
driver's model, so no checkpoint is ever written from a partial gradient (stages/update/workers.py retries the
step once with a fresh group, then fails naming the worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from stages.cluster import RayConfig

# How long a failed step waits for its other ranks before naming the culprit: a rank whose peer died fails as soon
# as its next collective sees the connection close; one still computing is killed when the wait ends.
FAULT_GRACE_S = 5.0
# torch.distributed's bound on one collective (its own default for gloo): a backstop for a peer that hangs without
# dying; a peer that dies closes its connections and fails the collective at once.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


class GroupFailure(RuntimeError):
    """A step failed on some rank; the message names each rank's outcome, the dead ones first."""


class UpdateWorker:
    """One rank of the group (a Ray actor): the base model loaded once, its adapter's weights set per step."""

    def __init__(self, rank: int, world: int, threads: int | None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.resident: Any = None
        self.device: Any = None

    def where(self) -> str:
        """This actor's Ray node, pid and parent pid (stages.cluster.placement)."""
        from stages.cluster import placement

        return placement()

    def rendezvous(self) -> str:
        """Rank 0: `tcp://<this node's address>:<a free port>`, where the process group meets."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, base_model: str, init_method: str, dtype: str | None = None) -> None:
        """Load the base model (fp32, or `dtype`: `grpo.dtype`) and join the process group (gloo on CPU, NCCL on a GPU)."""
        import torch
        import torch.distributed as dist

        from stages.policy.session import ResidentModel
        from stages.update.train import load_base

        use_gpu = torch.cuda.is_available()  # Ray shows a GPU actor its own GPU only
        if use_gpu:
            torch.cuda.set_device(0)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.resident = ResidentModel(load_base(base_model, self.device, dtype), tokenizer=None)
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=init_method, rank=self.rank,
                                world_size=self.world, timeout=COLLECTIVE_TIMEOUT)

    def step(self, common: dict[str, Any], shard: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        """Train this rank's shard with the driver's weights and optimizer state (`common`); returns rank 0's new
        weights (an AdapterState) and (optimizer state, whole-batch metrics, sha256 of the weights); (None, None)
        from the other ranks."""
        from peft import get_peft_model_state_dict

        from stages.policy.session import adapter_digest
        from stages.update.shards import cpu_state, train_shard

        begin = time.perf_counter()
        resident = self.resident
        driver_names = set(common["state"])
        unexpected = resident.hold(common["peft_config"], common["state"])
        own = set(get_peft_model_state_dict(resident.model))
        if unexpected or own != driver_names:
            raise RuntimeError(f"the worker's adapter differs from the driver's: {sorted(own ^ driver_names)[:5]}")
        held_at = time.perf_counter()
        try:
            optimizer, history = train_shard(resident.trainable(), common, shard, self.device)
        finally:
            resident.settle(None)  # activation checkpointing off, no grads kept between steps
        trained_at = time.perf_counter()
        if self.rank != 0:
            return None, None
        state = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(resident.model).items()}
        out = {"optimizer": cpu_state(optimizer.state_dict()), "history": history, "digest": adapter_digest(state)}
        # Where rank 0's call went (bench/bench_ddp.py reports it): taking the driver's weights, training, handing back.
        out["timing"] = {"worker_take_s": held_at - begin, "worker_train_s": trained_at - held_at,
                         "worker_return_s": time.perf_counter() - trained_at}
        return state, out


@dataclass
class UpdateGroup:
    """The driver's handle on a started group: its actors (rank order), their nodes and placements."""

    ray_config: RayConfig
    actors: list[Any]
    nodes: list[str]  # the node id of each rank
    placements: list[str]  # `<node id>:<pid>:<parent pid>` of each rank
    start_seconds: float  # placing the workers, loading the model, joining the process group
    steps: int = field(default=0)

    @property
    def workers(self) -> int:
        return len(self.actors)

    @classmethod
    def start(cls, ray_config: RayConfig, base_model: str, workers: int, dtype: str | None = None) -> UpdateGroup:
        """Place `workers` actors, load the base model in each and join them in one process group; stops
        whatever it started and raises GroupFailure (or the placement's RuntimeError) when that fails."""
        import ray
        import torch

        from stages.cluster import connect, held, pinned, spread

        connect(ray_config, num_cpus=workers)
        begin = time.perf_counter()
        what = f"grpo.workers: {workers}"
        use_gpu = torch.cuda.is_available()
        if use_gpu:  # placed by Ray where GPUs are free (unverified here: no GPU on this machine)
            places: list[tuple[str | None, int | None]] = [(None, None)] * workers
        else:
            places = list(spread(workers))
        actor = ray.remote(num_cpus=0, num_gpus=1 if use_gpu else 0, max_restarts=0)(UpdateWorker)
        nodes = [node for node, _ in places] if not use_gpu else None
        actors: list[Any] = []
        with held(workers, what, ray_config.placement_timeout_s, nodes=nodes):
            try:
                for rank, (node, threads) in enumerate(places):
                    options = {"scheduling_strategy": pinned(node)} if node else {}
                    actors.append(actor.options(**options).remote(rank, workers, threads))
                try:
                    placements = ray.get([a.where.remote() for a in actors], timeout=ray_config.placement_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise RuntimeError(f"{what}: the update workers were not placed within "
                                       f"{ray_config.placement_timeout_s:g} s (ray.placement_timeout_s); cluster "
                                       f"resources {ray.cluster_resources()}, free {ray.available_resources()}") from None
                group = cls(ray_config, actors, [p.split(":")[0] for p in placements], placements, 0.0)
                init_method = ray.get(actors[0].rendezvous.remote())
                group._wait([a.setup.remote(base_model, init_method, dtype) for a in actors], "while starting")
            except BaseException:
                for a in actors:
                    ray.kill(a)
                raise
        group.start_seconds = time.perf_counter() - begin
        return group

    def step(self, common: dict[str, Any], shards: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        """One update over the ranks (`shards[r]` to rank r), holding their CPUs meanwhile: (object ref of rank 0's
        new weights, rank 0's result). GroupFailure, with every worker killed, when any rank fails."""
        import ray

        from stages.cluster import held

        begin = time.perf_counter()
        common_ref = ray.put(common)  # one copy in the store, read by every rank
        put_at = time.perf_counter()
        with held(self.workers, f"grpo.workers: {self.workers}", self.ray_config.placement_timeout_s, nodes=self.nodes):
            held_at = time.perf_counter()
            calls = [a.step.options(num_returns=2).remote(common_ref, shard) for a, shard in zip(self.actors, shards)]
            self._wait([result for _, result in calls], f"in its step {self.steps + 1}")
            ran_at = time.perf_counter()
        self.steps += 1
        state_ref, result = calls[0]
        out = ray.get(result)
        out["timing"] = {**out.get("timing", {}), "put_s": put_at - begin, "hold_s": held_at - put_at,
                         "calls_s": ran_at - held_at, "release_s": time.perf_counter() - ran_at}
        return state_ref, out

    def _wait(self, refs: list[Any], what: str) -> None:
        """Wait for every rank's call; on the first failure, give the others FAULT_GRACE_S to end, kill the group and
        raise GroupFailure describing each rank."""
        import ray

        pending = list(refs)
        while pending:
            (ready,), pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except Exception as first:  # noqa: BLE001 - every failure of a rank fails the step; described below
                if pending:
                    ray.wait(pending, num_returns=len(pending), timeout=FAULT_GRACE_S)
                message = self._describe(refs, what)
                self.stop()
                raise GroupFailure(message) from first

    def _describe(self, refs: list[Any], what: str) -> str:
        """One clause per rank that did not succeed, the dead ones first."""
        import ray

        dead, failed, running = [], [], []
        for rank, ref in enumerate(refs):
            node, pid, _ = self.placements[rank].split(":")
            name = f"update worker rank {rank} (node {node[:12]}, pid {pid})"
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                running.append(f"{name} was still running")
            except ray.exceptions.RayActorError as e:
                dead.append(f"{name} died ({_first_line(e)})")
            except Exception as e:  # noqa: BLE001
                failed.append(f"{name} failed: {_first_line(e)}")
        return f"the update worker group failed {what}: " + "; ".join(dead + failed + running)

    def stop(self) -> None:
        """Kill every worker (a no-op for those already gone)."""
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)


def _first_line(error: BaseException) -> str:
    """The first line of a Ray error's reason: a task error's cause (the worker's exception), an actor error's own."""
    cause = getattr(error, "cause", None)
    reason = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    return f"{type(reason).__name__}: {lines[0][:300]}" if lines else type(reason).__name__
