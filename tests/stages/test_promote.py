"""The promotion gate's rule, the metrics it accepts, and the model references it serves by (hand-computed cases;
the gate on real runs: tests/flows/test_promotion.py)."""

from __future__ import annotations

import pytest

from stages.evaluate import Comparison, EvalConfig
from stages.promote import PromoteConfig, decide, decide_by_judge, gate_eval, gate_problems
from storage.registry import ModelRef


def _comparison(champion: float, challenger: float, low: float, high: float) -> Comparison:
    return Comparison("ck-champion", "ck-challenger", "correct@v1", 50, champion, challenger, low, high)


@pytest.mark.parametrize("champion, challenger, low, high, min_gain, promoted, why", [
    (0.50, 0.62, 0.04, 0.20, 0.0, True, "clears min_gain 0"),              # better beyond the noise
    (0.50, 0.56, -0.02, 0.14, 0.0, False, "not better beyond the noise"),  # better, within the noise
    (0.50, 0.50, 0.00, 0.00, 0.0, False, "does not clear"),                # equal: 0 is not above 0
    (0.62, 0.50, -0.20, -0.04, 0.0, False, "worse than the champion"),     # worse beyond the noise
    (0.50, 0.62, 0.04, 0.20, 0.05, False, "does not clear min_gain 0.05"),  # better, but not by the margin asked
    (0.50, 0.70, 0.06, 0.34, 0.05, True, "clears min_gain 0.05"),
])
def test_the_lower_bound_decides(champion, challenger, low, high, min_gain, promoted, why):
    decision, reason = decide(_comparison(champion, challenger, low, high), PromoteConfig(min_gain=min_gain))
    assert decision is promoted and why in reason
    assert f"[{low:+.3f}, {high:+.3f}]" in reason and f"{challenger - champion:+.3f}" in reason


def test_the_gate_evaluates_as_the_run_does_unless_asked_for_samples():
    run = EvalConfig(split="test", n_prompts=40, metric="correct")
    assert gate_eval(run, PromoteConfig()) == run  # the run's final evaluation: found done, not repeated
    sampled = gate_eval(run, PromoteConfig(samples=4, temperature=0.7))
    assert (sampled.samples, sampled.temperature, sampled.n_prompts, sampled.metric) == (4, 0.7, 40, "correct")


@pytest.mark.parametrize("promote, problem", [
    (PromoteConfig(), None),
    (PromoteConfig(metric="reward_mean"), None),
    (PromoteConfig(metric="pass@4", samples=4, temperature=1.0), None),
    (PromoteConfig(metric="pass@4", samples=2, temperature=1.0), "samples=2): one of accuracy, reward_mean, pass@2"),
    (PromoteConfig(metric="pass@1"), "samples=1): one of accuracy, reward_mean"),
    (PromoteConfig(metric="mean_turns"), "is not a per-prompt metric"),
    (PromoteConfig(samples=3), "greedy samples are all alike"),
])
def test_a_gate_metric_must_be_one_the_evaluation_produces(promote, problem):
    found = gate_problems(EvalConfig(), promote)
    assert (found == []) if problem is None else any(problem in p for p in found)


JUDGE = {"model": "judge", "base_url": "http://127.0.0.1:8000/v1"}


@pytest.mark.parametrize("promote, problem", [
    (PromoteConfig(judge=JUDGE), None),
    (PromoteConfig(judge=JUDGE, min_win_rate=0.6, level=0.9), None),
    (PromoteConfig(judge={"model": "/models/judge", "backend": "transformers"}), None),
    (PromoteConfig(judge={"model": "judge"}), "promote.judge.base_url: the openai backend needs"),
    (PromoteConfig(judge=JUDGE, samples=4, temperature=0.7), "compares one greedy answer per prompt"),
    (PromoteConfig(judge=JUDGE, temperature=0.7), "promote.temperature: a judge gate's answers are greedy"),
    (PromoteConfig(judge=JUDGE, metric="reward_mean"), "promote.metric: not used by a judge gate"),
    (PromoteConfig(judge=JUDGE, min_gain=0.1), "decides on promote.min_win_rate"),
    (PromoteConfig(min_win_rate=0.6), "promote.min_win_rate: is the judge gate's threshold"),
])
def test_a_judge_gate_is_checked_before_any_work(promote, problem):
    found = gate_problems(EvalConfig(samples=4, temperature=1.0), promote)  # the run's own eval is not the gate's
    assert (found == []) if problem is None else any(problem in p for p in found)


@pytest.mark.parametrize("win_rate, low, high, promoted, why", [
    (0.70, 0.58, 0.81, True, "clears min_win_rate 0.5"),
    (0.56, 0.47, 0.65, False, "does not clear min_win_rate 0.5"),
    (0.50, 0.50, 0.50, False, "does not clear"),  # a tie everywhere (or a judge that always picks the first shown)
    (0.30, 0.21, 0.40, False, "prefers the champion beyond the noise"),
    (None, None, None, False, "the judge gave no verdict on any prompt, 12 without a verdict"),
])
def test_the_win_rates_lower_bound_decides(win_rate, low, high, promoted, why):
    from stages.judge_gate import JudgeOutcome

    measured = JudgeOutcome(win_rate, low, high, prompts=0 if win_rate is None else 12,
                            errors=12 if win_rate is None else 0, judge_version="v", level=0.95)
    decision, reason = decide_by_judge(measured, PromoteConfig(judge=JUDGE))
    assert decision is promoted and why in reason


@pytest.mark.parametrize("text, ref", [
    ("nightly@champion", ModelRef("nightly", alias="champion")),
    ("models:/nightly@champion", ModelRef("nightly", alias="champion")),
    ("models:/nightly/3", ModelRef("nightly", version="3")),
    ("nightly@latest", None),  # a run's newest checkpoint, not the registry
    ("ck-0123456789abcdef", None),
    ("base", None),
])
def test_model_references(text, ref):
    assert ModelRef.parse(text) == ref


def test_a_malformed_model_uri_is_refused():
    with pytest.raises(KeyError, match="models:/NAME@ALIAS or models:/NAME/VERSION"):
        ModelRef.parse("models:/nightly")
