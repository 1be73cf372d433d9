#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine, for tests and for trying `fsdpclip launch --slurm`.
#
#   cluster/local-slurm.sh install            apt-get install slurm-wlm and munge (if slurmctld is missing)
#   cluster/local-slurm.sh start DIR [NODES]  install if needed, then start munged, slurmctld and NODES
#                                             slurmd (default 1) as fake nodes node1..nodeN of this host;
#                                             prints the line that points Slurm's commands at it
#   cluster/local-slurm.sh stop DIR           cancel its jobs, then stop its daemons by their pid files
#
# Everything (slurm.conf, munge key and socket, state, spool, logs, pid files) lives in DIR; nothing
# is written under /etc and no running daemon other than DIR's own is touched. Daemons listen on
# ports LOCAL_SLURM_PORT (slurmctld, default 16817) and LOCAL_SLURM_PORT+i (node i). Debian's
# slurm-wlm 22.05 + munge, run as root (what CI does); the fake nodes all claim every core.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
PORT="${LOCAL_SLURM_PORT:-16817}"

die() { echo "local-slurm: $*" >&2; exit 1; }

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    [ "$(id -u)" = 0 ] || die "slurmctld is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "slurmctld is not installed and there is no apt-get to install it"
    local packages=(slurm-wlm munge)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; } ||
        die "apt-get install ${packages[*]} failed"
}

# Run the command until it succeeds, for up to $1 seconds; fail if it never does.
wait_for() {
    local seconds=$1; shift
    for _ in $(seq $((seconds * 10))); do "$@" && return 0; sleep 0.1; done
    return 1
}

write_conf() {
    local dir=$1 nodes=$2 host hardware cpus memory
    host=$(hostname -s)
    hardware=$(slurmd -C)
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hardware")
    memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hardware")
    cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=$(id -un)
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
EOF
    for i in $(seq "$nodes"); do
        echo "NodeName=node$i NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$cpus RealMemory=$((memory * 9 / 10))"
    done >>"$dir/slurm.conf"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
}

all_idle() { [ "$(sinfo -h -N -o %t | sort -u)" = idle ]; }

start() {
    local dir nodes=${2:-1}
    mkdir -p "$1" && dir=$(cd "$1" && pwd)
    install
    mkdir -p "$dir"/{munge,state,spool,run,log}
    chmod 755 "$dir" "$dir/munge"  # jobs of other users reach the munge socket
    write_conf "$dir" "$nodes"
    export SLURM_CONF="$dir/slurm.conf"
    trap 'stop "$dir" >/dev/null 2>&1' EXIT  # a failed start stops what it started

    head -c 1024 /dev/urandom >"$dir/munge/munge.key"
    chmod 600 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket.2" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
    wait_for 10 test -s "$dir/run/munged.pid" || die "munged did not start (see $dir/log/munged.log)"

    slurmctld -c
    wait_for 10 test -s "$dir/run/slurmctld.pid" || die "slurmctld did not start (see $dir/log/slurmctld.log)"
    for i in $(seq "$nodes"); do
        slurmd -N "node$i"
        wait_for 10 test -s "$dir/run/slurmd-node$i.pid" || die "slurmd node$i did not start (see $dir/log)"
    done
    wait_for 30 all_idle || die "the nodes did not become idle (see $dir/log)"
    trap - EXIT
    echo "export SLURM_CONF=$SLURM_CONF"
}

gone() { ! kill -0 "$1" 2>/dev/null; }

# Stop the processes named by the given pid files (TERM, then KILL after 10 s) and wait until they are gone.
stop_pids() {
    local pids=() pid
    for file in "$@"; do [ -s "$file" ] && pids+=("$(cat "$file")"); done
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        wait_for 10 gone "$pid" || kill -KILL "$pid" 2>/dev/null || true
    done
    rm -f "$@"
}

no_jobs() { [ -z "$(squeue -h -o %A)" ]; }

stop() {
    local dir
    dir=$(cd "$1" && pwd)
    export SLURM_CONF="$dir/slurm.conf"
    if [ -s "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
        squeue -h -o %A | xargs -r scancel
        wait_for 60 no_jobs || echo "local-slurm: jobs still running after 60 s; stopping the daemons" >&2
    fi
    stop_pids "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid"
    stop_pids "$dir/run/munged.pid"
}

case "${1:-}" in
    install) install ;;
    start) [ $# -ge 2 ] || die "usage: $0 start DIR [NODES]"; start "$2" "${3:-1}" ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
    *) die "usage: $0 install | start DIR [NODES] | stop DIR" ;;
esac
