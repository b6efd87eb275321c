"""One doc_search GRPO step (4 prompts x G=8 multi-turn episodes, then the update), taken apart.

    .venv/bin/python bench/bench_agent_step.py --workspace WS [--policy ck-...] [--reps 1]

WS is a workspace from `rlops run configs/doc_search.yaml` (any run that made its SFT checkpoint); the
policy defaults to its newest SFT checkpoint, so the episodes have the real ~3 turns of search, read,
answer. In one process, alternating, it times:

- generation (`run_episodes`, the rollout stage's agent loop) with the HF backend's prefill levers off,
  with the group's first-turn prompt shared (`share_prompts`), and with each turn also reusing the previous
  turn's key/value cache (`reuse_turns`); all three must produce the same tokens;
- the update (`train_on_batch`) on those episodes with `grpo.micro_batch_tokens` 384 (the default: one
  ~400-token episode per micro-batch, nothing shared) and 2048 (a group's prompt run once per micro-batch
  of up to 8 continuations), shared or not, with activation checkpointing or not, with random advantages (the
  cost does not depend on their values).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import loopback  # bench/loopback.py: run under .ci/loopback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--policy", default=None, help="a checkpoint id (default: the newest SFT checkpoint)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="per turn (configs/doc_search.yaml: 64)")
    args = ap.parse_args()

    import torch

    from stages.common import resolve_policy
    from stages.policy.agent_loop import EpisodeSpec, run_episodes
    from stages.policy.hf import HFBackend
    from stages.policy.load import load_policy
    from stages.policy.sampling import SamplingConfig
    from stages.update.config import GRPOConfig
    from stages.update.data import Sample
    from stages.update.train import make_optimizer, train_on_batch
    from storage.workspace import Workspace
    from tasks.doc_search import make_task

    ws = Workspace.open(Path(args.workspace))
    policy = args.policy or ws.query(
        "SELECT policy_id FROM checkpoints WHERE kind = 'sft' ORDER BY created_at DESC LIMIT 1").to_pylist()[0]["policy_id"]
    base_model, adapter_dir = resolve_policy(ws, policy)
    model, tokenizer = load_policy(base_model, adapter_dir, trainable=True)  # generates, then trains
    task = make_task(k=3, max_turns=4)
    prompts = task.prompts("train")[:4]
    specs = [EpisodeSpec(p, 1000 + 8 * g + s) for g, p in enumerate(prompts) for s in range(8)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=11)
    print(f"policy {policy}, torch threads {torch.get_num_threads()}, {len(specs)} episodes (4 prompts x 8)")

    variants = {"no sharing": dict(share_prompts=False, reuse_turns=False),
                "shared first-turn prompt": dict(share_prompts=True, reuse_turns=False),
                "shared prompt + turn cache": dict(share_prompts=True, reuse_turns=True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    episodes = {}
    model.eval()  # no LoRA dropout while sampling; train_on_batch switches to training itself
    calls: dict[str, list[str]] = {}
    for _ in range(args.reps):
        for name, levers in variants.items():
            backend = _Timed(HFBackend(model, tokenizer, **levers))
            start = time.perf_counter()
            episodes[name] = run_episodes(backend, tokenizer, task, specs, sampling,
                                          max_total_tokens=1536, tool_timeout=5.0)
            times[name].append(time.perf_counter() - start)
            calls[name] = backend.log
    reference = episodes["no sharing"]
    eps = episodes["shared prompt + turn cache"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(eps, reference))
    turns = sum(e.num_turns for e in eps) / len(eps)
    tokens = sum(len(e.token_ids) for e in eps) / len(eps)
    print(f"episodes: {turns:.2f} turns, {tokens:.0f} tokens on average; {same}/{len(eps)} identical to the unshared run")
    base = min(times["no sharing"])
    for name, ts in times.items():
        print(f"  generation, {name:28s} {min(ts):6.1f} s  ({base / min(ts):.2f}x)")
        for line in calls[name]:
            print(f"      {line}")

    samples = [Sample(e.token_ids, e.loss_mask, e.behavior_logprobs) for e in eps]
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))
    updates = {"micro_batch_tokens 384 (default)": GRPOConfig(micro_batch_tokens=384),
               "micro_batch_tokens 2048, shared prompts": GRPOConfig(micro_batch_tokens=2048),
               "micro_batch_tokens 2048, unshared": GRPOConfig(micro_batch_tokens=2048, share_prompts=False),
               "micro_batch_tokens 2048, shared, no checkpointing": GRPOConfig(micro_batch_tokens=2048,
                                                                              activation_checkpointing=False)}
    seconds: dict[str, list[float]] = {name: [] for name in updates}
    for _ in range(args.reps):
        for name, config in updates.items():
            optimizer = make_optimizer(model, adapter_dir, config)
            start = time.perf_counter()
            train_on_batch(model, optimizer, samples, advantages, config, temperature=1.0)
            seconds[name].append(time.perf_counter() - start)
    first = min(seconds["micro_batch_tokens 384 (default)"])
    for name, ts in seconds.items():
        print(f"  update, {name:50s} {min(ts):6.1f} s  ({first / min(ts):.2f}x)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"peak RSS of the process {peak:.0f} MiB")


class _Timed:
    """A backend that logs each generate call: rows, prompt width, tokens generated (the longest row sets how
    many decoding steps the whole batch runs), seconds."""

    def __init__(self, backend) -> None:
        self.backend, self.eos_ids, self.log = backend, backend.eos_ids, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, sampling, seed=None):
        start = time.perf_counter()
        out = self.backend.generate(prompts, sampling, seed)
        lengths = sorted(len(s.token_ids) for s in out)
        self.log.append(f"turn: {len(prompts)} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
                        f"sampled median {lengths[len(lengths) // 2]} / max {lengths[-1]} tokens, "
                        f"{time.perf_counter() - start:.1f} s")
        return out


if __name__ == "__main__":
    loopback.enter()
    main()
