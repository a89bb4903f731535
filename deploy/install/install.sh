#!/bin/sh
# Install nats-node-agent from its single-file artifact (python -m deploy.build): the
# service users, /opt/nats-node-agent, the config and key paths with their modes, and the
# systemd units of deploy/nats/systemd/, enabled. deploy/install/README.md says what each
# step makes and why; tests/system/test_install.py runs it as root in a temporary root.
# The artifact carries this script: `nats-node-agent.pyz install ARGS` runs it on itself.
set -eu

usage() {
    cat <<'EOF'
usage: install.sh --artifact FILE [--role ROLE]... [--root DIR] [--start]

Installs the single-file artifact as /opt/nats-node-agent (bin/node-agent, bin/fleetctl)
and sets up each role (default: node). Existing configs, keys and certificates are kept;
their owners and modes are set to the ones below.

roles:
  node         user node-agent; /etc/node-agent (agent.toml 0640, operators 0644,
               tls/ 0700); /var/lib/node-agent 0700 with the node's key (node.nk 0600,
               made if missing: its public key is printed); node-agent.service
  aggregator   /etc/fleetctl (aggregator.toml 0644, tls/ 0700);
               fleetctl-aggregator.service (a DynamicUser: no user to create)
  nats-server  user nats; /usr/local/bin/nats-server (the one the artifact carries);
               /etc/nats 0750 (nats.conf and tls/ are yours to write); nats-server.service

options:
  --artifact FILE  the .pyz to install (`nats-node-agent.pyz install` passes itself)
  --role ROLE      node, aggregator or nats-server; repeatable
  --root DIR       install under DIR instead of / (an image, a test): users are added
                   to DIR/etc/passwd, units enabled with systemctl --root, nothing started
  --start          start (or restart) the units now
  -h, --help       this text
EOF
}

fail() {
    echo "install: error: $*" >&2
    exit 1
}

ARTIFACT=""
ROLES=""
ROOT=""
START=0
while [ $# -gt 0 ]; do
    case $1 in
    --artifact)
        [ $# -ge 2 ] || fail "--artifact needs a file"
        ARTIFACT=$2
        shift 2
        ;;
    --role)
        case ${2:-} in
        node | aggregator | nats-server) ROLES="$ROLES $2" ;;
        *) fail "--role: one of node, aggregator, nats-server" ;;
        esac
        shift 2
        ;;
    --root)
        [ $# -ge 2 ] || fail "--root needs a directory"
        ROOT=${2%/}
        shift 2
        ;;
    --start)
        START=1
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        usage >&2
        fail "unknown argument: $1"
        ;;
    esac
done
ROLES=${ROLES:-node}
[ -n "$ARTIFACT" ] || fail "--artifact FILE is required"
[ -f "$ARTIFACT" ] || fail "--artifact $ARTIFACT: no such file"
[ "$(id -u)" -eq 0 ] || fail "run as root (it creates users and root-owned files)"
if [ -n "$ROOT" ]; then
    [ -d "$ROOT" ] || fail "--root $ROOT: no such directory"
    [ "$START" -eq 0 ] || fail "--start with --root: nothing runs in another root"
fi

# The deploy files beside this script: deploy/ in a checkout, or the artifact's own copy.
DEPLOY=$(cd "$(dirname "$0")/.." && pwd)
OPT=/opt/nats-node-agent
PYZ=$OPT/nats-node-agent.pyz
UNITS=""

has_role() {
    case " $ROLES " in *" $1 "*) return 0 ;; esac
    return 1
}

# Numeric ids from the target's own files (names would be looked up in this host's).
uid_of() {
    id=$(awk -F: -v name="$1" '$1 == name { print $3 }' "$ROOT/etc/passwd")
    [ -n "$id" ] || fail "no user $1 in $ROOT/etc/passwd"
    echo "$id"
}

gid_of() {
    id=$(awk -F: -v name="$1" '$1 == name { print $3 }' "$ROOT/etc/group")
    [ -n "$id" ] || fail "no group $1 in $ROOT/etc/group"
    echo "$id"
}

# A system user with a group of its own name, no login and no home of its own making.
system_user() {
    if awk -F: -v name="$1" '$1 == name { found = 1 } END { exit !found }' "$ROOT/etc/passwd"; then
        return
    fi
    useradd ${ROOT:+--prefix "$ROOT"} --system --user-group --no-create-home \
        --shell /usr/sbin/nologin --home-dir "$2" --comment "$3" "$1"
}

# directory MODE USER GROUP PATH: made if missing; its mode and owner set either way.
directory() {
    install -d -m "$1" -o "$(uid_of "$2")" -g "$(gid_of "$3")" "$ROOT$4"
}

# keep MODE USER GROUP PATH: an existing file's mode and owner set (a missing one is fine).
keep() {
    if [ -f "$ROOT$4" ]; then
        chown "$(uid_of "$2"):$(gid_of "$3")" "$ROOT$4"
        chmod "$1" "$ROOT$4"
    fi
}

# config SOURCE MODE USER GROUP PATH: SOURCE copied if PATH is missing, then kept.
config() {
    if [ ! -e "$ROOT$5" ]; then
        cp "$1" "$ROOT$5"
    fi
    keep "$2" "$3" "$4" "$5"
}

# The TLS files systemd reads as root (LoadCredential=): certificates 0644, the key 0600.
tls_directory() {
    directory 0700 root root "$1"
    keep 0644 root root "$1/ca.pem"
    keep 0644 root root "$1/cert.pem"
    keep 0600 root root "$1/key.pem"
}

unit() {
    install -d -m 0755 "$ROOT/etc/systemd/system"
    install -m 0644 -o 0 -g 0 "$DEPLOY/nats/systemd/$1" "$ROOT/etc/systemd/system/$1"
    UNITS="$UNITS $1"
}

# The artifact, and its packages extracted once, now, as root: the services run code
# they cannot change, from a tree they cannot write (shiv's SHIV_ROOT, kept per build).
install_artifact() {
    directory 0755 root root "$OPT"
    directory 0755 root root "$OPT/bin"
    directory 0755 root root "$OPT/site"
    if [ "$(realpath "$ARTIFACT")" != "$(realpath -m "$ROOT$PYZ")" ]; then
        install -m 0755 -o 0 -g 0 "$ARTIFACT" "$ROOT$PYZ.new"
        mv -f "$ROOT$PYZ.new" "$ROOT$PYZ"
    fi
    SHIV_ROOT=$ROOT$OPT/site SHIV_COMPILE_PYC=1 "$ROOT$PYZ" fleetctl --version >/dev/null
    interpreter=$(sed -n '1s/^#!//p' "$ROOT$PYZ")
    # shellcheck disable=SC2086 # the shebang's words: /usr/bin/env pythonX.Y
    build=$($interpreter -c 'import json, sys, zipfile
print(json.loads(zipfile.ZipFile(sys.argv[1]).read("environment.json"))["build_id"])' "$ROOT$PYZ")
    CURRENT=$ROOT$OPT/site/nats-node-agent.pyz_$build
    [ -d "$CURRENT/site-packages" ] || fail "the artifact did not extract into $CURRENT"
    chmod -R go-w "$CURRENT"
    for program in node-agent fleetctl; do
        cat >"$ROOT$OPT/bin/$program.new" <<EOF
#!/bin/sh
# $program from the single-file artifact, run from the packages install.sh extracted.
export SHIV_ROOT=$OPT/site
exec $PYZ $program "\$@"
EOF
        chmod 0755 "$ROOT$OPT/bin/$program.new"
        mv -f "$ROOT$OPT/bin/$program.new" "$ROOT$OPT/bin/$program"
    done
}

# Trees of earlier builds, once nothing runs them any more.
remove_earlier_builds() {
    for tree in "$ROOT$OPT/site"/nats-node-agent.pyz_* "$ROOT$OPT/site"/.nats-node-agent.pyz_*_lock; do
        if [ -e "$tree" ] && [ "$tree" != "$CURRENT" ]; then
            rm -rf "$tree"
        fi
    done
}

install_node() {
    system_user node-agent /var/lib/node-agent "nats-node-agent node agent"
    directory 0750 root node-agent /etc/node-agent
    config "$DEPLOY/nats/agent.example.toml" 0640 root node-agent /etc/node-agent/agent.toml
    if [ ! -e "$ROOT/etc/node-agent/operators" ]; then
        : >"$ROOT/etc/node-agent/operators"
    fi
    keep 0644 root root /etc/node-agent/operators
    tls_directory /etc/node-agent/tls
    directory 0700 node-agent node-agent /var/lib/node-agent
    if [ ! -e "$ROOT/var/lib/node-agent/node.nk" ]; then
        # Prints the public key, and how to approve it.
        SHIV_ROOT=$ROOT$OPT/site "$ROOT$PYZ" node-agent init --state-dir "$ROOT/var/lib/node-agent"
    fi
    keep 0600 node-agent node-agent /var/lib/node-agent/node.nk
    unit node-agent.service
}

install_aggregator() {
    directory 0755 root root /etc/fleetctl
    config "$DEPLOY/nats/aggregator.example.toml" 0644 root root /etc/fleetctl/aggregator.toml
    tls_directory /etc/fleetctl/tls
    unit fleetctl-aggregator.service
}

install_nats_server() {
    system_user nats /var/lib/nats "NATS server"
    directory 0755 root root /usr/local/bin
    install -m 0755 -o 0 -g 0 "$CURRENT/site-packages/bin/nats-server" "$ROOT/usr/local/bin/nats-server"
    directory 0750 root nats /etc/nats
    keep 0640 root nats /etc/nats/nats.conf
    if [ ! -e "$ROOT/etc/nats/nats.conf" ]; then
        echo "write /etc/nats/nats.conf from deploy/nats/ (deploy/nats/README.md) before starting"
    fi
    unit nats-server.service
}

install_artifact
if has_role node; then install_node; fi
if has_role aggregator; then install_aggregator; fi
if has_role nats-server; then install_nats_server; fi

# shellcheck disable=SC2086 # UNITS is a list of unit names
if [ -n "$ROOT" ]; then
    systemctl --root "$ROOT" --quiet enable $UNITS
    remove_earlier_builds
elif [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl --quiet enable $UNITS
    # Running units (an upgrade) move to the new build before its predecessor goes.
    systemctl try-restart $UNITS
    remove_earlier_builds
    if [ "$START" -eq 1 ]; then systemctl start $UNITS; fi
else
    systemctl --quiet enable $UNITS
    remove_earlier_builds
    if [ "$START" -eq 1 ]; then fail "systemd is not running here: enabled, not started"; fi
fi
echo "installed $OPT ($(basename "$ARTIFACT")); enabled:$UNITS"
