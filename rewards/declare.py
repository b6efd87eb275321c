"""What a reward declares about itself: the decorators, their `RewardInfo`, and `NOT_APPLICABLE`.

The bottom of the rewards package (it imports nothing of rlops), so that the adapters of peers' reward
functions (rewards/peers.py) and the built-ins declare rewards without importing `rewards.base`, which loads
specs through them. `rewards.base` re-exports everything here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any, Literal, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RewardInfo:
    """What the decorator declares about a reward function."""

    kind: Literal["rollout", "group"]
    low: float
    high: float
    uses: tuple[Any, ...] = ()  # what the version covers beyond what the source's names reach (see `reward`)
    unversioned: tuple[str, ...] = ()  # operational params (timeouts, cache dirs) that cannot change values
    tokens: bool = False  # reads token_ids/loss_mask/behavior_logprobs (the score stage loads them only then)
    files: tuple[str, ...] = ()  # data files whose content is part of the version
    # Params naming a local file or folder (a judge's weights) whose content, not the name, is part of the version.
    content: tuple[str, ...] = ()
    # Values exist for some rollouts only (people's labels: rewards/human.py): one without is null with the reason,
    # and the score stage does not count it against `max_error_fraction`.
    partial: bool = False
    # (task name, task params, the reward's params) -> problems: what a config check can know about the reward
    # and its task before any rollout exists (rewards.reasoning_gym: a verifier of another dataset). Not part of
    # the version: it never changes a value.
    task_check: Callable[[str, dict[str, Any], dict[str, Any]], list[str]] | None = None
    # (the reward's params) -> more objects its version covers, like `uses`, chosen by the params: code the reward
    # runs that no name in its source reaches (a verifiers environment's rubric function, rewards/verifiers.py).
    reaches: Callable[[dict[str, Any]], Sequence[Any]] | None = None


def _declare(
    kind: Literal["rollout", "group"], low: float, high: float, uses: Sequence[Any], unversioned: Sequence[str],
    tokens: bool = False, files: Sequence[str | PathLike[str]] = (), partial: bool = False,
    task_check: Callable[[str, dict[str, Any], dict[str, Any]], list[str]] | None = None, content: Sequence[str] = (),
    reaches: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
) -> Callable[[F], F]:
    if not low <= high:
        raise ValueError(f"reward range is empty: low={low} > high={high}")

    def mark(fn: F) -> F:
        # The function itself is returned (not a wrapper), so it stays a plain, callable, testable function.
        fn.__reward__ = RewardInfo(  # type: ignore[attr-defined]
            kind, float(low), float(high), tuple(uses), tuple(unversioned), tokens, tuple(str(f) for f in files),
            partial=partial, task_check=task_check, content=tuple(content), reaches=reaches,
        )
        return fn

    return mark


def reward(
    low: float, high: float, *, uses: Sequence[Any] = (), unversioned: Sequence[str] = (), tokens: bool = False,
    files: Sequence[str | PathLike[str]] = (), partial: bool = False,
    task_check: Callable[[str, dict[str, Any], dict[str, Any]], list[str]] | None = None,
    reaches: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
) -> Callable[[F], F]:
    """Declare `fn(rollout, **params) -> float | (float, dict)` a reward with values in [low, high].

    The version covers what the function's source reaches by name, found automatically. `uses`: what it
    depends on that names do not show (code reached through a parameter's methods): functions and
    classes are walked like helpers, strings and other values hashed as they are. `files`: data files
    (or folders) the reward reads, whose content is part of the version; a relative path is taken from
    the folder of the reward's file, so read it as `Path(__file__).parent / name`. `unversioned`: param
    names that do not affect values (timeouts, cache dirs) and so stay out of the version. `tokens`: the
    reward reads the token lists (token_ids, loss_mask, behavior_logprobs); rescoring loads them only for
    such rewards, since turning ~300 token ids per rollout into Python objects would dominate its cost.
    `partial`: the reward has values for some rollouts only (people's labels); raising on the others makes them
    null with the reason, which the score stage does not count as failures. `task_check(task_name, task_params,
    params) -> [problem, ...]`: a mismatch between the reward's params and the run's task that config validation
    reports before any compute (`task_problems`). `reaches(params) -> [object, ...]`: what the version covers
    besides, chosen by the params (code the reward loads by name, walked like `uses`).
    """
    return _declare("rollout", low, high, uses, unversioned, tokens, files, partial, task_check, reaches=reaches)


def group_reward(
    low: float, high: float, *, uses: Sequence[Any] = (), unversioned: Sequence[str] = (), tokens: bool = False,
    files: Sequence[str | PathLike[str]] = (), content: Sequence[str] = (),
    task_check: Callable[[str, dict[str, Any], dict[str, Any]], list[str]] | None = None,
    reaches: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
) -> Callable[[F], F]:
    """Declare `fn(group: list[Rollout], **params) -> list[float | (float, dict)]` a group reward (a ranker).

    It gets all rollouts of one `group_id` and returns one value per rollout, in the same order.
    The keywords are those of `reward`, and `content`: param names whose value, where it names a local file or
    folder (a judge's weights; `$RLOPS_CACHE/...` expanded), is versioned by that content instead of its text;
    and `reaches` as for `reward`.
    """
    return _declare("group", low, high, uses, unversioned, tokens, files, task_check=task_check, content=content,
                    reaches=reaches)


class NotApplicable:
    """What a reward returns for a rollout it does not apply to (TRL's `None`): stored as a null value with no
    error, not counted as a failure, and left out of the weighted total (`weighted_total`)."""

    def __repr__(self) -> str:
        return "NOT_APPLICABLE"


NOT_APPLICABLE = NotApplicable()
