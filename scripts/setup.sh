#!/usr/bin/env bash
# Prepares a Debian 12 machine to run and test mcp-agent: Debian packages (bcc comes from
# python3-bpfcc, never from PyPI), kernel headers for bcc, tracefs/debugfs, and $REPO/.venv.
# Idempotent; run as root (`sudo make setup`). Quiet unless it changes something or fails.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
SYS_PY=/usr/bin/python3                  # Debian's python: the one python3-bpfcc is packaged for
DIST=/usr/lib/python3/dist-packages      # where python3-bpfcc puts the bcc module
# golang-go and nodejs: the real third-party HTTP servers of tests/http/realservers.py (Go net/http,
# Node http). A nodejs already installed from another source (e.g. NodeSource, same package name)
# counts as installed and is kept.
PKGS=(python3-bpfcc libbpfcc bpfcc-tools python3-venv python3-dev strace stress-ng tmux iproute2 make gcc golang-go nodejs)
# Without recommends: Debian's prometheus recommends prometheus-node-exporter (and its IPMI/SNMP
# tools). The tests run /usr/bin/prometheus and promtool themselves, on free ports; the packaged
# service is not needed (its postinst does not start it where there is no systemd or a policy-rc.d
# denies it, and where it does start, it holds 9090, which the tests never use).
PKGS_NO_RECOMMENDS=(prometheus)
export DEBIAN_FRONTEND=noninteractive

say() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }
# Runs a command with its output kept back; shows the output only if it fails, then stops.
quiet() {
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$log" >&2; rm -f "$log"
        die "command failed (exit $rc): $*"
    fi
    rm -f "$log"
}

[ "$(id -u)" -eq 0 ] || die "must run as root (try: sudo make setup)"
command -v apt-get >/dev/null || die "needs apt-get (written for Debian 12)"

# ---------------------------------------------------------------- Debian packages
installed() { dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null | grep -q '^ii'; }
has_candidate() {
    local c
    c="$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}')"
    [ -n "$c" ] && [ "$c" != "(none)" ]
}
lists_fresh() {  # package lists present and refreshed within the last day
    compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null || return 1
    [ -n "$(find /var/lib/apt/lists /var/lib/apt/lists/partial /var/lib/apt/periodic/update-success-stamp \
              -maxdepth 0 -mmin -1440 2>/dev/null || true)" ]
}
APT_UPDATED=0
apt_update() {
    [ "$APT_UPDATED" -eq 0 ] || return 0
    APT_UPDATED=1
    say "apt-get update"
    local log
    log="$(mktemp)"
    # A failing third-party source should not stop us: the install below fails loudly if needed.
    if apt-get -q update >"$log" 2>&1; then
        mkdir -p /var/lib/apt/periodic && touch /var/lib/apt/periodic/update-success-stamp
    else
        cat "$log" >&2
        echo "setup: warning: apt-get update reported errors; continuing" >&2
    fi
    rm -f "$log"
}
apt_install() {
    say "apt-get install $*"
    quiet apt-get install -y -q -o Dpkg::Use-Pty=0 "$@"
}

missing=()
for p in "${PKGS[@]}"; do installed "$p" || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    lists_fresh || apt_update
    for p in "${missing[@]}"; do has_candidate "$p" || { apt_update; break; }; done
    apt_install "${missing[@]}"
fi
missing=()
for p in "${PKGS_NO_RECOMMENDS[@]}"; do installed "$p" || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    lists_fresh || apt_update
    for p in "${missing[@]}"; do has_candidate "$p" || { apt_update; break; }; done
    apt_install --no-install-recommends "${missing[@]}"
fi

# ---------------------------------------------------------------- kernel headers
# bcc wants /lib/modules/$(uname -r)/build. A custom kernel has no headers package; then we install
# Debian's newest flavoured headers (they pull -common) and leave /lib/modules alone: the agent's
# loader finds /usr/src/linux-headers-* itself and points bcc at them through BCC_KERNEL_SOURCE.
KREL="$(uname -r)"
case "$(dpkg --print-architecture)" in
    amd64) FLAVOURS=(cloud-amd64 amd64) ;;
    arm64) FLAVOURS=(cloud-arm64 arm64) ;;
    *)     FLAVOURS=("$(dpkg --print-architecture)") ;;
esac
# Versioned packages only (linux-headers-6.12.118+deb12-cloud-amd64, linux-headers-6.1.0-57-amd64),
# not meta-packages (linux-headers-cloud-amd64, linux-headers-6.12-cloud-amd64); for flavour "amd64"
# the digit before "-amd64" keeps -cloud-amd64/-rt-amd64 out.
flavour_re() { echo "^linux-headers-[0-9]+\.[0-9]+\.[0-9]+[^ ]*[0-9]-$1\$"; }
installed_flavour_headers() {
    local f
    for f in "${FLAVOURS[@]}"; do
        dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' 'linux-headers-*' 2>/dev/null \
            | awk '$2 == "ii" {print $1}' | grep -E "$(flavour_re "$f")" || true
    done
}
newest_flavour_headers() {
    local f names
    for f in "${FLAVOURS[@]}"; do
        names="$(apt-cache search --names-only "$(flavour_re "$f")" | awk '{print $1}' \
                 | grep -E "$(flavour_re "$f")" | sed 's/^linux-headers-//' | sort -V | tail -n 1 || true)"
        if [ -n "$names" ]; then echo "linux-headers-$names"; return 0; fi
    done
}

if [ -e "/lib/modules/$KREL/build" ]; then
    HEADERS="/lib/modules/$KREL/build -> $(readlink -f "/lib/modules/$KREL/build")"
else
    if ! installed "linux-headers-$KREL" && [ -z "$(installed_flavour_headers)" ]; then
        lists_fresh || apt_update
        if has_candidate "linux-headers-$KREL"; then
            apt_install "linux-headers-$KREL"
        else
            pkg="$(newest_flavour_headers)"
            if [ -z "$pkg" ]; then apt_update; pkg="$(newest_flavour_headers)"; fi
            [ -n "$pkg" ] || die "no linux-headers package found for kernel $KREL nor for ${FLAVOURS[*]}"
            say "no headers package for kernel $KREL; installing the newest Debian one: $pkg"
            apt_install --no-install-recommends "$pkg"
        fi
    fi
    HEADERS="$(cd /usr/src 2>/dev/null && ls -d linux-headers-* 2>/dev/null | tr '\n' ' ' || true)"
    [ -n "$HEADERS" ] || die "no kernel headers under /usr/src after installing them"
    HEADERS="/usr/src: ${HEADERS% } (running kernel $KREL has no build dir; the agent sets BCC_KERNEL_SOURCE)"
fi

# ---------------------------------------------------------------- tracefs / debugfs
mounted() { awk -v m="$1" -v t="$2" '$2 == m && $3 == t {f = 1} END {exit !f}' /proc/mounts; }
for spec in tracefs:/sys/kernel/tracing debugfs:/sys/kernel/debug; do
    fs="${spec%%:*}"; dir="${spec#*:}"
    if ! mounted "$dir" "$fs"; then
        [ -d "$dir" ] || die "$dir does not exist: is $fs built into this kernel?"
        mount -t "$fs" none "$dir" || die "cannot mount $fs at $dir"
        say "mounted $fs at $dir"
    fi
done

# ---------------------------------------------------------------- .venv
[ -x "$SYS_PY" ] || die "$SYS_PY not found"
[ -d "$DIST/bcc" ] || die "Debian's bcc module is missing at $DIST/bcc (package python3-bpfcc)"
venv_ok() {
    [ -x "$VENV/bin/python" ] && [ -f "$VENV/pyvenv.cfg" ] \
        && grep -Eq '^home *= */usr/bin$' "$VENV/pyvenv.cfg" \
        && grep -Eqi '^include-system-site-packages *= *false$' "$VENV/pyvenv.cfg" \
        && "$VENV/bin/python" -c '' 2>/dev/null
}
if [ -e "$VENV" ] && ! venv_ok; then
    say "$VENV is broken or not made from $SYS_PY without system site-packages; recreating it"
    rm -rf "$VENV"
fi
if [ ! -e "$VENV" ]; then
    say "creating $VENV"
    quiet "$SYS_PY" -m venv "$VENV"
fi

# Only bcc from Debian's dist-packages: a directory holding one symlink, put on sys.path by a .pth.
mkdir -p "$VENV/bcc-only"
if [ "$(readlink "$VENV/bcc-only/bcc" || true)" != "$DIST/bcc" ]; then
    rm -rf "$VENV/bcc-only/bcc"
    ln -s "$DIST/bcc" "$VENV/bcc-only/bcc"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
if [ "$(cat "$SITE/debian_bcc.pth" 2>/dev/null || true)" != "$VENV/bcc-only" ]; then
    printf '%s\n' "$VENV/bcc-only" >"$SITE/debian_bcc.pth"
fi

# Editable install of this repo with its test extras; skipped while pyproject.toml is unchanged.
STAMP="$VENV/.installed-stamp"
WANT="$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || [ ! -x "$VENV/bin/mcp-agent" ]; then
    say "pip install -e .[test] into $VENV"
    rm -f "$STAMP"
    quiet env PIP_ROOT_USER_ACTION=ignore "$VENV/bin/pip" install -q -e "$REPO[test]"
    echo "$WANT" >"$STAMP"
fi

# ---------------------------------------------------------------- verify
"$VENV/bin/python" -E - "$VENV" "$DIST" <<'EOF' || die "venv check failed; try: sudo make clean setup"
import importlib.util, os, sys
venv, dist = sys.argv[1:]
try:
    import bcc, mcp_hostagent  # noqa: F401
except Exception as e:
    sys.exit(f"setup: ERROR: cannot import bcc and mcp_hostagent in the venv: {e!r}")
want = os.path.join(venv, "bcc-only", "bcc")
if os.path.dirname(bcc.__file__) != want:
    sys.exit(f"setup: ERROR: bcc imported from {bcc.__file__}, expected it under {want}")
leaks = [p for p in sys.path if p and os.path.realpath(p) == os.path.realpath(dist)]
if leaks or importlib.util.find_spec("apt") is not None:
    sys.exit(f"setup: ERROR: the venv sees Debian's {dist} (sys.path: {sys.path})")
EOF

say "kernel headers: $HEADERS"
say "ready ($VENV)"
