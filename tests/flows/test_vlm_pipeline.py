"""A vision-language policy through the in-process pipeline on the count_shapes task, with the tiny random
Idefics3 (`tiny_vlm_dir`): eval of the base -> rollout -> score -> one GRPO step -> eval, the rollout rows
token-exact with their images in the workspace's store, the language LoRA trained from the stored rows,
`eval compare` on the held-out split, a rerun that reuses everything; and what is not supported yet,
refused before compute."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flows import pipeline
from flows.run_config import from_dict, vision_language_problems
from stages import evaluate, ppo, rollout
from stages.common import StageContext, base_policy
from stages.policy.vlm import VisualSample, VLMPolicy, processor_fingerprint
from stages.policy.vlm_episodes import task_policy_problem
from stages.reward_ref import RewardRef
from storage.images import ImageStore
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tasks.base import Task, load_task
from tasks.count_shapes import draw_png
from tests.flows.conftest import ray_workers

# The module's run is set up once, on one xdist worker (--dist loadgroup), not once per worker its tests land on.
pytestmark = pytest.mark.xdist_group("vlm_pipeline")


def _config(vlm_dir: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "name": "vlm",
        "base_model": str(vlm_dir),
        "task": {"name": "count_shapes", "params": {"size": 32, "n_train": 8, "n_test": 4}},
        "steps": 1,
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6, "max_total_tokens": 256},
        "score": {"rewards": [{"name": "correct", "fn": "rewards.builtin.first_integer_match"},
                              {"name": "chars", "fn": f"{Path(__file__).parent / 'vlm_test_rewards.py'}:answer_chars"}]},
        "train_reward": "chars",
        "grpo": {"lr": 1e-2, "lora": {"r": 4, "alpha": 8}},
        "eval": {"n_prompts": 4, "every": 1, "metric": "correct"},
        **overrides,
    }


@pytest.fixture(scope="module")
def run(tiny_vlm_dir, tmp_path_factory) -> tuple[Workspace, pipeline.TrainResult, dict[str, Any]]:
    cfg = _config(tiny_vlm_dir)
    ws = Workspace.open(tmp_path_factory.mktemp("vlm") / "ws")
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name="vlm"), on_step=lambda row: None)
    return ws, result, cfg


def test_a_vlm_run_rolls_out_scores_trains_and_evaluates(run):
    ws, result, _ = run
    assert result.policies == [result.final] and set(result.evals) == {result.base, result.final}
    final = ws.catalog.get_checkpoint(result.final)
    assert final["kind"] == "grpo" and final["parent_id"] == result.base
    trained = ws.catalog.get_artifact(result.final)["meta"]["metrics"]
    assert trained["trained_rollouts"] > 0 and trained["first_pass_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # The LoRA is fresh (B = 0) before the step: a non-zero B is a trained weight, all on the language model.
    weights = load_file(str(Path(final["adapter_uri"]) / "adapter_model.safetensors"))
    assert weights and all("text_model" in k for k in weights)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)
    # The held-out split, for both policies, compared prompt by prompt.
    evals = ws.query("SELECT DISTINCT policy_id, split FROM evals WHERE metric = 'accuracy'").to_pylist()
    assert {(e["policy_id"], e["split"]) for e in evals} == {(result.base, "test"), (result.final, "test")}
    comparison = evaluate.compare(ws, result.base, result.final, split="test", resamples=200)
    assert comparison.prompts == 4 and comparison.metric.startswith("correct@")


def test_rollout_rows_are_token_exact_and_their_images_join_the_store(run, tiny_vlm_dir):
    ws, result, cfg = run
    [batch] = result.batches
    rows = from_table(ws.query("SELECT * FROM rollouts WHERE batch_id = $b ORDER BY rollout_id", {"b": batch}), Rollout)
    assert len(rows) == 2 * 3 and all(len(r.image_ids) == 1 for r in rows)
    joined = ws.query("""
        SELECT r.prompt_id, i.image_id, i.bytes FROM (SELECT prompt_id, unnest(image_ids) AS image_id FROM rollouts
        WHERE batch_id = $b) r JOIN images i USING (image_id)""", {"b": batch}).to_pylist()
    assert len(joined) == len(rows) and len({j["image_id"] for j in joined}) == 2  # a group shares its image
    metadata = {r.prompt_id: r.metadata for r in rows}
    assert all(j["bytes"] == draw_png(metadata[j["prompt_id"]]) for j in joined)  # the task's picture, as drawn
    assert all(f"<image:{r.image_ids[0]}>" in r.messages[1].content for r in rows)  # the record refers to it
    # Recomputed from the stored row and image by the base policy that sampled it: the behaviour log-probs.
    policy = VLMPolicy.load(tiny_vlm_dir, ImageStore(ws.settings.images_dir))
    assert rows[0].sampling["processor"] == policy.fingerprint
    for r in rows[:3]:
        assert all(m == 0 for t, m in zip(r.token_ids, r.loss_mask) if t in policy.banned_ids)
        sample = VisualSample(r.token_ids, r.loss_mask, r.behavior_logprobs, r.image_ids, policy.fingerprint, "", "")
        assert torch.allclose(policy.logprobs(sample), torch.tensor(r.behavior_logprobs), atol=1e-4, rtol=0)


def test_the_base_policy_id_covers_the_processor(run, tiny_vlm_dir):
    ws, result, _ = run
    policy = VLMPolicy.load(tiny_vlm_dir, ImageStore(ws.settings.images_dir))
    assert ws.catalog.get_checkpoint(result.base)["trained_on"]["processor"] == processor_fingerprint(policy.processor)


def test_a_rerun_reuses_every_stage(run):
    ws, result, cfg = run
    counts = ws.query("SELECT (SELECT count(*) FROM rollouts) AS r, (SELECT count(*) FROM rewards) AS w").to_pylist()
    again = pipeline.train(from_dict(cfg), StageContext(ws, run_name="vlm"), on_step=lambda row: None)
    assert again.final == result.final and again.batches == result.batches
    assert ws.query("SELECT (SELECT count(*) FROM rollouts) AS r, (SELECT count(*) FROM rewards) AS w").to_pylist() == counts
    runs = ws.query("SELECT status FROM stage_runs ORDER BY started_at").to_pylist()
    assert runs[-1]["status"] == "cached" and {r["status"] for r in runs} == {"complete", "cached"}


def test_a_dpo_step_from_the_stored_visual_rows_trains_the_language_lora(run, tiny_vlm_dir):
    from stages import dpo
    from stages.update.data import pixel_inputs, read_scored
    from stages.update.dpo import DPOConfig, MaskedPreferenceCollator
    from stages.update.pairs import preference_pairs

    ws, result, _ = run
    config = DPOConfig(lr=1e-2, pairs_per_step=2, micro_batch_size=2, lora={"r": 4, "alpha": 8})
    ref = dpo.run(config, StageContext(ws, run_name="vlm-dpo"), result.base, result.batches, RewardRef("chars"))
    row = ws.catalog.get_checkpoint(ref.id)
    assert row["kind"] == "dpo" and row["parent_id"] == result.base and row["trained_on"]["batches"] == result.batches
    state = json.loads((Path(row["adapter_uri"]) / "trainer_state.json").read_text())
    assert state["pairs"] and state["history"]
    assert state["history"][0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference on the first pass
    weights = load_file(str(Path(row["adapter_uri"]) / "adapter_model.safetensors"))
    assert weights and all("text_model" in k for k in weights)  # the language model only
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # B starts at 0: it trained
    # What the forward passes get: each row's pixels, chosen rows then rejected rows, rebuilt from the store.
    policy = VLMPolicy.load(tiny_vlm_dir, ImageStore(ws.settings.images_dir))
    rows = read_scored(ws, result.batches, RewardRef.parse(row["trained_on"]["reward"]), images=True)
    [pair, *_] = preference_pairs(rows)[0]
    by_id, rebuild = {r["rollout_id"]: r for r in rows}, pixel_inputs(policy)
    vision = {i: rebuild(by_id[i]) for i in (pair.chosen_id, pair.rejected_id)}
    batch = MaskedPreferenceCollator(policy.pad_id, vision)([pair.as_example()])
    assert batch["pixel_values"].shape[0] == 2 and batch["input_ids"].shape[0] == 2
    assert torch.equal(batch["pixel_values"][1:], vision[pair.rejected_id].tensors["pixel_values"])
    # lora.projector: another checkpoint (the field is in its identity), whose projector LoRA trained too.
    projector = config.model_copy(update={"lora": config.lora.model_copy(update={"projector": True})})
    other = dpo.run(projector, StageContext(ws, run_name="vlm-dpo"), result.base, result.batches, RewardRef("chars"))
    assert other.id != ref.id
    weights = load_file(str(Path(ws.catalog.get_checkpoint(other.id)["adapter_uri"]) / "adapter_model.safetensors"))
    assert not any("vision_model" in k for k in weights)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "connector" in k and "lora_B" in k)


def test_what_a_vlm_does_not_support_yet_is_a_config_problem_naming_it(tiny_vlm_dir):
    cfg = from_dict(_config(tiny_vlm_dir, algorithm="ppo", max_staleness=1, rollout={"backend": "vllm", "workers": 2},
                            grpo={}, sft={"data": "oracle", "lora": {"projector": True}}))
    problems = "\n".join(vision_language_problems(cfg, load_task(**cfg.task.model_dump())))
    for named in ("rollout.backend 'vllm' with lora.projector (vLLM applies LoRA to the language model only",
                  "ppo (its loss has no pixel inputs"):
        assert named in problems
    # Ray rollout actors, Ray update workers and asynchronous steps run a VLM (test_a_vlm_run_on_ray_workers...).
    on_ray = from_dict(_config(tiny_vlm_dir, max_staleness=1, rollout={"workers": 2}, grpo={"workers": 2}))
    assert vision_language_problems(on_ray, load_task(**on_ray.task.model_dump())) == []
    # vLLM generates a VLM's episodes (tests/flows/test_vllm_pipeline.py) when its adapters are the language model's.
    on_vllm = from_dict(_config(tiny_vlm_dir, rollout={"backend": "vllm"}))
    assert vision_language_problems(on_vllm, load_task(**on_vllm.task.model_dump())) == []
    # SFT and DPO train a VLM with pixels (and its projector's LoRA); a text model has no projector.
    both = from_dict(_config(tiny_vlm_dir, algorithm="dpo", sft={"data": "oracle", "lora": {"projector": True}}, grpo={}))
    assert vision_language_problems(both, load_task(**both.task.model_dump())) == []
    text = from_dict(_config(tiny_vlm_dir, base_model="/no/such/text-model", task={"name": "doc_search"},
                             grpo={"lora": {"projector": True}}))
    assert vision_language_problems(text, None) == [
        "grpo.lora.projector: the base model /no/such/text-model is text-only; a projector LoRA needs a vision-language model"]
    # Multi-turn tasks with tools (the zoom variant), text tasks, top_p and stop strings run.
    for task in ({"name": "count_shapes", "params": {"zoom_turns": 2, "n_train": 8, "n_test": 4}}, {"name": "doc_search"}):
        good = from_dict(_config(tiny_vlm_dir, task=task, rollout={"top_p": 0.9, "stop": ["</tool_call>"]}))
        assert vision_language_problems(good, load_task(**task)) == []


def test_a_text_model_on_a_visual_task_is_refused_naming_the_problem(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir)
    [problem] = vision_language_problems(from_dict(cfg), load_task(**cfg["task"]))
    assert "task 'count_shapes' shows images, and the base model is text-only" in problem
    ws = Workspace.open(tmp_path / "ws")
    ctx = StageContext(ws, run_name="text")
    with pytest.raises(ValueError, match="shows images, and the base model is text-only"):
        rollout.run(rollout.RolloutConfig(), ctx, base_policy(ws, str(tiny_model_dir)), rollout.TaskSpec(**cfg["task"]))
    # Tools bound to a prompt run in the visual loop only, so far.
    bound = Task(name="lookup", system_prompt="", prompts=lambda split: [], prompt_tools=lambda prompt: {})
    assert "tools bound to its prompts" in task_policy_problem(bound, False)
    assert task_policy_problem(bound, True) is None


def test_the_stages_refuse_it_before_compute(run, tiny_vlm_dir):
    ws, result, cfg = run
    ctx = StageContext(ws, run_name="refused")
    before = ws.query("SELECT count(*) AS n FROM artifacts").to_pylist()
    with pytest.raises(ValueError, match=r"vision-language model.*ppo \(its loss has no pixel inputs"):
        ppo.run(ppo.PPOConfig(), ctx, result.base, result.batches, RewardRef("chars"))
    assert ws.query("SELECT count(*) AS n FROM artifacts").to_pylist() == before


def test_rlops_inspect_shows_the_pictures_the_policy_saw(run, capsys):
    from bs4 import BeautifulSoup

    from flows.cli import main

    ws, result, _ = run
    assert main(["inspect", "vlm", "--reward", "correct", "--top", "1", "--format", "html",
                 "--workspace", str(ws.root)]) == 0
    page = Path(capsys.readouterr().out.strip().splitlines()[-1].split()[-1])
    html = BeautifulSoup(page.read_text(), "html.parser")
    shown = html.select("article.episode .role-user img.image")
    assert shown, "no image on the inspect page"
    stored = {r["image_id"] for r in ws.query("SELECT image_id FROM images").to_pylist()}
    assert {i["data-image-id"] for i in shown} <= stored
    assert all(i["src"].startswith("data:image/png;base64,") for i in shown)


@pytest.mark.slow
def test_a_vlm_run_on_ray_workers_through_rlops_run(run, tiny_vlm_dir, tmp_path):
    """`rlops run` of a VLM with `rollout.workers: 2`, `grpo.workers: 2` and `max_staleness: 1` on a local 2-CPU Ray:
    the visual episodes come from Ray rollout actors (each prompt's image stored once by the driver, the actors given
    references into the store), each update from the run's two update workers with pixel inputs (one group, started
    once), and step 2's batch from the policy one version back. Its first step is the module's in-process run: the
    same ids, the same rows, and the adapter to 1e-5."""
    import subprocess
    import sys

    import yaml

    ws0, result, cfg0 = run
    cfg = _config(tiny_vlm_dir, name="vlm-ray", steps=2, max_staleness=1,
                  rollout={**cfg0["rollout"], "workers": 2, "groups_per_shard": 1},
                  grpo={**cfg0["grpo"], "workers": 2}, eval={**cfg0["eval"], "every": 2},
                  ray={"local_cpus": 2, "placement_timeout_s": 120})  # a regression ends in an error, not a hang
    path = tmp_path / "vlm-ray.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--workspace", str(tmp_path / "ws"), "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]

    ws = Workspace.open(tmp_path / "ws")
    trained = [c for c in ws.catalog.checkpoints("vlm-ray") if c["kind"] == "grpo"]
    assert len(trained) == 2 and trained[0]["policy_id"] == result.final
    assert ws.catalog.get_artifact(trained[1]["policy_id"])["meta"]["metrics"]["staleness"] == 1
    weights = [load_file(str(Path(w.catalog.get_checkpoint(result.final)["adapter_uri"]) / "adapter_model.safetensors"))
               for w in (ws0, ws)]
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-5
    [batch] = result.batches
    rows = [w.query("SELECT token_ids, image_ids FROM rollouts WHERE batch_id = $b ORDER BY rollout_id", {"b": batch}
                    ).to_pylist() for w in (ws0, ws)]
    assert rows[0] == rows[1]  # the actors' episodes are the driver's, token for token, image for image

    for rollouts in {c["trained_on"]["batches"][0] for c in trained}:
        assert len(set(ray_workers(ws, rollouts))) == 2  # both shards on the Ray rollout actors
    groups = {tuple(ray_workers(ws, c["policy_id"])) for c in trained}
    assert len(groups) == 1 and len(next(iter(groups))) == 2
