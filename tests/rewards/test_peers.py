"""Rewards as the peers write them: TRL's own functions from the installed TRL, a TRL factory, verl's
compute_score, OpenRLHF's reward_func; "not applicable" and the weighted total; bad results as error rows;
wrong signatures as config errors; versions that follow the function; math-verify and format rewards."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rewards.base import NOT_APPLICABLE, Outcome, RewardSpec, compute, reward_version, weighted_total
from storage.schema import Message, Rollout
from tests.rewards.conftest import build_rollout


def episode(reply: str, group: str = "g0", sample: int = 0, *, text: bool = False, **metadata) -> Rollout:
    """One finished single-turn episode (user question, then `reply`) with `metadata` as its dataset columns."""
    base = build_rollout([Message("assistant", reply)], metadata={**metadata, "prompt_format": "text" if text else "messages"},
                         group_id=group, sample_idx=sample, loss_mask=[0, 0, 1, 1, 1])
    return dataclasses.replace(base, messages=[Message("user", "What is 1 + 2?"), Message("assistant", reply)])


def no_kwargs(completions: list) -> list[float]:
    """A TRL-style reward that takes nothing but its completions."""
    return [1.0] * len(completions)


def values(spec: RewardSpec, rollouts: list[Rollout]) -> list[tuple]:
    return [(o.value, o.error) for o in compute(spec, rollouts)]


def test_trl_rewards_from_the_installed_trl_score_unchanged_and_none_is_not_applicable():
    group = [episode("<think>add</think> \\boxed{3}", solution="3"), episode("3", sample=1, solution="3"),
             episode("\\boxed{4}", sample=2, solution="3"), episode("\\boxed{3}", sample=3, solution="\\frac{")]
    accuracy = compute(RewardSpec(fn="trl.rewards.accuracy_reward", style="trl"), group)
    # TRL's accuracy_reward reads \boxed{} (or anchored LaTeX); a gold answer it cannot parse is None
    assert [(o.value, o.error, o.applicable) for o in accuracy] == [
        (1.0, None, True), (0.0, None, True), (0.0, None, True), (None, None, False)]
    assert accuracy[0].details["gold_parsed"] == "[3, '3']"  # what it logged with log_extra lands in details
    think = values(RewardSpec(fn="trl.rewards.think_format_reward", style="trl"), group)
    assert think == [(1.0, None), (0.0, None), (0.0, None), (0.0, None)]


def test_a_trl_factory_is_called_with_the_params_and_its_reward_reads_the_sampled_tokens():
    spec = RewardSpec(fn="trl.rewards.get_soft_overlong_punishment", style="trl",
                      params={"max_completion_len": 4, "soft_punish_cache": 2})
    # 3 sampled tokens (loss_mask 1) of 5: inside the 2-token buffer before 4 -> (4 - 2 - 3) / 2
    assert values(spec, [episode("x")]) == [(-0.5, None)]
    from rewards.base import info, load_reward

    assert info(load_reward(spec)).tokens  # so rescoring loads the token lists for it
    assert not info(load_reward(RewardSpec(fn="trl.rewards.think_format_reward", style="trl"))).tokens


def test_a_trl_function_gets_the_dataset_columns_as_keyword_lists_and_text_completions_for_text_prompts(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def seen(prompts, completions, level, **kwargs):\n"
        "    assert kwargs['trainer_state'] is None and 'prompt_format' not in kwargs\n"
        "    return [float(len(c) + 10 * l) if isinstance(c, str) else -1.0 for c, l in zip(completions, level)]\n")
    spec = RewardSpec(fn=f"{tmp_path}/mine.py:seen", style="trl")
    assert values(spec, [episode("abc", text=True, level=1), episode("de", sample=1, text=True, level=2)]) == [
        (13.0, None), (22.0, None)]
    assert values(spec, [episode("abc", level=1)]) == [(-1.0, None)]  # conversational: a list of messages


def test_verl_compute_score_takes_the_ground_truth_and_keeps_a_dicts_other_keys(tmp_path):
    (tmp_path / "verl_score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    ok = solution_str.strip() == ground_truth\n"
        "    return {'score': float(ok) + bonus, 'acc': ok, 'source': data_source, 'index': extra_info['index']}\n")
    spec = RewardSpec(fn=f"{tmp_path}/verl_score.py:compute_score", style="verl", params={"bonus": 0.5})
    meta = {"data_source": "gsm8k", "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 7}}
    right, wrong = compute(spec, [episode(" 3 ", **meta), episode("4", sample=1, **meta)])
    assert (right.value, wrong.value) == (1.5, 0.5)
    assert right.details == {"acc": True, "source": "gsm8k", "index": 7}


def test_openrlhf_reward_func_gets_queries_prompts_and_labels(tmp_path):
    (tmp_path / "orm.py").write_text(
        "import torch\n"
        "def reward_func(queries, prompts, labels):\n"
        "    return {'rewards': torch.tensor([float(q.endswith(l)) for q, l in zip(queries, labels)]),\n"
        "            'scores': torch.zeros(len(queries))}\n")
    spec = RewardSpec(fn=f"{tmp_path}/orm.py:reward_func", style="openrlhf")
    assert values(spec, [episode("3", answer="3"), episode("4", sample=1, answer="3")]) == [(1.0, None), (0.0, None)]


@pytest.mark.parametrize("body,expected", [
    ("return [1.0]", "ValueError: returned 1 values for 2 completions"),
    ("return [float('nan'), 1.0]", "value is not finite: nan"),
    ("return ['high', 1.0]", "expected a number, got str"),
    ("raise RuntimeError('boom')", "RuntimeError: boom"),
])
def test_bad_results_of_a_peer_reward_are_error_rows_and_the_others_still_score(tmp_path, body, expected):
    (tmp_path / "bad.py").write_text(f"def bad(completions, **kwargs):\n    {body}\n")
    group = [episode("a"), episode("b", sample=1)]
    outcomes = compute(RewardSpec(fn=f"{tmp_path}/bad.py:bad", style="trl"), group)
    assert expected in (outcomes[0].error or "")
    assert outcomes[0].value is None and outcomes[0].applicable
    assert values(RewardSpec(fn="trl.rewards.think_format_reward", style="trl"), group) == [(0.0, None)] * 2


def test_the_weighted_total_leaves_out_what_does_not_apply_as_trls_nansum_does():
    a, b = RewardSpec(name="a", fn="x.y", weight=1.0), RewardSpec(name="b", fn="x.z", weight=0.5)
    na, failed = Outcome(None, {"not_applicable": True}), Outcome(None, None, "KeyError: 'solution'")
    totals = weighted_total([a, b], [[Outcome(1.0), na, na, Outcome(1.0)], [Outcome(2.0), Outcome(2.0), na, failed]])
    assert [(t.value, t.error) for t in totals] == [
        (2.0, None), (1.0, None), (None, None), (None, "component(s) without a value: b")]
    assert not totals[2].applicable and totals[3].applicable
    assert repr(NOT_APPLICABLE) == "NOT_APPLICABLE"


@pytest.mark.parametrize("spec,expected", [
    (RewardSpec(fn="trl.rewards.accuracy_reward"), "set `style: trl` (its signature is trl's)"),
    (RewardSpec(fn="trl.rewards.accuracy_reward", style="verl"), "has trl's signature"),
    (RewardSpec(fn="rewards.builtin.numeric_match", style="trl"), "is an rlops reward"),
    (RewardSpec(fn="trl.rewards.get_soft_overlong_punishment", style="trl", params={"max_len": 1}), "failed: TypeError"),
    (RewardSpec(fn="tests.rewards.test_peers.no_kwargs", style="trl", params={"strict": True}), "takes no parameter strict"),
    (RewardSpec(fn="math.hypot", style="openrlhf"), "not an OpenRLHF reward_func"),
    (RewardSpec(fn="trl.rewards.no_such_reward", style="trl"), "cannot load reward"),
])
def test_a_reward_of_the_wrong_signature_or_style_is_refused_before_any_rollout(spec, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        reward_version(spec)


def test_a_peer_rewards_version_follows_its_function_its_params_and_its_library(tmp_path):
    trl_acc = reward_version(RewardSpec(fn="trl.rewards.accuracy_reward", style="trl"))
    assert trl_acc != reward_version(RewardSpec(fn="trl.rewards.think_format_reward", style="trl"))  # one library
    overlong = RewardSpec(fn="trl.rewards.get_soft_overlong_punishment", style="trl",
                          params={"max_completion_len": 4, "soft_punish_cache": 2})
    assert reward_version(overlong) != reward_version(overlong.model_copy(update={"params": {
        "max_completion_len": 8, "soft_punish_cache": 2}}))
    from rewards.reach import reach
    from rewards.base import load_reward

    assert reach(load_reward(RewardSpec(fn="trl.rewards.accuracy_reward", style="trl"))).libraries["trl"] == "1.16.0"
    path = tmp_path / "mine.py"
    path.write_text("LIMIT = 3\ndef short(completions, **kw):\n    return [float(len(c[0]['content']) < LIMIT) for c in completions]\n")
    spec = RewardSpec(fn=f"{path}:short", style="trl")
    before = reward_version(spec)
    assert reward_version(spec) == before
    path.write_text(path.read_text().replace("LIMIT = 3", "LIMIT = 4"))
    assert reward_version(spec) != before


@pytest.mark.parametrize("reply,gold,expected", [
    ("so \\boxed{\\frac{1}{3}}", "1/3", 1.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("#### 72", "72", 1.0),
    ("\\boxed{2^{3}}", "8", 1.0),  # expressions are evaluated
    ("#### 71", "72", 0.0),
    ("no idea", "72", 0.0),
])
def test_math_equivalence_through_math_verify(reply, gold, expected):
    assert values(RewardSpec(fn="rewards.math.equivalent"), [episode(reply, answer=gold)]) == [(expected, None)]


def test_math_equivalence_of_an_unparsable_gold_answer_does_not_apply_and_a_missing_one_is_an_error():
    [na] = compute(RewardSpec(fn="rewards.math.equivalent"), [episode("3", answer="\\frac{")])
    assert (na.value, na.error, na.applicable) == (None, None, False)
    [missing] = compute(RewardSpec(fn="rewards.math.equivalent", params={"key": "solution"}), [episode("3")])
    assert "KeyError" in missing.error and "no 'solution'" in missing.error


@pytest.mark.parametrize("reply,answer_tags,expected", [
    ("<think>add them</think> 3", False, 1.0),
    ("<think>add</think><answer>3</answer>", True, 1.0),
    ("<think>add</think> 3", True, 0.0),
    ("3", False, 0.0),
    ("<think>add</think>", False, 0.0),
    ("<think>a</think> 3 <think>b</think> 4", False, 0.0),
    ("<think>unclosed 3", False, 0.0),
])
def test_the_r1_think_format(reply, answer_tags, expected):
    spec = RewardSpec(fn="rewards.format.think_format", params={"answer_tags": answer_tags})
    assert values(spec, [episode(reply)])[0][0] == expected


def test_a_regex_format_reward_and_its_bad_flags():
    spec = RewardSpec(fn="rewards.format.matches", params={"pattern": r"\\boxed\{\d+\}"})
    assert [v for v, _ in values(spec, [episode("\\boxed{3}"), episode(" \\boxed{3}", sample=1)])] == [1.0, 0.0]
    search = RewardSpec(fn="rewards.format.matches", params={"pattern": r"#### \d+", "mode": "search"})
    assert values(search, [episode("so #### 3")]) == [(1.0, None)]
    [bad] = compute(RewardSpec(fn="rewards.format.matches", params={"pattern": "x", "flags": "q"}), [episode("x")])
    assert "unknown regex flags 'q'" in bad.error
    assert math.isclose(1.0, values(spec, [episode("\\boxed{12}")])[0][0])
