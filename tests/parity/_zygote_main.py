"""A warm parent for parity ranks (started by parity_harness): imports torch and one library once, then forks
each rank it is asked for, so a rank starts in milliseconds instead of the ~2.7 s of CPU that importing
torch costs on a 2-core machine. The zygote never builds a state or a process group, so every rank still
starts with the library's global state untouched, as a fresh interpreter would.

Protocol on the connection (fd in argv[2]): the harness sends {"id", "env", "log", "cwd"} per rank; the
zygote answers ("started", id, pid) and, when that rank ends, ("exited", pid, exit code).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

import _rank_main

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _rank(request: dict, conn: Connection) -> None:
    """In the forked child: become the rank a fresh `python _rank_main.py` with this environment would be."""
    try:
        conn.close()
        _die_with_parent()  # the zygote; the harness kills the rank's session on a timeout
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        code = _rank_main.main()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(conn: Connection) -> None:
    while True:
        if conn.poll(0.02):
            try:
                request = conn.recv()
            except EOFError:  # the harness is gone
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _rank(request, conn)
            conn.send(("started", request["id"], pid))
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    _die_with_parent()
    _rank_main.preload(sys.argv[1])
    serve(Connection(int(sys.argv[2])))
