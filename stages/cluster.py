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
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PACKAGES = ("flows", "rewards", "stages", "storage", "tasks")  # what `ship_code` sends to workers


class RayConfig(BaseModel):
    """Where Ray work runs. Changing it never changes an artifact id: it is not part of any stage config."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None  # `host:port` of a running cluster's head (or "auto"); None: a local Ray
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # Ray's runtime_env (env_vars, pip, ...) for every task
    namespace: str | None = None  # Ray namespace; None: Ray's anonymous one per driver
    ship_code: bool = True  # send this process's rlops packages to the workers (runtime_env py_modules)


def runtime_env(config: RayConfig) -> dict[str, Any]:
    """The runtime_env given to Ray: the configured one, plus the rlops packages when `ship_code`."""
    env = dict(config.runtime_env)
    if config.ship_code and config.address:
        import importlib

        # A local Ray's workers import from this machine already; only a cluster needs the code sent.
        shipped = [importlib.import_module(name) for name in PACKAGES]
        env["py_modules"] = [*env.get("py_modules", []), *shipped]
    return env


def connect(config: RayConfig, num_cpus: int) -> None:
    """Initialise Ray in this process once: join `config.address`, or start a local Ray with `num_cpus`."""
    import ray

    if ray.is_initialized():
        return
    if config.address:
        ray.init(address=config.address, runtime_env=runtime_env(config), namespace=config.namespace,
                 log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, runtime_env=runtime_env(config) or None, namespace=config.namespace,
                 include_dashboard=False, log_to_driver=False)


def placement() -> str:
    """Where the calling Ray worker runs: `<node id>:<pid>:<parent pid>` (the parent is the node's raylet)."""
    import os

    import ray

    return f"{ray.get_runtime_context().get_node_id()}:{os.getpid()}:{os.getppid()}"
