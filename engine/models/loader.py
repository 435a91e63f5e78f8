"""Load a model: a Hugging Face checkpoint directory (config.json, safetensors weights sharded or not,
tokenizer) or a GGUF file (converted once to such a directory, engine/models/gguf.py). No hub access:
a model is a local path.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import QUANTIZATIONS
from engine.models.gguf import checkpoint_dir, file_digest, is_gguf, native_quantization, q4_weights, stored_fingerprint
from engine.models.llama import LlamaForCausalLM, ModelArgs, rope_inv_freq
from engine.models.quant import quantize_model
from kernels.ops import Ops, default_ops

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    args: ModelArgs
    tokenizer: Any                  # transformers PreTrainedTokenizerBase
    path: Path
    fingerprint: str                # hex; seeds the prefix-cache hashes
    tokenizer_version: str          # hex of tokenizer files + chat template
    eos_token_ids: list[int]
    name: str = ""                  # what the API calls it: the directory's or the .gguf file's name
    quantization: str = "none"      # weights kept quantized: none, int8, int4 (engine/models/quant.py)


def default_cache_dir() -> Path:
    """Where converted checkpoints go: $XDG_CACHE_HOME/prefixserve, else ~/.cache/prefixserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixserve"


def resolve_model_path(model: str) -> Path:
    """A checkpoint directory: `model` itself, or the directory a .gguf file converts to."""
    path = Path(model).expanduser()
    if is_gguf(model):
        return checkpoint_dir(path, default_cache_dir())
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} does not exist (give a checkpoint directory or a .gguf file)")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r} is not a Hugging Face checkpoint directory (no config.json) "
                                "nor a .gguf file")
    return path


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _fuse_map(args: ModelArgs) -> dict[str, tuple[str, int, int]]:
    """HF weight name suffix -> (our parameter suffix, row offset, rows) for fused projections."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    inter = args.intermediate_size
    return {
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv),
        "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0, q),
        "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", q, kv),
        "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", q + kv, kv),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, inter),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", inter, inter),
    }


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    fuse = _fuse_map(model.args)
    seen: set[str] = set()
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                tensor = f.get_tensor(name)
                ours = name.removeprefix("model.")
                if ours == "lm_head.weight" and model.args.tie_word_embeddings:
                    continue
                target, rows = ours, None
                if ours.startswith("layers."):
                    idx, rest = ours[len("layers."):].split(".", 1)
                    if rest in fuse:
                        dst, off, n = fuse[rest]
                        target, rows = f"layers.{idx}.{dst}", (off, n)
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                with torch.no_grad():
                    p = params[target]
                    if rows is None:
                        p.copy_(tensor)
                    else:
                        p[rows[0]:rows[0] + rows[1]].copy_(tensor)
                seen.add(target)
    missing = [n for n in params if n not in seen and not (n == "lm_head.weight" and model.args.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()


def weights_digest(path: Path, cache_dir: Path | None = None) -> str:
    """A digest of a checkpoint directory's weight files' content (the .safetensors files, by name and bytes):
    two fine-tunes of one base share config and tokenizer, not weights. Hashing reads every byte (~0.5 s a
    GB), so each file's digest is cached in `cache_dir` (default: default_cache_dir()) under its absolute path,
    size and modification time; a cache that cannot be read or written is only a slower start."""
    cache_file = (cache_dir or default_cache_dir()) / "weights-digests.json"
    try:
        cache: dict[str, list[Any]] = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    parts, changed = [], False
    for file in sorted(path.glob("*.safetensors")):
        st = file.stat()
        key, stamp = str(file.resolve()), [st.st_size, st.st_mtime_ns]
        entry = cache.get(key)
        if not (isinstance(entry, list) and entry[:2] == stamp and len(entry) == 3):
            entry = [*stamp, file_digest(file)]
            cache[key], changed = entry, True
        parts.append(f"{file.name}:{entry[2]}".encode())
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
        except OSError:
            pass
    return _digest(*parts)


def load_model(model: str, device: str = "cpu", dtype: str = "float32", quantization: str | None = None,
               ops: Ops | None = None) -> LoadedModel:
    """`quantization`: none, int8 or int4; None: the checkpoint's own (a GGUF's, where the op layer has quantized
    GEMMs: on the CPU; none otherwise). `ops`: the op layer the model runs on (default: one for `device`)."""
    from transformers import AutoTokenizer

    ops = ops or default_ops(device)
    if quantization is None:
        quantization = native_quantization(Path(model).expanduser()) if is_gguf(model) and ops.quantized_gemms \
            else "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization != "none" and not ops.quantized_gemms:
        raise ValueError(f"quantization {quantization!r} runs on the CPU only for now; use quantization 'none'")

    path = resolve_model_path(model)
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    torch_dtype = _DTYPES[dtype]
    with torch.device("meta"):
        net = LlamaForCausalLM(args, ops)
    net = net.to_empty(device=device)
    if args.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    load_weights(net, path)
    net = net.to(dtype=torch_dtype)
    if quantization != "none":
        exact = q4_weights(Path(model).expanduser()) if is_gguf(model) and quantization == "int4" else None
        quantize_model(net, quantization, exact, ops)
        net.mixed = True                  # bfloat16 between the quantized matmuls (kernels/ops.py)
    net.set_ops(ops)
    net.rotary.inv_freq = rope_inv_freq(args).to(device)  # float32 whatever the weights' dtype
    net.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tok_files = sorted(p for p in path.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "chat_template")))
    tokenizer_version = _digest(*(p.read_bytes() for p in tok_files),
                                (getattr(tokenizer, "chat_template", None) or "").encode())
    weights_cfg = json.dumps({k: v for k, v in cfg.items() if k != "transformers_version"}, sort_keys=True)
    # a converted GGUF carries the digest of the whole file (weights included); a directory, its config and
    # the digest of its weight files (two fine-tunes of one base must not share hashes nor a Redis namespace)
    source = stored_fingerprint(path) or weights_cfg + weights_digest(path)
    fingerprint = _digest(source.encode(), tokenizer_version.encode())[:32]
    eos = cfg.get("eos_token_id")
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    if not eos_ids and tokenizer.eos_token_id is not None:
        eos_ids = [tokenizer.eos_token_id]
    name = Path(model).name.removesuffix(".gguf") if is_gguf(model) else path.name
    return LoadedModel(net, args, tokenizer, path, fingerprint, tokenizer_version, eos_ids, name, quantization)
