#!/usr/bin/env bash
# Installs mcp-agent as a systemd service on one Debian 12 host, as root, from this source tree:
#
#   sudo packaging/install.sh              # install (or upgrade) and start
#   sudo packaging/install.sh --no-start   # install and enable, but do not start
#   sudo packaging/install.sh --deb FILE   # install that package instead of building one
#   sudo packaging/install.sh --uninstall  # stop and remove it (keeps /etc/mcp-hostagent and
#                                          # /var/lib/mcp-hostagent)
#   sudo packaging/install.sh --purge      # remove those too
#
# It installs exactly what a fleet installs: the Debian package that packaging/build-deb.sh builds
# (a venv at /opt/mcp-hostagent, /usr/bin/mcp-agent, the unit, /etc/mcp-hostagent/config.toml and a
# 0600 env file for OTEL_*, as conffiles). Around it, what only this host can tell: kernel headers for
# the running kernel (else Debian's newest of its flavour: the agent merges them with -common), and a
# check that the probes attach (`mcp-agent probes`). apt-get brings the package's dependencies
# (python3-bpfcc, libbpfcc) from Debian; the package's maintainer scripts enable and start the service
# where systemd runs. Idempotent: an unchanged tree is reinstalled, configuration files are kept.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PKG=mcp-hostagent
START=1
DEPS=1
CHECK=1
DEB=""
UNINSTALL=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-start) START=0 ;;
        --no-deps) DEPS=0 ;;
        --no-check) CHECK=0 ;;
        --deb) DEB="$2"; shift ;;
        --deb=*) DEB="${1#--deb=}" ;;
        --uninstall) UNINSTALL=remove ;;
        --purge) UNINSTALL=purge ;;
        -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
        *) echo "install: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
export DEBIAN_FRONTEND=noninteractive

say() { echo "install: $*"; }
die() { echo "install: ERROR: $*" >&2; exit 1; }
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
systemd_running() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }
pkg_installed() { dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null | grep -q '^ii'; }

[ "$(id -u)" -eq 0 ] || die "run as root (sudo $0)"
command -v apt-get >/dev/null || die "needs apt-get and dpkg (written for Debian 12)"

# Earlier versions of this script installed the same paths without a package: the unit in
# /etc/systemd/system (which would hide the package's) and an unowned venv.
remove_unpackaged() {
    local unit=/etc/systemd/system/mcp-agent.service
    if [ -f "$unit" ] && [ ! -L "$unit" ] && ! dpkg -S "$unit" >/dev/null 2>&1; then
        systemd_running && systemctl disable --now mcp-agent.service >/dev/null 2>&1 || true
        rm -f "$unit"
        say "removed $unit (installed without the package)"
    fi
    if [ -d /opt/mcp-hostagent ] && ! dpkg -S /opt/mcp-hostagent >/dev/null 2>&1; then
        rm -rf /opt/mcp-hostagent
        say "removed /opt/mcp-hostagent (installed without the package)"
    fi
}

if [ -n "$UNINSTALL" ]; then
    remove_unpackaged
    if dpkg-query -W "$PKG" >/dev/null 2>&1; then
        quiet apt-get "$UNINSTALL" -y -q "$PKG"
    fi
    [ "$UNINSTALL" = purge ] && rm -rf /etc/mcp-hostagent /var/lib/mcp-hostagent
    say "done ($UNINSTALL)"
    exit 0
fi

# ---------------------------------------------------------------- what the build and this host need
APT_UPDATED=0
apt_update() {
    [ "$APT_UPDATED" -eq 0 ] || return 0
    APT_UPDATED=1
    apt-get -q update >/dev/null || say "warning: apt-get update reported errors; continuing"
}
if [ "$DEPS" -eq 1 ]; then
    missing=()
    [ -n "$DEB" ] || pkg_installed python3-venv || missing+=(python3-venv)
    KREL="$(uname -r)"
    if [ ! -e "/lib/modules/$KREL/build" ] && ! compgen -G '/usr/src/linux-headers-*' >/dev/null; then
        apt_update
        if apt-cache policy "linux-headers-$KREL" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
            missing+=("linux-headers-$KREL")
        else  # a custom kernel: the newest Debian flavoured headers (the agent merges them with -common)
            arch="$(dpkg --print-architecture)"
            pkg="$(apt-cache search --names-only "^linux-headers-[0-9.]+[^ ]*[0-9]-(cloud-)?$arch\$" | awk '{print $1}' | sort -V | tail -n 1)"
            [ -n "$pkg" ] || die "no linux-headers package for kernel $KREL; install headers under /usr/src and pass --no-deps"
            missing+=("$pkg")
        fi
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        say "apt-get install ${missing[*]}"
        apt_update
        quiet apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
fi

# ---------------------------------------------------------------- the package
TMP="$(mktemp -d)"
POLICY=/usr/sbin/policy-rc.d
cleanup() { rm -rf "$TMP"; [ ! -f "$TMP.policy" ] || { rm -f "$POLICY" "$TMP.policy"; }; }
trap cleanup EXIT
if [ -z "$DEB" ]; then
    bash "$SRC/packaging/build-deb.sh" --out "$TMP"
    DEB="$(ls "$TMP"/${PKG}_*.deb)"
fi
[ -f "$DEB" ] || die "no such package: $DEB"
DEB="$(cd "$(dirname "$DEB")" && pwd)/$(basename "$DEB")"

remove_unpackaged
if [ "$START" -eq 0 ] && [ ! -e "$POLICY" ]; then
    # The Debian way to install without starting: deb-systemd-invoke asks policy-rc.d (101: no).
    printf '#!/bin/sh\nexit 101\n' >"$POLICY"
    chmod 0755 "$POLICY"
    touch "$TMP.policy"
fi
say "apt-get install $DEB"
for p in python3-bpfcc libbpfcc logrotate; do pkg_installed "$p" || { apt_update; break; }; done
# Headers were seen to above, so not the package's generic Recommends (a second headers tree);
# logrotate, its other Recommends, is named. confold: configuration an admin changed is kept.
quiet apt-get install -y -q --reinstall --allow-downgrades --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$DEB" logrotate
cleanup
trap - EXIT

# ---------------------------------------------------------------- check
if [ "$CHECK" -eq 1 ]; then
    say "checking that the probes attach (mcp-agent probes)"
    /usr/bin/mcp-agent probes --config /etc/mcp-hostagent/config.toml | sed 's/^/  /'
fi
if systemd_running; then
    if [ "$START" -eq 1 ]; then
        say "$(systemctl is-active mcp-agent.service || true): systemctl status mcp-agent; journalctl -u mcp-agent -f"
    else
        say "installed and enabled; start with: systemctl start mcp-agent"
    fi
else
    say "systemd is not running here (a container?): run mcp-agent run --config /etc/mcp-hostagent/config.toml"
fi
say "done"
