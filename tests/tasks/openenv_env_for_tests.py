"""An OpenEnv app for the fault tests: a text game (one string field) that misbehaves on request.

reset(seed, fault=...) picks the fault, which strikes on the second step of the episode with seed 1:
  "kill": the server process dies (SIGKILL to itself: every session in flight is lost);
  "slow": the step sleeps 8 s (over any test's step_timeout_s);
  "bad":  the observation's `text` is a number (it does not validate against the schema).
Every other step answers "echo: <message>" with reward 0.5; the third step ends the episode.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    message: str


class EchoObservation(Observation):
    text: str


class FaultyEnvironment(Environment[SayAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.seed, self.fault = State(step_count=0), 0, None

    def reset(self, seed: int | None = None, episode_id: str | None = None, fault: str | None = None,
              **kwargs: Any) -> EchoObservation:
        self._state, self.seed, self.fault = State(step_count=0), seed, fault
        return EchoObservation(text=f"say something (seed {seed})")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        if self.seed == 1 and self._state.step_count == 2:
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "slow":
                time.sleep(8)
            if self.fault == "bad":
                return EchoObservation.model_construct(text=12345, done=False, reward=0.0, metadata={})
        return EchoObservation(text=f"echo: {action.message[:40]}", reward=0.5, done=self._state.step_count >= 3)

    @property
    def state(self) -> State:
        return self._state


app = create_app(FaultyEnvironment, SayAction, EchoObservation, env_name="faulty", max_concurrent_envs=8)
small = create_app(FaultyEnvironment, SayAction, EchoObservation, env_name="faulty", max_concurrent_envs=2)
