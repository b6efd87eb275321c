"""An OpenEnv environment a 135M model can learn in a few CPU minutes: press the button of the lamp's colour.

Each turn a lamp lights up in one of four colours and the player presses a button (a typed
`ButtonAction(button: "red" | "green" | "blue" | "yellow")`). A right press earns REWARD_PER_LAMP
and lights the next lamp; a wrong press ends the game (reward 0 for that step). The lamps are drawn
from the reset seed, so a seed is a reproducible episode and the train and held-out seed ranges are
different sequences. The skill per step is simple (read the colour in this turn's observation, not
the first colour of the button list, not the last lamp's colour), but it must hold over several
turns in a growing conversation, with per-step rewards: the multi-turn case GRPO should visibly
improve on a small model (guess_env's halving search is beyond it in a few steps).

Serve it with openenv-core's own app (any OpenEnv client can drive it):

    uvicorn examples.environments.lamp_env:app --host 127.0.0.1 --port 8765

or let rlops start it (configs/openenv_learn.yaml).
"""

from __future__ import annotations

import random
from typing import Any, Literal
from uuid import uuid4

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

COLOURS = ("red", "green", "blue", "yellow")
LAMPS = 8  # lamps per game: more than a task's usual max_turns, so a flawless episode ends by the turn limit
REWARD_PER_LAMP = 0.25  # four right presses make 1.0


class ButtonAction(Action):
    """One press."""

    button: Literal["red", "green", "blue", "yellow"] = Field(description="the colour of the button to press")


class LampObservation(Observation):
    """What the player sees after a reset or a press."""

    message: str = Field(description="the game's reply")


def _lit(n: int, colour: str) -> str:
    return (f"Lamp {n} lights up {colour.upper()}. Buttons: {', '.join(COLOURS)}. "
            "Press the button of the lamp's colour.")


class LampEnvironment(Environment[ButtonAction, LampObservation, State]):
    """Colour matching over several turns; one instance per WebSocket session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: every session has its own lamps

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.lamps: list[str] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> LampObservation:
        rng = random.Random(seed)
        self.lamps = [rng.choice(COLOURS) for _ in range(LAMPS)]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return LampObservation(message=_lit(1, self.lamps[0]))

    def step(self, action: ButtonAction, timeout_s: float | None = None, **kwargs: Any) -> LampObservation:
        self._state.step_count += 1
        n = self._state.step_count
        lamp = self.lamps[n - 1]
        if action.button != lamp:
            return LampObservation(message=f"Wrong: lamp {n} was {lamp.upper()}. Game over.", done=True, reward=0.0)
        if n >= LAMPS:
            return LampObservation(message="Right. That was the last lamp: you win.", done=True, reward=REWARD_PER_LAMP)
        return LampObservation(message=f"Right. {_lit(n + 1, self.lamps[n])}", reward=REWARD_PER_LAMP)

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="lamp", description=f"press the button of each lamp's colour, {LAMPS} lamps",
                                   version="1")


app = create_app(LampEnvironment, ButtonAction, LampObservation, env_name="lamp", max_concurrent_envs=64)
