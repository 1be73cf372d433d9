#!/usr/bin/env bash
# A throw-away sshd on this machine, for tests and for trying `fsdpclip launch --hostfile`: the hostfile's
# "hosts" are names of this machine (localhost, 127.0.0.1), each reached over ssh as a node would be.
#
#   cluster/local-sshd.sh install          apt-get install openssh-server (if sshd is missing)
#   cluster/local-sshd.sh start DIR PORT   install if needed, then start sshd on 127.0.0.1:PORT; prints the ssh
#                                          options that reach it (also in DIR/ssh-options), for launch.ssh_options
#   cluster/local-sshd.sh stop DIR         stop that sshd by its pid file
#
# Everything (sshd_config, host key, the client's key pair and authorized_keys, pid file, log) lives in DIR; it
# admits only DIR's key, for the user that starts it. Nothing under /etc is written and no other sshd is touched
# (as root, sshd needs its privilege-separation directory /run/sshd, created when missing).
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"

die() { echo "local-sshd: $*" >&2; exit 1; }

install() {
    command -v sshd >/dev/null && return
    [ "$(id -u)" = 0 ] || die "sshd is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "sshd is not installed and there is no apt-get to install it"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends openssh-server >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends openssh-server >/dev/null; } ||
        die "apt-get install openssh-server failed"
}

start() {
    local dir port=$2
    mkdir -p "$1" && dir=$(cd "$1" && pwd)
    install
    [ "$(id -u)" = 0 ] && mkdir -p -m 755 /run/sshd
    ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
    ssh-keygen -q -t ed25519 -N '' -f "$dir/id_ed25519"
    cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
    cat >"$dir/sshd_config" <<CONF
Port $port
ListenAddress 127.0.0.1
HostKey $dir/host_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
AllowUsers $(id -un)
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
LogLevel ERROR
CONF
    "$(command -v sshd)" -f "$dir/sshd_config" -E "$dir/sshd.log" || die "sshd did not start (see $dir/sshd.log)"
    for _ in $(seq 100); do [ -s "$dir/sshd.pid" ] && break; sleep 0.1; done
    [ -s "$dir/sshd.pid" ] || die "sshd wrote no pid file (see $dir/sshd.log)"
    echo "-p $port -i $dir/id_ed25519 -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR" |
        tee "$dir/ssh-options"
}

stop() {
    local file=$1/sshd.pid pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

case "${1:-}" in
    install) install ;;
    start) [ $# -eq 3 ] || die "usage: $0 start DIR PORT"; start "$2" "$3" ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
    *) die "usage: $0 install | start DIR PORT | stop DIR" ;;
esac
