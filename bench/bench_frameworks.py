"""What each agent framework adds per episode: requests, and prompt tokens beyond the task's own.

    .venv/bin/python bench/bench_frameworks.py [--workspace WS] [--episodes 4] [--max-new-tokens 64] \\
        [--frameworks plain,langgraph,openai_agents,openai_agents_responses,pydantic_ai,smolagents,litellm]

Each framework's doc_search example (examples/frameworks/, and the plain openai agent of
examples/doc_search_openai as the baseline) runs `--episodes` doc_search train questions, one at a
time, through the real rollout path (tasks/agent.py's entry forms, stages/service/external.py) against
one policy service on 127.0.0.1: the newest SFT checkpoint of `--workspace` if it has one (the policy
then calls tools as trained), else the base SmolLM2-135M-Instruct. From the service's recording of
each episode it prints, per framework:

  requests/episode      calls the framework made (tool round trips, retries, its own extra calls)
  extra prompt tokens   first request's prompt tokens minus the task's own (the doc_search system +
                        user prompt rendered alone by the chat template, no tools): what the framework's
                        prompt, tool schemas and message shapes cost on every request
  prompt tokens/episode all requests' prompt tokens, summed
  segments/episode      1 when every call extended the last (the framework's echo was recognised)
  s/episode             wall seconds per episode (CPU: generation dominates)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
ENTRIES = {
    "plain": "examples/doc_search_openai/agent.py:rollout",
    "langgraph": "examples/frameworks/langgraph/agent.py:rollout",
    "openai_agents": "examples/frameworks/openai_agents/agent.py:rollout",
    "openai_agents_responses": "examples/frameworks/openai_agents/agent.py:rollout_responses",
    "pydantic_ai": "examples/frameworks/pydantic_ai/agent.py:rollout",
    "smolagents": "examples/frameworks/smolagents/agent.py:rollout",
    "litellm": "examples/frameworks/litellm/agent.py:rollout",
}


def _policy(workspace: str | None) -> tuple[str, str, str | None]:
    """(policy id, base model, adapter folder): the workspace's newest SFT checkpoint, else the base."""
    from stages.policy.model import DEFAULT_MODEL, resolve_model

    if workspace:
        from stages.common import resolve_policy
        from storage.workspace import Workspace

        ws = Workspace.open(Path(workspace))
        rows = ws.query("SELECT policy_id FROM checkpoints WHERE kind = 'sft' ORDER BY created_at DESC LIMIT 1").to_pylist()
        if rows:
            base, adapter = resolve_policy(ws, rows[0]["policy_id"])
            return rows[0]["policy_id"], base, adapter
    return "base", resolve_model(DEFAULT_MODEL), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", default=None)
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--frameworks", default=",".join(ENTRIES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from stages.policy.resident import ResidentPolicy
    from stages.policy.sampling import SamplingConfig
    from stages.service.app import ServerThread, build_app
    from stages.service.external import _one
    from stages.service.recorder import EpisodeLog, assemble
    from stages.service.resolve import fixed_resolver
    from stages.service.service import PolicyService, ServiceConfig
    from storage.schema import Message
    from tasks.agent import make_task
    from tasks.doc_search import make_task as doc_search

    torch.set_num_threads(args.threads)
    policy_id, base, adapter = _policy(args.workspace)
    resident = ResidentPolicy.load(base)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    resolve, names = fixed_resolver(policy_id, adapter)
    service = PolicyService(resident, resolve, ServiceConfig(default_max_tokens=args.max_new_tokens, forced=sampling,
                                                             max_total_tokens=2048, seed=7), names)
    example = REPO / "examples" / "doc_search_openai"
    spec = make_task(prompts=str(example / "prompts.jsonl"), entry=f"{example / 'agent.py'}:rollout")
    system_prompt = sys.modules[spec.agent.fn.__module__].SYSTEM_PROMPT
    questions = doc_search().prompts("train")[: args.episodes]
    print(f"policy {policy_id} ({'SFT adapter ' + adapter if adapter else 'base model'}), {len(questions)} episodes "
          f"per framework, max_new_tokens {args.max_new_tokens}", flush=True)

    rows = []
    with ServerThread(build_app(service)) as url:
        for name in args.frameworks.split(","):
            try:
                task = make_task(prompts=str(example / "prompts.jsonl"), entry=str(REPO / ENTRIES[name]),
                                 episode_timeout=900.0)
            except ModuleNotFoundError as e:
                print(f"{name}: skipped, its framework is not installed ({e})", flush=True)
                continue
            requests, extra, prompt_tokens, segments, seconds, errors = [], [], [], [], [], []
            for i, q in enumerate(questions):
                eid = f"bench-{name}-{i}"
                result, error, took = asyncio.run(_one(url, policy_id, task.agent, eid, q))
                log = service.recorder.pop(eid) or EpisodeLog()
                own = len(service.chat.encode(service.chat.render(
                    [Message("system", system_prompt), Message("user", q.question)], True)))
                if error or not log.calls:
                    errors.append(error or "no call recorded")
                    continue
                prompts = [c.choices[0].prompt_ids for c in log.calls]
                requests.append(len(log.calls))
                extra.append(len(prompts[0]) - own)
                prompt_tokens.append(sum(map(len, prompts)))
                segments.append(len(assemble(log).segment_starts) + 1)
                seconds.append(took)
            ok = len(requests)
            row = (name, ok, len(errors), *(statistics.mean(v) if v else float("nan")
                                             for v in (requests, extra, prompt_tokens, segments, seconds)))
            rows.append(row)
            print(f"{name}: {ok} episodes ({len(errors)} errors{': ' + errors[0][:200] if errors else ''}), "
                  f"{row[3]:.2f} requests/episode, {row[4]:.0f} extra prompt tokens on the first request, "
                  f"{row[5]:.0f} prompt tokens/episode, {row[6]:.2f} segments/episode, {row[7]:.1f} s/episode", flush=True)
    service.close()
    print("\n| framework | episodes | errors | requests/episode | extra prompt tokens (first request) | "
          "prompt tokens/episode | segments/episode | s/episode |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, ok, err, req, ex, pt, seg, sec in rows:
        print(f"| {name} | {ok} | {err} | {req:.2f} | {ex:.0f} | {pt:.0f} | {seg:.2f} | {sec:.1f} |")


if __name__ == "__main__":
    loopback.enter()
    main()
