#!/usr/bin/env bash
# Installs mcp-agent as a systemd service on a Debian 12 host, once, as root, from this source tree:
#
#   sudo packaging/install.sh              # install (or upgrade) and start
#   sudo packaging/install.sh --no-start   # install only
#   sudo packaging/install.sh --uninstall  # stop and remove the service and /opt/mcp-hostagent
#                                          # (keeps /etc/mcp-hostagent and /var/lib/mcp-hostagent)
#
# What it does: Debian packages (bcc from python3-bpfcc, never PyPI; kernel headers, the nearest
# Debian ones when the running kernel has none), a venv at /opt/mcp-hostagent that sees only Debian's
# bcc module, the package installed into it (non-editable), /etc/mcp-hostagent/config.toml (the
# commented example, if absent), /etc/mcp-hostagent/env (0600, for OTEL_*; if absent), the unit, and
# `systemctl daemon-reload && systemctl enable --now mcp-agent` when systemd is running. Then it checks
# that the probes attach (`mcp-agent probes`). Idempotent.
#
# --root DIR stages every file under DIR instead (no apt, no systemctl, no probe check): for packagers
# and for tests/test_packaging.py. The staged venv names its final path (/opt/mcp-hostagent) in its
# bcc .pth, so it imports bcc only once moved there.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
START=1
DEPS=1
CHECK=1
UNINSTALL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT="${2%/}"; DEPS=0; START=0; CHECK=0; shift ;;
        --root=*) ROOT="${1#--root=}"; ROOT="${ROOT%/}"; DEPS=0; START=0; CHECK=0 ;;
        --no-start) START=0 ;;
        --no-deps) DEPS=0 ;;
        --no-check) CHECK=0 ;;
        --uninstall) UNINSTALL=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
        *) echo "install: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

PREFIX="$ROOT/opt/mcp-hostagent"
ETC="$ROOT/etc/mcp-hostagent"
UNIT_DIR="$ROOT/etc/systemd/system"
STATE="$ROOT/var/lib/mcp-hostagent"
SYS_PY=/usr/bin/python3
DIST=/usr/lib/python3/dist-packages
export DEBIAN_FRONTEND=noninteractive PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "install: $*"; }
die() { echo "install: ERROR: $*" >&2; exit 1; }
systemd_running() { [ -z "$ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

[ "$(id -u)" -eq 0 ] || [ -n "$ROOT" ] || die "run as root (sudo $0)"

if [ "$UNINSTALL" -eq 1 ]; then
    if systemd_running; then
        systemctl disable --now mcp-agent.service 2>/dev/null || true
    fi
    rm -f "$UNIT_DIR/mcp-agent.service"
    systemd_running && systemctl daemon-reload
    rm -rf "$PREFIX"
    say "removed the service and $PREFIX; kept $ETC and $STATE"
    exit 0
fi

# ---------------------------------------------------------------- Debian packages, kernel headers
if [ "$DEPS" -eq 1 ]; then
    command -v apt-get >/dev/null || die "needs apt-get (written for Debian 12); or install python3-bpfcc and kernel headers yourself and pass --no-deps"
    PKGS=(python3-bpfcc libbpfcc python3-venv)
    missing=()
    for p in "${PKGS[@]}"; do dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p"); done
    KREL="$(uname -r)"
    if [ ! -e "/lib/modules/$KREL/build" ] && ! compgen -G '/usr/src/linux-headers-*' >/dev/null; then
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
        apt-get -q update >/dev/null || say "warning: apt-get update reported errors; continuing"
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

# ---------------------------------------------------------------- venv at /opt/mcp-hostagent
[ -x "$SYS_PY" ] || die "$SYS_PY not found"
if [ ! -x "$PREFIX/bin/python" ]; then
    say "creating the venv $PREFIX"
    mkdir -p "$(dirname "$PREFIX")"
    "$SYS_PY" -m venv "$PREFIX"
fi
# Debian's bcc module and nothing else from dist-packages (as scripts/setup.sh does for .venv)
mkdir -p "$PREFIX/bcc-only"
ln -sfn "$DIST/bcc" "$PREFIX/bcc-only/bcc"
SITE="$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
# the .pth names the final path, not the staging one
printf '%s\n' "${PREFIX#"$ROOT"}/bcc-only" >"$SITE/debian_bcc.pth"
say "installing mcp-hostagent from $SRC into $PREFIX"
"$PREFIX/bin/pip" install -q --upgrade "$SRC"

# ---------------------------------------------------------------- config, env, unit
install -d -m 0755 "$ETC"
install -d -m 0750 "$STATE"
if [ ! -e "$ETC/config.toml" ]; then
    install -m 0640 "$SRC/packaging/config.example.toml" "$ETC/config.toml"
    say "wrote $ETC/config.toml (every setting commented out: the defaults)"
fi
if [ ! -e "$ETC/env" ]; then
    (umask 077; cat >"$ETC/env" <<'EOF'
# Environment of mcp-agent.service (root only, mode 0600). The standard OpenTelemetry variables:
#OTEL_EXPORTER_OTLP_ENDPOINT=https://otel-collector.example:4317
#OTEL_EXPORTER_OTLP_PROTOCOL=grpc
#OTEL_EXPORTER_OTLP_CERTIFICATE=/etc/mcp-hostagent/tls/ca.crt
#OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=/etc/mcp-hostagent/tls/client.crt
#OTEL_EXPORTER_OTLP_CLIENT_KEY=/etc/mcp-hostagent/tls/client.key
# A token is better kept out of the environment (/proc/PID/environ): put "authorization=Bearer ..."
# in a root-owned 0600 file and name it in config.toml: [export] headers_file = "/etc/mcp-hostagent/otlp-headers"
EOF
    )
    say "wrote $ETC/env (mode 0600)"
fi
chmod 0600 "$ETC/env"
install -d -m 0755 "$UNIT_DIR"
install -m 0644 "$SRC/packaging/mcp-agent.service" "$UNIT_DIR/mcp-agent.service"
say "installed $UNIT_DIR/mcp-agent.service"

# ---------------------------------------------------------------- check, start
if [ "$CHECK" -eq 1 ]; then
    say "checking that the probes attach (mcp-agent probes)"
    "$PREFIX/bin/mcp-agent" probes --config "$ETC/config.toml" | sed 's/^/  /'
fi
if systemd_running; then
    systemctl daemon-reload
    if [ "$START" -eq 1 ]; then
        systemctl enable --now mcp-agent.service
        systemctl restart mcp-agent.service   # an upgrade runs the new code
        say "started: systemctl status mcp-agent; journalctl -u mcp-agent -f"
    else
        say "installed; start with: systemctl enable --now mcp-agent"
    fi
elif [ -z "$ROOT" ]; then
    say "systemd is not running here (a container?): run $PREFIX/bin/mcp-agent run --config $ETC/config.toml"
fi
say "done"
