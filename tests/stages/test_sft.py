"""SFT warm-start on doc_search demonstrations with a tiny random Llama and the real SmolLM2 tokenizer:
held-out loss goes down, the first assistant turn becomes a well-formed tool call, the checkpoint is
registered with lineage and loads with peft, a rerun is a cache hit, and only assistant tokens carry loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stages.common import ArtifactRef, StageContext, base_policy
from stages.policy.lora import LoRASettings
from stages.sft import SFTConfig, build_trainer, load_conversations, run
from storage.workspace import Workspace
from tasks.base import parse_tool_calls
from tasks.doc_search import TOOL_SPECS, write_oracle_dataset

KNOWN_TOOLS = {spec["function"]["name"] for spec in TOOL_SPECS}

# ~20 s of CPU training. Every linear layer gets a near-full-rank adapter and the learning rate is high
# because a random 2-layer model has to learn the call format from scratch, not just be nudged towards it
# (fewer steps or attention-only adapters left some seeds at 0 well-formed calls); max_length keeps the
# prompt and the first call (~215 tokens), the turn the tool-call test samples.
CONFIG = SFTConfig(
    max_steps=100, lr=1e-2, batch_size=4, max_length=256, lora=LoRASettings(r=64, alpha=128, dropout=0.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    eval_fraction=0.1, seed=0,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A random LlamaForCausalLM (hidden 64, 2 layers) with SmolLM2's tokenizer. initializer_range 0.2
    (not 0.02) gives the tied embeddings enough norm for a peaked next-token distribution: with 0.02 and
    hidden 64 no logit can exceed ~1.3, so the loss could not fall much below ln(49152)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-64")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Oracle demonstrations: 40 train questions (the stage holds 4 out) and 16 test-split questions."""
    root = tmp_path_factory.mktemp("sft-data")
    write_oracle_dataset(root / "train.jsonl", "train", n=40)
    write_oracle_dataset(root / "test.jsonl", "test", n=16)
    return {"train": root / "train.jsonl", "test": root / "test.jsonl"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path,
            data: dict[str, Path]) -> tuple[Workspace, ArtifactRef]:
    ws = Workspace.open(tmp_path_factory.mktemp("ws"))
    return ws, run(CONFIG, StageContext(ws, run_name="sft-test"), str(tiny_llama), str(data["train"]))


def tool_call_rate(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]]) -> float:
    """Share of first assistant turns (greedy, from system + user) holding a call with valid JSON and a known tool."""
    import torch

    tokenizer.padding_side = "left"  # prompts must end at the same column for batched generation
    prompts = [tokenizer.apply_chat_template(c[:2], tokenize=False, add_generation_prompt=True) for c in conversations]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    # parse_tool_calls leaves the name empty unless the body parsed as JSON
    good = [any(call.name in KNOWN_TOOLS for call in parse_tool_calls(text, 0)) for text in texts]
    return sum(good) / len(good)


@pytest.mark.slow  # ~45 s on 2 shared cores, nearly all of it the module's one training run
def test_sft_lowers_held_out_loss_and_teaches_tool_calls(trained: tuple[Workspace, ArtifactRef], tiny_llama: Path,
                                                         data: dict[str, Path], tokenizer: Any) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ws, ref = trained
    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["steps"] == CONFIG.max_steps and metrics["n_eval"] == 4 and metrics["n_train"] == 36
    assert metrics["eval_loss_after"] < 0.5 * metrics["eval_loss_before"], metrics

    test_conversations = load_conversations(data["test"])
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    base_rate = tool_call_rate(base, tokenizer, test_conversations)
    adapter = ws.catalog.get_checkpoint(ref.id)["adapter_uri"]
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), adapter).eval()
    sft_rate = tool_call_rate(sft, tokenizer, test_conversations)
    assert sft_rate >= base_rate + 0.25, (base_rate, sft_rate)


@pytest.mark.slow  # shares the training run above
def test_checkpoint_has_lineage_and_rerun_is_cached(trained: tuple[Workspace, ArtifactRef], tiny_llama: Path,
                                                    data: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    ws, ref = trained
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "sft" and row["step"] == 0 and row["run_name"] == "sft-test"
    assert row["parent_id"] == base_policy(ws, str(tiny_llama)) and row["base_model"] == str(tiny_llama)
    assert row["trained_on"]["data"] == str(data["train"].resolve()) and len(row["trained_on"]["data_hash"]) == 16
    losses = ws.tracker.client.get_metric_history(row["mlflow_run_id"], "loss")  # logged by the stage per step
    assert sorted(m.step for m in losses) == list(range(1, CONFIG.max_steps + 1))
    folder = Path(row["adapter_uri"])
    assert folder == ws.root / "checkpoints" / ref.id
    assert not list(folder.parent.glob("*.tmp-*"))  # the temporary folder was renamed, not left behind
    weights = load_file(folder / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at 0: it trained
    # The saved tokenizer keeps the model's own template; the generation markers were for training only.
    assert "generation" not in json.dumps(json.loads((folder / "tokenizer_config.json").read_text()))
    assert "{% generation %}" not in (folder / "chat_template.jinja").read_text()

    again = run(CONFIG, StageContext(ws), str(tiny_llama), str(data["train"]))
    assert again.id == ref.id and again.cached


def test_loss_mask_covers_assistant_turns_only(tiny_llama: Path, data: dict[str, Path], tokenizer: Any,
                                               tmp_path: Path) -> None:
    conversations = load_conversations(data["train"])[:2]
    config = CONFIG.model_copy(update={"max_length": 1024})  # whole episodes, all three assistant turns
    trainer = build_trainer(config, str(tiny_llama), conversations, [], str(tmp_path))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    for row, conversation in enumerate(conversations):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        trained = (labels != -100).tolist()
        assert (labels[labels != -100] == ids[labels != -100]).all()
        # Contiguous runs of trained tokens, decoded: exactly each assistant message plus its stop token.
        runs, start = [], None
        for i, on in enumerate([*trained, False]):
            if on and start is None:
                start = i
            elif not on and start is not None:
                runs.append(tokenizer.decode(ids[start:i]))
                start = None
        expected = [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"]
        assert runs == expected


def test_parquet_tool_calls_become_tool_call_text(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pydantic import ValidationError

    call = {"id": "c0", "type": "function", "function": {"name": "search", "arguments": '{"query": "Vexhollow"}'}}
    messages = [{"role": "user", "content": "q", "tool_calls": None},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "d12: Vexhollow", "tool_calls": None}]
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), tmp_path / "d.parquet")
    [conversation] = load_conversations(tmp_path / "d.parquet")
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool"]
    [parsed] = parse_tool_calls(conversation[1]["content"], 0)
    assert parsed.name == "search" and json.loads(parsed.arguments) == {"query": "Vexhollow"}
    with pytest.raises(ValidationError):
        SFTConfig(learning_rate=1e-4)  # a typo must not silently train with the default


def _png(color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, format="PNG")
    return buf.getvalue()


def _visual_demonstrations() -> list[list[dict[str, Any]]]:
    """What color is the picture: an image in the user's message, or (the last) in a tool's result."""
    from storage.images import data_url

    def image(color: tuple[int, int, int]) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": data_url(_png(color))}}

    out = [[{"role": "user", "content": [image(c), {"type": "text", "text": "What color?"}]},
            {"role": "assistant", "content": name}] for c, name in (((200, 0, 0), "red"), ((0, 0, 200), "blue"))] * 2
    out.append([{"role": "user", "content": "Look, then say the color."}, {"role": "assistant", "content": "look()"},
                {"role": "tool", "content": [{"type": "text", "text": "seen:"}, image((0, 200, 0))]},
                {"role": "assistant", "content": "green"}])
    return out


def test_sft_of_a_vlm_trains_on_its_demonstrations_with_pixels(tmp_path: Path, tiny_vlm_dir: Path,
                                                                tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from stages.common import identity
    from stages.policy.vlm import VLMPolicy
    from stages.update.visual_sft import demonstration_loss, demonstration_sample
    from storage.ids import config_hash
    from storage.images import ImageStore

    demos = _visual_demonstrations()
    data = tmp_path / "visual.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in demos))
    ws = Workspace.open(tmp_path / "ws")
    config = SFTConfig(max_steps=8, lr=2e-2, batch_size=5, eval_fraction=0.0, lora=LoRASettings(
        r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ref = run(config, StageContext(ws, run_name="vlm-sft"), base_model=str(tiny_vlm_dir), data=str(data))
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "sft" and row["parent_id"] == base_policy(ws, str(tiny_vlm_dir))
    assert row["trained_on"]["data_hash"] and row["config_hash"] == config_hash(identity(config))
    folder = Path(row["adapter_uri"])
    assert all("text_model" in k for k in load_file(str(folder / "adapter_model.safetensors")))  # the language model
    assert run(config, StageContext(ws, run_name="vlm-sft"), base_model=str(tiny_vlm_dir), data=str(data)).cached

    policy = VLMPolicy.load(tiny_vlm_dir, ImageStore(ws.settings.images_dir))
    samples = [demonstration_sample(policy, d, config.max_length) for d in demos]
    tok = policy.processor.tokenizer
    # Only the assistant's replies and their end-of-turn token are trained; image placeholders never are.
    assert tok.decode([t for t, m in zip(samples[0].token_ids, samples[0].loss_mask) if m]) == "red<|im_end|>"
    assert tok.decode([t for t, m in zip(samples[4].token_ids, samples[4].loss_mask) if m]) == "look()<|im_end|>green<|im_end|>"
    assert all(m == 0 for s in samples for t, m in zip(s.token_ids, s.loss_mask) if t in policy.banned_ids)
    assert all(s.vision.tensors["pixel_values"].shape[1] == 1 for s in samples)  # each demonstration's image
    assert ws.query("SELECT count(*) AS n FROM images").to_pylist() == [{"n": 3}]  # red, blue, green: stored once each
    # Measured on the demonstrations, base vs the saved adapter. The tiny VLM's logits are nearly flat (hidden 32,
    # embeddings at 0.02: no logit reaches 1), so its loss starts at ~ln(vocab) = 10.8 and cannot fall below ~10.1;
    # 8 steps take it to ~10.55 (measured; 0.16 with the attention-only LoRA in 6 steps).
    before = demonstration_loss(policy.model, samples, 5)
    after = demonstration_loss(PeftModel.from_pretrained(policy.model, folder), samples, 5)
    assert after < before - 0.15, (before, after)

    with pytest.raises(ValueError, match="assistant message in a demonstration may hold text only"):
        demonstration_sample(policy, [demos[0][0], {"role": "assistant", "content": demos[0][0]["content"]}], 1024)
    with pytest.raises(ValueError, match="image tokens reach past max_length"):
        demonstration_sample(policy, demos[0], 4)
    # The same demonstrations for a text model: refused by name before training, and no checkpoint.
    with pytest.raises(ValueError, match="is text-only and cannot take image_url content parts"):
        run(config, StageContext(ws, run_name="text-sft"), base_model=str(tiny_model_dir), data=str(data))
    assert ws.query("SELECT count(*) AS n FROM checkpoints WHERE kind = 'sft'").to_pylist() == [{"n": 1}]
