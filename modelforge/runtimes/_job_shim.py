"""The first process of every subprocess_job: it starts the job's command and holds its whole
process tree, so nothing the job starts outlives the job.

Run by the node as `python -I -S _job_shim.py STATUS_FD COMMAND...` (standard library only, so it
starts in a few tens of milliseconds without the project on its path). It:

- makes itself a child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`): a process the job
  starts that detaches (double fork, `setsid()`) is re-parented to this shim when its parent
  dies, not to init, so it stays in the shim's process tree where the node finds it;
- forks and execs COMMAND in its own session and process group (the node signals that group on
  a preemption); an exec that fails is written to STATUS_FD (closed on a successful exec), so
  the node still refuses a missing program as it did when it started the job itself;
- survives the preemption signals the node sends to the group (they are the job's to act on)
  and reaps every orphan that ends while the job runs;
- when the job's main process ends, kills (SIGKILL) whatever it left behind and reaps it, then
  ends as the job ended: the same exit code, or killed by the same signal.

The node kills the shim's tree itself when it stops a job early (a cancel, max_duration, a
preemption's grace), and scans for the job's environment marker (MODELFORGE_JOB_TAG) as a
backstop for anything that escaped while the shim was gone."""

import ctypes
import os
import resource
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
# The signals the node may send the job's group (preempt_signal's choices): the job's to handle.
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _children() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(name))
    return found


def _ignore(signum: int, frame: object) -> None:
    """The shim outlives a signal to the group; the job decides what it means."""


def main(argv: list[str]) -> None:
    status_fd, command = int(argv[0]), argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the node's marker scan is what remains
        pass
    for signum in PASSED_ON:
        signal.signal(signum, _ignore)  # caught, so reset to the default by exec in the job
    os.set_inheritable(status_fd, False)  # closed by the job's exec: EOF says it started
    job = os.fork()
    if job == 0:
        try:
            # Python ignores SIGPIPE and SIGXFSZ; a job starts with the defaults, as subprocess gives them.
            for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            os.execvp(command[0], command)
        except OSError as error:
            os.write(status_fd, (error.strerror or str(error)).encode())
        os._exit(127)
    os.close(status_fd)
    status = None
    while status is None:
        pid, waited = os.waitpid(-1, 0)  # the job, or an orphan re-parented here
        if pid == job:
            status = waited
    # The job is over: nothing it started outlives it.
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    # Ended by a signal: the shim ends by the same one, so the node classifies it as before.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL and SIGSTOP cannot be caught: already their default
        pass
    os.kill(os.getpid(), -code)
    os._exit(128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
