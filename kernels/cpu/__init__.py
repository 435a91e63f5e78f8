"""C++ kernels for the CPU: compiled at `pip install` for named instruction-set variants (build.py, run by
setup.py), one of them chosen at start from the CPU's flags and loaded with ctypes (library.py).

    paged_decode.cpp / .py    paged decode attention (bf16 or fp32 KV read in place, GQA, split-KV, cascade)
    paged_prefill.cpp / .py   paged prefill attention over bf16 caches (every chunk of a step in one call)
    fused.cpp / .py           a decoder layer's elementwise work in one pass a row (norms, RoPE, SiLU)
    logits.cpp / .py          per-row reductions over a step's logits (logsumexp + argmax, top-k)
    *.h                       what they share: bf16 conversions, vector exp, the bf16 tiles of prefill
    build.py                  the variants (portable, avx2, avx512, avx512_bf16, amx) and their build
    library.py                the variant for this CPU, loaded: CpuKernels

Each kernel is a C++ file (the algorithm) and a Python launcher class (shapes, dtypes, strides, the work
split) over the loaded library, as the Triton kernels are; the op layer (kernels/ops.py) calls them, and
keeps torch's implementations where they are not built or do not apply.
"""
