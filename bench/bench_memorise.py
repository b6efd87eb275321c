"""What the tests' memorised models cost to train (tests/scripted_model.py): the causal LM loss of the whole
conversation computed the way `model(labels=...)` does (logits over the 49k-token vocabulary at every position)
vs `labelled_loss` (`logits_to_keep`: the logits only at the positions that predict a labelled token), on the
tiny test Llama (hidden 32, 2 layers, SmolLM2's tokenizer) and the scripted doc-search conversation.

    .venv/bin/python bench/bench_memorise.py [--steps 150] [--repeats 3]

Both train the same seeded copy in this process, one thread, alternating, and report the CPU seconds of the
training loop only (model load and imports excluded), their ratio, and the final losses, which agree to float
noise: the two compute the same loss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def train(model_dir: Path, ids: list[int], labels: list[int], steps: int, kept: bool) -> tuple[float, float]:
    """(CPU seconds of `steps` Adam steps, the last loss)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.scripted_model import labelled_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids_t, labels_t = torch.tensor([ids]), torch.tensor([labels])
    start = time.process_time()
    for _ in range(steps):
        loss = labelled_loss(model, ids, labels) if kept else model(input_ids=ids_t, labels=labels_t).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.process_time() - start, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from stages.policy.model import prepare_default_model
    from tests.conftest import _tiny_llama
    from tests.scripted_model import conversation_tokens, script_messages

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**_tiny_llama(tok))).save_pretrained(tmp)
        ids, labels = conversation_tokens(tok, script_messages())
        print(f"conversation: {len(ids)} tokens, {sum(x != -100 for x in labels)} labelled; {args.steps} steps")
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for kept in (False, True):
                runs[kept].append(train(Path(tmp), ids, labels, args.steps, kept))
    for kept, name in ((False, "every position (model(labels=...))"), (True, "labelled positions (labelled_loss)")):
        cpu = [c for c, _ in runs[kept]]
        print(f"{name:40s} CPU {statistics.median(cpu):6.2f} s (runs {', '.join(f'{c:.2f}' for c in cpu)}), "
              f"last loss {runs[kept][-1][1]:.5f}")
    ratio = statistics.median(c for c, _ in runs[True]) / statistics.median(c for c, _ in runs[False])
    print(f"labelled / every: {ratio:.3f}x CPU")


if __name__ == "__main__":
    main()
