"""The local transformers judge backend, run on a tiny random model built offline (imports torch: slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewards.base import RewardSpec, compute
from storage.schema import Message

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 1-layer Llama with a word-level tokenizer and a chat template, saved as a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "{", "}", '"scores"', ":", "[", "]", "1", "2", "0.5", "id", "score", ","]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("tiny-judge")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_local_judge_runs_and_invalid_output_gives_error_rows(tiny_model: Path, make_rollout) -> None:
    from rewards.ruler import JudgeConfig, make_client

    client = make_client(JudgeConfig(str(tiny_model), backend="transformers", max_retries=0, concurrency=1, max_tokens=6))
    reply = client.complete([{"role": "user", "content": "score 1 2"}])
    assert reply.prompt_tokens > 0 and 0 < reply.completion_tokens <= 6

    # A random model cannot write valid scores: the group gets error rows after one correction retry.
    spec = RewardSpec(fn="rewards.ruler.ruler_reward", params={"backend": "transformers", "model": str(tiny_model), "max_tokens": 6})
    rollouts = [make_rollout([Message("assistant", a)], group_id="g", sample_idx=i) for i, a in enumerate(["1", "2"])]
    outs = compute(spec, rollouts)
    assert all(o.value is None and o.error.startswith("JudgeError: judge output invalid after one retry") for o in outs)
