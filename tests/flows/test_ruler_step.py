"""One training step of configs/doc_search_ruler.yaml with the RULER judge served by rlops over real HTTP.

rollout -> score -> grpo, as flows.pipeline.train runs a step, on tiny models built offline. The
policy is the tiny random Llama of tests/conftest.py. The judge is served by the rlops policy service
(FastAPI + uvicorn on 127.0.0.1, its batcher, a resident policy): a tiny Llama whose word-level
vocabulary can spell the scores JSON, with its own chat template, so its replies are real greedy
generations decoded by the real tokenizer:
  - random weights: it writes no valid scores, so what a failing judge leaves behind is checked;
  - the same model trained (a second on CPU) to write one verdict for any two-trajectory group
    ({"scores": [{"id": "1", "score": 1}, {"id": "2", "score": 0}]}, like tests/scripted_model.py
    teaches the policy a tool call): a judge whose scores GRPO can train on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows.config import read_yaml
from flows.run_config import RunConfig, from_dict, semantic_problems
from rewards.ruler import DEFAULT_RUBRIC, common_prefix_len, judge_messages
from stages import grpo, rollout, score
from stages.common import StageContext, base_policy
from stages.reward_ref import RewardRef
from stages.score import ScoreError
from storage.schema import Message, Rollout
from storage.workspace import Workspace
from tests.scripted_model import labelled_loss

pytestmark = pytest.mark.slow  # tiny models, two rollouts, a judge trained for a few seconds, an update: ~15 s

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "doc_search_ruler.yaml"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# Whitespace-separated words: the roles of the template, and the pieces of the scores JSON (everything
# else in a request reads as <unk>). Decoding joins words with spaces, which JSON allows.
WORDS = ["<unk>", "<s>", "</s>", "system:", "user:", "assistant:", '{"scores":', '[{"id":', '{"id":', '"1",', '"2",',
         '"score":', "0},", "1},", "0.5},", "0}]}", "1}]}", "0.5}]}"]
VERDICT = '{"scores": [{"id": "1", "score": 1}, {"id": "2", "score": 0}]}'
GROUPS, GROUP_SIZE = 2, 2


def build_judge(folder: Path) -> Path:
    """A 1-layer random Llama with the word-level tokenizer, saved as a model folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)  # words joined by single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def doc_search_group(question: str, answers: list[str]) -> list[Rollout]:
    """One-turn doc_search episodes with the task's real opening (the shape a tiny policy produces)."""
    from tasks.base import load_task
    from tests.rewards.conftest import build_rollout

    task = load_task("doc_search", {})
    system = task.messages(task.prompts("train")[0])[0]["content"]
    group = [build_rollout([Message("assistant", a)], sample_idx=i) for i, a in enumerate(answers)]
    for r in group:
        r.messages[:2] = [Message("system", system), Message("user", question)]
    return group


def judge_request(group: list[Rollout]) -> list[dict[str, Any]]:
    """The chat request rewards.ruler.rank sends for `group` (one permutation, shown in input order)."""
    trajectories = [[m.to_openai() for m in r.messages] for r in group]
    cut = common_prefix_len(trajectories)
    return judge_messages(trajectories[0][:cut], [t[cut:] for t in trajectories], DEFAULT_RUBRIC)


def train_verdict(random_dir: Path, out: Path, steps: int = 60) -> Path:
    """Copy the random judge and train it to answer VERDICT to two-trajectory doc_search groups (a few
    made-up ones, none of them the test's rollouts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(random_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    groups = [doc_search_group("Who founded Vexhollow Dynamics?", ["Ana Perel", "I do not know"]),
              doc_search_group("When was the Orlin bridge built?", ["1987", '<tool_call>{"name": "search"}</tool_call>'])]
    sequences = []
    for group in groups:
        prompt = tok(tok.apply_chat_template(judge_request(group), tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        answer = tok(VERDICT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        sequences.append((prompt + answer, [-100] * len(prompt) + answer))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        for ids, labels in sequences:
            loss = labelled_loss(model, ids, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def random_judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_judge(tmp_path_factory.mktemp("judge-random"))


@pytest.fixture(scope="module")
def verdict_judge_dir(random_judge_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_verdict(random_judge_dir, tmp_path_factory.mktemp("judge-verdict") / "model")


@dataclass
class ServedJudge:
    url: str  # what the config's base_url gets: http://127.0.0.1:PORT/v1
    requests: list[dict[str, Any]] = field(default_factory=list)  # what the service answered: model, texts, usage


@contextmanager
def served_judge(model_dir: Path, workspace: Path) -> Iterator[ServedJudge]:
    """The policy service as `rlops serve --base-model MODEL_DIR --workspace WORKSPACE` builds it, on a
    free port; every chat request it answers is recorded (the handler is wrapped on the instance)."""
    from stages.policy.resident import ResidentPolicy
    from stages.service.app import ServerThread, build_app
    from stages.service.resolve import catalog_resolver
    from stages.service.service import PolicyService
    from storage.settings import Settings

    resolve, names = catalog_resolver(Settings.from_env(workspace).snapshot_dir / "checkpoints.parquet", str(model_dir))
    service = PolicyService(ResidentPolicy.load(str(model_dir)), resolve, names=names)
    served = ServedJudge("")
    handle = service.chat_completion

    async def chat_completion(req: Any, episode_id: str | None) -> dict[str, Any]:
        out = await handle(req, episode_id)
        served.requests.append({"model": req.model, "text": "\n".join(m.content or "" for m in req.conversation()),
                                "reply": out["choices"][0]["message"]["content"], "usage": out["usage"]})
        return out

    service.chat_completion = chat_completion
    try:
        with ServerThread(build_app(service)) as url:
            served.url = url + "/v1"
            yield served
    finally:
        service.close()


def step_config(policy_dir: Path, judge_url: str, max_error_fraction: float | None = None) -> RunConfig:
    """configs/doc_search_ruler.yaml at a tiny size: the tiny policy, 2 groups of 2, the judge at judge_url."""
    data = read_yaml(CONFIG)
    data.update(base_model=str(policy_dir), steps=1, sft=None)
    data["rollout"].update(prompts_per_step=GROUPS, group_size=GROUP_SIZE, max_new_tokens=6)
    (ruler,) = [r for r in data["score"]["rewards"] if r["name"] == "ruler"]
    ruler["params"].update(base_url=judge_url, max_tokens=24, timeout=120)
    if max_error_fraction is not None:
        data["score"]["max_error_fraction"] = max_error_fraction
    cfg = from_dict(data)
    assert semantic_problems(cfg) == []
    return cfg


def ruler_rows(ws: Workspace, batch: str, reward: RewardRef) -> list[dict[str, Any]]:
    """Every rollout of `batch` with its row of `reward` (None columns when it has none)."""
    return ws.query("""
        SELECT ro.rollout_id, ro.group_id, w.rollout_id AS scored, w.value, w.error, w.details
        FROM rollouts ro LEFT JOIN rewards w
          ON w.rollout_id = ro.rollout_id AND w.reward_name = $name AND w.reward_version = $version
        WHERE ro.batch_id = $batch ORDER BY ro.rollout_id""",
        {"name": reward.name, "version": reward.version, "batch": batch}).to_pylist()


def check_requests(judge: ServedJudge, rows: list[dict[str, Any]]) -> None:
    """The server answered exactly the requests the rows account for: a scored group made the
    requests its group_usage records, a failed one two (its reply and the correction retry)."""
    groups = {r["group_id"]: r for r in rows}
    expected = sum(json.loads(r["details"])["group_usage"]["requests"] if r["value"] is not None else 2
                   for r in groups.values())
    assert len(judge.requests) == expected >= len(groups)
    for req in judge.requests:
        assert req["model"] == "base" and req["text"].count("<trajectory id=") == GROUP_SIZE
        assert req["usage"]["prompt_tokens"] > 0 and req["usage"]["completion_tokens"] > 0


def test_a_failing_judge_leaves_an_error_row_per_rollout_and_grpo_refuses_an_all_error_batch(
        tmp_path: Path, tiny_model_dir: Path, random_judge_dir: Path) -> None:
    with served_judge(random_judge_dir, tmp_path / "judge-ws") as judge:
        shipped = step_config(tiny_model_dir, judge.url)
        lenient = step_config(tiny_model_dir, judge.url, max_error_fraction=1.0)
        ws = Workspace.open(tmp_path / "ws")
        ctx = StageContext(ws, run_name="ruler-step")
        base = base_policy(ws, shipped.base_model)
        batch = rollout.run(shipped.rollout, ctx, policy_id=base, task=shipped.task, split="train", step=0).id
        reward = RewardRef.configured(shipped.score, shipped.reward_name)
        assert reward.name == "ruler"

        # The shipped threshold refuses a judge that fails on more than 10 % of rollouts, before
        # writing any of its rows; with every error allowed, the rows are stored.
        try:
            score.run(shipped.score, ctx, batches=[batch])
            refused, first = None, 0
        except ScoreError as e:
            refused, first = str(e), len(judge.requests)
            assert all(r["scored"] is None for r in ruler_rows(ws, batch, reward))
            score.run(lenient.score, ctx, batches=[batch])
    rows = ruler_rows(ws, batch, reward)
    assert len(rows) == GROUPS * GROUP_SIZE and all(r["scored"] for r in rows)
    for r in rows:  # a value in [0, 1], or no value and the judge's reason
        assert (r["value"] is not None and 0.0 <= r["value"] <= 1.0 and r["error"] is None) or (
            r["value"] is None and r["error"].startswith("JudgeError: "))
    errors = [r for r in rows if r["value"] is None]
    assert (refused is not None) == (len(errors) / len(rows) > shipped.score.max_error_fraction)
    if refused:
        assert refused.startswith(f"reward 'ruler' failed on {len(errors)}/{len(rows)} rollouts")
    judge.requests = judge.requests[first:]  # the requests behind the stored rows
    check_requests(judge, rows)
    correct = ws.query("SELECT value FROM rewards WHERE reward_name = 'correct' AND batch_id = ?", [batch]).to_pylist()
    assert len(correct) == len(rows) and all(c["value"] is not None for c in correct)  # stored next to the judge's

    if len(errors) < len(rows):  # some groups judged: errored rows are dropped, the rest trained on
        ref = grpo.run(lenient.grpo, ctx, parent_policy=base, batches=[batch], reward=reward)
        metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
        assert metrics["dropped_null_rewards"] == len(errors)
        assert ws.catalog.get_checkpoint(ref.id)["trained_on"]["reward"] == str(reward)
    else:  # nothing to train on: the update refuses and no checkpoint is written
        with pytest.raises(ValueError, match="no rollout of these batches has a value for this reward"):
            grpo.run(lenient.grpo, ctx, parent_policy=base, batches=[batch], reward=reward)
        assert ws.query("SELECT count(*) AS n FROM checkpoints WHERE kind = 'grpo'").to_pylist() == [{"n": 0}]
        (run,) = ws.query("SELECT status, error FROM stage_runs WHERE stage = 'grpo'").to_pylist()
        assert run["status"] == "failed" and "has a value for this reward" in run["error"]


def test_a_judge_that_writes_scores_trains_a_checkpoint_on_them(
        tmp_path: Path, tiny_model_dir: Path, verdict_judge_dir: Path) -> None:
    from safetensors.torch import load_file

    with served_judge(verdict_judge_dir, tmp_path / "judge-ws") as judge:
        cfg = step_config(tiny_model_dir, judge.url)  # the shipped max_error_fraction
        ws = Workspace.open(tmp_path / "ws")
        ctx = StageContext(ws, run_name="ruler-step")
        base = base_policy(ws, cfg.base_model)
        batch = rollout.run(cfg.rollout, ctx, policy_id=base, task=cfg.task, split="train", step=0).id
        score.run(cfg.score, ctx, batches=[batch])
    reward = RewardRef.configured(cfg.score, cfg.reward_name)
    rows = ruler_rows(ws, batch, reward)
    assert all(r["error"] is None for r in rows), rows[0]["error"]
    assert all(r["reply"] == VERDICT for r in judge.requests)
    check_requests(judge, rows)
    assert len(judge.requests) == GROUPS  # one valid reply per group, no correction retry
    # The verdict scores whatever is shown first 1 and second 0; the order shown is a seeded shuffle.
    by_group: dict[str, list[float]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r["value"])
        details = json.loads(r["details"])
        assert details["judge_model"] == "base" and details["permutation_scores"] == [r["value"]]
    assert sorted(map(sorted, by_group.values())) == [[0.0, 1.0]] * GROUPS

    ref = grpo.run(cfg.grpo, ctx, parent_policy=base, batches=[batch], reward=reward)
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "grpo" and row["trained_on"] == {"batches": [batch], "reward": str(reward)}
    metrics = ws.catalog.get_artifact(ref.id)["meta"]["metrics"]
    assert metrics["trained_rollouts"] == GROUPS * GROUP_SIZE and metrics["dropped_null_rewards"] == 0
    assert metrics["zero_variance_groups"] == 0
    weights = load_file(Path(row["adapter_uri"]) / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)  # LoRA B starts at 0: it moved
