#!/usr/bin/env bash
# Install Horovod 0.28.1 into a virtualenv, built from its PyPI sdist against
# the TensorFlow already installed there (TF 2.21 on CPU, Gloo, no MPI).
#
# Usage: scripts/install_horovod.sh [--wheel-only] [VENV_DIR]   (default: .venv)
#
# --wheel-only builds (or finds) the wheel and installs nothing, so that it
# can run beside another pip install into the same venv (`make setup`); a
# second call without it installs the wheel.
#
# Horovod 0.28.1 (2023, the last release) ships no wheels. Against TF 2.21 it
# compiles only with two changes from a plain `pip install horovod` (TF <= 2.18.1
# builds unpatched, per docs/design.md section 1.3):
#   * --no-build-isolation, so the build sees the venv's TensorFlow;
#   * horovod/tensorflow/xla_mpi_ops.cc dropped from
#     horovod/tensorflow/CMakeLists.txt (it only holds the optional XLA ops,
#     and no longer compiles against TF's headers).
# The built wheel is kept in VENV/horovod-wheels/ so that a reinstall into the
# same venv takes seconds instead of minutes. Only PyPI is used: the sdist
# vendors gloo, eigen, flatbuffers and boost, and CMake fetches nothing.
#
# Environment:
#   HOROVOD_BUILD_JOBS  parallel compile jobs (default: nproc)
set -euo pipefail

HVD_VERSION=0.28.1
WHEEL_ONLY=0
if [ "${1:-}" = "--wheel-only" ]; then
    WHEEL_ONLY=1
    shift
fi
VENV=${1:-.venv}
PY="$VENV/bin/python"
WHEEL_DIR="$VENV/horovod-wheels"
START=$(date +%s)

log() { printf '[install_horovod] %s\n' "$*"; }
die() { printf '[install_horovod] ERROR: %s\n' "$*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - START ))s"; }

[ -x "$PY" ] || die "no python at $PY (create the venv first: python3 -m venv $VENV)"
VENV=$(cd "$VENV" && pwd)
PY="$VENV/bin/python"
WHEEL_DIR="$VENV/horovod-wheels"
# horovod's setup.py looks for `cmake` on PATH; prefer the venv's tools.
export PATH="$VENV/bin:$PATH"

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

hvd_imports() { "$PY" -c "import horovod.tensorflow" >/dev/null 2>&1; }

# Runtime deps of horovod (its install_requires); installed explicitly because
# the wheel itself goes in with --no-deps (so pip never touches tensorflow).
install_runtime_deps() {
    pip_ install -q cloudpickle psutil pyyaml packaging
}

verify() {
    log "verifying"
    # What `horovodrun --check-build` reports for TensorFlow and Gloo, in one
    # process (it starts a process per framework and controller to ask).
    "$PY" - <<'EOF'
import horovod, horovod.tensorflow as hvd
hvd.init()
print(f"[install_horovod] horovod {horovod.__version__}: size={hvd.size()} rank={hvd.rank()}")
assert hvd.size() == 1, hvd.size()
assert hvd.gloo_built(), "horovod was built without Gloo"
print("[install_horovod] built with TensorFlow and Gloo")
EOF
}

# 1. Already there?
if hvd_imports; then
    log "horovod already installed ($("$PY" -c 'import horovod; print(horovod.__version__)')) in $VENV"
    exit 0
fi

# 2. Cached wheel from an earlier build into this venv?
shopt -s nullglob
cached=("$WHEEL_DIR"/horovod-"$HVD_VERSION"-*.whl)
shopt -u nullglob
if [ ${#cached[@]} -gt 0 ] && [ "$WHEEL_ONLY" = 1 ]; then
    log "wheel already built: ${cached[0]}"
    exit 0
fi
if [ ${#cached[@]} -gt 0 ]; then
    log "installing cached wheel ${cached[0]}"
    install_runtime_deps
    pip_ install -q --no-deps --force-reinstall "${cached[0]}"
    verify
    log "done in $(elapsed) (cached wheel)"
    exit 0
fi

# 3. Build from the sdist.
TF_VERSION=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null) \
    || die "tensorflow is not importable from $PY; install it first"
log "building horovod $HVD_VERSION against tensorflow $TF_VERSION in $VENV"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Build deps. A system cmake >= 3.13 is enough (horovod's setup.py checks
# this; if it finds none it pip-installs one itself, into a temp dir); only
# fetch the pip one when needed.
"$PY" -c "import setuptools, packaging, wheel" >/dev/null 2>&1 \
    || pip_ install -q setuptools packaging wheel
cmake_ok=0
if command -v cmake >/dev/null 2>&1; then
    cmake_ver=$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
    if "$PY" -c "import sys; from packaging.version import Version as V; sys.exit(V('$cmake_ver') < V('3.13'))"; then
        cmake_ok=1
        log "using cmake $cmake_ver at $(command -v cmake)"
    fi
fi
if [ "$cmake_ok" = 0 ]; then
    log "no cmake >= 3.13 on PATH; installing cmake from PyPI into the venv"
    pip_ install -q "cmake>=3.13"
fi
command -v c++ >/dev/null 2>&1 || die "no C++ compiler (apt-get install g++)"
command -v make >/dev/null 2>&1 || die "no make (apt-get install make)"

log "downloading the sdist"
pip_ download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$WORK/dl"
sdist=$(ls "$WORK"/dl/horovod-"$HVD_VERSION".tar.gz)
tar -xzf "$sdist" -C "$WORK"
SRC="$WORK/horovod-$HVD_VERSION"

# The one-line patch: drop the XLA ops source from the TF extension.
CML="$SRC/horovod/tensorflow/CMakeLists.txt"
XLA_LINE='^list(APPEND TF_SOURCES "[$]{PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops\.cc")$'
[ "$(grep -c "$XLA_LINE" "$CML")" = 1 ] \
    || die "patch target not found in $CML (expected exactly one line listing xla_mpi_ops.cc); is this horovod $HVD_VERSION?"
cp "$CML" "$CML.orig"
sed -i "\\|$XLA_LINE|d" "$CML"
log "patched horovod/tensorflow/CMakeLists.txt:"
diff "$CML.orig" "$CML" | sed 's/^/    /' || true
! grep -q 'xla_mpi_ops' "$CML" || die "xla_mpi_ops.cc still listed in $CML after patching"

# Horovod vendors Gloo and builds it twice against a C++17 TensorFlow: as
# `gloo` and as `compatible17_gloo`, the copy horovod/tensorflow links
# (horovod/tensorflow/CMakeLists.txt). Nothing else is built here, so
# `gloo` is left out of the default build (EXCLUDE_FROM_ALL: still built if
# a target links it): about a sixth of the compile.
TOP="$SRC/CMakeLists.txt"
GLOO_LINE='^    add_subdirectory(third_party/gloo)$'
[ "$(grep -c "$GLOO_LINE" "$TOP")" = 1 ] \
    || die "patch target not found in $TOP (expected one add_subdirectory(third_party/gloo)); is this horovod $HVD_VERSION?"
sed -i "s|$GLOO_LINE|    add_subdirectory(third_party/gloo EXCLUDE_FROM_ALL)|" "$TOP"
log "patched CMakeLists.txt: third_party/gloo built only if linked"

# Horovod builds RelWithDebInfo (-O3 -g). The same -O3 code without debug
# information compiles in about four fifths of the CPU time, and the wheel
# is 1 MB instead of 15: setup.py runs the cmake that HOROVOD_CMAKE names,
# and this wrapper gives the configure step the flags without -g.
CMAKE_BIN=$(command -v cmake)
CMAKE_NO_DEBUG_INFO="$WORK/cmake"
{
    echo '#!/usr/bin/env bash'
    echo 'case "$1" in'
    echo "    --build|--version) exec \"$CMAKE_BIN\" \"\$@\" ;;"
    echo "    *) exec \"$CMAKE_BIN\" \"\$@\" '-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG'" \
         "'-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG' ;;"
    echo 'esac'
} > "$CMAKE_NO_DEBUG_INFO"
chmod +x "$CMAKE_NO_DEBUG_INFO"

JOBS=${HOROVOD_BUILD_JOBS:-$(nproc)}
log "compiling with $JOBS parallel jobs (takes a few minutes)"
mkdir -p "$WHEEL_DIR"
BUILD_START=$(date +%s)
HOROVOD_CMAKE="$CMAKE_NO_DEBUG_INFO" \
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
MAKEFLAGS="-j$JOBS" \
    pip_ wheel --no-deps --no-build-isolation -w "$WHEEL_DIR" "$SRC"
log "wheel built in $(( $(date +%s) - BUILD_START ))s"

shopt -s nullglob
built=("$WHEEL_DIR"/horovod-"$HVD_VERSION"-*.whl)
shopt -u nullglob
[ ${#built[@]} -gt 0 ] || die "pip wheel produced no horovod-$HVD_VERSION wheel in $WHEEL_DIR"
if [ "$WHEEL_ONLY" = 1 ]; then
    log "done in $(elapsed) (wheel only: ${built[0]})"
    exit 0
fi

install_runtime_deps
pip_ install -q --no-deps --force-reinstall "${built[0]}"
verify
log "done in $(elapsed) (built from source)"
