"""The policy runtime: a base model plus a LoRA adapter, loaded, sampled from, scored and kept resident.

model (base model resolution), lora (adapter settings), load (base + adapter), the generation
backends and their contract, the batched agent loop, log-probs, and the resident policies of a
served model and of a chained run. It imports no stage, service or update module: those build on it.
"""
