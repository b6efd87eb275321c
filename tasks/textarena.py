"""TextArena games as tasks: single-player text games, the model's plain text as each move.

    task:
      name: textarena
      params:
        env_id: GuessTheNumber-v0   # any single-player game of `textarena.make`
        max_turns: 10
        train_seeds: [0, 1000]
        eval_seeds: [1000000, 1000064]

Each episode is a game of its own (`ta.make(env_id)`, `reset(num_players=1, seed=...)`), played in
this process by tasks/environment.py's driver: the game's first observation is the prompt, each
assistant reply is the move (`step(text)`), and what the game says next is the user turn (TextArena
repeats the whole game log in every observation; the model is shown only what is new). The game's
own reward (`close()` when it is done, player 0's) is the last step's reward; earlier steps have none,
so the `env` reward's sum and last agree. A game that runs past max_turns ends unscored (0).

Decided where the issue left it open: two-player games are refused before compute (a game that does
not take `num_players=1`). Playing one needs an opponent policy (a scripted one per game, or a second
served checkpoint); that is a config section of its own, left for later. TextArena's word games
download NLTK data when they are first made: they are not used by the tests.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version as package_version
from typing import Any

from tasks.base import Task
from tasks.environment import EVAL_SEEDS, TRAIN_SEEDS, DriverConfig, StepOutcome, check_seeds, env_task

SYSTEM_PROMPT = "You are playing a text game. Each turn, reply with your move in the format the game asks for."


def make_task(env_id: str, max_turns: int = 10, train_seeds: list[int] = list(TRAIN_SEEDS),
              eval_seeds: list[int] = list(EVAL_SEEDS), step_timeout_s: float = 30.0,
              system_prompt: str = SYSTEM_PROMPT, max_error_frac: float = 0.25) -> Task:
    """A single-player TextArena game as a task (module docstring); an unknown or two-player `env_id`
    is a ValueError naming it."""
    if max_turns < 1 or step_timeout_s <= 0:
        raise ValueError("task.params: max_turns must be >= 1 and step_timeout_s > 0")
    train, held_out = check_seeds(train_seeds, eval_seeds)
    _single_player(env_id)
    config = DriverConfig(name=f"textarena {env_id}", system_prompt=system_prompt, max_turns=max_turns,
                          action_schema={"type": "object", "properties": {"move": {"type": "string"}}}, action="text",
                          step_timeout_s=step_timeout_s)
    identity = {"source": "textarena", "textarena": package_version("textarena"), "env_id": env_id,
                "config": {"max_turns": max_turns, "reward": "last"}}

    async def open_session() -> GameSession:
        return GameSession(env_id)

    return env_task(name="textarena", identity=identity, config=config, train_seeds=train, eval_seeds=held_out,
                    open_session=open_session, max_error_frac=max_error_frac,
                    episode_timeout=step_timeout_s * (2 * max_turns + 2) + 60.0)


def _single_player(env_id: str) -> None:
    import textarena as ta

    try:
        env = ta.make(env_id)
    except Exception as e:  # noqa: BLE001 - an unknown id (ValueError) or a game that cannot load here
        raise ValueError(f"task.params.env_id: cannot make {env_id!r}: {type(e).__name__}: {e} "
                         f"(TextArena {package_version('textarena')})") from e
    try:
        env.reset(num_players=1, seed=0)
    except Exception as e:  # noqa: BLE001 - each game refuses a wrong player count in its own words
        raise ValueError(f"task.params.env_id: {env_id} is not a single-player game ({type(e).__name__}: {e}); "
                         "two-player games need an opponent, which rlops does not provide yet") from e


class GameSession:
    """One game in this process; its calls run in a thread, so step_timeout_s bounds them too."""

    def __init__(self, env_id: str) -> None:
        import textarena as ta

        self.env = ta.make(env_id)
        self.shown = ""  # the game log the model has seen

    async def reset(self, seed: int) -> StepOutcome:
        await asyncio.to_thread(self.env.reset, num_players=1, seed=seed)
        return StepOutcome(self._news())

    async def step(self, action: dict[str, Any]) -> StepOutcome:
        done, _ = await asyncio.to_thread(self.env.step, action["move"])
        news = self._news()
        if not done:
            return StepOutcome(news)
        rewards, _ = self.env.close()
        return StepOutcome(news, float((rewards or {}).get(0, 0.0)), True)

    async def close(self) -> None:
        pass

    def _news(self) -> str:
        """The part of the game log the model has not seen yet (all of it when the game rewrote it)."""
        _, observation = self.env.get_observation()
        text = observation if isinstance(observation, str) else str(observation)
        news = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return news.strip() or text.strip()
