# Shared by scripts/test, scripts/check, scripts/quickstart and scripts/chaos: helpers and the
# .venv set-up.
# Source it from the repo root with ROOT, VENV and PYTHON set.

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'scripts/%s: error: %s\n' "${0##*/}" "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root or sudo to run: $*"
    fi
}

venv_ok() {
    # A venv made while python3-venv was missing has a python but no pip; treat it as absent.
    [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/pip" ]
}

ensure_python_venv_support() {
    # A venv made while python3-venv was missing has a python but no pip.
    local pkgs=()
    command -v "$PYTHON" >/dev/null 2>&1 || pkgs+=(python3)
    if ! venv_ok && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        pkgs+=(python3-venv)
    fi
    if [ ${#pkgs[@]} -gt 0 ]; then
        command -v apt-get >/dev/null 2>&1 || die "missing ${pkgs[*]} and no apt-get; install them"
        say "installing system packages: ${pkgs[*]}"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
}

ensure_venv() {
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); ductor_celery needs Python >= 3.11 (set PYTHON=...)"

    # virtualenv
    if ! venv_ok; then
        say "creating .venv"
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV"
    fi

    stamp=$VENV/.ductor-installed
    want=$(sha256sum pyproject.toml | cut -d' ' -f1)
    # -I keeps the repo root off sys.path, so only an installed package is found; find_spec does
    # not import it (importing pulls in celery: a second per run).
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -I -c \
        'import importlib.util, sys; sys.exit(importlib.util.find_spec("ductor_celery") is None)'; then
        say "installing ductor_celery[dev] into .venv"
        "$VENV/bin/python" -m pip install -q -e '.[dev]'
        printf '%s\n' "$want" >"$stamp"
    fi
}
