"""The promotion gate's rule: when a challenger becomes the champion.

    config = PromoteConfig(metric="accuracy", min_gain=0.0)
    eval_config = gate_eval(run_eval, config)          # how both are evaluated: the run's `eval:`, the gate's samples
    promoted, why = decide(comparison, config)         # comparison: stages.evaluate.paired(champion, challenger)

Both policies are evaluated on the same held-out prompts with the same reward, and the difference of their
per-prompt statistic gets a paired bootstrap interval (`stages.evaluate.paired`, as `rlops eval compare`).
The challenger is promoted only when the interval's lower bound is above `min_gain`: with the default 0,
when it is better and the difference is not within the prompt-to-prompt noise.

Without labels (`judge:` set), both answer the held-out prompts greedily and a pairwise judge compares the answers
(stages/judge_gate.py); `decide_by_judge` promotes when the lower bound of the challenger's win-rate interval is
above `min_win_rate`. Registering, moving the aliases and recording each decision is flows/promotion.py's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from stages.evaluate import Comparison, EvalConfig
from stages.judge_gate import GateJudge, JudgeOutcome
from storage.registry import NAME_PATTERN


class PromoteConfig(BaseModel):
    """The `promote:` section of a run config. A run with it (and every scheduled run, with these defaults
    when it has none) registers its final checkpoint as the `challenger` and applies the gate."""

    model_config = ConfigDict(extra="forbid")
    # The MLflow registered model the run's checkpoints become versions of; None: the run's name.
    model_name: str | None = Field(None, pattern=NAME_PATTERN)
    # The per-prompt statistic compared: accuracy (success rate), reward_mean, or pass@k with k = samples.
    metric: str = "accuracy"
    # Promote when the interval's lower bound on the difference (challenger - champion) is above this:
    # 0 asks for "better, and not within noise"; a positive value asks for a margin as well.
    min_gain: float = 0.0
    level: float = Field(0.95, gt=0.0, lt=1.0)  # the bootstrap interval's coverage, as `rlops eval compare`
    resamples: int = Field(10_000, ge=100)  # bootstrap resamples: ~0.5 s for 100 prompts
    # Samples per held-out prompt for the gate's evaluations (None: the run's eval.samples); more samples
    # measure each prompt's success rate more finely. With samples > 1 a temperature > 0 is needed.
    samples: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)  # None: the run's eval.temperature (greedy by default)
    # A judge instead of labels: served traffic has no ground truth, so both policies answer the held-out prompts
    # greedily and this judge compares the answers pairwise (stages/judge_gate.py); `metric`, `min_gain`, `samples`
    # and `temperature` are then not used. None: the labelled gate above.
    judge: GateJudge | None = None
    # With a judge: promote when the lower bound of the challenger's win-rate interval is above this. 0.5 asks for
    # "the judge prefers the challenger, beyond the prompt-to-prompt noise"; a tie on every prompt is 0.5 exactly.
    min_win_rate: float = Field(0.5, ge=0.0, lt=1.0)


def gate_eval(run_eval: EvalConfig, config: PromoteConfig) -> EvalConfig:
    """The evaluation both champion and challenger get: the run's `eval:` section (split, prompts, reward,
    threshold), with the gate's samples and temperature where set. With neither set it has the run's final
    evaluation's id, so the challenger's evaluation is found done."""
    fields = {k: getattr(run_eval, k) for k in EvalConfig.model_fields}
    if config.samples is not None:
        fields["samples"] = config.samples
    if config.temperature is not None:
        fields["temperature"] = config.temperature
    return EvalConfig(**fields)


def gate_problems(run_eval: EvalConfig, config: PromoteConfig) -> list[str]:
    """What makes the gate unusable with this evaluation, each as `promote.<field>: ...` (before any work)."""
    if config.judge is not None:
        return _judge_problems(config)
    if config.min_win_rate != PromoteConfig.model_fields["min_win_rate"].default:
        return ["promote.min_win_rate: is the judge gate's threshold; set promote.judge, or use promote.min_gain"]
    evaluation = gate_eval(run_eval, config)
    produced = ["accuracy", "reward_mean"] + ([f"pass@{evaluation.samples}"] if evaluation.samples > 1 else [])
    problems = []
    if config.metric not in produced:
        problems.append(f"promote.metric: {config.metric!r} is not a per-prompt metric the gate's evaluation "
                        f"produces (samples={evaluation.samples}): one of {', '.join(produced)}")
    if (config.samples or 1) > 1 and evaluation.temperature == 0:
        problems.append(f"promote.samples: {evaluation.samples} greedy samples are all alike; set "
                        "promote.temperature (or eval.temperature) above 0")
    return problems


def _judge_problems(config: PromoteConfig) -> list[str]:
    """A judge gate's problems: a judge it cannot reach, and the labelled gate's settings, which it would ignore
    (compared by value: a config written back out carries every default)."""
    judge, defaults, problems = config.judge, PromoteConfig.model_fields, []
    if judge.backend == "openai" and not judge.base_url:
        problems.append("promote.judge.base_url: the openai backend needs the judge's endpoint "
                        "(e.g. http://localhost:8000/v1)")
    if (config.samples or 1) > 1:
        problems.append(f"promote.samples: {config.samples} answers per prompt, but a judge gate compares one greedy "
                        "answer per prompt; remove it")
    if (config.temperature or 0.0) > 0.0:
        problems.append("promote.temperature: a judge gate's answers are greedy; remove it")
    for name, instead in (("metric", "the judge's win rate"), ("min_gain", "promote.min_win_rate")):
        if getattr(config, name) != defaults[name].default:
            problems.append(f"promote.{name}: not used by a judge gate, which decides on {instead}; remove it")
    return problems


def rule(config: PromoteConfig) -> str:
    """The decision rule in words, as each promotions row records it."""
    if config.judge is not None:
        how = "judged pairwise in both orders" if config.judge.mode == "pairwise" else "each judged alone, yes or no"
        return (f"promote when the lower bound of the {config.level:.0%} bootstrap interval of the challenger's win "
                f"rate against the champion (greedy answers to the held-out prompts, {how} by {config.judge.model}) "
                f"is above {config.min_win_rate:g}")
    return (f"promote when the lower bound of the {config.level:.0%} paired bootstrap interval of "
            f"{config.metric}(challenger) - {config.metric}(champion) is above {config.min_gain:g}")


def decide(comparison: Comparison, config: PromoteConfig) -> tuple[bool, str]:
    """(promoted, why) for a comparison of the champion (policy a) with the challenger (policy b)."""
    c = comparison
    measured = (f"{c.statistic} {c.accuracy_b:.3f} vs {c.accuracy_a:.3f} on {c.prompts} prompts: difference "
                f"{c.difference:+.3f}, {config.level:.0%} interval [{c.low:+.3f}, {c.high:+.3f}]")
    if c.low > config.min_gain:
        return True, f"{measured}; the lower bound clears min_gain {config.min_gain:g}"
    if c.high < config.min_gain:
        return False, (f"{measured}; worse than the champion by more than the noise (the whole interval is below "
                       f"{config.min_gain:g})")
    return False, (f"{measured}; the lower bound does not clear min_gain {config.min_gain:g} (not better beyond the "
                   "noise)")


def decide_by_judge(measured: JudgeOutcome, config: PromoteConfig) -> tuple[bool, str]:
    """(promoted, why) for a judge's comparison of the challenger with the champion (stages.judge_gate.outcome):
    promoted when the lower bound of the win-rate interval is above `min_win_rate`."""
    m, threshold = measured, config.min_win_rate
    failed = f", {m.errors} without a verdict (their rows' error says why)" if m.errors else ""
    if m.win_rate is None or m.low is None or m.high is None:
        return False, f"the judge gave no verdict on any prompt{failed}: nothing to promote on"
    measured_text = (f"challenger's win rate {m.win_rate:.3f} on {m.prompts} prompts{failed}, "
                     f"{m.level:.0%} interval [{m.low:.3f}, {m.high:.3f}]")
    if m.low > threshold:
        return True, f"{measured_text}; the lower bound clears min_win_rate {threshold:g}"
    if m.high < threshold:
        return False, (f"{measured_text}; the judge prefers the champion beyond the noise (the whole interval is "
                       f"below {threshold:g})")
    return False, (f"{measured_text}; the lower bound does not clear min_win_rate {threshold:g} (not preferred "
                   "beyond the noise)")
