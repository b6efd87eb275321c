"""Constrained decoding: the grammars agents ask for, and the logits processor that masks each row to its grammar.

    c = tool_call_constraint(tools, only="search", parallel=False, label="tool_choice=search")
    problem = check(c, tokenizer, eos_ids)        # None, or why llguidance cannot compile it
    backend.generate(prompts, sampling, rows=[RowOptions(constraint=c), RowOptions()])

The grammars are llguidance's Lark dialect (`%json {schema}` embeds a JSON schema), so the HF backend here
and vLLM's "guidance" structured-output backend (stages/policy/vllm.py) run the same library on the same
text. A tool-call turn is exactly what tasks.base.render_system_prompt asks of the model and
tasks.base.parse_tool_calls reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or
more, then EOS.

`GrammarMasker` (HF backend) keeps one llguidance matcher per constrained row, feeds it the token the row
sampled at the previous step, computes the rows' allowed-token bitmasks (in parallel, on CPU) and sets
every other token's logit to -inf; free rows are not touched. It runs before the log-prob recorder, so
the recorded behaviour log-prob is log_softmax(masked logits / T): the distribution the token was drawn
from. llguidance is imported inside functions; torch only by the masker.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from stages.policy.sampling import Constraint

if TYPE_CHECKING:
    import torch

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # tasks.base's format (OPEN_TAG, TOOL_CALL_RE)


# JSON as the tool-call format shows it ({"name": "TOOL", "arguments": {...}}): one way to write each
# value, so the constraint adds no whitespace freedom the prompt never showed (and a weak or random
# model cannot spend its token budget on blank lines). A schema's own "x-guidance" wins.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict[str, Any]) -> str:
    return json.dumps({"x-guidance": _LAYOUT, **schema})


def _tool_call_rules(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """Lark rules `calls` (one or more tool calls, exactly one when not `parallel`) of the OpenAI
    function specs `tools` (only the one named `only`, when given), arguments valid against each schema."""
    specs = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not specs:
        raise ValueError(f"no tool named {only!r} among the request's tools")
    # "name" first, then "arguments": llguidance emits properties in schema order, as the prompt shows them.
    bodies = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                "arguments": f.get("parameters") or {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False} for f in specs]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"calls: call{repeat}\n"
            f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: %json {_json(body)}\n")


def tool_call_constraint(tools: list[dict[str, Any]], only: str | None, parallel: bool, label: str) -> Constraint:
    """A turn of tool calls only (`tool_choice: "required"`, or naming the tool `only`), then EOS."""
    return Constraint(label, "start: calls\n" + _tool_call_rules(tools, only, parallel))


def json_constraint(schema: dict[str, Any], label: str) -> Constraint:
    """A turn that is one JSON value valid against `schema` ({"type": "object"} for any object), then EOS."""
    return Constraint(label, f"start: %json {_json(schema)}\n")


def tool_call_or_json_constraint(tools: list[dict[str, Any]], parallel: bool, schema: dict[str, Any],
                                 label: str) -> Constraint:
    """Either tool calls or a JSON answer valid against `schema` (`tool_choice: "auto"` with a
    `response_format`: OpenAI's response_format shapes the answer, and calling a tool stays allowed)."""
    return Constraint(label, f"start: calls | answer\nanswer: %json {_json(schema)}\n"
                      + _tool_call_rules(tools, None, parallel))


_LOCK = threading.Lock()
_TOKENIZERS: dict[int, tuple[Any, Any]] = {}  # id(HF tokenizer) -> (it, its LLTokenizer): ~1 s to build
_COMPILED: dict[tuple[int, str], Any] = {}  # (id(tokenizer), lark) -> a fresh matcher to deep-copy per row


def _ll_tokenizer(tokenizer: Any, eos_ids: set[int]) -> Any:
    import llguidance.hf

    with _LOCK:
        if id(tokenizer) not in _TOKENIZERS:
            # The tokenizer is kept alive with its wrapper, so its id cannot be reused by another.
            _TOKENIZERS[id(tokenizer)] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids)))
        return _TOKENIZERS[id(tokenizer)][1]


def matcher(constraint: Constraint, tokenizer: Any, eos_ids: set[int]) -> Any:
    """A fresh llguidance matcher for the constraint (compiled once per grammar, then copied); ValueError
    with llguidance's reason when the grammar does not compile."""
    import llguidance

    key = (id(tokenizer), constraint.lark)
    with _LOCK:
        template = _COMPILED.get(key)
    if template is None:
        ll = _ll_tokenizer(tokenizer, eos_ids)
        template = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(constraint.lark), log_level=0)
        if template.is_error():
            raise ValueError(template.get_error().strip())
        with _LOCK:
            if len(_COMPILED) > 256:  # a long-running server sees many schemas: bound the cache
                _COMPILED.clear()
            _COMPILED[key] = template
    return template.deep_copy()


def check(constraint: Constraint, tokenizer: Any, eos_ids: set[int]) -> str | None:
    """None when llguidance compiles the constraint, else its reason (the service's 400)."""
    try:
        matcher(constraint, tokenizer, eos_ids)
    except ValueError as e:
        return str(e)
    return None


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's packed bitmask (R, ceil(V'/32)) int32 -> (R, vocab) bool; tokens past the
    tokenizer's vocabulary (a padded output layer) are never allowed."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)  # (R, 32 * W)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)


class GrammarMasker:
    """A logits processor: each constrained row's logits outside its grammar's allowed tokens set to -inf.

    At step t > 0 the last column of `input_ids` is the token each row sampled at step t-1; the row's
    matcher consumes it before the next mask is computed. A row that sampled EOS, or whose matcher
    refuses the token (generate pads a row that ended on a stop string), is finished and left alone. A row left with no allowed token (a grammar that cannot be completed; should not happen) is
    ended with EOS and its error kept in `errors` (row -> (step, message)), so the turn ends, never hangs.
    """

    def __init__(self, constraints: list[Constraint | None], tokenizer: Any, eos_ids: set[int]) -> None:
        import torch

        self.eos_ids, self.eos = eos_ids, min(eos_ids)
        self.rows = [i for i, c in enumerate(constraints) if c is not None]
        self.matchers = {i: matcher(constraints[i], tokenizer, eos_ids) for i in self.rows}
        words = (_ll_tokenizer(tokenizer, eos_ids).vocab_size + 31) // 32
        self.bitmask = torch.zeros(len(self.rows), words, dtype=torch.int32)  # (R, W) packed, llguidance's layout
        self.executor = _executor()
        self.live = set(self.rows)
        self.errors: dict[int, tuple[int, str]] = {}
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        if self.step > 0:
            last = input_ids[:, -1].tolist()
            for i in sorted(self.live):
                if last[i] in self.eos_ids or not self.matchers[i].consume_token(last[i]):
                    self.live.discard(i)
        self.step += 1
        live = sorted(self.live)
        if not live:
            return scores
        slots = [self.rows.index(i) for i in live]
        # What llguidance.torch.fill_next_token_bitmask_par does; importing that module costs ~10-20 s
        # (it loads torch.compile for a GPU kernel this CPU path does not use).
        self.executor.unsafe_compute_mask_ptr([(self.matchers[i], k) for i, k in zip(live, slots)],
                                              self.bitmask.data_ptr(), self.bitmask.shape[1] * 4, self.bitmask.shape[0])
        allowed = allowed_tokens(self.bitmask[slots], scores.shape[1]).to(scores.device)  # (R, V)
        dead = ~allowed.any(dim=1)  # (R,)
        for r in dead.nonzero().flatten().tolist():
            i = live[r]
            m = self.matchers[i]
            self.errors[i] = (self.step - 1, m.get_error() or "the constraint allows no token here")
            allowed[r, self.eos] = True  # end the turn
            self.live.discard(i)
        index = torch.tensor(live, device=scores.device)
        # transformers hands processors a float copy of the step's logits, so editing in place is safe.
        scores[index] = scores[index].masked_fill(~allowed, float("-inf"))
        return scores


_EXECUTOR: Any = None


def _executor() -> Any:
    """One llguidance thread pool per process (it computes the rows' masks in parallel)."""
    import llguidance

    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR
