#!/usr/bin/env bash
# Set up what this machine lacks, then serve or test Switchyard from this checkout.
#
#   deploy/dev.sh serve [switchyard serve flags]   install, then run the server
#   deploy/dev.sh test [pytest args]               install, then run the test suite
#   deploy/dev.sh setup                            install only
#
# Installs only what is missing:
#   - Debian/Ubuntu: OpenBLAS (libopenblas0-pthread) and, if there is no Python >= 3.11 with
#     venv, python3 + python3-venv (apt-get update first; sudo when not root). macOS: nothing.
#   - a virtual environment (default <checkout>/.venv) with `pip install -e '.[dev]'` and,
#     without their declared dependencies, the packages pyproject.toml's [tool.switchyard]
#     vision-no-deps names (mlx-vlm); re-run only when pyproject.toml changes.
# Environment: PYTHON (interpreter for a new venv), VENV (venv directory).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.switchyard-installed"

say() { printf 'dev.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
  sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# -- system packages (Debian/Ubuntu) ------------------------------------------------------------

have_apt() {
  [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 \
    && command -v dpkg-query >/dev/null 2>&1
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "need root for: $*"; fi
}

APT_UPDATED=0
apt_install() {
  say "installing $*"
  if [ "$APT_UPDATED" = 0 ]; then
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

deb_installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    python_ok "$PYTHON" || die "PYTHON=$PYTHON is not a Python >= 3.11"
    echo "$PYTHON"
    return 0
  fi
  local candidate
  for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

ensure_system_packages() {
  have_apt || return 0
  local missing=()
  deb_installed libopenblas0-pthread || missing+=(libopenblas0-pthread)
  if [ ! -x "$VENV/bin/python" ] && ! find_python >/dev/null; then
    missing+=(python3 python3-venv)
  fi
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
}

# -- virtual environment ------------------------------------------------------------------------

create_venv() {
  local py
  py="$(find_python)" || die "no Python >= 3.11 found (set PYTHON=/path/to/python3.11+)"
  say "creating $VENV with $py"
  if ! "$py" -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    have_apt || die "'$py -m venv' failed"
    local ver
    ver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    apt_install "python$ver-venv"  # Debian splits ensurepip out of the interpreter
    "$py" -m venv "$VENV"
  fi
}

file_hash() {
  "$VENV/bin/python" -c \
    'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ] || ! python_ok "$VENV/bin/python"; then
    rm -rf "$VENV"
    create_venv
  fi
  local want
  want="$(file_hash "$ROOT/pyproject.toml")"
  if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    say "pip install -e '.[dev]' into $VENV"
    (cd "$ROOT" && "$VENV/bin/python" -m pip install --disable-pip-version-check \
      --progress-bar off -q -e '.[dev]')
    local no_deps
    no_deps="$("$VENV/bin/python" -c 'import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["tool"]["switchyard"]["vision-no-deps"]))' \
      "$ROOT/pyproject.toml")"
    if [ -n "$no_deps" ]; then
      say "pip install --no-deps $no_deps"
      # shellcheck disable=SC2086  # one argument per package
      "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
        --no-deps $no_deps
    fi
    echo "$want" > "$STAMP"
  fi
}

setup() {
  ensure_system_packages
  ensure_venv
}

# -- commands -----------------------------------------------------------------------------------

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
  serve)
    setup
    exec "$VENV/bin/switchyard" serve "$@"
    ;;
  test)
    setup
    cd "$ROOT"
    blas="$("$VENV/bin/python" -m switchyard.deploy.blas)"
    if [ -n "$blas" ] && [[ ":${LD_PRELOAD:-}:" != *":$blas:"* ]]; then
      export LD_PRELOAD="$blas${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
    # One BLAS thread per process: two workers' groups already keep both cores busy, and idle
    # OpenBLAS threads spin against them (measured: 13-15% less wall time, half the system
    # time; tests/README.md "Budgets").
    export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
    # Two workers, a test file on one of them (its module groups are its own), the files with
    # the largest budgets first (tests/README.md "Budgets"); SWITCHYARD_TEST_WORKERS=0 runs
    # them in this process, and arguments given here come after, so `-n 0` works too.
    exec "$VENV/bin/python" -m pytest -q -n "${SWITCHYARD_TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "$@"
    ;;
  setup)
    setup
    ;;
  *)
    usage
    ;;
esac
