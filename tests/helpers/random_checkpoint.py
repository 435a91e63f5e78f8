"""Random-weight Hugging Face checkpoints (Llama, Mistral, Qwen2) with a trained byte-level BPE tokenizer
and a ChatML chat template, built deterministically: the tiny models of the fast tests and of some
benchmarks (their text is gibberish; the real model is engine/models/default.py's)."""
from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to and in is was for on that with as by at from it this be are or not have has had "
    "you we they he she his her their our your what which who when where why how all any some many "
    "model token cache block prefix prompt system user assistant request server stream memory page "
    "attention kernel batch sequence hash pin share reuse time fast slow first last next value key "
    "question answer example hello world please thank help write read code data list number name "
    "one two three four five six seven eight nine ten hundred thousand new old good great small large"
).split()
_EXTRA = ["café", "naïve", "über", "日本語", "中文", "한국어", "Ελληνικά", "русский", "🙂", "🚀", "€", "ß",
          "{", "}", "(", ")", "[", "]", ":", ";", ",", ".", "!", "?", "\n", "  ", "0", "1", "42", "2026"]


def demo_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.9 else rng.choice(_EXTRA) for _ in range(rng.randint(4, 24))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, corpus: list[str]) -> int:
    """Trains a byte-level BPE tokenizer with a chat template into out_dir; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()


def build_checkpoint(out_dir: Path, architecture: str = "llama", *, hidden_size: int, num_layers: int,
                     num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                     head_dim: int | None = None, initializer_range: float = 0.02, seed: int = 0,
                     max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                     rope_parameters: dict | None = None, corpus: list[str] | None = None) -> Path:
    """Writes a random-weight HF checkpoint (safetensors) plus a trained tokenizer into out_dir."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir, vocab_size, corpus or demo_corpus())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    cfg_cls, model_cls = classes[architecture]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, initializer_range=initializer_range,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    if architecture == "mistral":
        kwargs["sliding_window"] = None
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
