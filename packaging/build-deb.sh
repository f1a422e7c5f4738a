#!/usr/bin/env bash
# Builds mcp-hostagent_<version>_<arch>.deb from this source tree, for hosts without PyPI access:
#
#   packaging/build-deb.sh                  # -> build/mcp-hostagent_<version>_<arch>.deb
#   packaging/build-deb.sh --out DIR        # the .deb goes to DIR
#   packaging/build-deb.sh --wheels DIR     # Python dependencies only from the wheels in DIR (no index)
#
# The package holds a virtualenv at /opt/mcp-hostagent with mcp-hostagent and every Python dependency
# installed, so installing it needs no network. A venv names its own absolute path (script shebangs,
# activate), so it is built at /opt/mcp-hostagent itself, in a private mount namespace: an overlay on
# /opt and a tmpfs at /opt/mcp-hostagent, so that neither the host's /opt nor a copy installed there
# is touched or seen. Like scripts/setup.sh's .venv it does not see Debian's site-packages, except the
# bcc module of python3-bpfcc (a directory holding one symlink, named by a .pth file).
#
# Dependency wheels are kept in build/wheels (--wheels or $MCP_WHEELHOUSE: another directory): a
# build installs from there without asking any index, and downloads into it (pip's index settings
# apply) only what is missing. So a second build is offline, and an air-gapped build host needs only
# that directory filled once. The build host is the target platform: Debian's /usr/bin/python3 (its
# version becomes a dependency) and the architecture of the wheels. $DEB_MAINTAINER sets Maintainer.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PKG=mcp-hostagent
PREFIX=/opt/mcp-hostagent
SYS_PY=/usr/bin/python3
DIST=/usr/lib/python3/dist-packages      # where python3-bpfcc puts the bcc module
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

say() { echo "build-deb: $*"; }
die() { echo "build-deb: ERROR: $*" >&2; exit 1; }
# Runs a command with its output kept back; shows the output only if it fails.
quiet() {
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || cat "$log" >&2
    rm -f "$log"
    return "$rc"
}
silent() { "$@" >/dev/null 2>&1; }

# ---------------------------------------------------------------- the venv (at $PREFIX, which is empty)
# Called as `build-deb.sh --venv-here DEST SRC WHEELS OFFLINE` where $PREFIX is a fresh directory of
# this process only; leaves the finished venv in DEST.
make_venv() {
    local dest="$1" src="$2" wheels="$3" offline="$4" w site
    w="$(mktemp -d)"
    quiet "$SYS_PY" -m venv "$PREFIX" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    mkdir "$PREFIX/bcc-only"
    ln -s "$DIST/bcc" "$PREFIX/bcc-only/bcc"
    site="$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    printf '%s\n' "$PREFIX/bcc-only" >"$site/debian_bcc.pth"

    # The project's wheel, built in pip's isolated build environment from the wheelhouse, whose build
    # requirements (pyproject.toml's) are fetched first if missing.
    build_wheel() { "$PREFIX/bin/pip" wheel --no-deps --no-index --find-links "$wheels" -w "$w" "$src"; }
    if ! silent build_wheel; then
        [ "$offline" -eq 0 ] || die "building the mcp-hostagent wheel from $wheels failed (does it hold pyproject.toml's build requirements, setuptools and wheel?)"
        say "downloading build requirements into $wheels"
        mapfile -t reqs < <("$PREFIX/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' "$src/pyproject.toml")
        quiet "$PREFIX/bin/pip" download --only-binary :all: -d "$wheels" "${reqs[@]}" \
            || die "fetching ${reqs[*]} failed (no index reachable? build once with network, or pass --wheels DIR)"
        quiet build_wheel || die "building the mcp-hostagent wheel failed"
    fi
    local whl=("$w"/mcp_hostagent-*.whl)
    # Installed by path, so that no index is ever asked for a project named mcp-hostagent.
    install_offline() { "$PREFIX/bin/pip" install --no-compile --no-index --find-links "$wheels" "${whl[0]}"; }
    if ! silent install_offline; then
        [ "$offline" -eq 0 ] || die "the wheels in $wheels do not satisfy mcp-hostagent's dependencies"
        say "downloading dependency wheels into $wheels"
        quiet "$PREFIX/bin/pip" wheel -w "$wheels" --find-links "$wheels" "${whl[0]}" \
            || die "fetching the dependencies failed (no index reachable? build once with network, or pass --wheels DIR)"
        rm -f "$wheels"/mcp_hostagent-*.whl
        quiet install_offline || die "installing from $wheels failed"
    fi

    # pip records the scratch wheel's path (PEP 610); nothing in the package names the build's files.
    rm -f "$site"/mcp_hostagent-*.dist-info/direct_url.json
    sed -i '/^mcp_hostagent-[^/]*\.dist-info\/direct_url\.json,/d' "$site"/mcp_hostagent-*.dist-info/RECORD

    # What the unit runs, with bcc from Debian's package and nothing else from dist-packages.
    "$PREFIX/bin/mcp-agent" version >/dev/null || die "the venv's mcp-agent does not run"
    if [ -d "$DIST/bcc" ]; then
        "$PREFIX/bin/python" -c '
import os, sys, bcc
want = os.path.join(sys.argv[1], "bcc-only", "bcc")
assert os.path.dirname(bcc.__file__) == want, (bcc.__file__, want)
assert not [p for p in sys.path if os.path.realpath(p) == os.path.realpath(sys.argv[2])], sys.path
' "$PREFIX" "$DIST" || die "the venv imports bcc from the wrong place or sees $DIST"
    fi
    # pip and setuptools were only for building: the installed tree is dpkg's, not pip's.
    quiet "$PREFIX/bin/python" -m pip uninstall -y pip setuptools
    find "$PREFIX" -depth -type d -name __pycache__ -exec rm -rf {} +
    rm -rf "$w"
    cp -a "$PREFIX/." "$dest/"
}

if [ "${1:-}" = "--venv-here" ]; then
    shift
    if [ -n "${MCP_BUILD_NS:-}" ]; then
        # In the new mount namespace: /opt/mcp-hostagent may not exist, and creating it must not touch
        # the host, so /opt becomes an overlay whose upper layer is a tmpfs of ours.
        ns="$MCP_BUILD_NS"
        mkdir "$ns"
        mount -t tmpfs -o mode=0755 mcp-build "$ns" || die "cannot mount a tmpfs in the build namespace"
        mkdir "$ns/upper" "$ns/work"
        mount -t overlay mcp-build -o "lowerdir=/opt,upperdir=$ns/upper,workdir=$ns/work" /opt \
            || die "cannot mount an overlay on /opt in the build namespace"
        mkdir -p "$PREFIX"
        mount -t tmpfs -o mode=0755 mcp-build "$PREFIX" || die "cannot mount a tmpfs on $PREFIX"
    fi
    make_venv "$@"
    exit 0
fi

# ---------------------------------------------------------------- options
OUT="$REPO/build"
WHEELS="${MCP_WHEELHOUSE:-$REPO/build/wheels}"
OFFLINE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift ;;
        --out=*) OUT="${1#--out=}" ;;
        --wheels) WHEELS="$2"; OFFLINE=1; shift ;;
        --wheels=*) WHEELS="${1#--wheels=}"; OFFLINE=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
        *) echo "build-deb: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "${MCP_WHEELHOUSE:-}" ] && OFFLINE=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WHEELS="$(mkdir -p "$WHEELS" && cd "$WHEELS" && pwd)"

command -v dpkg-deb >/dev/null || die "dpkg-deb not found (Debian: apt-get install dpkg)"
[ -x "$SYS_PY" ] || die "$SYS_PY not found"
"$SYS_PY" -c 'import ensurepip, venv' 2>/dev/null || die "$SYS_PY has no venv module (apt-get install python3-venv)"

VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$REPO/agent/__init__.py")"
[ -n "$VERSION" ] || die "no __version__ in agent/__init__.py"
# PEP 440 to Debian ordering: pre-releases sort before the release (~), post-releases after (+).
DEBVERSION="$(echo "$VERSION" | sed -E 's/[.-]?(a|b|rc|dev)([0-9]*)/~\1\2/g; s/[.-]?post([0-9]*)/+post\1/g')"
ARCH="$(dpkg --print-architecture)"
PYVER="$("$SYS_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
PYNEXT="$("$SYS_PY" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')"
DEB="$OUT/${PKG}_${DEBVERSION}_${ARCH}.deb"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
chmod 0755 "$TMP"
STAGE="$TMP/root"
install -d -m 0755 "$STAGE$PREFIX"

# A copy of the source tree: setuptools builds in place and would pick up stale files in build/.
SRC="$TMP/src"
mkdir "$SRC"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$SRC"
else
    tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./build -cf - . | tar -xf - -C "$SRC"
fi

# ---------------------------------------------------------------- the venv, at its final path
say "building the venv $PREFIX (python $PYVER) from $REPO"
VENV_ARGS=("$STAGE$PREFIX" "$SRC" "$WHEELS" "$OFFLINE")
export TMPDIR="$TMP"    # the venv build's scratch files go where the trap removes them
if unshare --mount true 2>/dev/null; then
    MCP_BUILD_NS="$TMP/ns" unshare --mount --propagation private bash "$0" --venv-here "${VENV_ARGS[@]}"
elif unshare --map-root-user --mount true 2>/dev/null; then
    MCP_BUILD_NS="$TMP/ns" unshare --map-root-user --mount --propagation private bash "$0" --venv-here "${VENV_ARGS[@]}"
elif [ ! -e "$PREFIX" ] && [ -w "$(dirname "$PREFIX")" ]; then
    # No namespaces (an unprivileged container): build in place, since nothing is there to disturb.
    trap 'rm -rf "$TMP" "$PREFIX"' EXIT
    mkdir "$PREFIX"
    bash "$0" --venv-here "${VENV_ARGS[@]}"
    rm -rf "$PREFIX"
else
    die "cannot build at $PREFIX: no mount namespace (unshare) here and $PREFIX exists or is not writable"
fi
[ -x "$STAGE$PREFIX/bin/mcp-agent" ] || die "the venv build left no $PREFIX/bin/mcp-agent"

# ---------------------------------------------------------------- files
install -d -m 0755 "$STAGE/usr/bin" "$STAGE/lib/systemd/system" "$STAGE/etc/logrotate.d" \
    "$STAGE/usr/share/doc/$PKG"
ln -s "$PREFIX/bin/mcp-agent" "$STAGE/usr/bin/mcp-agent"
install -m 0644 "$REPO/packaging/mcp-agent.service" "$STAGE/lib/systemd/system/mcp-agent.service"
exec_start="$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$STAGE/lib/systemd/system/mcp-agent.service")"
[ -x "$STAGE$exec_start" ] || die "the unit's ExecStart=$exec_start is not in the package"
install -d -m 0755 "$STAGE/etc/mcp-hostagent"
install -m 0640 "$REPO/packaging/config.example.toml" "$STAGE/etc/mcp-hostagent/config.toml"
install -m 0600 "$REPO/packaging/env.example" "$STAGE/etc/mcp-hostagent/env"
install -m 0644 "$REPO/packaging/logrotate" "$STAGE/etc/logrotate.d/$PKG"
install -m 0644 "$REPO/README.md" "$STAGE/usr/share/doc/$PKG/README.md"
# the Grafana dashboard and the Prometheus rules (checked with promtool by the tests), for the
# monitoring side to pick up; docs/TELEMETRY.md and docs/TRACEQL.md say what they show
install -d -m 0755 "$STAGE/usr/share/$PKG/grafana" "$STAGE/usr/share/$PKG/prometheus"
install -m 0644 "$REPO/packaging/grafana/mcp-agent-dashboard.json" "$STAGE/usr/share/$PKG/grafana/"
install -m 0644 "$REPO/packaging/prometheus/rules.yml" "$STAGE/usr/share/$PKG/prometheus/"
for d in TELEMETRY.md TRACEQL.md PROMETHEUS.md; do install -m 0644 "$REPO/docs/$d" "$STAGE/usr/share/doc/$PKG/$d"; done
cat >"$STAGE/usr/share/doc/$PKG/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: mcp-hostagent

Files: *
Copyright: the mcp-agent authors
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.

Files: opt/mcp-hostagent/lib/*
Copyright: the authors of each Python distribution installed there
License: various
 Each distribution's license is in its *.dist-info directory under
 /opt/mcp-hostagent/lib/python3*/site-packages.
EOF
DATE="$(date -R -d "@${SOURCE_DATE_EPOCH:-$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || date +%s)}")"
printf '%s (%s) unstable; urgency=medium\n\n  * Built from the source tree by packaging/build-deb.sh.\n\n -- %s  %s\n' \
    "$PKG" "$DEBVERSION" "${DEB_MAINTAINER:-mcp-agent maintainers <root@localhost>}" "$DATE" \
    | gzip -9n >"$STAGE/usr/share/doc/$PKG/changelog.gz"

# ---------------------------------------------------------------- control
install -d -m 0755 "$STAGE/DEBIAN"
for s in postinst prerm postrm; do install -m 0755 "$REPO/packaging/deb/$s" "$STAGE/DEBIAN/$s"; done
printf '%s\n' /etc/mcp-hostagent/config.toml /etc/mcp-hostagent/env "/etc/logrotate.d/$PKG" >"$STAGE/DEBIAN/conffiles"
(cd "$STAGE" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort \
    | grep -vxF -f <(sed 's|^/||' DEBIAN/conffiles) | tr '\n' '\0' | xargs -0 md5sum) >"$STAGE/DEBIAN/md5sums"
SIZE="$(cd "$STAGE" && du -sk --apparent-size --exclude=./DEBIAN . | cut -f1)"
cat >"$STAGE/DEBIAN/control" <<EOF
Package: $PKG
Version: $DEBVERSION
Architecture: $ARCH
Maintainer: ${DEB_MAINTAINER:-mcp-agent maintainers <root@localhost>}
Installed-Size: $SIZE
Depends: python3 (>= $PYVER~), python3 (<< $PYNEXT), python3-bpfcc, libbpfcc
Recommends: linux-headers-$ARCH | linux-headers-cloud-$ARCH, logrotate
Section: admin
Priority: optional
Description: eBPF host observability for GPU inference hosts, as OpenTelemetry
 mcp-agent counts, in the kernel, what the host does to each inference
 request (page faults, reclaim, context switches, off-CPU time) and exports
 it as OpenTelemetry spans and metrics inside the application's own traces.
 .
 The agent and its Python dependencies live in a virtualenv at
 /opt/mcp-hostagent; bcc comes from python3-bpfcc. Service: mcp-agent.service.
 Settings: /etc/mcp-hostagent/config.toml; OTEL_* variables:
 /etc/mcp-hostagent/env.
 Kernel headers of the running kernel, or the nearest Debian ones, are needed
 to compile the BPF programs.
EOF

dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
say "built $DEB ($(du -h "$DEB" | cut -f1))"
if command -v lintian >/dev/null; then
    lintian --no-tag-display-limit "$DEB" || say "lintian reported the above (not fatal)"
fi
