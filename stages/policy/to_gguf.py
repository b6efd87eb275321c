"""A llama-architecture model and its tokenizer as one GGUF file, for llama.cpp, Ollama and transformers' GGUF
loader (`from_pretrained(folder, gguf_file=...)`).

    problems = gguf_problems(model_folder)                 # before any work: what this writer cannot express
    write_gguf(model, model_folder, "policy.gguf", "f32", name="ck-...")  # model: a merged LlamaForCausalLM

Names, metadata keys and the q/k row permutation are those of llama.cpp's `convert_hf_to_gguf.py` for
LlamaForCausalLM (llama.cpp applies rotary embeddings to interleaved pairs, transformers to the two halves
of a head; transformers' loader undoes the permutation). The tokenizer goes in whole, as llama.cpp's
converter writes it and transformers' loader reads it: the byte-level BPE vocabulary in id order with each
added token's type (special ones CONTROL, so they stay one token), the merges, the special token ids and the
chat template. `f16` stores the matrices in half precision and keeps the 1-D norm weights in f32, as
llama.cpp does; `f32` keeps every weight as trained. torch, transformers and gguf are imported inside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from storage.atomic import atomic_path

# tokenizer.json pre-tokenizers llama.cpp knows by name (`tokenizer.ggml.pre`): GPT-2's regex, and SmolLM's
# (single digits first, then GPT-2's).
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
_PRE_TOKENIZERS = {"gpt-2": [_BYTE_LEVEL], "smollm": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
# transformers' LlamaForCausalLM weight name -> GGUF tensor name ("{i}": the layer)
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
DTYPES = ("f32", "f16")


def gguf_problems(folder: Path) -> list[str]:
    """Why the model in `folder` cannot be written by `write_gguf` (an empty list: it can): reads its config and
    tokenizer files only."""
    config = json.loads((folder / "config.json").read_text())
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"gguf export writes llama-architecture models; {folder.name} is {config.get('model_type')!r} "
                        "(use --format hf)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"gguf export writes default rotary embeddings; the model uses {rope.get('rope_type')!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("gguf export writes llama models without biases; this one has attention or MLP biases")
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        return problems + [f"gguf export needs a fast tokenizer (tokenizer.json) in {folder}"]
    spec = json.loads(tokenizer.read_text())
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append("gguf export writes byte-level BPE tokenizers (GPT-2's kind); this one is "
                        f"{spec['model']['type']} with a {(spec.get('decoder') or {}).get('type')} decoder")
    elif pre_tokenizer_name(spec) is None:
        problems.append(f"the tokenizer's pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:120]} has no "
                        f"llama.cpp name this writer knows ({', '.join(_PRE_TOKENIZERS)})")
    return problems


def pre_tokenizer_name(spec: dict[str, Any]) -> str | None:
    """llama.cpp's name for a tokenizer.json's pre-tokenizer, or None."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for name, wanted in _PRE_TOKENIZERS.items():
        if len(steps) == len(wanted) and all(all(s.get(k) == v for k, v in w.items()) for s, w in zip(steps, wanted)):
            return name
    return None


def write_gguf(model: Any, folder: Path, path: Path | str, dtype: str, *, name: str) -> None:
    """Write `model` (a LlamaForCausalLM, adapters merged) with the tokenizer of `folder` to `path`, atomically;
    `name` is the file's `general.name` (what llama.cpp shows)."""
    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(tmp, "llama")
        writer.add_name(name)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10_000.0))))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        _add_tokenizer(writer, folder, config.vocab_size)
        for name, tensor in _tensors(model, heads, kv_heads, dtype):
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _tensors(model: Any, heads: int, kv_heads: int, dtype: str) -> Any:
    """(GGUF name, numpy array) of every weight; the tied output layer is left out, as llama.cpp does (the
    loader ties it to the embeddings again)."""
    import numpy as np

    layers = range(model.config.num_hidden_layers)
    names = {hf.format(i=i): ours.format(i=i) for hf, ours in _NAMES.items() for i in layers}
    tied = model.config.tie_word_embeddings
    for hf_name, weight in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        if hf_name not in names:
            raise ValueError(f"no GGUF name for the weight {hf_name!r} (not a plain LlamaForCausalLM)")
        w = weight.detach().float().cpu().numpy()
        if ".attn_q." in names[hf_name]:
            w = _permute(w, heads)
        elif ".attn_k." in names[hf_name]:
            w = _permute(w, kv_heads)
        half = dtype == "f16" and w.ndim > 1  # llama.cpp keeps 1-D weights (the norms) in f32
        yield names[hf_name], np.ascontiguousarray(w.astype(np.float16 if half else np.float32))


def _permute(w: Any, heads: int) -> Any:
    """llama.cpp's row order for a q or k projection (out_features, in_features): within each head, the two
    rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: Any, folder: Path, vocab_size: int) -> None:
    """The tokenizer of `folder` as llama.cpp's `tokenizer.*` keys; ids past the tokenizer's (a padded embedding)
    become unused `[PADn]` tokens, as llama.cpp's converter writes them."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, bos/eos/unk/pad ids, add_bos_token and the chat template (chat_template.jinja), as llama.cpp reads them
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
