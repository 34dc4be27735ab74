# The shell inside a bubblewrap sandbox (batchrun/environments/bubblewrap/shell.py speaks to it).
#
# $1 is the token it prints when ready, $2 the ulimit command that caps it and everything it starts. It
# reads one line per command, ``run MARKER $'WORKDIR' $'COMMAND'``, and answers with a MARKER line, the
# command's merged output, then a line "MARKER STATUS" after a newline of its own. The command is a job
# in a process group of its own (started under set -m) that the shell waits for; the time limit is kept
# by the runner, which at the limit sends the shell SIGUSR1, whose trap kills the job's whole process
# group (a timeout(1) process per command would cost as much CPU as the command's own bash). A signal
# that comes as the command ends, or while the shell waits for the next line, changes nothing.
# ``reap MARKER`` kills every other process of the sandbox (kill -1 spares the caller and the sandbox's
# init) and answers with MARKER. Its own stderr (bash's "Killed" notes about timed-out commands) is not
# output and goes nowhere.
eval "$2" || exit 1
exec 2>/dev/null
job=
trap 'expired=1; [ -z "$job" ] || kill -9 -- "-$job"' USR1
run() {
    local status again
    expired=
    printf '%s\n' "$1"     # from here on the runner may signal
    if cd -- "$2" 2>&1; then
        set -m      # only while starting it: job control's own waiting can spin (bash 5.2, wait -f)
        bash -c "$3" </dev/null 2>&1 &
        job=$!
        set +m      # so wait ignores a job that stops itself, as a foreground command's shell would
        [ -z "$expired" ] || kill -9 -- "-$job"     # the time-out came before the job had started
        wait "$job"; status=$?
        if [ -n "$expired" ]; then      # the wait was cut short by the trap (or the job had ended)
            wait "$job"; again=$?
            [ "$again" -eq 127 ] || status=$again
        fi
        job=    # a signal that comes late must not reach what this command left running
    else
        status=1
    fi
    printf '\n%s %d\n' "$1" "$status"
}
reap() {
    kill -9 -1
    printf '%s\n' "$1"
}
printf '%s\n' "$1"
while :; do
    IFS= read -r line || { [ $? -gt 128 ] && continue; break; }    # > 128: a late signal, not the end
    eval "$line"
done
