"""An OpenEnv environment whose actions are MCP tools: look a key up, then answer with its value.

openenv-core's `MCPEnvironment` (RFC 003) serves FastMCP tools through the ordinary step API:
`ListToolsAction` lists them, `CallToolAction(tool_name, arguments)` calls one. rlops offers the
model exactly these tools (not a single `act` tool), calls them through the session's `call_tool`
steps, and stores each call's reward and `done` like any step's.

The store is drawn from the reset seed: five keys (animal names) with two-digit values, and the
question asks for one key's value. Two tools:

- `lookup(key)`: the value stored under `key` (or "no such key"); reward 0;
- `answer(value)`: (a whole number, 10..99) ends the episode; reward 1 when `value` is the asked key's value, else 0.

Serve it with `uvicorn examples.environments.lookup_env:app --host 127.0.0.1 --port 8766`, or let
rlops start it (`task: {name: openenv, params: {app: "examples.environments.lookup_env:app"}}`).
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

Key = Literal["otter", "heron", "lynx", "moose", "viper", "bison", "crane", "gecko", "koala", "lemur"]
KEYS = Key.__args__
STORE_SIZE = 5


class QuestionObservation(Observation):
    """What a reset shows: the question (later observations are the tools' results)."""

    question: str = Field(description="the key to find, and the keys there are")


class LookupEnvironment(MCPEnvironment):
    """One episode: a seeded store of five keys and a question about one of them (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("lookup")

        @mcp.tool()
        def lookup(key: Key) -> str:
            """The value stored under a key."""
            return str(self.store[key]) if key in self.store else f"no such key: {key!r}"

        @mcp.tool()
        def answer(value: Annotated[int, Field(ge=10, le=99)]) -> str:
            """Answer the question with the value you found. This ends the episode."""
            self.finished = True
            self.correct = value == self.store[self.asked]
            return "correct" if self.correct else "wrong"

        super().__init__(mcp)
        self.store: dict[str, int] = {}
        self.asked, self.finished, self.correct = "", False, False
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self.store = {k: rng.randrange(10, 100) for k in rng.sample(KEYS, STORE_SIZE)}
        self.asked = rng.choice(sorted(self.store))
        self.finished = self.correct = False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return QuestionObservation(done=False, reward=0.0, question=(
            f"Which number is stored under the key '{self.asked}'? The keys are {', '.join(sorted(self.store))}. "
            "Look it up with the lookup tool, then answer."))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(observation, CallToolObservation):
            observation.done = self.finished
            observation.reward = 1.0 if self.correct else 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "act through the lookup and answer tools"})

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="lookup", description=__doc__.splitlines()[0], version="1")


app = create_app(LookupEnvironment, CallToolAction, CallToolObservation, env_name="lookup", max_concurrent_envs=64)
