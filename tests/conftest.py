"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random Llama built around it.

Tests never run the 135M model; the tiny model has the real tokenizer and chat template, so
everything about tokens and templates is exercised for real while a forward pass stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One OpenMP/MKL thread in every process the tests start (`rlops` commands, Prefect flow runs, Ray
# workers, servers), set before any of them is: the xdist workers already fill the cores, and each
# child's torch defaulting to one thread per core oversubscribed them (torch threads that spin-wait on
# each other slow down many times over on a loaded 2-core machine). A value the caller set is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

pytest_plugins = ["tests.netguard"]  # loopback only, and no server outlives the suite
# Before any test module imports mlflow: storage.tracking turns MLflow's usage reports off, as it does
# for rlops itself (stages/cluster.py does the same for Ray's); the guard catches anything else.
import storage.tracking  # noqa: E402, F401


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    # The test machine's cores are shared; tiny models gain nothing from more threads.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (a no-op once prepared); used for its tokenizer."""
    from stages.policy.model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    """The real SmolLM2 tokenizer (chatml template, eos = pad = <|im_end|>), left padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A folder with a tiny random LlamaForCausalLM (hidden 32, 2 layers, SmolLM2's vocabulary) and
    the SmolLM2 tokenizer, loadable by path like any model (e.g. `load_policy(str(path))`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _isolated_tracking_uri() -> Iterator[None]:
    # mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI, which Settings honours (a remote server
    # is a settings change): without this, one test's workspace would leak into the next. Cleared
    # after each test too, not only before: a package- or module-scoped fixture set up for the next
    # test runs before this one does (found by pytest -n 2, whose order put a views fixture after
    # tests/storage/test_tracking.py: the fixture's run then tracked into that test's database).
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)
