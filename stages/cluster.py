"""The `ray:` section: where rollout, scoring and multi-worker GRPO run their Ray work.

    ray:
      address: 10.0.0.5:6379      # a cluster started with `ray start --head`; omit for a local Ray
      runtime_env: {env_vars: {HF_HOME: /shared/hf}}

One home for `ray.init`: every stage that uses Ray calls `connect(config, num_cpus)`. With an
`address`, this process joins that cluster as a driver; without one, it starts a local Ray sized
for the stage (only when a stage asks for more than one worker: starting Ray costs ~5 s).

Token authentication (Ray >= 2.60 enables it on `ray start`): the driver needs the cluster's token,
from `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`, in the environment of the
process that runs `rlops` (set before Ray is first imported). Every node needs the same token.

The project's code reaches the workers through Ray's `runtime_env`: unless `ship_code` is off,
this process's rlops packages travel as `py_modules`, so workers run exactly the driver's code
(an installed rlops on the nodes is shadowed). Workers read the base model by name (resolved on
the worker: the default model's cache, a hub id, or a folder every node can see), adapters and
data from the workspace and data root, which must therefore be shared (NFS, or an `s3://` data
root with credentials in every node's environment).

Sharing the cluster between stages (a run never waits forever):
- Rollout actors stay resident for a run but reserve **no CPU**: they compute only during rollout
  stages, when nothing else of the run does. Each is pinned to a node that has CPUs, spread over
  the nodes in proportion to their CPUs (`spread`). So resident actors never starve the score tasks
  or the GRPO workers that run between rollouts.
- Score tasks take 1 CPU each (they queue when there are fewer). GRPO's update workers stay resident for
  a run too, reserving no CPU while idle; each update step holds `grpo.workers` CPUs on their nodes
  (`held`). Before a score task or a step starts, `reserve`/`held` waits up to `placement_timeout_s` for
  its CPUs, then fails naming the numbers instead of hanging.
- A local Ray has `local_cpus` logical CPUs (default: this machine's cores, raised to what one stage
  needs at once): logical, so `grpo.workers: 2` runs on one core, slower but placed.

Loopback by construction: a local Ray (no `address`) is always rlops' own (`address="local"`:
neither `RAY_ADDRESS` nor `/tmp/ray/ray_current_cluster` makes it join another), and its node
advertises LOCAL_NODE_IP. Ray rewrites 127.0.0.1 and "localhost" into the machine's interface
address (`services.resolve_ip_for_localhost`), so node-to-node traffic would leave loopback; any
other 127.x address is kept. A driver joining a cluster at a 127.x address takes that address as
its own node address too. Gloo (DDP on CPU) is told to use `lo` there.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PACKAGES = ("flows", "rewards", "stages", "storage", "tasks")  # what `ship_code` sends to workers
LOCAL_NODE_IP = "127.0.0.2"  # a local Ray's node address: loopback, and not one Ray rewrites (see above)


class RayConfig(BaseModel):
    """Where Ray work runs. Changing it never changes an artifact id: it is not part of any stage config."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None  # `host:port` of a running cluster's head (or "auto"); None: a local Ray
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # Ray's runtime_env (env_vars, pip, ...) for every task
    namespace: str | None = None  # Ray namespace; None: Ray's anonymous one per driver
    ship_code: bool = True  # send this process's rlops packages to the workers (runtime_env py_modules)
    local_cpus: int | None = Field(None, ge=1)  # a local Ray's logical CPUs; None: this machine's cores
    # How long a stage waits for the CPUs it needs at once (busy or too small a cluster) before failing.
    placement_timeout_s: float = Field(120.0, gt=0)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def runtime_env(config: RayConfig) -> dict[str, Any]:
    """The runtime_env given to Ray: the configured one, plus the rlops packages when `ship_code`,
    plus `GLOO_SOCKET_IFNAME=lo` on a loopback cluster (gloo otherwise binds the hostname's address)."""
    env = dict(config.runtime_env)
    env_vars = dict(env.get("env_vars", {}))
    if config.address is None or _loopback(_host(config.address)):
        env_vars.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["env_vars"] = env_vars
    if config.ship_code and config.address:
        import importlib

        # A local Ray's workers import from this machine already; only a cluster needs the code sent.
        shipped = [importlib.import_module(name) for name in PACKAGES]
        env["py_modules"] = [*env.get("py_modules", []), *shipped]
        # Bytecode is not sent: Ray unpacks without the sources' times, so the workers could not use it anyway.
        env["excludes"] = [*env.get("excludes", []), "__pycache__"]
    return env


def connect(config: RayConfig, num_cpus: int) -> None:
    """Initialise Ray in this process once: join `config.address`, or start a local Ray of rlops' own
    with at least `num_cpus` logical CPUs (what the calling stage needs at once)."""
    import ray

    if ray.is_initialized():
        return
    if config.address:
        host = _host(config.address)
        ray.init(address=config.address, runtime_env=runtime_env(config), namespace=config.namespace,
                 log_to_driver=False, _node_ip_address=host if _loopback(host) else None)
    else:
        cpus = max(config.local_cpus or os.cpu_count() or 1, num_cpus)
        # Ray starts one idle worker per CPU for the first driver; rlops' actors and tasks all carry this
        # job's runtime_env, which those workers lack, so each went unused (~0.5 s of CPU apiece, measured).
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # read by the raylet ray.init starts
        ray.init(address="local", num_cpus=cpus, runtime_env=runtime_env(config), namespace=config.namespace,
                 include_dashboard=False, log_to_driver=False, _node_ip_address=LOCAL_NODE_IP)


def cpu_nodes() -> list[tuple[str, float]]:
    """(node id, CPUs) of the cluster's live nodes that have CPUs, largest first."""
    import ray

    nodes = [(n["NodeID"], n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n["Alive"]]
    return sorted([n for n in nodes if n[1] > 0], key=lambda n: -n[1])


def spread(n: int) -> list[tuple[str, int]]:
    """Where `n` resident actors go: (node id, torch threads) each, over the nodes with CPUs in
    proportion to their CPUs (each actor goes where CPUs per actor stay highest)."""
    nodes = cpu_nodes()
    if not nodes:
        raise RuntimeError("the Ray cluster has no node with CPUs: rollout actors cannot be placed")
    counts = {node: 0 for node, _ in nodes}
    cpus = dict(nodes)
    chosen = []
    for _ in range(n):
        node = max(counts, key=lambda k: (cpus[k] / (counts[k] + 1), -counts[k]))
        counts[node] += 1
        chosen.append(node)
    return [(node, max(1, int(cpus[node] // counts[node]))) for node in chosen]


def pinned(node_id: str) -> Any:
    """A Ray scheduling strategy that places an actor on exactly `node_id`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def prepare(config: RayConfig, workers: dict[str, int], overlapped: bool = False) -> None:
    """Before a run's first stage: when a stage asks for Ray workers (`workers`: config key -> count),
    start or join Ray now, a local one sized for the largest GRPO group, and fail at once, naming the
    numbers, when the cluster can never place what the config asks. Rollout actors need a node with
    CPUs, score tasks one CPU each (they queue), `grpo.workers` that many CPUs at once. `overlapped`
    (max_staleness > 0): a step's score tasks run while the update trains, so Ray score tasks beside an
    update that holds every CPU would wait for it past `placement_timeout_s`: refused here instead."""
    if max(workers.values(), default=1) <= 1:
        return
    import ray

    gang = workers.get("grpo.workers", 1)
    connect(config, num_cpus=gang)
    nodes = cpu_nodes()
    total = sum(cpus for _, cpus in nodes)
    where = f"the Ray cluster at {config.address}" if config.address else "the local Ray"
    if not nodes:
        raise RuntimeError(f"{where} has no node with CPUs; the run asks for {workers}")
    if gang > total:
        raise RuntimeError(f"grpo.workers: {gang} needs {gang} CPUs at once; {where} has {total:g} "
                           f"({len(nodes)} node{'s' if len(nodes) > 1 else ''} with CPUs, {ray.cluster_resources()})")
    if overlapped and workers.get("score.workers", 1) > 1 and gang > 1 and gang >= total:
        raise RuntimeError(f"max_staleness > 0 scores the next batches while the update trains, but grpo.workers: "
                           f"{gang} holds all {total:g} CPUs of {where}, so the score tasks (score.workers: "
                           f"{workers['score.workers']}) would wait for it and fail after ray.placement_timeout_s: lower "
                           f"grpo.workers or set score.workers: 1 (scoring then runs in this process)")


def reserve(cpus: int, what: str, timeout_s: float) -> None:
    """Wait until `cpus` CPUs can be held at once (released at once), or raise naming the numbers: a stage
    that cannot be placed fails instead of waiting forever."""
    with held(cpus, what, timeout_s):
        pass


@contextmanager
def held(cpus: int, what: str, timeout_s: float, nodes: list[str] | None = None) -> Iterator[None]:
    """Hold `cpus` CPUs for the block (a placement group of 1-CPU bundles; `nodes`: bundle i on node `nodes[i]`),
    so that other Ray work queues for them meanwhile; raise naming the numbers when they do not come free within
    `timeout_s`. The resident update workers reserve no CPU of their own (stages/update/group.py): an update
    step holds its CPUs this way, on the workers' nodes, only while it runs."""
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group

    total = ray.cluster_resources().get("CPU", 0.0)
    need = f"{what} needs {cpus} CPU{'s' if cpus > 1 else ''}{' at once' if cpus > 1 else ''}"
    if cpus > total:
        raise RuntimeError(f"{need}; the Ray cluster has {total:g} in all")
    selectors = [{NODE_ID_LABEL_KEY: node} for node in nodes] if nodes else None
    group = placement_group([{"CPU": 1}] * cpus, bundle_label_selector=selectors)
    try:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get("CPU", 0.0)
            raise RuntimeError(f"{need}; the Ray cluster has {total:g}, {free:g} free, and none came free within "
                               f"{timeout_s:g} s (ray.placement_timeout_s)") from None
        yield
    finally:
        remove_placement_group(group)


def placement() -> str:
    """Where the calling Ray worker runs: `<node id>:<pid>:<parent pid>` (the parent is the node's raylet)."""
    import os

    import ray

    return f"{ray.get_runtime_context().get_node_id()}:{os.getpid()}:{os.getppid()}"
