"""Fixtures shared by the engine tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_parity import MAX_NEW, make_prompts


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The tiny checkpoint, the parity prompts, and transformers' greedy outputs for them (both backends'
    parity tests compare with these)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    prompts = make_prompts(hf.config.vocab_size)
    expected = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        expected.append(out[0, len(p):].tolist())
    return tiny_model_dir, prompts, expected
