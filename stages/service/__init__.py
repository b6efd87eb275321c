"""The policy service: an OpenAI-compatible HTTP endpoint over a resident policy, recording tokens.

The batching service, the FastAPI app and its server thread, the request schemas, which policies a
model name resolves to, the token-exact recorder, and external agents' rollouts through it. Builds on
stages/policy/; no stage module imports it except the rollout stage (for an external agent task).
"""
