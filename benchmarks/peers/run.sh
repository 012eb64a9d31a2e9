#!/usr/bin/env bash
# The side-by-side peer benchmark, in one command (no Makefile needed):
#
#   benchmarks/peers/run.sh [bench.py options]      e.g.  --quick,  --only mmcache-memory,numpy
#
# 1. creates benchmarks/peers/.venv (git-ignored) on first use, or when the pins change;
# 2. installs torch==2.13.0 FIRST (the CPU build; a plain `torch` or an open range
#    would pull a multi-GB CUDA build), then each peer of requirements.txt on its own
#    with constraints.txt (so none can swap torch), then mmcache from this checkout;
#    a peer that fails to install is recorded with pip's reason (bench.py reports it);
# 3. runs bench.py from the repository root; results go to benchmarks/results/.
#
# Environment: PYTHON (interpreter for the venv, default python3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PY="$VENV/bin/python"
STATUS="$VENV/install-status"
STAMP="$VENV/.peers-installed"

want="$(cat "$HERE/requirements.txt" "$HERE/constraints.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    echo "run.sh: setting up $VENV (a few minutes, once)" >&2
    [[ -x "$PY" ]] || "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch==2.13.0
    rm -rf "$STATUS"
    mkdir -p "$STATUS"
    reqs=()
    while read -r req; do
        req="${req%%#*}"
        req="${req//[[:space:]]/}"
        [[ -n "$req" ]] && reqs+=("$req")
    done <"$HERE/requirements.txt"
    # All peers in one resolution first, so that their shared dependencies agree.
    if "$PY" -m pip install -q -c "$HERE/constraints.txt" "${reqs[@]}" >"$STATUS/all.log" 2>&1; then
        for req in "${reqs[@]}"; do echo "$req" >"$STATUS/${req%%[=<>!~]*}.ok"; done
    else
        # Then each on its own: the ones that install run, the others are reported.
        for req in "${reqs[@]}"; do
            name="${req%%[=<>!~]*}"
            log="$STATUS/$name.log"
            if "$PY" -m pip install -q -c "$HERE/constraints.txt" "$req" >"$log" 2>&1; then
                echo "$req" >"$STATUS/$name.ok"
            else
                # Keep pip's own words: bench.py shows them as the peer's reason.
                grep -E '^(ERROR|error):' "$log" | tail -n 3 >"$STATUS/$name.err" || true
                [[ -s "$STATUS/$name.err" ]] || tail -n 3 "$log" >"$STATUS/$name.err"
                echo "run.sh: could not install $req (bench.py reports it): $(head -c 300 "$STATUS/$name.err")" >&2
            fi
        done
    fi
    # mmcache itself, editable, from this checkout (the repository root is two levels up).
    (cd "$HERE" && "$PY" -m pip install -q -c constraints.txt -e ../..)
    "$PY" -m pip freeze --exclude-editable >"$STATUS/freeze.txt"
    echo "$want" >"$STAMP"
fi

cd "$ROOT"
exec "$PY" benchmarks/peers/bench.py "$@"
