# The keeper of one launch's rank groups: `sh group_keeper.sh KERNEL_PID FOLDER`, started by rank_groups.py
# before any rank, in a session of its own.
#
# It waits for the kernel's end and nothing else. The kernel ends it first when the launch ends as it should;
# when the kernel dies instead (SIGKILL, the OOM killer, a test's timeout) the ranks die with it
# (worker/parent_death.py), but not what they started: the keeper then stops every process group registered
# in FOLDER (an empty file per group, named by its number) and every process whose environment names FOLDER
# (SIGTERM, SIGKILL a second later), and removes the folder. A POSIX shell script rather than Python: it starts
# in about half a millisecond of CPU (a Python interpreter takes ~14 ms, which a 30 ms launch on 2 cores pays),
# and looks for the kernel (its own parent) once a second, which costs a `sleep` process a second.
kernel=$1
folder=$2
trap '' INT USR1 USR2  # a terminal's Ctrl-C is the kernel's to handle, a batch system's checkpoint signal the ranks'

kernel_alive() {  # whether the kernel is still this script's parent: a dead kernel its own parent has not reaped yet
    # still answers `kill -0`, but its children were re-parented the moment it died. Without /proc: `kill -0`
    if read -r _ _ _ parent _ < "/proc/$$/stat"; then [ "$parent" = "$kernel" ]; else kill -0 "$kernel"; fi
} 2>/dev/null

if [ "$PPID" = "$kernel" ]; then  # else the kernel died before this script got here
    while sleep 1 && kernel_alive; do :; done
fi

signal_groups() {  # signal_groups SIGNAL: send it to every registered group but this script's own
    for entry in "$folder"/*; do
        leader=${entry##*/}
        case $leader in '' | *[!0-9]*) continue ;; esac
        [ "$leader" -gt 1 ] && [ "$leader" != "$$" ] && kill -s "$1" -- "-$leader" 2>/dev/null
    done
}

signal_strays() {  # signal_strays SIGNAL: send it to every process that started with this launch's folder in its
    # environment (the ranks pass it down): what a dead rank started in a session of its own, in no group here.
    # GNU grep's -z reads each NUL-ended variable as a line; without it, nothing is found
    grep -lsxzF -- "NBACCEL_RANK_GROUPS=$folder" /proc/[0-9]*/environ 2>/dev/null | while IFS=/ read -r _ _ pid _; do
        [ "$pid" != "$$" ] && kill -s "$1" "$pid" 2>/dev/null
    done
}

signal_groups TERM
signal_strays TERM
sleep 1
signal_groups KILL
signal_strays KILL
rm -rf -- "$folder"
