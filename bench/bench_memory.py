"""Where a run's memory goes (issue 24: "a doc_search run peaks at 6.1 GB RSS for a 135M model"): each stage of
a config run alone in a child process, its peak RSS and the biggest contributors.

    .venv/bin/python bench/bench_memory.py [--config configs/doc_search.yaml] [--sft-steps 4] [--prompts N]
        [--stages sft rollout grpo] [--chain] [--kv-before] [--set key=value ...]

The lead's measured runs (quiet machine), after and before the rollout cache cut:
    bench/bench_memory.py --config configs/doc_search.yaml --sft-steps 0 --chain
    bench/bench_memory.py --config configs/doc_search.yaml --sft-steps 0 --chain --kv-before
(the whole SFT: a policy that calls the tools, so the rollout's episodes have the real run's turns and lengths; a
few SFT steps leave the model answering at once, and the rollout's caches stay short).

The stages run in order in one fresh workspace, each in its own process (this script re-invoked with `--child`),
with no resident policy session, so each peak is that stage's own: `sft` (the config's SFT, or `--sft-steps`
optimizer steps of it, its real batch size and max length), `rollout` (one training batch of the SFT checkpoint with
the config's prompts_per_step x group_size episodes, max_new_tokens and max_total_tokens; then its score stage,
no torch), `grpo` (one update on that batch with the config's micro_batch_tokens). A thread samples RSS every
20 ms. What the child measures besides:
- `base`: RSS once torch, transformers and the stage's modules are imported, before any model exists;
- `models`: every model `from_pretrained` loads (count, parameter bytes each, RSS added by the load);
- `kv`: the rollout's key/value caches at their largest (bytes allocated, bytes holding tokens, rows x columns),
  read from the growing cache layers (stages/policy/kv_cache.py) each time a turn's cache is kept;
- `logits`: the largest output-layer chunk (rows x vocab x 4 bytes; stages/policy/logprobs.py scores a chunk of
  rows at a time) and the largest sequence batch the update or SFT ran through the decoder (rows x tokens).
`--chain` then runs the same stages again in one process with a resident policy session, as `rlops run` does,
printing each stage's peak and the RSS left after it. `--kv-before` restores the rollout cache's first rule (an
adopted turn's cache doubled into a new buffer, stages/policy/kv_cache.py) for the A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import loopback  # bench/loopback.py: run under .ci/loopback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """RSS sampling and the contributors' sizes, recorded by wrapping the functions that allocate them."""

    def __init__(self) -> None:
        self.peak, self.base = 0, 0
        self.models: list[dict[str, float]] = []
        self.kv = {"allocated": 0, "used": 0, "rows": 0, "columns": 0}
        self.logits = {"chunk_rows": 0, "chunk_bytes": 0, "batch_rows": 0, "batch_tokens": 0}
        self._done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, _rss())

    def stop(self) -> None:
        self._done.set()
        self.peak = max(self.peak, _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def install(self) -> None:
        import torch  # noqa: F401 - imported before `base` is read: its own RSS is not a model's
        from transformers import PreTrainedModel

        from stages.policy import kv_cache, logprobs

        load = PreTrainedModel.from_pretrained.__func__

        def from_pretrained(cls: Any, *a: Any, **kw: Any) -> Any:
            before = _rss()
            model = load(cls, *a, **kw)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            self.models.append({"class": cls.__name__, "param_bytes": params, "rss_added": _rss() - before})
            return model

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # every model class inherits it

        keep = kv_cache.KeptCache.keep

        def kept(cache_self: Any, tokens: Any, width: int, prompts: Any, cache: Any) -> None:
            layers = getattr(cache, "layers", None) or []
            allocated = sum((l._keys.nbytes + l._values.nbytes) if getattr(l, "_keys", None) is not None
                            else l.keys.nbytes + l.values.nbytes for l in layers if l.is_initialized)
            if allocated > self.kv["allocated"]:
                used = sum(l.keys.nbytes + l.values.nbytes for l in layers if l.is_initialized)
                self.kv = {"allocated": allocated, "used": used, "rows": layers[0].keys.shape[0],
                           "columns": layers[0].keys.shape[-2]}
            return keep(cache_self, tokens, width, prompts, cache)

        kv_cache.KeptCache.keep = kept

        chunk = logprobs._chunk_logprobs

        def chunk_logprobs(lm_head: Any, hidden: Any, targets: Any, temperature: float) -> Any:
            rows = hidden.shape[0]
            if rows > self.logits["chunk_rows"]:
                self.logits.update(chunk_rows=rows, chunk_bytes=rows * lm_head.weight.shape[0] * 4)
            return chunk(lm_head, hidden, targets, temperature)

        logprobs._chunk_logprobs = chunk_logprobs
        for name in ("token_logprobs", "shared_prefix_logprobs"):
            original = getattr(logprobs, name)

            def wrapped(model: Any, ids: Any, *a: Any, _f: Any = original, **kw: Any) -> Any:
                # token_logprobs(model, ids (B, T), ...); shared_prefix_logprobs(model, prefix (P,), suffixes (n, S), ...)
                rows, tokens = (ids.shape[0], ids.shape[1]) if ids.dim() == 2 else (a[0].shape[0], ids.shape[0] + a[0].shape[1])
                if rows * tokens > self.logits["batch_rows"] * self.logits["batch_tokens"]:
                    self.logits.update(batch_rows=rows, batch_tokens=tokens)
                return _f(model, ids, *a, **kw)

            setattr(logprobs, name, wrapped)
        self.base = _rss()


def child(args: argparse.Namespace) -> None:
    import yaml

    from flows.config import apply_overrides
    from flows.pipeline import resident, sft_data
    from flows.run_config import from_dict
    from stages import grpo, rollout, score, sft
    from stages.common import StageContext, base_policy
    from stages.reward_ref import RewardRef
    from storage.workspace import Workspace

    cfg = from_dict(apply_overrides(yaml.safe_load(Path(args.config).read_text()), args.set))
    probe = Probe()
    probe.install()
    if args.kv_before:
        from stages.policy.kv_cache import _growing_layer

        _growing_layer().double_adopted = True
    ws = Workspace.open(Path(args.workspace))
    state = {"policy": base_policy(ws, cfg.base_model) if args.policy == "base" else args.policy, "batch": args.batch}

    def one(stage: str, ctx: StageContext) -> dict[str, Any]:
        t0 = time.perf_counter()
        if stage == "sft":
            assert cfg.sft is not None, "the config has no sft: section"
            config = cfg.sft.model_copy(update={"max_steps": args.sft_steps}) if args.sft_steps else cfg.sft
            state["policy"] = sft.run(config, ctx, base_model=cfg.base_model, data=sft_data(cfg, ws.root)).id
        elif stage == "rollout":
            config = cfg.rollout.model_copy(update={"prompts_per_step": args.prompts or cfg.rollout.prompts_per_step})
            state["batch"] = rollout.run(config, ctx, policy_id=state["policy"], task=cfg.task, split="train", step=0).id
            score.run(cfg.score, ctx, batches=[state["batch"]])
        else:
            reward = RewardRef.configured(cfg.score, cfg.reward_name)
            state["policy"] = grpo.run(cfg.grpo, ctx, parent_policy=state["policy"], batches=[state["batch"]],
                                       reward=reward).id
        return {"seconds": time.perf_counter() - t0}

    ctx = StageContext(ws, run_name=f"{cfg.name}-memory")
    if args.child != "chain":
        out = one(args.child, ctx)
        probe.stop()
        print(json.dumps({**state, **out, "peak": probe.peak, "base": probe.base, "models": probe.models,
                          "kv": probe.kv, "logits": probe.logits}))
        return
    # The stages in one process with the run's resident policy, as `rlops run` chains them: each stage's peak
    # and what stays resident after it (a model kept, or freed memory the allocator did not give back).
    chain = []
    with resident(ctx) as ctx:
        for stage in args.stages:
            probe.peak = _rss()
            out = one(stage, ctx)
            chain.append({"stage": stage, **out, "peak": max(probe.peak, _rss()), "after": _rss()})
    probe.stop()
    print(json.dumps({"chain": chain, "base": probe.base, "models": probe.models}))


def report(stage: str, r: dict[str, Any]) -> None:
    models = r["models"]
    kv, lg = r["kv"], r["logits"]
    print(f"{stage:>8} {r['peak'] / GB:>7.2f} {r['base'] / GB:>7.2f} {r['seconds']:>7.0f}  "
          f"models {len(models)} x {max((m['param_bytes'] for m in models), default=0) / GB:.2f} GB params "
          f"(+{sum(m['rss_added'] for m in models) / GB:.2f} GB RSS at load)", flush=True)
    if kv["allocated"]:
        print(f"{'':>34}KV cache {kv['allocated'] / GB:.2f} GB allocated, {kv['used'] / GB:.2f} GB holding tokens "
              f"({kv['rows']} rows x {kv['columns']} columns)")
    if lg["chunk_rows"]:
        print(f"{'':>34}logits chunk {lg['chunk_rows']} rows = {lg['chunk_bytes'] / GB:.2f} GB fp32; largest decoder "
              f"batch {lg['batch_rows']} x {lg['batch_tokens']} tokens")
    rest = r["peak"] - r["base"] - sum(m["rss_added"] for m in models) - kv["allocated"]
    print(f"{'':>34}the rest of the peak (activations, optimizer, allocator slack): {rest / GB:.2f} GB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "doc_search.yaml"))
    p.add_argument("--sft-steps", type=int, default=4, help="SFT optimizer steps (the real batch size and lengths); 0: the config's whole SFT")
    p.add_argument("--prompts", type=int, default=None, help="rollout prompts (default: the config's prompts_per_step)")
    p.add_argument("--stages", nargs="+", default=["sft", "rollout", "grpo"], choices=["sft", "rollout", "grpo"])
    p.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    p.add_argument("--chain", action="store_true", help="also run the stages in one process with a resident policy")
    p.add_argument("--kv-before", action="store_true", help="the rollout's caches as before issue 24's cut (A/B)")
    p.add_argument("--child", choices=["sft", "rollout", "grpo", "chain"])
    p.add_argument("--workspace")
    p.add_argument("--policy")
    p.add_argument("--batch")
    args = p.parse_args()
    if args.child:
        return child(args)
    print(f"{'stage':>8} {'peak GB':>7} {'base GB':>7} {'s':>7}  contributors")
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        policy, batch = "base", None
        for stage in ("sft", "rollout", "grpo"):
            if stage not in args.stages:
                continue
            cmd = [sys.executable, __file__, "--child", stage, "--config", args.config, "--workspace", str(Path(tmp) / "ws"),
                   "--sft-steps", str(args.sft_steps), "--policy", policy, "--set", *args.set]
            cmd += ["--prompts", str(args.prompts)] if args.prompts else []
            cmd += ["--batch", batch] if batch else []
            cmd += ["--kv-before"] if args.kv_before else []
            r = json.loads(subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True).stdout
                           .strip().splitlines()[-1])
            report(stage, r)
            if stage == "sft":
                policy = r["policy"]
            elif stage == "rollout":
                batch = r["batch"]
        if args.chain:
            cmd = [sys.executable, __file__, "--child", "chain", "--config", args.config, "--workspace",
                   str(Path(tmp) / "chain"), "--sft-steps", str(args.sft_steps), "--policy", "base",
                   "--stages", *args.stages, "--set", *args.set]
            cmd += ["--prompts", str(args.prompts)] if args.prompts else []
            cmd += ["--kv-before"] if args.kv_before else []
            r = json.loads(subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True).stdout
                           .strip().splitlines()[-1])
            print(f"one process, resident policy (base {r['base'] / GB:.2f} GB, {len(r['models'])} models loaded): "
                  + "; ".join(f"{c['stage']} peak {c['peak'] / GB:.2f} GB, {c['seconds']:.0f} s, "
                              f"{c['after'] / GB:.2f} GB after" for c in r["chain"]), flush=True)


if __name__ == "__main__":
    loopback.enter()
    main()
