"""Greedy replies of exported models with plain transformers and no rlops import (tests/stages/test_export.py runs
it in a process of its own):

    python plain_replies.py QUESTIONS.json SYSTEM MAX_NEW_TOKENS MODEL...

MODEL is an hf folder, or FOLDER/FILE.gguf for transformers' GGUF loader (`from_pretrained(FOLDER,
gguf_file=FILE.gguf)`, tokenizer included). Prints one JSON object: {"replies": {MODEL: [reply, ...]},
"rlops_modules": [...]}, the second empty when nothing of rlops was imported.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def replies(model_path: str, questions: list[str], system: str, max_new: int) -> list[str]:
    path = Path(model_path)
    folder, extra = (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (path, {})
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
    eos = model.generation_config.eos_token_id
    out = []
    for q in questions:
        chat = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, pad_token_id=eos)
        new = ids[0, inputs["input_ids"].shape[1]:].tolist()
        new = new[:-1] if new and new[-1] == eos else new  # as the service returns a turn: without its EOS
        out.append(tokenizer.decode(new, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return out


def main() -> None:
    questions, system, max_new = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    found = {m: replies(m, questions, system, max_new) for m in sys.argv[4:]}
    ours = sorted({m.split(".")[0] for m in sys.modules} & {"flows", "stages", "storage", "rewards", "tasks"})
    print(json.dumps({"replies": found, "rlops_modules": ours}))


if __name__ == "__main__":
    main()
