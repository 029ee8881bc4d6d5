"""Grammar compile worker processes: an xgrammar compile that can be killed.

xgrammar's compiles are C++ that cannot be interrupted, so a compile run on a thread holds
that thread (and a core) until it returns, whether or not anyone still wants the result or
its budget is long spent. Here each compile runs in a worker process instead; the server
kills the process when the compile's budget runs out or its last client leaves, and starts
a fresh one.

A worker is forked from a zygote process (started by the server on the first compile),
which imports this module (so xgrammar, and the torch and transformers that xgrammar
imports: ~280 MB, ~2 s of CPU) once; a fork from it starts in milliseconds and shares
those pages. Not multiprocessing's forkserver or spawn: their children re-import the
server's __main__ (and re-run a script without a main guard). A worker gets the serialized
TokenizerInfo first, then answers requests over a socket (a multiprocessing Connection),
one at a time:

    request: (method, text)             method in COMPILE_METHODS
    reply:   ("ok", seconds, grammar)   CompiledGrammar.serialize_json()
             ("invalid", seconds, msg)  xgrammar refused the input (a user error)
             ("failed", seconds, msg)   anything else (not the input's fault)

Deserializing in the server costs ~1/10 of the compile (both release the GIL): measured in
structured/README.md.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import xgrammar as xgr

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
COMPILE_METHODS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")
_PR_SET_PDEATHSIG = 1


class WorkerDied(Exception):
    """The worker process ended (killed, or crashed) before it answered."""


def compile_text(compiler: xgr.GrammarCompiler, method: str, text: str) -> xgr.CompiledGrammar:
    """One compile. Compact JSON (no free whitespace): a small model cannot wander into
    endless whitespace, and fixed separators give jump-forward more to skip."""
    if method == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False)
    if method == "json_object":  # strict_mode=False: any properties (strict means `{}` only)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "structural_tag":
        return compiler.compile_structural_tag(text)
    assert method == "grammar", method
    return compiler.compile_grammar(text)


def xgrammar_message(error: BaseException) -> str:
    """The first line of xgrammar's message, without its source-location prefix."""
    text = str(error).strip()
    return _XGR_PREFIX.sub("", text).splitlines()[0] if text else repr(error)


def worker_main(conn: Connection) -> None:
    """The worker process: compiles requests until its connection closes."""
    try:  # the zygote is our parent and exits with the server: die with it
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):
        return
    # Our cache (the server's) is the only one: xgrammar's is unbounded by default.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", 0.0, ""))
    while True:
        try:
            method, text = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            serialized = compile_text(compiler, method, text).serialize_json()
            reply = ("ok", time.perf_counter() - start, serialized)
        except (RuntimeError, ValueError, TypeError) as e:  # InvalidStructuralTagError too
            reply = ("invalid", time.perf_counter() - start, xgrammar_message(e))
        except Exception as e:  # noqa: BLE001 - reported, the server decides
            reply = ("failed", time.perf_counter() - start, repr(e)[:500])
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def zygote_main(control_fd: int) -> None:
    """The zygote process: imports xgrammar once, then forks a worker for each socket the
    server sends it (SCM_RIGHTS) and answers the worker's pid. It exits when the server
    does (its control socket closes); SIGCHLD ignored: the kernel reaps dead workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            os._exit(0)
        if not fds:  # the server closed the socket
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                worker_main(Connection(fds[0]))
            finally:
                os._exit(0)
        os.close(fds[0])
        control.sendall(pid.to_bytes(8, "little"))


class _Zygote:
    """The server's handle on the zygote process (started on first use, restarted if it
    died). Forking from it, not from the server, keeps the server's threads and CUDA or
    OpenMP state out of the workers, and a worker starts in milliseconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None

    def fork(self) -> tuple[int, Connection]:
        """A new worker process: (pid, the server's end of its connection)."""
        ours, theirs = socket.socketpair()
        with self._lock:
            try:
                control = self._started()
                socket.send_fds(control, [b"F"], [theirs.fileno()])
                pid = int.from_bytes(_recv_exactly(control, 8), "little")
            except OSError as e:
                self._stop()
                ours.close()
                raise WorkerDied(f"the grammar compile zygote failed: {e!r}") from None
            finally:
                theirs.close()
        return pid, Connection(ours.detach())

    def _started(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._control:
            return self._control
        self._stop()
        ours, theirs = socket.socketpair()
        code = f"from {__name__} import zygote_main; zygote_main({theirs.fileno()})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._control = ours
        return ours

    def _stop(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the zygote closed its socket")
        data += chunk
    return data


_ZYGOTE = _Zygote()


class CompileWorker:
    """One worker process, driven by one thread (compile blocks); `kill` may come from
    any thread and makes a blocked `compile` raise WorkerDied."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid: int | None = None
        self._pidfd: int | None = None  # signals this process, never a reused pid
        self._conn: Connection | None = None
        self._killed = False  # set by kill(): the process is gone or going
        self._signal_lock = threading.Lock()  # kill() vs reap() closing the pidfd

    def is_alive(self) -> bool:
        return self._conn is not None and not self._killed

    def start(self, tokenizer_info_json: str) -> None:
        """Starts the process (if not running) and waits until it is ready."""
        if self.is_alive():
            return
        self.reap()
        pid, conn = _ZYGOTE.fork()
        self.pid, self._conn = pid, conn
        try:  # now, while it waits for the TokenizerInfo below: it cannot have died
            self._pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = None
        try:
            conn.send(tokenizer_info_json)
            conn.recv()  # ("ready", ...)
        except (EOFError, OSError) as e:
            self.reap()
            raise WorkerDied(f"the grammar compile worker did not start: {e!r}") from None

    def compile(self, method: str, text: str) -> tuple[str, float, str]:
        """(status, seconds, payload); raises WorkerDied if the process ends first."""
        conn = self._conn
        if conn is None:
            raise WorkerDied("not started")
        try:
            conn.send((method, text))
            return conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerDied(repr(e)) from None

    def kill(self) -> None:
        """SIGKILL (from any thread): the compile stops now, its core is free. Through
        a pidfd where the kernel has them: the zygote's dead children are reaped at once,
        so a bare pid could name another process by the time it is signalled."""
        with self._signal_lock:
            self._killed = True
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                elif self.pid is not None:
                    os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def reap(self) -> None:
        """Kills the process if it runs and closes its connection (its thread only)."""
        if self._conn is not None:
            self.kill()
            self._conn.close()
            self._conn = None
        with self._signal_lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self.pid = None
            self._killed = False
