#!/usr/bin/env bash
# The emulated aarch64 tier (optional; not in the default CI tier). README § Platforms.
#
# Builds an arm64 Debian root with Debian's own tools (mmdebstrap, qemu-user-static,
# binfmt-support), installs moe-pipe and its aarch64 wheels from PyPI inside it, and
# runs there, under qemu-user:
#   1. the quant kernel tests on the dot-product branch (QEMU_CPU=max: FEAT_DotProd)
#   2. the same on the portable branch (QEMU_CPU=cortex-a53: no dot product, found so at import)
#   3. the model tests of the three original families on the tiny models
#   4. one pipeline byte-identity run on the tiny model (processes, shm, O_DIRECT or
#      its buffered fallback: the script prints which)
# and prints each stage's time. Needs root (chroot, mounts, binfmt). The binfmt entry
# is registered for the run and unregistered after (if this script registered it).
#
#   tests/aarch64/run.sh            build the root if missing, then test
#   tests/aarch64/run.sh build      only build the root (network-bound: do it early)
#   MOE_PIPE_ARM_ROOT=/path ...     where the root lives (default /var/tmp/moe-pipe-aarch64)
set -euo pipefail

ROOT=${MOE_PIPE_ARM_ROOT:-/var/tmp/moe-pipe-aarch64}
SUITE=${MOE_PIPE_ARM_SUITE:-bookworm}
MIRROR=${MOE_PIPE_ARM_MIRROR:-http://deb.debian.org/debian}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MODE=${1:-all}
SRC=/src/moe-pipe
T0=$(date +%s)
MOUNTED=()
REGISTERED=0

say() { printf '[aarch64 %4ds] %s\n' "$(($(date +%s) - T0))" "$*"; }

[ "$(id -u)" = 0 ] || { echo "tests/aarch64/run.sh: needs root (chroot, mounts, binfmt)" >&2; exit 2; }
for tool in mmdebstrap qemu-aarch64-static update-binfmts; do
    command -v "$tool" >/dev/null || { echo "tests/aarch64/run.sh: $tool missing: apt-get install mmdebstrap qemu-user-static binfmt-support" >&2; exit 2; }
done

cleanup() {
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTED[$i]}" 2>/dev/null || true; done
    if [ "$REGISTERED" = 1 ]; then update-binfmts --disable qemu-aarch64 && say "binfmt qemu-aarch64 unregistered"; fi
}
trap cleanup EXIT

# -- binfmt: registered for this run only ------------------------------------------------
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64
    REGISTERED=1
    say "binfmt qemu-aarch64 registered"
fi

inroot() { chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt "$@"; }

# -- the root ---------------------------------------------------------------------------
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    say "building the arm64 $SUITE root in $ROOT"
    mmdebstrap --arch=arm64 --variant=apt --include=python3,python3-venv,python3-pip,ca-certificates "$SUITE" "$ROOT" "$MIRROR"
fi
for m in proc sys dev dev/shm; do
    mkdir -p "$ROOT/$m"
    case $m in
        proc) mount -t proc proc "$ROOT/proc" ;;
        dev/shm) mount -t tmpfs -o mode=1777 shm "$ROOT/dev/shm" ;;
        *) mount --rbind "/$m" "$ROOT/$m" && mount --make-rslave "$ROOT/$m" ;;
    esac
    MOUNTED+=("$ROOT/$m")
done
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# The host's CA bundle, for pip inside the root: where egress passes a TLS-inspecting proxy,
# its CA is in the host's bundle and not in Debian's fresh one.
HOST_CA=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[ -f "$HOST_CA" ] && cp "$HOST_CA" "$ROOT/etc/ssl/certs/host-ca-bundle.crt"
# The working tree (not git's HEAD): what is being tested is what is on disk.
mkdir -p "$ROOT$SRC"
tar -C "$REPO" --exclude=.git --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest-tmp -cf - . | tar -C "$ROOT$SRC" -xf -
if [ ! -x "$ROOT/opt/venv/bin/pytest" ]; then
    say "installing moe-pipe and its aarch64 wheels from PyPI (inside the root)"
    inroot python3 -m venv /opt/venv
    inroot pip install -q --only-binary=:all: "numpy>=1.26" "numba>=0.60" "gguf>=0.17" "tokenizers>=0.20" "jinja2>=3.1" "rich>=13" \
        "pyzmq>=25" "msgpack>=1.0" "orjson>=3.9" "psutil>=5.9" "aiohttp>=3.9" "uvloop>=0.19" "threadpoolctl>=3.1" "llguidance>=1.9" \
        "pytest>=8" "hypothesis>=6" "setuptools>=77"
fi
inroot pip install -q --no-deps --no-build-isolation -e "$SRC"
say "root ready: $(inroot python3 -c 'import platform, numpy, numba; print(platform.machine(), "numpy", numpy.__version__, "numba", numba.__version__)')"
[ "$MODE" = build ] && exit 0

# -- the tests --------------------------------------------------------------------------
SUMMARY=()
stage() { # name, QEMU_CPU, pytest args...
    local name=$1 cpu=$2 t=$(date +%s) rc=0
    shift 2
    say "stage $name (QEMU_CPU=$cpu)"
    chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin LANG=C.UTF-8 QEMU_CPU="$cpu" \
        NUMBA_CACHE_DIR=/tmp/numba-cache-"$cpu" \
        sh -c "cd $SRC && python -m pytest -q -p no:cacheprovider $*" 2>&1 | tee "/tmp/aarch64-$name.log" | tail -n 15 || true
    rc=${PIPESTATUS[0]}
    local line
    line=$(grep -E "[0-9]+ (passed|failed|error)" "/tmp/aarch64-$name.log" | tail -n 1 || true)
    SUMMARY+=("$(printf '%-22s %-11s rc=%s %5ds  %s' "$name" "$cpu" "$rc" "$(($(date +%s) - t))" "$line")")
}

# (pyproject's addopts already deselect -m slow)
stage kernels-sdot max -s tests/aarch64/test_arm_kernels.py::test_the_build_follows_the_cpus_dot_product tests/test_quant.py
stage kernels-portable cortex-a53 -s tests/aarch64/test_arm_kernels.py::test_the_build_follows_the_cpus_dot_product tests/test_quant.py
stage models max tests/test_model.py
stage pipeline max -s tests/aarch64/test_arm_kernels.py::test_pipeline_io_mode

say "summary (total $(($(date +%s) - T0)) s):"
printf '  %s\n' "${SUMMARY[@]}"
grep -h "^pipeline I/O:" /tmp/aarch64-pipeline.log || true
! printf '%s\n' "${SUMMARY[@]}" | grep -qv "rc=0 "
