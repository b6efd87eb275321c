"""The pipeline config: one section per stage, validated as a whole before any compute.

    name: arithmetic-demo          # the run: its lineage continues across reruns and schedules
    base_model: SmolLM2-135M-Instruct
    task: {name: arithmetic, params: {digits: 2}}
    steps: 40
    sft: {data: oracle, max_steps: 60}     # optional warm-start
    rollout: {...}  score: {rewards: [...]}  grpo: {...}  eval: {...}
    ray: {address: 10.0.0.5:6379}          # optional: a Ray cluster for rollout, score and grpo workers
    promote: {metric: accuracy, min_gain: 0}  # optional: register the final checkpoint, gate it against the champion
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flows.config import ConfigError, load_config, validate
from flows.step_data import Curriculum, Replay
from stages.cluster import RayConfig
from stages.common import Operational
from stages.evaluate import EvalConfig
from stages.promote import PromoteConfig, gate_problems
from stages.rollout import RolloutConfig, TaskSpec, concurrent_episodes
from stages.score import ScoreConfig, versions
from stages.sft import SFTConfig
from stages.update.config import GRPOConfig
from stages.update.dpo import DPOConfig
from stages.update.ppo import PPOConfig
from stages.update.presets import ReinforcePPConfig, RLOOConfig
from stages.update.rm import RMConfig

if TYPE_CHECKING:
    from tasks.base import Task

# The update each step runs (flows/algorithms.py); each has its own section, named as the algorithm.
Algorithm = Literal["grpo", "rloo", "reinforce_pp", "dpo", "ppo"]


class SFTSection(SFTConfig):
    # A chat JSONL/Parquet file, or "oracle": the task's scripted demonstrations
    # (tasks that define write_oracle_dataset, e.g. doc_search and arithmetic).
    # Not part of the SFT checkpoint id as a path: the file's content hash is.
    data: str = Operational(...)


class EvalSection(EvalConfig):
    # A pipeline setting, not an evaluation's: how often the train flow evaluates (it never enters eval ids).
    every: int = Operational(5, ge=1)  # evaluate every k GRPO steps (and at the start and end)


class DynamicSampling(BaseModel):
    """DAPO's dynamic sampling (arXiv 2503.14476): when a step's groups come back with all-equal rewards
    (no signal), generate more groups on other train prompts until `min_groups` informative groups are
    in hand or `max_batches` rollout batches were made; the update then trains on all of them. Each
    extra batch is an ordinary rollout batch of the step (its prompts drawn by a seeded shuffle), so
    the GRPO checkpoint's id names every batch it trained on."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    min_groups: int | None = Field(None, ge=1)  # informative groups wanted per step; None: rollout.prompts_per_step
    max_batches: int = Field(4, ge=1)  # rollout batches per step at most, the first one included


ALGORITHM_SECTIONS = ("grpo", "rloo", "reinforce_pp", "dpo", "ppo")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")  # the run's name: reruns and schedules continue its lineage
    base_model: str = "SmolLM2-135M-Instruct"  # default name, local folder, or hub id (when reachable)
    task: TaskSpec
    steps: int = Field(10, ge=0)  # GRPO steps (each: rollout -> score -> update)
    sft: SFTSection | None = None  # warm-start before RL; None starts GRPO from the base model
    rollout: RolloutConfig = RolloutConfig()
    score: ScoreConfig
    train_reward: str | None = None  # reward name GRPO optimises; None = score.total
    # Which update each step runs; absent = grpo, so configs written before it keep their ids.
    algorithm: Algorithm = "grpo"
    grpo: GRPOConfig = GRPOConfig()
    rloo: RLOOConfig = RLOOConfig()  # algorithm: rloo
    reinforce_pp: ReinforcePPConfig = ReinforcePPConfig()  # algorithm: reinforce_pp
    dpo: DPOConfig = DPOConfig()  # algorithm: dpo (online DPO), and `rlops stage dpo`
    ppo: PPOConfig = PPOConfig()  # algorithm: ppo (a learned critic, GAE per token or per turn)
    rm: RMConfig = RMConfig()  # `rlops stage rm`: a learned reward model from preference pairs (stages/rm.py)
    dynamic_sampling: DynamicSampling = DynamicSampling()  # more groups when a step's are uninformative
    curriculum: Curriculum = Curriculum()  # prompts chosen by their past pass rates (flows/step_data.py)
    replay: Replay = Replay()  # a step without signal also trains on earlier batches that had some
    # Generation runs up to K policy versions ahead of training (flows/async_steps.py): the batch of step s
    # comes from the policy after step s - K. 0 = the synchronous loop (and its ids); verl, ART and
    # prime-rl users typically run 1-4, paired with grpo.correction (TIS) for the policy lag.
    max_staleness: int = Field(0, ge=0)
    eval: EvalSection = EvalSection()
    # Checkpoints logged to MLflow as models (adapter files + lineage tags): the final one, or every
    # one (SFT and each GRPO step; ~1 adapter's size per step in mlartifacts/).
    mlflow_models: Literal["final", "all"] = "final"
    ray: RayConfig = RayConfig()  # where rollout, score and GRPO workers run (stages/cluster.py)
    # The promotion gate (stages/promote.py, flows/promotion.py): the final checkpoint becomes a version of an
    # MLflow registered model, aliased `challenger`, and `champion` when it beats the current one. None: no
    # registration for `rlops run`; a scheduled run gates anyway, with PromoteConfig's defaults.
    promote: PromoteConfig | None = None

    @field_validator("base_model")
    @classmethod
    def _cache_folder(cls, value: str) -> str:
        from stages.policy.model import expand_cache

        return expand_cache(value)  # `$RLOPS_CACHE/models/...`: a model a make target built in the cache

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        # rollout.ray_address became the run-wide `ray.address` (scoring and training use the cluster too).
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict) and "ray_address" in data["rollout"]:
            raise ValueError("rollout.ray_address was moved: set `ray: {address: ...}` at the top level "
                             "(it applies to rollout, score and grpo)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _verifiers_rubric(cls, data: Any) -> Any:
        # A verifiers environment's rubric as rewards (rewards/verifiers.py): `rewards.verifiers.functions` becomes
        # one reward per rubric function, and every rewards.verifiers spec gets the task's env and env_args.
        task, score = (data.get("task"), data.get("score")) if isinstance(data, dict) else (None, None)
        if not (isinstance(task, dict) and task.get("name") == "verifiers" and isinstance(score, dict)
                and isinstance(score.get("rewards"), list)):
            return data
        from rewards.verifiers import expand

        params = task.get("params") or {}
        if not isinstance(params.get("env"), str):
            return data  # the task's own check names the missing env
        return {**data, "score": {**score, "rewards": expand(score["rewards"], params["env"], params.get("env_args"))}}

    @model_validator(mode="after")
    def _one_algorithm(self) -> RunConfig:
        # A section of an algorithm the run does not use would be silently ignored: say so instead. A section
        # at its defaults is fine (a serialised config carries every section), and so is `grpo:`, which every
        # shipped config carries: switching `algorithm:` on one of them must not need an edit.
        unused = [a for a in ALGORITHM_SECTIONS if a in self.model_fields_set and a not in (self.algorithm, "grpo")
                  and getattr(self, a) != type(self).model_fields[a].default]
        if unused:
            raise ValueError(f"algorithm is {self.algorithm!r}, but the config sets {', '.join(unused)}: "
                             f"set `algorithm: {unused[0]}` or remove the section")
        return self

    @model_validator(mode="after")
    def _gate(self) -> RunConfig:
        # The gate's metric must be one its evaluation produces: found now, not after a night of training.
        problems = gate_problems(self.eval, self.gate_config)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def gate_config(self) -> PromoteConfig:
        """The promotion gate's settings: the `promote:` section, or its defaults (what a scheduled run applies)."""
        return self.promote or PromoteConfig()

    @property
    def reward_name(self) -> str:
        """The reward GRPO trains on (ScoreConfig.default_reward decides the fallback)."""
        return self.score.default_reward(self.train_reward)


def semantic_problems(cfg: RunConfig) -> list[str]:
    """Checks that need more than types: loadable task and rewards, files that exist, consistent sections."""
    from rewards.base import task_problems
    from stages.policy.model import DEFAULT_MODEL
    from tasks.base import TaskParamsError, load_task

    problems, task = [], None
    try:
        task = load_task(cfg.task.name, cfg.task.params)
        for split in ("train", cfg.eval.split):
            if not task.prompts(split) and not task.live:
                problems.append(f"task: split {split!r} has no prompts")
        if task.agent is not None and task.agent.check_sessions is not None:
            task.agent.check_sessions(concurrent_episodes(cfg.rollout, cfg.rollout.prompts_per_step))
    except TaskParamsError as e:
        problems.extend(e.problems)  # each already names its param: task.params.digits: expected int, ...
    except Exception as e:  # noqa: BLE001 - any failure to build the task is a config problem to report
        problems.append(f"task: cannot load {cfg.task.name!r}: {type(e).__name__}: {e}")
    from rewards.base import reward_version

    broken = []  # every reward that cannot load, each named, not only the first
    for spec in cfg.score.rewards:
        try:
            reward_version(spec)
        except Exception as e:  # noqa: BLE001
            broken.append(spec.name)
            problems.append(f"score.rewards.{spec.name}: {e}")
    if not broken:  # the checks that need every reward loaded
        if task is not None:
            problems += column_problems(cfg, task)
        try:
            names = set(versions(cfg.score))
            if cfg.reward_name not in names:
                problems.append(f"train_reward: {cfg.reward_name!r} is not one of the score rewards {sorted(names)}")
            if cfg.eval.metric and cfg.eval.metric not in names:
                problems.append(f"eval.metric: {cfg.eval.metric!r} is not one of the score rewards {sorted(names)}")
            problems += [f"score.rewards.{spec.name}: {p}" for spec in cfg.score.rewards
                         for p in task_problems(spec, cfg.task.name, cfg.task.params)]
        except Exception as e:  # noqa: BLE001
            problems.append(f"score.rewards: {type(e).__name__}: {e}")
    if cfg.sft and cfg.sft.data != "oracle" and not Path(cfg.sft.data).expanduser().exists():
        problems.append(f"sft.data: file not found: {cfg.sft.data}")
    teacher = cfg.grpo.distill.teacher if cfg.grpo.distill else None
    if teacher and teacher.startswith((".", "/", "~")) and not Path(teacher).expanduser().is_dir():
        problems.append(f"grpo.distill.teacher: folder not found: {teacher}")
    if cfg.base_model != DEFAULT_MODEL and cfg.base_model.startswith((".", "/", "~")) and not Path(cfg.base_model).expanduser().exists():
        # Whatever the task asks of the model cannot be checked without it: the folder is the one problem.
        return problems + [f"base_model: folder not found: {cfg.base_model}{_build_hint(cfg.base_model)}"]
    return problems + vision_language_problems(cfg, task)


def column_problems(cfg: RunConfig, task: Task) -> list[str]:
    """A TRL-style reward's required columns (`solution` of `accuracy_reward`) that the task's prompts lack: found
    now from the first train prompt's metadata, not as an error row per rollout."""
    from rewards.base import import_callable
    from rewards.peers import required_columns
    from tasks.base import pick

    train = task.prompts("train")
    if not train:
        return []
    have = set(pick(train, [0])[0].metadata)
    return [f"score.rewards.{spec.name}: {spec.fn} needs the column(s) {', '.join(missing)}, which the task's prompts "
            f"do not have (they have: {', '.join(sorted(have)) or 'none'})"
            for spec in cfg.score.rewards if spec.style == "trl"
            for missing in [[c for c in required_columns(import_callable(spec.fn), spec.params) if c not in have]]
            if missing]


def _build_hint(base_model: str) -> str:
    """How to make a missing model folder that rlops itself builds (the small VLM); empty for any other."""
    from stages.policy import small_vlm

    if Path(base_model).name != small_vlm.NAME:
        return ""
    return f" (`{small_vlm.BUILD_COMMAND}` builds it there; examples/vision/build_small_vlm.py --out DIR elsewhere)"


def vision_language_problems(cfg: RunConfig, task: Task | None) -> list[str]:
    """What the run asks of a vision-language base model that the VLM path does not support yet
    (stages.policy.vlm_episodes.unsupported_with_vlm), one `base_model: ...` line each; for a text model, a
    task that shows images and a `lora.projector` asked for. `task`: the run's task (None: it did not load, a
    problem reported already)."""
    from stages.policy.vlm import is_vision_language_model
    from stages.policy.vlm_episodes import task_policy_problem, unsupported_with_vlm

    sections = [("sft", cfg.sft)] * (cfg.sft is not None) + [(cfg.algorithm, getattr(cfg, cfg.algorithm))]
    if not is_vision_language_model(cfg.base_model):
        problem = task_policy_problem(task, False) if task is not None else None
        return [f"base_model: {problem}"] * bool(problem) + [
            f"{name}.lora.projector: the base model {cfg.base_model} is text-only; a projector LoRA needs a "
            "vision-language model" for name, section in sections if section.lora.projector]
    found = unsupported_with_vlm(
        backend=cfg.rollout.backend, task=task, update=cfg.algorithm,
        projector_lora=any(section.lora.projector for _, section in sections), base_model=cfg.base_model)
    return [f"base_model: {cfg.base_model} is a vision-language model; not supported with it yet: {p}" for p in found]


def load_run_config(path: str | Path, overrides: list[str] | None = None, workspace: str | Path | None = None) -> RunConfig:
    """Read, override and validate a pipeline config; raise one ConfigError listing every problem. `workspace` (the
    command's): where a task that reads the workspace (`traffic`) reads, unless its params name one."""
    cfg = load_config(RunConfig, path, overrides)
    if cfg.task.name == "traffic":
        from storage.settings import Settings
        from tasks.traffic import in_workspace

        cfg.task.params = in_workspace(cfg.task.params, str(Settings.from_env(workspace).workspace))
    problems = semantic_problems(cfg)
    if problems:
        raise ConfigError(f"{path} is invalid ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  - "
                          + "\n  - ".join(problems))
    if cfg.sft and cfg.sft.data != "oracle":
        cfg.sft.data = str(Path(cfg.sft.data).expanduser().resolve())  # relative to where rlops runs
    return cfg


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate an in-memory config (tests, flows receiving a serialised config)."""
    return validate(RunConfig, data)
