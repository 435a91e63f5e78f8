# prefixserve engine image, in two stages:
#   builder   the C++ compiler builds the package as a wheel: the C++ CPU kernels compiled for every
#             instruction-set variant (portable, avx2, avx512, avx512_bf16, amx; kernels/cpu/build.py)
#   runtime   python slim, torch, and that wheel: no compiler; the kernels' variant is chosen at start from
#             the CPU's flags (the log, /get_server_info and /metrics name it)
# CPU torch by default; for CUDA pass a CUDA build of torch:
#   docker build --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=<a CUDA wheel index> .
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md cli.py ./
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY prefix_store ./prefix_store
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# torch first, from the pinned spec: an open `torch` requirement would pull the CUDA packages
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else pip install "$TORCH_SPEC"; fi
COPY --from=builder /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels

EXPOSE 8000
USER nobody
ENV HOME=/tmp
CMD ["prefixserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
