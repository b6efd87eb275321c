"""The label-free promotion gate's comparison: champion and challenger answer the same held-out scenarios
greedily, and a judge says, scenario by scenario, whose answer is better: the two side by side (pairwise, both
orders), or each alone (yes_no).

    answers = [answer(ctx, policy_id=p, task=cfg.task, rollout_config=cfg.rollout, eval_config=cfg.eval)
               for p in (champion, challenger)]
    ref = run(JudgeGateConfig(judge=promote.judge), ctx, answers[0].id, answers[1].id)
    measured = outcome(ctx.ws, ref.id)            # win rate, its interval, prompts judged, errors

Traffic served to a deployed agent has no ground truth, so this gate asks a judge instead of a reward with labels.
For each prompt both batches answered, the judge sees the two trajectories in both orders
(`rewards.judge_modes.judge_group`, pairwise mode: one first-token request per order) and gives P(challenger
better) with the challenger shown first and shown second; their mean is the prompt's `win`, so a judge that
prefers whatever it is shown first says 0.5. Identical answers are a tie (0.5) without a request. A prompt the
judge fails on keeps the reason in its row's `error` and is left out of the win rate: one broken request never
stops the gate. One `verdicts` row per prompt (storage/loop_schema.py); the artifact's meta holds the win rate
(the mean win over judged prompts), its percentile bootstrap interval over prompts
(`stages.evaluate.bootstrap_interval`), how many prompts were judged and how many failed. The decision rule is
stages/promote.py's (`decide_by_judge`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rewards.base import RewardSpec, describe_error, reward_version, short_hash
from rewards.judge_client import JudgeError, scrub
from rewards.judge_modes import judge_group
from rewards.reach import reach
from rewards.ruler import JudgeConfig, make_client
from stages import rollout as rollout_stage
from stages.common import ArtifactRef, Operational, StageContext, run_stage
from stages.evaluate import EvalConfig, bootstrap_interval, episodes_config
from storage.schema import SCHEMA_VERSION, TABLES, Rollout, from_table, now

if TYPE_CHECKING:
    from storage.workspace import Workspace

TIE = 0.5  # the win of two identical answers: nothing to prefer, and nothing to ask


class GateJudge(BaseModel):
    """The `promote.judge:` section: which judge compares champion and challenger, and how to reach it. The same
    settings as the RULER reward's judge (rewards.ruler.JudgeConfig), read in its pairwise mode."""

    model_config = ConfigDict(extra="forbid")
    model: str  # the served model name (openai) or a local folder / hub id (transformers)
    # pairwise: the two answers side by side, in both orders; yes_no: each answer alone ("does it achieve its goal?"),
    # read from the same first-token log-probs. A small judge that prefers whatever it is shown first decides nothing
    # pairwise (docs/BENCHMARKS.md, "The deployment loop": Qwen2.5-Coder-1.5B gave the first shown ~0.64 whatever it
    # was); judged alone, an answer has no position.
    mode: Literal["pairwise", "yes_no"] = "pairwise"
    backend: Literal["openai", "transformers"] = "openai"  # openai: any OpenAI-compatible server giving log-probs
    base_url: str | None = None  # the openai backend's endpoint, e.g. http://localhost:8000/v1
    api_key_env: str | None = None  # the env var holding the API key (never the key itself)
    rubric: str | None = None  # the grading standards; None: rewards.judge_modes.POINT_RUBRIC
    # The weights an endpoint serves as `model` (a local folder or file): their content enters the judge's version,
    # so a judge whose weights change under the same name gives new verdicts instead of reusing old ones.
    weights: str | None = None
    timeout: float = Operational(60.0, gt=0.0)  # seconds per request
    concurrency: int = Operational(4, ge=1)  # requests in flight; prompts are judged side by side up to this

    def client_config(self) -> JudgeConfig:
        """The client settings (rewards.ruler.make_client shares one client per distinct value)."""
        return JudgeConfig(self.model, backend=self.backend, base_url=self.base_url, api_key_env=self.api_key_env,
                           timeout=self.timeout, concurrency=self.concurrency)


def judge_version(judge: GateJudge) -> str:
    """The judge's version: the one home of what makes two verdicts comparable, in each verdicts row and the
    artifact's id. What enters it is what changes a verdict, hashed as rewards are (rewards/base.py):

    - the RULER reward's version (`rewards.base.reward_version`) in the gate's mode with these settings: `model`,
      `backend`, `base_url`, `rubric`, the content of `weights` (and of `model` when it is a local folder), and the
      code that asks and reads, reached from `rewards.ruler.ruler_reward` (the pairwise prompt and its default
      rubric, `judge_group`, the reading of the first-token log-probs, the client) with its libraries' versions;
    - the reach of `_verdict`, which turns the judge's answers on a pair into a row (which side is the challenger,
      the tie of identical answers).

    The API key's variable, the timeout and the concurrency change no verdict and stay out."""
    params = {"model": judge.model, "backend": judge.backend, "base_url": judge.base_url, "rubric": judge.rubric,
              "weights": judge.weights, "mode": judge.mode}
    asks = reward_version(RewardSpec(name="judge_gate", fn="rewards.ruler.ruler_reward", params=params))
    return short_hash({"judge": asks, "verdict": reach(_verdict).fingerprint()})


class JudgeGateConfig(BaseModel):
    """The comparison stage's config: the judge, and the interval around the win rate."""

    model_config = ConfigDict(extra="forbid")
    judge: GateJudge
    level: float = Field(0.95, gt=0.0, lt=1.0)  # the interval's coverage (promote.level)
    resamples: int = Field(10_000, ge=100)  # bootstrap resamples (promote.resamples): ~0.5 s for 100 prompts


@dataclass(frozen=True)
class JudgeOutcome:
    """What a comparison measured (its artifact's meta): the challenger's win rate against the champion."""

    win_rate: float | None  # the mean win over the judged prompts; None when the judge judged none
    low: float | None  # its bootstrap interval over prompts
    high: float | None
    prompts: int  # prompts with a verdict (ties included)
    errors: int  # prompts the judge failed on (left out)
    judge_version: str
    level: float


def answer(ctx: StageContext, *, policy_id: str, task: rollout_stage.TaskSpec,
           rollout_config: rollout_stage.RolloutConfig, eval_config: EvalConfig) -> ArtifactRef:
    """`policy_id`'s greedy answer to each held-out prompt the run evaluates on (`eval_config.split`, its first
    `n_prompts`): a rollout batch of one episode per prompt at temperature 0. Its id is the rollout stage's, so a
    rerun finds it, and a greedy single-sample evaluation of the same policy already made it."""
    greedy = eval_config.model_copy(update={"samples": 1, "temperature": 0.0})
    return rollout_stage.run(episodes_config(greedy, rollout_config, task), ctx, policy_id, task,
                             split=eval_config.split, step=0)


def run(config: JudgeGateConfig, ctx: StageContext, champion_batch: str, challenger_batch: str) -> ArtifactRef:
    """Judge the challenger's answers against the champion's, prompt by prompt (the module docstring); returns the
    verdicts artifact, whose id covers the two batches, the interval settings and `judge_version`: a rerun
    returns it without asking the judge again."""
    version = judge_version(config.judge)
    # Filled in by the body: run_stage stores `meta` when the body has returned, so the measured numbers are there.
    meta: dict[str, Any] = {"champion_batch": champion_batch, "challenger_batch": challenger_batch,
                            "judge_model": config.judge.model, "judge_version": version, "level": config.level}

    def body(comparison_id: str, mlflow_run_id: str) -> dict[str, float]:
        pairs = _pairs(ctx.ws, champion_batch, challenger_batch)
        verdict = functools.partial(_verdict, _asker(config.judge, ctx.ws, version), config.judge.mode,
                                    fixed={"comparison_id": comparison_id, "judge_model": config.judge.model,
                                           "judge_version": version, "schema_version": SCHEMA_VERSION})
        with ThreadPoolExecutor(max_workers=config.judge.concurrency) as pool:  # the client caps requests in flight
            rows = list(pool.map(lambda pair: verdict(*pair), pairs))
        ctx.ws.write_part("verdicts", comparison_id, pa.Table.from_pylist(rows, schema=TABLES["verdicts"]),
                          part="part-00000")
        wins = [r["win"] for r in rows if r["error"] is None]
        measured: dict[str, Any] = {"win_rate": None, "low": None, "high": None}
        if wins:
            low, high = bootstrap_interval(wins, config.resamples, seed=0, level=config.level)
            measured = {"win_rate": sum(wins) / len(wins), "low": low, "high": high}
        metrics = {"prompts": len(wins), "errors": len(rows) - len(wins),
                   "ties": sum(r["win"] == TIE and r["p_challenger_first"] is None for r in rows)}
        meta.update(measured, **metrics)
        return {**metrics, **{k: v for k, v in measured.items() if v is not None}}

    return run_stage(ctx, "judge_gate", "verdicts", [champion_batch, challenger_batch],
                     {"level": config.level, "resamples": config.resamples}, body, version=version, meta=meta)


def outcome(ws: Workspace, verdicts_id: str) -> JudgeOutcome:
    """What the comparison `verdicts_id` measured, from its artifact's meta."""
    meta = ws.catalog.get_artifact(verdicts_id)["meta"]
    return JudgeOutcome(meta["win_rate"], meta["low"], meta["high"], meta["prompts"], meta["errors"],
                        meta["judge_version"], meta["level"])


def _pairs(ws: Workspace, champion_batch: str, challenger_batch: str) -> list[tuple[Rollout, Rollout]]:
    """(champion's episode, challenger's episode) per prompt both batches answered, in the champion's order."""
    champion, challenger = (_first_per_prompt(ws, b) for b in (champion_batch, challenger_batch))
    shared = [p for p in champion if p in challenger]
    if not shared:
        raise ValueError(f"the answer batches {champion_batch} and {challenger_batch} share no prompt")
    return [(champion[p], challenger[p]) for p in shared]


def _first_per_prompt(ws: Workspace, batch_id: str) -> dict[str, Rollout]:
    rollouts = sorted(from_table(ws.read_artifact(batch_id), Rollout), key=lambda r: (r.group_id, r.sample_idx))
    out: dict[str, Rollout] = {}
    for r in rollouts:
        out.setdefault(r.prompt_id, r)  # a greedy answer batch has one episode per prompt
    return out


Ask = Callable[[list[list[dict[str, Any]]]], list[tuple[float, dict[str, Any]]]]


def _asker(judge: GateJudge, ws: Workspace, version: str) -> Ask:
    """The pairwise judge as a function of two trajectories, raising JudgeError (its text free of the API key) for
    whatever fails, a judge that cannot be reached included (an unset key variable: every prompt's row says so).
    Answers are cached per judge version in the workspace's judge cache: a forced rerun asks only what is missing."""
    def ask(pair: list[list[dict[str, Any]]]) -> list[tuple[float, dict[str, Any]]]:
        try:
            client = make_client(judge.client_config())  # one shared client per config: built once
            return judge_group(pair, judge.mode, client, rubric=judge.rubric,
                               cache_dir=ws.judge_cache_dir / "gate" / version, concurrency=2)
        except Exception as e:  # noqa: BLE001 - recorded in the prompt's row, as a reward's failure is
            text = str(e) if isinstance(e, JudgeError) else describe_error(e)
            raise JudgeError(scrub(text, [os.environ.get(judge.api_key_env or "", "")])) from None

    return ask


def _verdict(ask: Ask, mode: str, champion: Rollout, challenger: Rollout, fixed: dict[str, Any]) -> dict[str, Any]:
    """One `verdicts` row: the judge asked in both orders (pairwise) or of each answer alone (yes_no), or a tie for
    identical answers, or the judge's failure. Judged alone, the challenger's win is 0.5 + (P(its answer achieves the
    goal) - P(the champion's does)) / 2: the chance the judge says yes to it and no to the champion's, with half of
    its agreeing verdicts, were the two verdicts drawn independently."""
    a, b = ([m.to_openai() for m in r.messages] for r in (champion, challenger))
    row = {**fixed, "prompt_id": champion.prompt_id, "champion": champion.policy_id, "challenger": challenger.policy_id,
           "champion_rollout": champion.rollout_id, "challenger_rollout": challenger.rollout_id,
           "p_challenger_first": None, "p_challenger_second": None, "p_champion": None, "p_challenger": None,
           "win": None, "error": None, "created_at": now()}
    if a == b:
        return row | {"win": TIE}
    try:
        (p_champion, _), (p_challenger, details) = ask([a, b])  # per trajectory: (score, details)
    except JudgeError as e:  # failures are data: this prompt's row says why, the others go on
        return row | {"error": str(e)}
    if mode == "yes_no":
        return row | {"p_champion": p_champion, "p_challenger": p_challenger, "win": 0.5 + (p_challenger - p_champion) / 2}
    first, second = details["order_probs"][0]  # P(challenger better) shown first, shown second
    return row | {"p_challenger_first": first, "p_challenger_second": second, "win": (first + second) / 2}
