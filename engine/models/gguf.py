"""GGUF files (llama.cpp's format) for Llama-family models, through the `gguf` package.

    file.gguf ──► config (from the metadata) + tensors dequantized to float32 + tokenizer and chat
                  template (transformers builds them from the metadata)
              ──► a Hugging Face checkpoint directory in ~/.cache/prefixserve/gguf-<digest>/
              ──► loaded like any safetensors checkpoint (loader.py)

The directory is keyed by a digest of the whole file (metadata and tensor contents), written to a
temporary directory and renamed into place, so concurrent starts are safe and a second start only
reads it back. The digest becomes the model's fingerprint, so two GGUFs that differ only in their
weights never share a prefix registry.

NOTE: llama.cpp's converter permutes the rows of Llama's Q and K projections (it pairs rotary halves
differently: interleaved rather than split in two); `_unpermute` restores transformers' layout. Tensor
types are whatever `gguf.quants.dequantize` handles (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the
K-quants, ...); anything else is refused naming the tensor and its type.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

GGUF_SUFFIX = ".gguf"
_FINGERPRINT_FILE = "prefixserve-fingerprint"
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}      # the GGUF architecture names we load
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


class UnsupportedGGUF(ValueError):
    """A GGUF this loader cannot serve: an architecture or tensor type it does not know."""


def is_gguf(model: str) -> bool:
    return model.endswith(GGUF_SUFFIX)


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """The Hugging Face checkpoint directory for `gguf_path`, converted on first use."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    digest = file_digest(gguf_path)
    target = cache_dir / f"gguf-{digest}"
    if (target / _FINGERPRINT_FILE).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gguf-convert-", dir=cache_dir))
    try:
        _convert(gguf_path, tmp)
        (tmp / _FINGERPRINT_FILE).write_text(digest)   # last: its presence means the directory is whole
        try:
            os.rename(tmp, target)
        except OSError:                                # another process won the race: use its copy
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def stored_fingerprint(path: Path) -> str | None:
    """The GGUF digest a converted checkpoint directory carries (None for ordinary checkpoints)."""
    f = path / _FINGERPRINT_FILE
    return f.read_text().strip() if f.exists() else None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def hf_config(reader: Any) -> dict[str, Any]:
    """transformers' config.json for the model a GGUF holds."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedGGUF(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}")
    p = f"{arch}."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedGGUF(f"GGUF RoPE scaling {scaling!r} is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedGGUF("GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "attention.key_length", _field(reader, p + "rope.dimension_count",
                                                                           hidden // heads))),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: [heads, 2, half, in] <- [heads, half, 2, in]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: Any, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor, dequantized to float32, under its transformers name and in its layout."""
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedGGUF(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which gguf cannot "
                                  f"dequantize here ({exc})") from exc
        w = np.array(w, dtype=np.float32, order="C").reshape([int(d) for d in reversed(t.shape)])  # writable
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = w
    return out


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_TENSORS:
            return f"model.layers.{idx}.{_LAYER_TENSORS[rest]}"
    raise UnsupportedGGUF(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")


_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
_EIGHT_BIT = ("Q8_0", "Q8_1", "Q8_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def native_quantization(gguf_path: Path) -> str:
    """The quantization that keeps a GGUF's layer weights as small as they are: int4 for 4-bit types,
    int8 for 5- to 8-bit ones, none for F32 / F16 / BF16 (by the type most of the layer weights have)."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors
                    if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2)
    if not kinds:
        return "none"
    top = kinds.most_common(1)[0][0]
    return "int4" if top in _FOUR_BIT else "int8" if top in _EIGHT_BIT else "none"


def q4_weights(gguf_path: Path) -> dict[str, tuple[Any, ...]]:
    """The exact 4-bit form (engine/models/quant.gguf_q4) of every Q4_0 / Q4_1 projection, under our fused
    parameter names (layers.i.self_attn.qkv_proj.weight, layers.i.mlp.gate_up_proj.weight, ...), Q/K rows
    un-permuted as `hf_tensors` does. A fused projection is listed only if all its parts are 4-bit."""
    import torch
    from gguf import GGUFReader

    from engine.models.quant import gguf_q4

    reader = GGUFReader(str(gguf_path))
    cfg = hf_config(reader)
    parts: dict[str, tuple[Any, ...]] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        cols, rows = (int(d) for d in t.shape)
        got = gguf_q4(np.asarray(t.data), t.tensor_type.name, rows, cols)
        if got is None:
            continue
        name = _hf_name(t.name).removeprefix("model.")
        if name.endswith("q_proj.weight"):
            got = tuple(torch.from_numpy(_unpermute(x.numpy(), cfg["num_attention_heads"])) for x in got)
        elif name.endswith("k_proj.weight"):
            got = tuple(torch.from_numpy(_unpermute(x.numpy(), cfg["num_key_value_heads"])) for x in got)
        parts[name] = got
    out: dict[str, tuple[Any, ...]] = {}
    for i in range(cfg["num_hidden_layers"]):
        for fused, names in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("self_attn.o_proj", ("self_attn.o_proj",)),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                             ("mlp.down_proj", ("mlp.down_proj",))):
            pieces = [parts.get(f"layers.{i}.{n}.weight") for n in names]
            if all(p is not None for p in pieces):
                out[f"layers.{i}.{fused}.weight"] = tuple(torch.cat([p[k] for p in pieces]) for k in range(3))  # type: ignore[index]
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer into `out`."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    cfg = hf_config(reader)
    tensors = {k: torch.from_numpy(v) for k, v in hf_tensors(reader, cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if "eos_token_id" in cfg:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
