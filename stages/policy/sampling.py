"""What every generation backend shares: how a turn is sampled, what a sample holds, the backend contract.

One small interface, `Backend.generate(prompt_token_ids, sampling, seed) -> list[Sample]`, with two
implementations: `HFBackend` (stages/policy/hf.py: transformers, batched, the CPU default) and
`VLLMBackend` (stages/policy/vllm.py: GPU, LoRA adapters hot-loaded per policy id).

The behavior log-prob of a sampled token is log_softmax(logits / temperature) at that token: the
same definition the GRPO stage uses when it recomputes log-probs. top_p truncation changes which
tokens can be drawn but is NOT part of the definition (greedy decoding, temperature 0, records the
log-probs at temperature 1).

Per row, a generate call can also be asked for more (`RowOptions`): the k most likely tokens at each
step (`top_logprobs`, OpenAI's shape is built by the service) and a grammar the turn must follow
(`Constraint`, masked decoding by llguidance: stages/policy/constrain.py). Under a constraint the
behaviour log-prob is log_softmax of the masked logits / T, i.e. the renormalised distribution the
token was really drawn from (the definition above, applied to the masked logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingConfig:
    """How one assistant turn is sampled (stored as JSON in `rollouts.sampling`)."""

    # The policy's own distribution: the behavior log-probs and the GRPO ratio then describe what
    # was actually sampled; other values are allowed (the log-probs follow the temperature).
    temperature: float = 1.0
    # No nucleus truncation: with top_p < 1 the sampler draws from a truncated distribution that
    # the recorded log-probs (untruncated, see module docstring) do not describe exactly.
    top_p: float = 1.0
    # Per assistant turn: room for a tool call or a short answer from a small model, and a bound
    # on what one rambling turn costs. The whole episode is bounded by `max_total_tokens`.
    max_new_tokens: int = 256
    # The model's EOS ends a turn; stop strings are opt-in (e.g. "</tool_call>" to cut a turn
    # right after a call). The stop string stays in the text and the tokens.
    stop: tuple[str, ...] = ()
    # Base seed of a rollout batch; each generate call's seed derives from it, so reruns repeat.
    seed: int = 0


@dataclass(frozen=True)
class Constraint:
    """A grammar one row's turn must follow (built in stages/policy/constrain.py).

    `lark` is llguidance's Lark dialect (`%json {schema}` embeds a JSON schema); both backends hand it
    to llguidance, so CPU and GPU constrain alike. `label` says what asked for it (recorded per call,
    e.g. "tool_choice=required")."""

    label: str
    lark: str


@dataclass(frozen=True)
class RowOptions:
    """What one prompt of a generate call asks beyond the call's shared `SamplingConfig`; rows with
    different options still share the call (the default asks nothing: no extra work)."""

    top_logprobs: int = 0  # the k most likely tokens per step, k <= 20 (OpenAI's limit)
    constraint: Constraint | None = None


@dataclass
class Sample:
    """One sampled assistant turn.

    `token_ids` are the sampled tokens, ending with EOS when the model emitted one (EOS is a
    policy action, so it is trained on); `logprobs` are aligned with them. `text` is
    `tokenizer.decode(token_ids minus a final EOS)` with special tokens kept, so it renders back
    to exactly these tokens. `finish_reason` is "stop" (EOS or a stop string) or "length".
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    # Per sampled token, the k most likely (token id, log-prob), best first, from the distribution the
    # token was drawn from (temperature applied, constraint mask applied); None when not asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    constraint: str | None = None  # the label of the constraint the turn followed, None when free
    # Set when the constraint left no allowed token (a grammar bug): the turn was ended there with EOS.
    error: str | None = None


class Backend(Protocol):
    """What the agent loop needs from a generation engine."""

    eos_ids: set[int]  # token ids that end an assistant turn

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None,
        rows: list[RowOptions] | None = None,
    ) -> list[Sample]:
        """Sample one continuation per prompt (same order); `seed` defaults to `sampling.seed`;
        `rows[i]` is what prompt i asks beyond `sampling` (None: nothing)."""
        ...


def decode_turn(tokenizer: Any, token_ids: list[int], eos_ids: set[int]) -> str:
    """The text of a sampled turn: the tokens minus a final EOS, special tokens kept, no clean-up,
    so that the chat template renders it back to the same characters."""
    if token_ids and token_ids[-1] in eos_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end an assistant turn: the generation config's EOS (an int or a list), else the
    tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
