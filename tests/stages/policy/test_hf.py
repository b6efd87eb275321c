"""HFBackend and the agent loop on a tiny random Llama: seeding, log-probs against a fresh forward
pass, stop strings, and a full multi-turn run_episodes; plus load_policy with a LoRA adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stages.policy.agent_loop import EpisodeSpec, run_episodes
from stages.policy.hf import HFBackend
from stages.policy.load import load_policy
from stages.policy.sampling import SamplingConfig
from tasks.base import Prompt, Task

QUESTIONS = ["Hi", "What is 12 + 30? Answer with a number.", "Tell me a long story about a cat who lives in Paris."]
CALL = '<tool_call>{"name": "ping"}</tool_call>'


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_policy(str(tiny_model_dir))


def prompts(tokenizer: Any) -> list[list[int]]:
    """Chat prompts of different lengths, so the batch is left-padded."""
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats]


@torch.no_grad()
def next_token_logits(model: Any, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits that predicted each of `tokens` after `prefix`, from one unpadded forward pass. (n, V)"""
    ids = torch.tensor([prefix + tokens])  # (1, P + n)
    return model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()


def forward_logprobs(model: Any, prefix: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at `tokens` (T = 1 for greedy). (n,)"""
    logprobs = torch.log_softmax(next_token_logits(model, prefix, tokens) / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_load_policy(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    assert not model.training and tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert next(model.parameters()).dtype == torch.float32


def test_seeded_and_deterministic(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    backend, batch = HFBackend(model, tokenizer), prompts(tokenizer)
    sampling = SamplingConfig(max_new_tokens=8)
    first, again, other = (backend.generate(batch, sampling, seed) for seed in (1, 1, 2))
    assert first == again
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    for s in first:
        assert len(s.token_ids) == len(s.logprobs) and s.finish_reason in ("stop", "length")
        assert s.text == tokenizer.decode([t for t in s.token_ids if t != tokenizer.eos_token_id])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_match_a_fresh_forward_pass(policy: tuple[Any, Any], temperature: float, top_p: float) -> None:
    model, tokenizer = policy
    batch = prompts(tokenizer)
    samples = HFBackend(model, tokenizer).generate(batch, SamplingConfig(temperature, top_p, max_new_tokens=10), seed=3)
    for prefix, s in zip(batch, samples):
        expected = forward_logprobs(model, prefix, s.token_ids, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4)
        if temperature == 0:  # greedy: each token is the argmax
            assert next_token_logits(model, prefix, s.token_ids).argmax(-1).tolist() == s.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_fast_sampler_draws_from_the_softmax(temperature: float) -> None:
    from stages.policy.processors import _InverseCDFSampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0, 0.5]]).repeat(40_000, 1)  # (N, V): one draw per row
    torch.manual_seed(0)
    out = _InverseCDFSampler(temperature)(None, logits)
    picks = out.argmax(-1)
    assert bool((out.isfinite().sum(-1) == 1).all())  # generate's greedy step can take only the pick
    freq = torch.bincount(picks, minlength=6).double() / len(picks)
    p = torch.softmax(logits[0].double() / temperature, -1)
    # 40k draws: 4.5 standard errors on every token's frequency; the ~1e-13 token is never drawn
    assert bool(((freq - p).abs() <= 4.5 * (p * (1 - p) / len(picks)).sqrt() + 1e-9).all()), (freq, p)
    assert freq[4] == 0


def shared_matches_full_prefill(model: Any, tokenizer: Any, batch: list[list[int]],
                                first_calls: list[tuple[int, ...]]) -> None:
    """Greedy and sampled: the shared prefill's first forward calls have the shapes `first_calls`, and it samples
    the same tokens and log-probs as a full prefill per row (`share_prompts=False`)."""
    calls: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        for temperature in (0.0, 1.0):
            sampling = SamplingConfig(temperature, max_new_tokens=6)
            calls.clear()
            shared = HFBackend(model, tokenizer, share_prompts=True).generate(batch, sampling, seed=5)
            assert calls[: len(first_calls)] == first_calls
            separate = HFBackend(model, tokenizer, share_prompts=False).generate(batch, sampling, seed=5)
            assert [s.token_ids for s in shared] == [s.token_ids for s in separate]
            for a, b in zip(shared, separate):
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    finally:
        hook.remove()


def test_repeated_prompts_share_one_prefill(policy: tuple[Any, Any]) -> None:
    """A group's G copies of a prompt are prefilled once: the same tokens and log-probs as one prefill per row."""
    model, tokenizer = policy
    batch = [p for p in prompts(tokenizer) for _ in range(3)]  # 3 prompts x G=3, different lengths
    width = max(map(len, batch))
    shared_matches_full_prefill(model, tokenizer, batch, [(3, width - 1), (9, 1)])  # 3 prompts, then a token a row


def test_distinct_prompts_share_the_prefill_of_their_common_prefix(policy: tuple[Any, Any]) -> None:
    """Distinct prompts that begin alike (here the template's default system prompt, as an evaluation's prompts share
    theirs): the common prefix is run once as a batch of one, then only the columns where they differ; the same
    tokens and log-probs as a full prefill per row."""
    from stages.policy.hf import MIN_SHARED_PREFIX

    model, tokenizer = policy
    batch = prompts(tokenizer)
    common = next(i for i in range(min(map(len, batch))) if len({p[i] for p in batch}) > 1)
    assert common >= MIN_SHARED_PREFIX and len({tuple(p) for p in batch}) == len(batch)
    longest_tail = max(len(p) - common for p in batch)
    shared_matches_full_prefill(model, tokenizer, batch, [(1, common), (len(batch), longest_tail)])


def test_a_half_precision_models_output_layer_gets_a_contiguous_input(tiny_model_dir: Path) -> None:
    """generate's first step hands the output layer the last position of the prefilled columns, a slice; in bf16 that
    slice is made contiguous (torch's batched product for it copied the output weight once per row: ~7 s for an
    evaluation's 100 rows of SmolLM2), once per model however many backends it gets; fp32 is left as it was."""
    seen: dict[str, list[bool]] = {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_policy(str(tiny_model_dir), dtype=dtype)
        head = model.get_output_embeddings()
        backend = HFBackend(model, tokenizer)
        HFBackend(model, tokenizer)
        seen[dtype] = []
        head.register_forward_pre_hook(lambda module, args, into=seen[dtype]: into.append(args[0].is_contiguous()))
        backend.generate(prompts(tokenizer), SamplingConfig(temperature=0.0, max_new_tokens=3))
        assert len(head._forward_pre_hooks) == (1 if dtype == "float32" else 2)  # the test's, and rlops' once
    assert False in seen["float32"]  # the prefilled columns' last position: a slice, handed on as it is
    assert len(seen["bfloat16"]) == len(seen["float32"]) and all(seen["bfloat16"])



def test_a_dynamically_quantized_model_samples(tiny_model_dir: Path) -> None:
    """torch's dynamic int8 quantization (bench/bench_sample_dtype.py) leaves the output layer a `weight()` method, not
    a tensor: the backend leaves that layer as it is and samples."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    [sample] = HFBackend(quantized, tokenizer).generate(prompts(tokenizer)[:1], SamplingConfig(max_new_tokens=3), seed=1)
    assert len(sample.token_ids) == len(sample.logprobs) > 0

def test_stop_strings_cut_where_generation_stopped(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    backend, batch = HFBackend(model, tokenizer), prompts(tokenizer)[:1]
    free = backend.generate(batch, SamplingConfig(max_new_tokens=12), seed=5)[0]
    stop = tokenizer.decode(free.token_ids[2:4])  # a string the seeded sample reaches at token 4
    stopped = backend.generate(batch, SamplingConfig(max_new_tokens=12, stop=(stop,)), seed=5)[0]
    assert stopped.finish_reason == "stop" and stop in stopped.text
    assert 0 < len(stopped.token_ids) <= 4 and free.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    assert stopped.logprobs == free.logprobs[: len(stopped.token_ids)]


def bias_towards(model: Any, tokenizer: Any, text: str, strength: float) -> Any:
    """Make the random model likely to write `text` at the start of each assistant turn: a forward
    hook adds `strength` to the logit of the token that follows the previous token in `text`
    ("\\n", the end of every generation prompt, leads to its first token). A fresh forward pass
    of the hooked model sees the same bias, so log-probs stay comparable."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    table = torch.full((len(tokenizer),), -1)
    for prev, nxt in zip([tokenizer("\n", add_special_tokens=False)["input_ids"][0]] + ids, ids):
        if table[prev] < 0:  # first wins: the closing tag's ">" ends the turn by stop string anyway
            table[prev] = nxt

    def hook(module: Any, args: Any, kwargs: dict, output: Any) -> Any:
        logits = output.logits  # (B, T', V): during generation only the last position (T' = 1)
        following = table[kwargs["input_ids"][:, -logits.shape[1] :]]  # (B, T')
        b, t = (following >= 0).nonzero(as_tuple=True)
        logits[b, t, following[b, t]] += strength
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def test_run_episodes_matches_a_fresh_forward_pass(tiny_model_dir: Path) -> None:
    model, tokenizer = load_policy(str(tiny_model_dir))
    handle = bias_towards(model, tokenizer, CALL, strength=12.0)  # a mix: calls, malformed calls, answers
    task = Task(
        name="ping",
        system_prompt="Call ping.",
        prompts=lambda split: [],
        tools={"ping": lambda: "pong"},
        tool_specs=[{"type": "function", "function": {"name": "ping", "description": "pong"}}],
        max_turns=3,
    )
    specs = [EpisodeSpec(Prompt(f"p{k}", f"Question {k}", {}), seed=k) for k in range(6)]
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=20, stop=("</tool_call>",))
    episodes = run_episodes(
        HFBackend(model, tokenizer), tokenizer, task, specs, sampling, max_total_tokens=400, tool_timeout=5.0
    )
    try:
        assert sum(ep.num_tool_calls for ep in episodes) >= 2  # the biased model did call the tool
        assert any(m.content == "pong" for ep in episodes for m in ep.messages)
        assert max(ep.num_turns for ep in episodes) >= 2
        for ep in episodes:
            rendered = tokenizer.apply_chat_template([m.to_openai() for m in ep.messages], tokenize=False)
            assert tokenizer.decode(ep.token_ids) == rendered
            mask = torch.tensor(ep.loss_mask, dtype=torch.bool)  # (T,)
            expected = forward_logprobs(model, ep.token_ids[:1], ep.token_ids[1:], sampling.temperature)  # (T-1,)
            recorded = torch.tensor(ep.behavior_logprobs)[1:]
            assert not mask[0] and mask.sum() > 0
            assert torch.allclose(recorded[mask[1:]], expected[mask[1:]], atol=1e-4)
    finally:
        handle.remove()


def test_later_turns_reuse_the_previous_turns_cache(tiny_model_dir: Path) -> None:
    """Each turn of an episode prefills only its new tokens (tool results, the next generation prompt), taking the
    rest from the previous turn's key/value cache: the same episodes, token for token, as re-prefilling the
    whole conversation every turn."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    handle = bias_towards(model, tokenizer, CALL, strength=12.0)
    task = Task(
        name="ping",
        system_prompt="Call ping.",
        prompts=lambda split: [],
        tools={"ping": lambda: "pong " * 5},
        tool_specs=[{"type": "function", "function": {"name": "ping", "description": "pong"}}],
        max_turns=4,
    )
    specs = [EpisodeSpec(Prompt(f"p{k // 2}", f"Question {k // 2}" + "?" * k, {}), seed=k) for k in range(6)]
    widths: list[int] = []  # tokens run through the model by each call that had more than one
    hook = model.register_forward_pre_hook(
        lambda m, a, k: widths.append(k["input_ids"].shape[1]) if k["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    try:
        runs = {}
        for reuse in (True, False):
            widths.clear()
            sampling = SamplingConfig(temperature=0.9, max_new_tokens=24, stop=("</tool_call>",))
            backend = HFBackend(model, tokenizer, reuse_turns=reuse, share_prefix=False)  # the turn cache alone
            runs[reuse] = (run_episodes(backend, tokenizer, task, specs, sampling, max_total_tokens=600), list(widths))
            assert backend._kept is None  # nothing is held once the episodes end
    finally:
        hook.remove()
        handle.remove()
    (reused, reused_widths), (fresh, fresh_widths) = runs[True], runs[False]
    assert max(ep.num_turns for ep in fresh) >= 3  # the biased model called the tool over several turns
    for a, b in zip(reused, fresh):
        assert a.token_ids == b.token_ids and a.messages == b.messages and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs), atol=1e-5)
    # Turn 1 is the same prefill; from turn 2 on, the fresh run prefills whole conversations, the reused one
    # only the tokens added since the previous turn.
    assert len(reused_widths) == len(fresh_widths) >= 3 and reused_widths[0] == fresh_widths[0]
    for later_reused, later_fresh in zip(reused_widths[1:], fresh_widths[1:]):
        assert later_reused < later_fresh / 2


def test_load_policy_with_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
    frozen, tokenizer = load_policy(str(tiny_model_dir), adapter_dir=str(tmp_path))
    assert isinstance(frozen, PeftModel) and not frozen.training
    assert not any(p.requires_grad for p in frozen.parameters())
    batch = prompts(tokenizer)[:2]
    (sample, _) = HFBackend(frozen, tokenizer).generate(batch, SamplingConfig(max_new_tokens=4), seed=0)
    expected = forward_logprobs(frozen, batch[0], sample.token_ids, 1.0)
    assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)
    trainable, _ = load_policy(str(tiny_model_dir), adapter_dir=str(tmp_path), trainable=True)
    assert trainable.training and any(p.requires_grad for n, p in trainable.named_parameters() if "lora_" in n)


def test_the_decoding_cache_appends_in_place() -> None:
    """The cache layer generate uses holds what transformers' concatenating layer holds, but appends each new
    token into a preallocated buffer (one allocation for a prompt and its decoding steps, not one per step),
    and starts a new buffer when its tensors were replaced from outside (batch_select_indices)."""
    from transformers import DynamicCache, LlamaConfig

    from stages.policy.kv_cache import growing

    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    grown, plain = growing(DynamicCache(config=config)), DynamicCache(config=config)
    torch.manual_seed(0)
    steps = [torch.randn(3, 1, n, 8) for n in (5, 1, 1, 1)]  # a prompt of 5, then 3 decoding steps
    pointers = set()
    for kv in steps:
        keys, values = grown.update(kv, -kv, 0)
        expected, _ = plain.update(kv, -kv, 0)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        pointers.add(keys.data_ptr())
    assert len(pointers) == 1 and grown.get_seq_length() == 8
    grown.batch_select_indices(torch.tensor([2, 0]))
    plain.batch_select_indices(torch.tensor([2, 0]))
    keys, _ = grown.update(steps[1][:2], steps[1][:2], 0)
    assert torch.equal(keys, plain.update(steps[1][:2], steps[1][:2], 0)[0]) and keys.shape == (2, 1, 9, 8)


def test_an_adopted_cache_reserves_one_turn_of_room_not_a_second_copy() -> None:
    """A kept turn's cache, adopted by the next turn's generate (`growing`), is copied into a buffer with room for
    this turn's new columns and `reserve` decoding steps, not twice its length (a second copy of the whole
    conversation's keys and values per layer: the rollout's largest waste, bench/bench_memory.py); decoding
    stays in place, and a full buffer of its own still doubles."""
    from transformers import DynamicCache, LlamaConfig

    from stages.policy.kv_cache import growing

    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    kept, plain = DynamicCache(config=config), DynamicCache(config=config)
    torch.manual_seed(0)
    turn = torch.randn(2, 1, 300, 8)  # the previous turn: 300 columns
    kept.update(turn, -turn, 0)
    plain.update(turn, -turn, 0)
    grown = growing(kept)
    layer = grown.layers[0]
    new = torch.randn(2, 1, 20, 8)  # this turn's uncached columns (a tool result)
    keys, values = grown.update(new, -new, 0)
    assert torch.equal(keys, plain.update(new, -new, 0)[0]) and torch.equal(values, -keys)
    assert layer._keys.shape[-2] == 320 + layer.reserve  # was 2 * 300 before
    pointer = keys.data_ptr()
    for _ in range(layer.reserve):  # a turn's decoding steps: in place
        step = torch.randn(2, 1, 1, 8)
        keys, _ = grown.update(step, step, 0)
        assert keys.data_ptr() == pointer
    keys, _ = grown.update(step, step, 0)  # full: a buffer of its own doubles
    assert layer._keys.shape[-2] == 2 * (320 + layer.reserve) and keys.shape[-2] == 320 + layer.reserve + 1


def test_the_fast_sampler_hands_the_recorder_its_picks_log_probs() -> None:
    """With the recorder given, the sampler hands it each row's log-normaliser: the recorded log-probs are
    log_softmax(z / T) at the picked tokens, and the recorder reads only those tokens' scores (no pass over (B, V)).
    A row asking for its top tokens gets them, the picked one with the very log-prob recorded for it, and the other
    rows record the same bits as without it."""
    from stages.policy.processors import _InverseCDFSampler, _LogprobRecorder

    torch.manual_seed(1)
    steps = [torch.randn(5, 300) * 4 for _ in range(3)]  # (B, V) raw logits per decoding step
    recorded_by = {}
    for top_k in (None, [0, 2, 0, 0, 0]):
        recorder = _LogprobRecorder(0.7, top_k)
        sampler = _InverseCDFSampler(0.7, recorder)
        torch.manual_seed(2)  # the same draws in both batches
        picks = []
        for logits in steps:
            last = picks[-1][:, None] if picks else torch.zeros(5, 1, dtype=torch.long)
            recorder(last, logits)
            if top_k is None:  # reading more of a step's scores than the picked tokens' would raise
                recorder._scores = _OnlyGather(logits)
            picks.append(sampler(last, logits).argmax(-1))
        recorded = recorder.finish(picks[-1])  # (B, 3)
        expected = torch.stack([torch.log_softmax(z / 0.7, -1).gather(1, p[:, None]).squeeze(1)
                                for z, p in zip(steps, picks)], dim=1)
        assert recorded.dtype == torch.float32 and torch.allclose(recorded, expected, atol=1e-5)
        recorded_by[bool(top_k)] = recorded
        if top_k:
            best = recorder.top(1, 2, 3)  # row 1: its 2 best tokens at each of the 3 steps
            assert [[t for t, _ in step] for step in best] == [z[1].topk(2).indices.tolist() for z in steps]
            for step, (tops, p) in enumerate(zip(best, picks)):
                assert dict(tops).get(int(p[1]), recorded[1, step].item()) == recorded[1, step].item()
    assert torch.equal(recorded_by[False], recorded_by[True])  # same seed, same picks: the same bits


class _OnlyGather:
    """A step's scores that allow `gather` alone (a pass over (B, V) would need any other method)."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.gather = scores.gather
