"""The policy update: how a stage turns scored rollouts into new LoRA weights.

config (the algorithm's settings), data (the scored batch as training samples with advantages), loss
(the pure objective), train (micro-batches, the accumulated loss, the optimizer step) and workers
(in-process or data-parallel over the resident update worker group, group). GRPO is the first algorithm; new ones land here beside
it, and the stage module (stages/grpo.py) stays read -> train -> save. Builds on stages/policy/.
"""
