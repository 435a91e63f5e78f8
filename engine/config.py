"""EngineConfig: every engine knob in one validated dataclass, passed explicitly.

Each field's `metadata["help"]` is its one-line documentation: `prefixserve serve|generate` turn every
field into a flag (`--block-size`) and an environment variable (`PREFIXSERVE_BLOCK_SIZE`) from it
(service/flags.py), so a knob is declared once, here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.kv import backends as kv_backends
from engine.kv.events import KVEventsConfig
from kernels.cpu.build import X86_VARIANTS

if TYPE_CHECKING:
    from engine.kv.event_publisher import CurveKeys

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")
# NOTE: the weight formats of engine/models/quant.py, declared here and not there: quant.py imports torch at
# module level (its layers are nn.Modules), and this module must not (the CLI builds its flags from
# EngineConfig without loading torch: tests/test_layout.py). The loader checks against it.
QUANTIZATIONS = ("none", "int8", "int4")
CPU_KERNELS = ("auto", "none", *(v.name for v in X86_VARIANTS))


def knob(default: Any, help: str, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """A dataclass field with its help text (and choices, for strings), for the generated CLI; a secret one
    is left out of the dataclass's repr."""
    return field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str | None = knob(None, "model: a Hugging Face checkpoint directory (safetensors) or a .gguf file "
                                   "(default: the built-in model)")
    device: str = knob("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = knob("float32", "weights and activations dtype (quantized layers keep their own)", DTYPES)
    kv_cache_dtype: str | None = knob(None, "KV cache dtype (default: bfloat16 when the weights are quantized on the "
                                            "CPU, else --dtype)", DTYPES)
    quantization: str | None = knob(None, "weights kept quantized on the CPU: none, int8 (per row) or int4 (per group "
                                          "of 32; GGUF Q4_0 / Q4_1 nibbles kept as they are). Default: the "
                                          "checkpoint's own (int4 for a 4-bit GGUF, int8 for Q5-Q8, none otherwise)",
                                    QUANTIZATIONS)
    block_size: int = knob(16, "KV cache block size in tokens")
    num_kv_blocks: int | None = knob(None, "KV cache blocks (default: as many as --kv-cache-memory-gb holds)")
    kv_cache_memory_gb: float = knob(1.0, "KV cache budget in GiB, used when --num-kv-blocks is not given")
    max_num_seqs: int = knob(128, "most sequences in one step's batch")
    max_num_batched_tokens: int = knob(2048, "most tokens in one step's batch (prefill chunks are cut to fit)")
    decode_prefill_cost: int = knob(288, "a step that carries decodes (or a prompt's chunk under way) admits new "
                                         "prompts only up to this cost, at least one: prompt tokens counted with "
                                         "their attention over the context "
                                         "(a token after c others costs 1 + c / C, C the model's context length "
                                         "whose attention equals a token's projections); 0: no cap "
                                         "(engine/sched/scheduler.py)")
    max_model_len: int | None = knob(None, "context length cap (default: the model's)")
    max_num_waiting: int = knob(1024, "waiting queue cap, per tenant (each API key or group; one without keys): "
                                      "beyond it that tenant's requests are refused (HTTP 429)")
    attention_backend: str | None = knob(None, "attention kernels: triton (GPU), cpu (C++ decode kernel and flash "
                                               "prefill), torch (default: triton on CUDA; on the CPU, cpu for a "
                                               "bfloat16 KV cache, torch for float32 (the exact path))",
                                         ATTENTION_BACKENDS)
    kv_backend: str = knob("paged", "KV cache backend: paged (block tables, PagedAttention) or vattention (each "
                                    "request's KV virtually contiguous, pages mapped on demand; CPU only for now)",
                           kv_backends.names())
    map_ahead_tokens: int = knob(4, "vattention: a decoding request gets its next page this many tokens before it "
                                    "needs it, mapped by a background thread during a forward pass (0: never ahead)")
    kv_max_mappings: int = knob(32768, "vattention: most memory mappings (kernel VMAs) its KV cache may hold, of "
                                       "the process's vm.max_map_count (65,530 by default); what would need more "
                                       "is refused (HTTP 507)")
    cpu_kernels: str = knob("auto", "which build of the C++ CPU kernels runs: auto (the best this CPU has, "
                                    "chosen from its flags), none (torch's ops only), or a variant by name; a "
                                    "variant this CPU lacks stops the server at start", CPU_KERNELS)
    # (the default is kernels/quant_gemm.py AMX_DENSE_FROM_ROWS, written out: this module imports no torch)
    amx_dense_from_rows: int = knob(10, "on a CPU with AMX: the decode rows from which a GGUF 4-bit model's steps "
                                        "take oneDNN's GEMM on the tile units instead of our int4 x bfloat16 GEMM "
                                        "(prompt chunks always do; kernels/quant_gemm.py AMX_DENSE_FROM_ROWS: not "
                                        "measured on AMX yet, `prefixserve bench gemm` measures it); no effect "
                                        "without AMX")
    int16_activations: bool = knob(True, "on an AVX-512 CPU with VNNI but no BF16 (Cascade Lake, Ice Lake): a GGUF "
                                         "4-bit model's prompt chunks and decode steps run our int4 x int16 GEMM "
                                         "(each group of 32 activations rounded to 16-bit integers, the 4-bit weights "
                                         "exact: kernels/cpu/int4_gemm.py gemm_q16) instead of float32 GEMMs; off: "
                                         "oneDNN's float32 GEMM, gemm_wide and torch's int4 kernel; no effect on "
                                         "other CPUs")
    batch_invariant: bool = knob(False, "a request's tokens and logprobs do not depend on its batch, chunking or the "
                                        "prefix cache: one GEMM kernel for every step, fixed decode splits, no "
                                        "cascade, one attention kernel for prompt and generated tokens (slower; CPU "
                                        "with the C++ kernels; README, Batch invariance)")
    compile_decode: bool = knob(False, "torch.compile the decode step (one graph per batch bucket 1-32, compiled at "
                                       "startup; prefill and larger batches stay eager; CPU only for now)")
    enable_prefix_caching: bool = knob(True, "share full KV blocks between requests with the same prefix")
    kv_tier_dir: str | None = knob(None, "the KV tier: a directory (made 0700; files 0600) where evicted and pinned KV "
                                         "blocks are written, and from which a prompt loads the blocks it would "
                                         "otherwise compute, also after a restart. The files hold what prompts "
                                         "computed: off unless set (README: The KV tier on disk)")
    kv_tier_bytes: int = knob(8 * 2**30, "most bytes of block files in --kv-tier-dir (least recently used deleted "
                                         "first)")
    kv_tier_shared_dir: str | None = knob(None, "a KV tier directory several replicas share (a volume they all mount, "
                                                "run as one user): a block one replica computed is a hit on the "
                                                "others; read after --kv-tier-dir, written with it")
    kv_tier_shared_bytes: int = knob(32 * 2**30, "most bytes of block files in --kv-tier-shared-dir, as this "
                                                 "replica sees them")
    kv_tier_load_timeout: float = knob(5.0, "seconds a request waits for its blocks to load from the KV tier; then "
                                            "it computes them (a slow or hung disk)")
    pinned_fraction: float = knob(0.5, "cap on pinned (registered-prefix) blocks, as a share of all blocks")
    pinned_tenant_fraction: float = knob(0.25, "one tenant's share of that cap: the most blocks its own prefixes and "
                                               "prompt_cache_key leases may pin together (beyond it 507); "
                                               "published prefixes and a server without keys have the cap only")
    torch_threads: int | None = knob(None, "torch intra-op threads (serve / generate default: the cores this "
                                           "process may use, affinity and cgroup quota; offline LLM(): torch's)")
    adaptive_threads: bool = knob(True, "fewer torch threads while other processes want the same cores (the "
                                        "threads' schedstat wait / run ratio; engine/worker/threads.py), one more "
                                        "when they leave; off with torch's default threads or batch_invariant")
    chat_template: str | None = knob(None, "a Jinja chat template (a file, or the template itself) replacing "
                                           "the checkpoint's")
    grammar_compile_timeout: float = knob(10.0, "seconds of CPU time a structured-output grammar (json_schema, "
                                                "regex, choice) may take to compile; a slower one is refused (HTTP "
                                                "400) and its compile killed, as is the compile of a client that went "
                                                "away (on a machine too busy to give it that, after 6x as long in "
                                                "wall-clock time, saying so)")
    grammar_compile_workers: int = knob(2, "structured-output grammars compiled at once (each in a child process of "
                                           "its own, then in this one); the rest wait their turn")
    grammar_cache_size: int = knob(64, "compiled grammars kept for reuse (least recently used dropped first)")
    grammar_cache_mb: float = knob(256.0, "MiB of compiled grammars kept for reuse (least recently used dropped "
                                          "first; a larger grammar serves its request and is not kept)")
    kv_events_config: str | None = knob(None, "vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, "
                                              "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\"}': "
                                              "block stored / removed events over ZMQ (engine/kv/events.py). They "
                                              "carry prompt token ids: bind loopback (the default endpoint) or use "
                                              "CURVE")
    kv_events_secret_key: str | None = knob(None, "KV events over ZMQ CURVE: this server's secret key (40 Z85 "
                                                  "characters, e.g. from zmq.curve_keypair()); subscribers need its "
                                                  "public key (logged at start). Set it by the variable: a command "
                                                  "line is readable by every user of the host", secret=True)
    kv_events_client_keys: tuple[str, ...] = knob((), "KV events over CURVE: the public keys (Z85) of the "
                                                      "subscribers admitted, comma-separated (default: any that "
                                                      "knows the server's public key)")

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}"),
            (self.kv_cache_memory_gb > 0, "kv_cache_memory_gb must be > 0"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.decode_prefill_cost >= 0, "decode_prefill_cost must be >= 0"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.max_num_waiting >= 1, "max_num_waiting must be >= 1"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.kv_cache_dtype is None or self.kv_cache_dtype in DTYPES,
             f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}"),
            (0.0 <= self.pinned_fraction <= 1.0, "pinned_fraction must be within [0, 1]"),
            (0.0 <= self.pinned_tenant_fraction <= 1.0, "pinned_tenant_fraction must be within [0, 1]"),
            (self.torch_threads is None or self.torch_threads >= 1, "torch_threads must be >= 1"),
            (self.quantization is None or self.quantization in QUANTIZATIONS,
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"),
            (self.kv_backend in kv_backends.names(),
             f"kv_backend must be one of {kv_backends.names()}, got {self.kv_backend!r}"),
            (self.map_ahead_tokens >= 0, "map_ahead_tokens must be >= 0"),
            (self.kv_max_mappings >= 16, "kv_max_mappings must be >= 16"),
            (self.kv_tier_bytes >= 2**20, "kv_tier_bytes must be >= 1 MiB"),
            (self.kv_tier_shared_bytes >= 2**20, "kv_tier_shared_bytes must be >= 1 MiB"),
            (self.kv_tier_load_timeout > 0, "kv_tier_load_timeout must be > 0"),
            (self.enable_prefix_caching or (self.kv_tier_dir is None and self.kv_tier_shared_dir is None),
             "the KV tier (kv_tier_dir, kv_tier_shared_dir) needs enable_prefix_caching: its keys are block hashes"),
            (self.kv_tier_dir is None or self.kv_tier_shared_dir is None
             or Path(self.kv_tier_dir).expanduser().resolve() != Path(self.kv_tier_shared_dir).expanduser().resolve(),
             "kv_tier_dir and kv_tier_shared_dir must be two directories"),
            (self.grammar_compile_timeout > 0, "grammar_compile_timeout must be > 0"),
            (self.grammar_compile_workers >= 1, "grammar_compile_workers must be >= 1"),
            (self.grammar_cache_size >= 1, "grammar_cache_size must be >= 1"),
            (self.grammar_cache_mb > 0, "grammar_cache_mb must be > 0"),
            (not self.compile_decode or self.device == "cpu",
             "compile_decode runs on the CPU only for now (CUDA graphs are not built yet)"),
            (self.cpu_kernels in CPU_KERNELS, f"cpu_kernels must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}"),
            (self.amx_dense_from_rows >= 1, f"amx_dense_from_rows must be >= 1, got {self.amx_dense_from_rows}"),
            (not self.batch_invariant or self.device == "cpu",
             "batch_invariant runs on the CPU only for now (the Triton kernels' splits follow the batch)"),
            (not self.batch_invariant or self.cpu_kernels != "none",
             "batch_invariant needs the C++ CPU kernels (cpu_kernels is none)"),
            (not self.batch_invariant or self.attention_backend in (None, "cpu"),
             "batch_invariant needs the cpu attention kernels"),
            (not self.batch_invariant or self.kv_backend == "paged", "batch_invariant needs the paged KV backend"),
            (not self.batch_invariant or not self.compile_decode,
             "batch_invariant and compile_decode do not go together (the compiled graph computes decode rows "
             "another way than prefill rows)"),
            (self.chat_template is None or "{{" in self.chat_template or "{%" in self.chat_template
             or Path(self.chat_template).expanduser().is_file(),
             f"chat_template {self.chat_template!r} is neither a file nor a Jinja template"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.model is not None:
            path = Path(self.model).expanduser()
            if self.model.endswith(".gguf") and not path.is_file():
                raise ValueError(f"model {self.model!r}: no such GGUF file")
            if not self.model.endswith(".gguf") and not (path / "config.json").is_file():
                raise ValueError(f"model {self.model!r} is neither a .gguf file nor a Hugging Face checkpoint "
                                 "directory (a directory with config.json)")
        events = KVEventsConfig.from_json(self.kv_events_config) if self.kv_events_config is not None else None
        if (self.kv_events_secret_key or self.kv_events_client_keys) and (events is None or not events.enabled):
            raise ValueError("kv_events_secret_key / kv_events_client_keys need KV events on (--kv-events-config)")
        if self.kv_events_client_keys and not self.kv_events_secret_key:
            raise ValueError("kv_events_client_keys need kv_events_secret_key (the server's CURVE key)")
        self.kv_events_curve()                                   # ValueError naming a malformed key
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    def kv_events_curve(self) -> CurveKeys | None:
        """The KV event sockets' CURVE keys, or None (plain ZMQ)."""
        if not self.kv_events_secret_key:
            return None
        from engine.kv.event_publisher import CurveKeys  # zmq, only when events are on
        return CurveKeys(self.kv_events_secret_key, tuple(self.kv_events_client_keys))
