"""C++ kernels for the CPU: built at first use with the system's compiler, loaded with ctypes (build.py).

    paged_decode.cpp / .py    paged decode attention (bf16 or fp32 KV read in place, GQA, split-KV, cascade)
    paged_prefill.cpp / .py   paged prefill attention over bf16 caches (every chunk of a step in one call)
    fused.cpp / .py           a decoder layer's elementwise work in one pass a row (norms, RoPE, SiLU)
    logits.cpp / .py          per-row reductions over a step's logits (logsumexp + argmax, top-k)

Each kernel is a C++ file (the algorithm) and a Python launcher (shapes, dtypes, strides, the work split),
as the Triton kernels are; without a compiler the CPU attention backend falls back to its torch path.
"""
