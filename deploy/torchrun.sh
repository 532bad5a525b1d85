#!/usr/bin/env bash
# torchrun with its own datastatesd on this node, without Slurm: one node, or each node of
# several (run it once per node, with torchrun's multi-node options).
#
#   DATASTATES_ROOT=/data/ckpt deploy/torchrun.sh [torchrun options] train.py [train.py args]
#
#   one node:   DATASTATES_ROOT=/data/ckpt deploy/torchrun.sh --standalone --nproc-per-node 8 train.py --lr 3e-4
#   each node:  DATASTATES_ROOT=/shared/ckpt deploy/torchrun.sh --nnodes 2 --node-rank "$R" --nproc-per-node 8 \
#                 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id job42 train.py --lr 3e-4
#
# It renders the node config template (default deploy/node-torchrun.yaml) into a private
# per-run folder, exports DATASTATES_ENDPOINT (an ipc:// socket in that folder) so the
# trainers' Client() finds the daemon, starts datastatesd, waits until it answers, runs
# torchrun with every argument given here, then `datastatesctl wait` (every snapshot
# written, every commit done; skipped when torchrun failed) and `datastatesctl shutdown`
# (drain: every admitted snapshot is written; then stop). On any exit
# (an error, Ctrl-C, SIGTERM) a trap stops the daemon with SIGTERM, which drains too, and
# removes the run folder. SIGTERM, SIGINT or SIGHUP while torchrun runs is passed on to
# torchrun as SIGTERM; the daemon still writes what it admitted, then stops as above.
#
# Environment (everything but DATASTATES_ROOT is optional):
#   DATASTATES_ROOT           the checkpoint folder, the daemon's storage root (created if missing)
#   DATASTATES_NODE_CONFIG    the node config template (default: node-torchrun.yaml beside this script)
#   DATASTATES_HOST_MEMORY, DATASTATES_CHUNK_SIZE, DATASTATES_COMMIT_TIMEOUT, DATASTATES_LOG_LEVEL
#                             values the default template reads (8GiB, 64MiB, 600, info)
#   DATASTATES_RUNDIR         the run folder for the socket and the rendered config (default: a
#                             fresh mktemp -d folder under $TMPDIR or /tmp; made mode 0700)
#   DATASTATES_LOG            the daemon's log (default: in the run folder; its tail is printed
#                             when the script fails, and it is removed with the folder)
#   DATASTATES_START_TIMEOUT  seconds to wait for the daemon to answer (default 60)
#   DATASTATES_WAIT_TIMEOUT   seconds `datastatesctl wait` may take after training (default 600)
#   DATASTATES_STOP_TIMEOUT   seconds to wait for the daemon to drain and exit (default 900)
#   DATASTATES_PYTHON         the python that renders the template (default python3)
# datastatesd, datastatesctl and torchrun are taken from PATH (activate the venv first).
#
# Exit status: torchrun's when it failed; else 1 when `datastatesctl wait` failed (a snapshot
# failed, or the wait timed out); else 0 when the daemon drained and stopped. 2 when the
# daemon could not be started (bad config, missing tools); 128+N after signal N outside training.

# shellcheck disable=SC2317  # cleanup and on_signal run from traps
set -euo pipefail

prog=${0##*/}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() {
    echo "$prog: error: $*" >&2
    exit 2
}

usage() {
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

(($# > 0)) || usage
case $1 in -h | --help) usage ;; esac

[[ -n ${DATASTATES_ROOT:-} ]] || die "set DATASTATES_ROOT to the checkpoint folder (the daemon's storage root)"
[[ $DATASTATES_ROOT == /* ]] || die "DATASTATES_ROOT must be an absolute path, not $DATASTATES_ROOT"
python=${DATASTATES_PYTHON:-python3}
template=${DATASTATES_NODE_CONFIG:-$here/node-torchrun.yaml}
start_timeout=${DATASTATES_START_TIMEOUT:-60}
wait_timeout=${DATASTATES_WAIT_TIMEOUT:-600}
stop_timeout=${DATASTATES_STOP_TIMEOUT:-900}
for tool in datastatesd datastatesctl torchrun "$python"; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH (activate the environment datastates is installed in)"
done
[[ -r $template ]] || die "cannot read the node config template $template"

# render TEMPLATE OUT: ${NAME} -> $NAME, ${NAME:-default} -> $NAME or default; comments kept as they are.
render() {
    "$python" - "$1" "$2" <<'EOF'
import os, re, sys
src, dst = sys.argv[1], sys.argv[2]
pattern = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
missing = []
def value(m):
    v = os.environ.get(m.group(1)) or m.group(2)
    if v is None:
        missing.append(m.group(1))
        return ""
    return v
with open(src) as f:
    lines = [line if line.lstrip().startswith("#") else pattern.sub(value, line) for line in f]
if missing:
    sys.exit(f"{src}: set {', '.join(sorted(set(missing)))}")
with open(dst, "w") as f:
    f.writelines(lines)
EOF
}

# alive PID: the process exists and is not a zombie (an exited child stays one until waited for).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

# exited_within PID SECONDS: whether PID has exited (or never existed) within SECONDS.
exited_within() {
    local ticks=$(($2 * 10))
    while alive "$1"; do
        ((ticks-- > 0)) || return 1
        sleep 0.1
    done
}

# stop_daemon [signal]: SIGTERM (a drain) unless told "nosignal" (after datastatesctl shutdown,
# when it is already on its way out), bounded by DATASTATES_STOP_TIMEOUT, then SIGKILL;
# reaps it and sets daemon_rc.
stop_daemon() {
    [[ -n $daemon_pid ]] || return 0
    if [[ ${1:-} != nosignal ]] && alive "$daemon_pid"; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
    fi
    if ! exited_within "$daemon_pid" "$stop_timeout"; then
        echo "$prog: datastatesd $daemon_pid still running after $stop_timeout s; killing it" >&2
        kill -KILL "$daemon_pid" 2>/dev/null || true
    fi
    daemon_rc=0
    wait "$daemon_pid" 2>/dev/null || daemon_rc=$?
    daemon_pid=''
}

daemon_pid='' train_pid='' phase=start made_rundir=0 daemon_rc=0 rundir=''

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [[ -n $train_pid ]] && alive "$train_pid"; then
        kill -TERM "$train_pid" 2>/dev/null || true
        wait "$train_pid" 2>/dev/null || true
    fi
    stop_daemon
    if ((rc != 0)) && [[ -s ${log:-} ]]; then
        echo "$prog: the last lines of the datastatesd log ($log):" >&2
        tail -n 20 "$log" | sed 's/^/    /' >&2
    fi
    if [[ -n $rundir ]]; then
        if ((made_rundir)); then
            rm -rf -- "$rundir"
        else
            rm -f -- "$rundir/node.yaml" "$rundir/datastatesd.sock" "$rundir/datastatesd.sock.lock"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT

on_signal() {
    local name=$1 num=$2
    if [[ $phase == train ]]; then
        if [[ -z ${forwarded:-} ]]; then
            forwarded=1
            echo "$prog: SIG$name: stopping torchrun; the daemon still writes every snapshot it admitted" >&2
            kill -TERM "$train_pid" 2>/dev/null || true
        fi
    else
        exit $((128 + num))
    fi
}
trap 'on_signal INT 2' INT
trap 'on_signal TERM 15' TERM
trap 'on_signal HUP 1' HUP

# -- the run folder, the config and the endpoint ---------------------------------------------
if [[ -n ${DATASTATES_RUNDIR:-} ]]; then
    rundir=$DATASTATES_RUNDIR
    if [[ ! -d $rundir ]]; then
        mkdir -p -- "$(dirname -- "$rundir")"
        mkdir -m 0700 -- "$rundir"
        made_rundir=1
    fi
else
    rundir=$(mktemp -d "${TMPDIR:-/tmp}/datastates-XXXXXX")
    made_rundir=1
fi
rundir=$(cd "$rundir" && pwd -P)
socket=$rundir/datastatesd.sock
((${#socket} <= 100)) || die "the socket path $socket is too long for a unix socket; set DATASTATES_RUNDIR to a shorter folder"
config=$rundir/node.yaml
log=${DATASTATES_LOG:-$rundir/datastatesd.log}
mkdir -p -- "$DATASTATES_ROOT"
render "$template" "$config" || die "cannot render $template"
if grep -Eq '^endpoint[[:space:]]*:' "$config"; then
    die "$template sets endpoint; leave it out: this script gives the daemon its own, through DATASTATES_ENDPOINT"
fi
export DATASTATES_ENDPOINT=ipc://$socket

# -- start the daemon, and wait until it answers ----------------------------------------------
# In a session of its own, so a Ctrl-C reaches torchrun and this script, never the daemon
# directly: the script stops it after the trainers are done.
launch=()
command -v setsid >/dev/null && launch=(setsid)
"${launch[@]}" datastatesd --node-config "$config" </dev/null >>"$log" 2>&1 &
daemon_pid=$!

datastatesctl --connect-timeout "$start_timeout" status >/dev/null 2>&1 &
probe=$!
while alive "$probe"; do
    if ! alive "$daemon_pid"; then
        kill "$probe" 2>/dev/null || true
        wait "$probe" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || daemon_rc=$?
        daemon_pid=
        die "datastatesd exited with status $daemon_rc before it answered"
    fi
    sleep 0.1
done
wait "$probe" || die "datastatesd did not answer on $DATASTATES_ENDPOINT within $start_timeout s"
echo "$prog: datastatesd $daemon_pid ready on $DATASTATES_ENDPOINT, root $DATASTATES_ROOT" >&2

# -- train -------------------------------------------------------------------------------------
phase=train
torchrun "$@" &
train_pid=$!
train_rc=0
while :; do
    train_rc=0
    wait "$train_pid" || train_rc=$?
    [[ -e /proc/$train_pid ]] || break # reaped; else a trapped signal interrupted the wait: wait again
done
train_pid=
phase=drain
((train_rc == 0)) || echo "$prog: torchrun exited with status $train_rc" >&2

# -- every snapshot written, every commit done; then drain and stop ----------------------------
# After a failed torchrun, no wait: a commit still waiting for ranks that died would hold it
# until its timeout, and the shutdown's drain writes every admitted snapshot all the same.
wait_rc=0
if ((train_rc == 0)); then
    datastatesctl wait --timeout "$wait_timeout" || wait_rc=$?
fi
shutdown_rc=0
datastatesctl shutdown >/dev/null || shutdown_rc=$?
if ((shutdown_rc == 0)); then stop_daemon nosignal; else stop_daemon; fi
echo "$prog: datastatesd stopped (status $daemon_rc)" >&2

if ((train_rc != 0)); then
    exit "$train_rc"
elif ((wait_rc != 0)); then
    exit 1
elif ((shutdown_rc != 0 || daemon_rc != 0)); then
    exit 2
fi
exit 0
