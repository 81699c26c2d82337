# chatd server image: the packaged SmolLM2 model, SQLite by default or PostgreSQL (compose.yaml).
#
#   docker build -t chatd .                          # CPU torch (2.13.0, pinned by constraints.txt)
#   docker build -t chatd --build-arg TORCH=cuda .   # a CUDA build of torch; run with --gpus all
#   docker run -p 127.0.0.1:8000:8000 -v chatd-data:/data chatd
#
# Linux torch wheels on the default index bundle the CUDA libraries; for a smaller CPU image, pass PyTorch's
# CPU wheel index as --build-arg PIP_EXTRA_INDEX_URL=... (pip reads it from the environment).
FROM python:3.11-slim

ARG TORCH=cpu
ARG PIP_EXTRA_INDEX_URL=""
WORKDIR /app
# A C compiler: the engine builds its native decode-attention kernel for the CPU it runs on at first start
# (chatd/engine/kernels/loader.py; without one it falls back to torch's attention, slower).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml constraints.txt README.md alembic.ini config.toml ./
COPY scripts/ scripts/
COPY chatd/ chatd/
COPY migrations/ migrations/
COPY static/ static/
# The install steps: the same script as `make run` (runtime dependencies only, constrained). tests/test_container.py
# runs this line in a clean venv, as this machine has no container engine.
RUN CHATD_VENV=/opt/chatd CHATD_EXTRAS=server,postgres CHATD_TORCH=$TORCH scripts/setup.sh && rm -rf /root/.cache/pip

ENV PATH=/opt/chatd/bin:$PATH \
    CHATD_DATA_DIR=/data \
    CHATD_SERVER__HOST=0.0.0.0 \
    CHATD_SERVER__PORT=8000
VOLUME /data
EXPOSE 8000
# Ready, not just alive: /readyz is 503 while the model loads (the first start converts it once).
HEALTHCHECK --interval=10s --start-period=120s \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/readyz', timeout=5)"]
CMD ["chatd", "serve"]
