# prefixserve engine image. CPU torch by default; for CUDA pass a CUDA build of torch:
#   docker build --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=<a CUDA wheel index> .
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
# torch first, from the pinned spec: an open `torch` requirement would pull the CUDA packages
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else pip install "$TORCH_SPEC"; fi
COPY pyproject.toml README.md cli.py ./
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY prefix_store ./prefix_store
RUN pip install .

EXPOSE 8000
USER nobody
ENV HOME=/tmp
CMD ["prefixserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
