"""Environments written for `verifiers` as their authors would (nothing of rlops in them), loaded by file:
`load_environment(kind=...)` builds a ToolEnv with two tools (`tools`) or a custom MultiTurnEnv guessing
game (`guess`); the game's `fault` makes its env_response raise, hang (a blocking sleep) or answer with
something that is not a message."""

import time

import verifiers as vf
from datasets import Dataset

SYSTEM = "You answer questions with the tools."
QUESTION = "When was Vexhollow Dynamics founded?"
TOOL_RESULT = "d12: Vexhollow Dynamics was founded in 1987."


def search(query: str) -> str:
    """Search the knowledge base.

    Args:
        query: what to look for
    """
    return TOOL_RESULT if "vexhollow" in query.lower() else "no results"


def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def answered(parser, completion, answer, question) -> float:
    """1 when the final reply holds the answer (`question`: a dataset column, passed by its name)."""
    assert question == QUESTION
    return 1.0 if answer in (parser.parse_answer(completion) or "") else 0.0


def solved(state) -> float:
    """1 when the game was won: read from the state the game kept."""
    return 1.0 if state.get("solved") else 0.0


def fewest_guesses(states) -> list[float]:
    """A group function: 1 for the rollouts of the group that used the fewest guesses."""
    used = [len(s["guesses"]) for s in states]
    return [1.0 if u == min(used) else 0.0 for u in used]


class GuessEnv(vf.MultiTurnEnv):
    """Guess the secret number (in the row's info); the game says higher or lower."""

    def __init__(self, fault=None, **kwargs):
        super().__init__(**kwargs)
        self.fault = fault

    async def setup_state(self, state):
        state["secret"] = int(state["info"]["secret"])
        state["guesses"] = []
        state["solved"] = False
        return state

    async def env_response(self, messages, state, **kwargs):
        if self.fault == "raise":
            raise RuntimeError("the game server is down")
        if self.fault == "hang":
            time.sleep(30)  # blocks its event loop: only a thread of its own can be given up on
        if self.fault == "malformed":
            return 42
        reply = messages[-1].content or ""
        digits = "".join(c for c in reply if c.isdigit())
        guess = int(digits[:3]) if digits else -1
        state["guesses"].append(guess)
        if guess == state["secret"]:
            state["solved"] = True
            state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
            return state["final_env_response"]
        hint = "higher" if guess < state["secret"] else "lower"
        return [{"role": "user", "content": f"{guess} is wrong: go {hint}."}]


def load_environment(kind: str = "guess", fault: str | None = None, max_turns: int = 3) -> vf.Environment:
    if kind == "tools":
        rows = [{"question": QUESTION, "answer": "1987"}] * 2
        parser = vf.Parser()
        return vf.ToolEnv(tools=[search, add], max_turns=max_turns, dataset=Dataset.from_list(rows),
                          system_prompt=SYSTEM, parser=parser,
                          rubric=vf.Rubric(funcs=[answered], weights=[1.0], parser=parser))
    rows = [{"question": "Guess my number between 1 and 9.", "answer": str(s), "info": {"secret": s}} for s in (3, 7)]
    rubric = vf.Rubric(funcs=[solved, fewest_guesses], weights=[1.0, 0.5])
    return GuessEnv(fault=fault, max_turns=max_turns, dataset=Dataset.from_list(rows),
                    eval_dataset=Dataset.from_list(rows[:1]), system_prompt="Reply with one number.", rubric=rubric)
