"""`rlops export` of a trained arithmetic checkpoint (the tiny model after a GRPO step that changed its greedy
replies) as an hf folder and as GGUF files, loaded by plain transformers in a process that imports nothing of
rlops, against the policy service's greedy replies on 20 held-out prompts; the peft adapter alone; a
vision-language policy merged into its model; and what export refuses before writing anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from stages.policy.resident import ResidentPolicy
from stages.service.resolve import catalog_resolver
from stages.service.service import ServiceConfig
from storage.workspace import Workspace
from tasks.arithmetic import SYSTEM_PROMPT
from tests.service_fixtures import serving

MAX_NEW = 8
RUN = "exported"
CHARS = f"{Path(__file__).parent / 'export_rewards.py'}:answer_chars"


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    """A tiny Llama (tests/conftest.py's shape) over a byte-level BPE of 400 tokens trained here on arithmetic text,
    with SmolLM2's special tokens first and its chat template: the GGUF round trip of a tokenizer (vocabulary,
    merges, special tokens, template) is the same code for any size, and transformers' GGUF loader parses a
    49k-token vocabulary for ~10 s. Its weights are drawn 15x larger (std 0.3), so its greedy replies differ from
    prompt to prompt (the usual tiny model's flat logits answer every prompt alike) and equal replies on 20
    prompts say something."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.conftest import _tiny_llama

    bpe = ByteLevelBPETokenizer()
    corpus = [SYSTEM_PROMPT, tokenizer.chat_template] + [f"What is {a} + {b}? {a + b}" for a in range(100)
                                                         for b in range(0, 100, 7)]
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    small = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                    pad_token="<|im_end|>", unk_token="<|endoftext|>")
    small.chat_template = tokenizer.chat_template
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sharp-llama")
    LlamaForCausalLM(LlamaConfig(**_tiny_llama(small), initializer_range=0.3)).save_pretrained(path)
    small.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, sharp_model_dir: Path) -> SimpleNamespace:
    """One GRPO step (4 epochs at a high rate) on the answers' length: an adapter that changes greedy replies."""
    cfg = {"name": RUN, "base_model": str(sharp_model_dir), "steps": 1,
           "task": {"name": "arithmetic", "params": {"n_train": 8, "n_test": 20}},
           "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": MAX_NEW, "max_total_tokens": 128},
           "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.numeric_match"},
                                 {"name": "chars", "fn": CHARS}]},
           "train_reward": "chars", "grpo": {"lr": 0.05, "epochs": 4}, "eval": {"n_prompts": 1, "metric": "correct"}}
    ws = Workspace.open(tmp_path_factory.mktemp("export") / "ws")
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name=RUN), on_step=lambda row: None)
    from tasks.base import load_task

    questions = [p.question for p in load_task("arithmetic", cfg["task"]["params"]).prompts("test")]
    return SimpleNamespace(ws=ws, final=result.final, model_dir=sharp_model_dir, questions=questions)


def _export(ws: Workspace, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from flows.cli import main

    capsys.readouterr()
    code = main(["export", *args, "--workspace", str(ws.root)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _served(trained: SimpleNamespace, model: str) -> list[str]:
    """The policy service's greedy replies (the service `rlops serve` runs, on 127.0.0.1, through openai)."""
    resolver = catalog_resolver(trained.ws.settings.snapshot_dir / "checkpoints.parquet", str(trained.model_dir))
    with serving(ResidentPolicy.load(str(trained.model_dir)), resolver, ServiceConfig(batch_window_s=0.0)) as service:
        client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
        return [client.chat.completions.create(model=model, max_tokens=MAX_NEW, temperature=0, messages=[
            {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]).choices[0].message.content
            for q in trained.questions]


def _plain(tmp_path: Path, questions: list[str], *models: Path) -> dict[str, list[str]]:
    """Greedy replies of each exported model by plain transformers, in a process of its own
    (tests/stages/plain_replies.py)."""
    (tmp_path / "questions.json").write_text(json.dumps(questions))
    script = Path(__file__).parent / "plain_replies.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "questions.json"), SYSTEM_PROMPT, str(MAX_NEW),
                          *map(str, models)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert found["rlops_modules"] == []
    return found["replies"]


def test_hf_and_gguf_exports_reply_as_the_served_policy(trained, tmp_path, capsys, monkeypatch):
    from gguf import GGUFReader

    from flows.cli import main
    from stages.policy.model import fingerprint

    hf, f32, f16 = tmp_path / "hf", tmp_path / "gguf" / "policy-f32.gguf", tmp_path / "gguf" / "policy-f16.gguf"
    code, out, _ = _export(trained.ws, capsys, f"{RUN}@latest", "--format", "hf", str(hf))
    assert code == 0 and out.strip().splitlines()[-1] == str(hf)
    assert _export(trained.ws, capsys, trained.final, "--format", "gguf", str(f32))[0] == 0
    assert _export(trained.ws, capsys, trained.final, "--format", "gguf", "--dtype", "f16", str(f16))[0] == 0

    files = {p.name for p in hf.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "rlops_export.json"} <= files
    assert "auto_map" not in json.loads((hf / "config.json").read_text())  # no custom code to import
    manifest = json.loads((hf / "rlops_export.json").read_text())
    assert (manifest["policy_id"], manifest["format"]) == (trained.final, "hf")
    halves, whole = GGUFReader(f16).tensors, GGUFReader(f32).tensors
    assert {t.tensor_type.name for t in halves} == {"F16", "F32"} and {t.tensor_type.name for t in whole} == {"F32"}
    assert 0.5 <= sum(int(t.n_bytes) for t in halves) / sum(int(t.n_bytes) for t in whole) < 0.51  # norms stay f32

    # `rlops model prepare FILE.gguf` (how a judge or a policy comes from a GGUF) converts it into the cache
    monkeypatch.setenv("RLOPS_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["model", "prepare", str(f32), "--name", "from-gguf", "--json"]) == 0
    prepared = json.loads(capsys.readouterr().out)
    converted = tmp_path / "cache" / "models" / "from-gguf"
    assert prepared == {"model_dir": str(converted), "fingerprint": fingerprint(str(converted))}

    served, unadapted = _served(trained, trained.final), _served(trained, "base")
    assert len(set(served)) > 3  # replies that depend on the prompt
    assert served != unadapted  # and on the adapter: an export that lost it would differ
    plain = _plain(tmp_path, trained.questions, hf, f32, f16, converted)
    assert plain[str(hf)] == served
    assert plain[str(f32)] == served  # f32 GGUF: the same weights, the same tokenizer and template
    assert plain[str(converted)] == served  # and the folder prepared from it
    agree = sum(a == b for a, b in zip(plain[str(f16)], served))
    print(f"f16 GGUF: {agree}/{len(served)} greedy replies equal to the served f32 policy's")


def test_adapter_export_is_the_peft_adapter(trained, tmp_path, capsys):
    from peft import PeftConfig

    out = tmp_path / "adapter"
    assert _export(trained.ws, capsys, trained.final, "--format", "adapter", str(out))[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "rlops_export.json"]
    source = Path(trained.ws.catalog.get_checkpoint(trained.final)["adapter_uri"])
    assert (out / "adapter_model.safetensors").read_bytes() == (source / "adapter_model.safetensors").read_bytes()
    assert PeftConfig.from_pretrained(out).peft_type.value == "LORA"


def test_a_vision_language_policy_exports_merged(tiny_vlm_dir, tmp_path, capsys):
    from PIL import Image
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from stages.policy.lora import LoRASettings, add_vlm_lora
    from stages.policy.vlm import load_processor

    ws = Workspace.open(tmp_path / "ws")
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    adapted = add_vlm_lora(base, LoRASettings(), seed=1)
    torch.manual_seed(2)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:  # a fresh adapter is the identity: give it weights that change the outputs
            p.data.normal_(0, 0.5)
    adapted.save_pretrained(ws.settings.checkpoints_dir / "ck-vlm")
    ws.catalog.add_checkpoint({"policy_id": "ck-vlm", "parent_id": None, "base_model": str(tiny_vlm_dir), "kind": "sft",
                               "adapter_uri": str(ws.settings.checkpoints_dir / "ck-vlm"), "step": 0, "trained_on": {},
                               "config_hash": None, "run_name": "vlm"})

    code, _, err = _export(ws, capsys, "ck-vlm", "--format", "gguf", str(tmp_path / "vlm.gguf"))
    assert code == 2 and "vision-language model: gguf export writes text models" in err
    out = tmp_path / "vlm-hf"
    assert _export(ws, capsys, "vlm@latest", "--format", "hf", str(out))[0] == 0

    processor = load_processor(out)
    inputs = processor(text=["<image>How many squares?"], images=[[Image.new("RGB", (32, 32), (200, 0, 0))]],
                       return_tensors="pt")
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32),
        ws.settings.checkpoints_dir / "ck-vlm").eval()
    plain_base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        got, want, before = (m(**inputs).logits for m in (exported, reference, plain_base))
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, before, atol=1e-3)


def test_export_refuses_before_writing_anything(trained, tmp_path, capsys):
    ws = trained.ws
    adapter = ws.catalog.get_checkpoint(trained.final)["adapter_uri"]
    ws.catalog.add_checkpoint({"policy_id": "ck-elsewhere", "parent_id": None, "base_model": "/nowhere/base-model",
                               "kind": "grpo", "adapter_uri": adapter, "step": 1, "trained_on": {},
                               "config_hash": None, "run_name": "elsewhere"})
    code, _, err = _export(ws, capsys, "ck-elsewhere", "--format", "hf", str(tmp_path / "out"))
    assert code == 2 and "'/nowhere/base-model' of ck-elsewhere is not available on this machine" in err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = _export(ws, capsys, trained.final, "--format", "hf", str(taken))
    assert code == 2 and "exists: export writes a new file or folder, never over one" in err
    base = pipeline.base_policy(ws, str(trained.model_dir))
    code, _, err = _export(ws, capsys, base, "--format", "adapter", "--dtype", "f16", str(tmp_path / "a"))
    assert code == 2 and "is a base model: it has no adapter" in err and "--dtype: an adapter" in err
    assert _export(ws, capsys, "ck-unknown", "--format", "hf", str(tmp_path / "u"))[0] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and (taken / "keep.txt").read_text() == "mine"
