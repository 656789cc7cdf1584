# The keeper of one launch's rank groups: `sh group_keeper.sh KERNEL_PID FOLDER`, started by rank_groups.py
# before any rank, in a session of its own.
#
# It waits for the kernel's end and nothing else. The kernel ends it first when the launch ends as it should;
# when the kernel dies instead (SIGKILL, the OOM killer, a test's timeout) the ranks die with it
# (worker/parent_death.py), but not what they started: the keeper then stops every process group registered
# in FOLDER (an empty file per group, named by its number: SIGTERM, SIGKILL a second later) and removes the
# folder. A POSIX shell script rather than Python: it starts in about half a millisecond of CPU (a Python
# interpreter takes ~14 ms, which a 30 ms launch on 2 cores pays), and looks for the kernel (`kill -0`) once a
# second, which costs a `sleep` process a second.
kernel=$1
folder=$2
trap '' INT  # a terminal's Ctrl-C is the kernel's to handle

if [ "$PPID" = "$kernel" ]; then  # else the kernel died before this script got here
    while sleep 1 && kill -0 "$kernel" 2>/dev/null; do :; done
fi

signal_groups() {  # signal_groups SIGNAL: send it to every registered group but this script's own
    for entry in "$folder"/*; do
        leader=${entry##*/}
        case $leader in '' | *[!0-9]*) continue ;; esac
        [ "$leader" -gt 1 ] && [ "$leader" != "$$" ] && kill -s "$1" -- "-$leader" 2>/dev/null
    done
}

signal_groups TERM
sleep 1
signal_groups KILL
rm -rf -- "$folder"
