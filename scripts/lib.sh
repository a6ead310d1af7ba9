# Shared helpers for scripts/up and scripts/test. Sourced, not run.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian packages space needs at run time and to build and test.
PACKAGES=(btrfs-progs busybox-static bubblewrap runc nftables postgresql iproute2 util-linux procps tar gzip curl ca-certificates gcc libc6-dev pkg-config)
GUEST_TARGET=x86_64-unknown-linux-gnu

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run this as root (space manages namespaces, cgroups, btrfs and loop devices)"
}

ensure_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install a Rust toolchain >= 1.90 (https://rustup.rs), then rerun"
    rustup target list --installed 2>/dev/null | grep -q "$GUEST_TARGET" || true
}

# Build the static guest binaries (space-daemon, space-probe). $1 = cargo profile flag ("" or --release).
build_guest() {
    say "building the static guest daemon${1:+ ($1)}"
    RUSTFLAGS="-C target-feature=+crt-static" cargo build ${1:-} --locked -q \
        -p space-daemon -p space-probe --target "$GUEST_TARGET"
}
