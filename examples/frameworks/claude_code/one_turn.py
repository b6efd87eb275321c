"""Claude Code pointed at `rlops serve`: one prompt, one recorded episode (or the service's clear error).

    rlops serve --base-model MODEL --port 8000 &          # a long-context model: see docs/TASKS.md
    python examples/frameworks/claude_code/one_turn.py --url http://127.0.0.1:8000 "What is 2 + 2?"

Claude Code (the `claude` CLI: npm `@anthropic-ai/claude-code`, or the one the `claude-agent-sdk`
wheel bundles) speaks Anthropic's Messages API to ANTHROPIC_BASE_URL. It is given the episode's URL
(`/ep/{episode_id}`, so every call it makes is recorded under the episode), `base` as its main and
its small model (it names Claude models otherwise, which the service does not serve), and any API
key (unchecked). Prints what Claude Code printed, then the episode the service recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the root URL of `rlops serve`")
    ap.add_argument("--model", default="base", help="the policy to ask (`rlops serve --policy`)")
    ap.add_argument("--claude", default="claude", help="the Claude Code executable")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    episode = f"claude-code-{uuid.uuid4().hex[:8]}"
    env = os.environ | {
        "ANTHROPIC_BASE_URL": f"{args.url}/ep/{episode}", "ANTHROPIC_API_KEY": "rlops-local",
        "ANTHROPIC_MODEL": args.model, "ANTHROPIC_SMALL_FAST_MODEL": args.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": args.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        # Claude Code asks for extended thinking by default, which the service refuses (the policy has none).
        "MAX_THINKING_TOKENS": "0",
    }
    run = subprocess.run([args.claude, "-p", args.prompt, "--max-turns", "1", "--effort", "high"], env=env, capture_output=True,
                         text=True, timeout=args.timeout)
    print(f"claude exited {run.returncode}\n--- stdout\n{run.stdout.strip()}\n--- stderr\n{run.stderr.strip()[-2000:]}")
    try:
        with urllib.request.urlopen(f"{args.url}/rlops/episodes/{episode}") as r:
            recorded = json.load(r)
    except urllib.error.HTTPError as e:
        print(f"--- episode {episode}: {e.code} {e.read().decode()}")
        return
    print(f"--- episode {episode}: {recorded['num_turns']} call(s), {len(recorded['token_ids'])} tokens, "
          f"{sum(recorded['loss_mask'])} sampled, segments at {recorded['segment_starts']}")


if __name__ == "__main__":
    main()
