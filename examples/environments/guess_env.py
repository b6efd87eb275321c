"""An OpenEnv environment of our own: guess a secret number in a few tries (multi-turn, typed Action).

The secret is drawn from the reset seed (1..HIGH), so a seed is a reproducible episode and the
train and held-out seed ranges are different secrets. Each step takes a typed `GuessAction(guess: int)`
and says "higher" or "lower"; the episode ends on the right guess (reward 1, minus a small cost per
extra guess, so fewer guesses are better) or after MAX_GUESSES (reward 0). A 135M model can learn
something here in a few GRPO steps: stay in range, read "higher"/"lower", and not repeat a guess.

Serve it with openenv-core's own app (any OpenEnv client can drive it):

    uvicorn examples.environments.guess_env:app --host 127.0.0.1 --port 8765

or let rlops start it (`task: {name: openenv, params: {app: "examples.environments.guess_env:app"}}`,
configs/openenv.yaml).
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

HIGH = 16  # secrets are 1..HIGH: four guesses suffice with halving
MAX_GUESSES = 6  # the environment's own limit; the task's max_turns may be lower
GUESS_COST = 0.1  # each guess after the first costs this much of the final reward


class GuessAction(Action):
    """One guess."""

    guess: int = Field(ge=1, le=HIGH, description=f"your guess, a whole number from 1 to {HIGH}")


class GuessObservation(Observation):
    """What the player sees after a reset or a guess."""

    message: str = Field(description="the game's reply")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Number guessing; one instance per WebSocket session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: every session has its own secret

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, HIGH)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(message=f"I picked a whole number from 1 to {HIGH}. Guess it: you have "
                                        f"{MAX_GUESSES} tries, and after each I say higher or lower.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        n = self._state.step_count
        if action.guess == self.secret:
            return GuessObservation(message=f"{action.guess} is right!", done=True,
                                    reward=round(1.0 - GUESS_COST * (n - 1), 6))
        if n >= MAX_GUESSES:
            return GuessObservation(message=f"{action.guess} is wrong, and that was the last try: it was {self.secret}.",
                                    done=True, reward=0.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(message=f"{action.guess} is wrong: the number is {hint}.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="guess", description=f"guess a number from 1 to {HIGH} in {MAX_GUESSES} tries",
                                   version="1")


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
