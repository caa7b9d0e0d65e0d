#!/usr/bin/env bash
# install.sh VENV ARGS...: `pip install ARGS` into the venv VENV, carried out by uv, which every
# set-up script installs with (measured by scripts/test.sh on a fresh clone of the 2-core dev
# machine, uv's cache empty: the set-up's main path 136-141 s, where pip took 270 s).
#
# uv reads none of pip's configuration, so what pip is configured with here (`pip config list`:
# its index, extra indexes, find-links and constraints, PIP_* variables before the files) is
# handed to it, and like pip it takes the best version across every index. uv itself goes into
# VENV first, with pip (a few seconds). WEIGHTSYNC_PIP=1 installs with pip instead.
set -euo pipefail
venv=$1
shift
python="$venv/bin/python"
if [[ -n "${WEIGHTSYNC_PIP:-}" ]]; then
    exec "$python" -m pip install --quiet --disable-pip-version-check "$@"
fi
args=()
for arg in "$@"; do # pip's resolver warnings: uv checks only what it installs, and says no more
    [[ "$arg" == --no-warn-conflicts ]] || args+=("$arg")
done
[[ -x "$venv/bin/uv" ]] || "$python" -m pip install --quiet --disable-pip-version-check "uv==0.13.9"
given=$(
    "$python" - <<'PY'
import shlex, subprocess, sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
RANK = {":env:": 0, "install": 1, "global": 2}  # pip's own precedence
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
found: dict[str, tuple[int, str]] = {}
for line in listed.stdout.splitlines():
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if name in FLAGS and scope in RANK and (name not in found or RANK[scope] < found[name][0]):
        found[name] = (RANK[scope], " ".join(shlex.split(value)))
for name, (_, value) in found.items():
    for item in value.split():
        print(FLAGS[name])
        print(item)
PY
)
settings=()
[[ -z "$given" ]] || mapfile -t settings <<<"$given"
exec "$venv/bin/uv" pip install --quiet --python "$python" --index-strategy unsafe-best-match "${settings[@]}" "${args[@]}"
