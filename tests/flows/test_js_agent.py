"""A doc_search agent written in JavaScript (examples/doc_search_js: Node's http module and the official
`openai` npm package) trained one GRPO step by rlops through the real pipeline: the agent runs in its
own process, calls the policy service with the episode header, and its rollouts are recorded token
for token."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from flows import pipeline
from flows.run_config import from_dict
from stages.common import StageContext
from storage.schema import Rollout, from_table
from storage.workspace import Workspace
from tests.processes import free_port, stop
from tests.scripted_model import train_scripted
from tests.stages.service.test_agent_service import start_service

REPO = Path(__file__).resolve().parents[2]
JS = REPO / "examples" / "doc_search_js"
QUESTION, ANSWER, QUERY = "In which town was Grougo Ninael born?", "Fograndford", "Grougo Ninael"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node (Node.js 20+) is not installed")


def python_example() -> Any:
    """examples/doc_search_openai/agent.py: the same prompt, tools and BM25 the JS agent ports."""
    spec = importlib.util.spec_from_file_location("doc_search_openai_agent", REPO / "examples/doc_search_openai/agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def js_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model that memorised the JS agent's episode: search, the search result, the answer."""
    from tasks.base import render_system_prompt

    ex = python_example()
    call = {"name": "search", "arguments": {"query": QUERY}}
    messages = [{"role": "system", "content": render_system_prompt(ex.SYSTEM_PROMPT, ex.TOOLS)},
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "tool", "content": ex.search(QUERY), "tool_call_id": "call_0"},
                {"role": "assistant", "content": ANSWER}]
    return train_scripted(tiny_model_dir, tmp_path_factory.mktemp("js-scripted"), messages=messages)


@pytest.mark.slow
def test_a_javascript_agent_trains_one_grpo_step(tmp_path, js_model_dir):
    assert (JS / "node_modules" / "openai").is_dir(), "run `make js` (npm ci in examples/doc_search_js) first"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": QUESTION, "split": split,
                                           "metadata": {"answer": ANSWER}}) + "\n"
                               for i, split in enumerate(["train", "train", "test"])))
    port = free_port()
    proc = start_service(["node", str(JS / "server.mjs")], port, cwd=JS)
    try:
        cfg = from_dict({
            "name": "js-agent", "base_model": str(js_model_dir),
            "task": {"name": "agent", "params": {"url": f"http://127.0.0.1:{port}/rollout", "prompts": str(prompts)}},
            "steps": 1,
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 32, "max_total_tokens": 1024,
                        "temperature": 1.0},
            "score": {"rewards": [{"name": "odd", "fn": "tests.stages.service.agents_for_tests.odd_answer_length"},
                                  {"name": "correct", "fn": "rewards.builtin.exact_match"}], "total": None},
            "train_reward": "odd",
            "eval": {"n_prompts": 1, "every": 1, "metric": "correct"},
        })
        ws = Workspace.open(tmp_path / "ws")
        result = pipeline.train(cfg, StageContext(ws, run_name="js-agent"))
    finally:
        stop(proc)
    assert len(result.policies) == 1 and ws.catalog.get_checkpoint(result.final)["step"] == 1
    rows = from_table(ws.read_artifact(result.batches[0]), Rollout) + \
        from_table(ws.query("SELECT * FROM rollouts WHERE split = 'test'"), Rollout)
    assert len(rows) == 6 and all(r.finish_reason != "error" for r in rows)
    for r in rows:  # every token the server sampled for the agent, and nothing else, is trained on
        assert sum(r.loss_mask) == r.metadata["completion_tokens"] > 0
        assert len(r.token_ids) == len(r.loss_mask) == len(r.behavior_logprobs)
    # The greedy eval episodes follow the script: the JS agent's own search result is in the stored messages.
    for r in rows[4:]:
        assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert r.messages[3].content == python_example().search(QUERY) and r.messages[-1].content == ANSWER
