"""GrammarProbe: a grammar not compiled yet compiles first in a child process that can be killed, so that this
process only ever compiles what is known to finish within the timeout.

Why: xgrammar's compile cannot be interrupted (one C++ call; it does release the GIL), and a 2.8 KB JSON schema
(forty strings with large maxLength) compiled for a minute on a 49k vocabulary. Nor can a compiled grammar
come back from another process cheaply (serialize_json of an eight-field schema's grammar: 600 MB of JSON,
40 s). So the child answers only "it compiles (or this error)"; it is killed once it has used the timeout in CPU
time, or when its client leaves, and only a grammar that compiled there in time is compiled again here: the same
deterministic work, taking about as long, so nothing uninterruptible runs here for much longer than the
timeout. The price: a cache miss compiles twice (milliseconds for ordinary schemas).

Why CPU time and not wall-clock time: on a loaded machine (the engine's threads on every core) a child compiling
an ordinary schema in 50 ms of CPU waited seconds for a core, and a wall-clock timeout refused 93 of 101 such
schemas (issue 34, item 10). The timeout is what the grammar costs; waiting for a core is not the client's
doing. The child's CPU time is read from /proc (Linux); a wall-clock backstop of WALL_FACTOR times the timeout
bounds how long a client waits on a starved machine, and its refusal says the server was busy.

The children are forked from one helper process, the zygote (spawned once: xgrammar imported, the tokenizer
info loaded), so a probe costs a fork (pages shared copy-on-write), not an interpreter start (3 s and 180 MB).
The zygote is single-threaded, so forking it is safe; forking this multi-threaded server would not be. It
exits when this process closes its socket (or dies), killing its children.

Protocol, pickled tuples over a socketpair: first the tokenizer info (serialize_json), then
  -> ("probe", id, kind, value)   ("kill", id)
  <- ("started", id, child pid)   ("done", id, error message or None)   ("killed", id)
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]      # the folder holding the `engine` package
START_TIMEOUT_S = 120.0     # the zygote's start (imports) and a queue of probes ahead: not the client's budget
PR_SET_PDEATHSIG = 1
POLL_S = 0.05               # how often a waiting probe looks at its client's cancel flag and its child's CPU time
WALL_FACTOR = 6.0           # the wall-clock backstop: a child given this many times its CPU timeout is killed
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CompileTimedOut(Exception):
    """The grammar did not compile within the timeout (its child was killed). `busy`: the wall-clock backstop
    ended it before it had used its CPU time (the machine was too loaded to tell); `cpu_seconds`: what it used."""

    def __init__(self, message: str, busy: bool = False, cpu_seconds: float | None = None) -> None:
        super().__init__(message)
        self.busy = busy
        self.cpu_seconds = cpu_seconds


class CompileCancelled(Exception):
    """Its client went away before the grammar compiled (its child was killed, or never started)."""


@dataclass
class _Slot:
    started: threading.Event = field(default_factory=threading.Event)
    child: int | None = None                    # the compiling process, once started
    done: threading.Event = field(default_factory=threading.Event)
    outcome: tuple[str, str | None] = ("lost", "the grammar compiler process exited")


class GrammarProbe:
    """The parent side. `check` is called from any number of threads at once."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._lock = threading.Lock()           # the connection, its process and the waiting slots
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._waiting: dict[int, tuple[_Slot, Connection]] = {}     # probe id -> its slot, the zygote it is on
        self._ids = itertools.count()
        self._closed = False

    def start(self) -> None:
        """Starts the zygote now (it takes seconds), so that the first probe does not wait for it."""
        with self._lock:
            self._connection()

    def check(self, kind: str, value: str, timeout: float, cancelled: threading.Event) -> str | None:
        """None when the grammar compiles in a child within `timeout` s of CPU time there, else xgrammar's error
        message. Raises CompileTimedOut (over its CPU time, or WALL_FACTOR x `timeout` s of wall-clock time
        after it started), or CompileCancelled once `cancelled` is set."""
        slot = _Slot()
        with self._lock:
            if self._closed:
                raise CompileCancelled("the grammar compiler is closed")
            pid = next(self._ids)
            try:
                conn = self._connection()
                conn.send(("probe", pid, kind, value))
            except OSError:                     # the zygote died and its reader has not noticed yet
                self._conn = self._proc = None
                conn = self._connection()
                conn.send(("probe", pid, kind, value))
            self._waiting[pid] = (slot, conn)
        deadline = time.monotonic() + START_TIMEOUT_S
        started = False
        cpu: float | None = None
        while not slot.done.wait(POLL_S):
            if not started and slot.started.is_set():
                started, deadline = True, time.monotonic() + timeout * WALL_FACTOR
            if started and slot.child is not None:
                cpu = _cpu_seconds(slot.child) or cpu       # None once it has exited (its answer is on the way)
            over = cpu is not None and cpu >= timeout
            if cancelled.is_set() or over or time.monotonic() >= deadline:
                self._kill(pid)
                if cancelled.is_set():
                    raise CompileCancelled("the client went away")
                if over:
                    raise CompileTimedOut(f"did not compile within {timeout:g} s of CPU time", cpu_seconds=cpu)
                raise CompileTimedOut(f"did not compile within {timeout * WALL_FACTOR:g} s: the server was busy",
                                      busy=started, cpu_seconds=cpu)
        kind_, message = slot.outcome
        if kind_ == "done":
            return message
        if kind_ == "killed":               # not by us (we stopped waiting first): it crashed on this grammar
            return "the compiler's process crashed on it"
        return str(message)                 # lost: the zygote died (the next probe starts another)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, proc = self._conn, self._proc
            self._conn = self._proc = None
        if conn is not None:        # the zygote reads EOF, kills its children and exits
            # NOTE: shut down, not only closed: a close does not end the reader thread's recv in progress,
            # and while that holds the socket the zygote never sees EOF
            sock = socket.socket(fileno=conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.detach()
            conn.close()
        if proc is not None:
            _reap(proc)

    def _connection(self) -> Connection:
        """The zygote's connection, spawned on first use or after it died. Called under the lock."""
        if self._conn is None:
            ours, theirs = socket.socketpair()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                              if p)}
            self._proc = subprocess.Popen([sys.executable, "-m", "engine.sample.grammar_probe", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, env=env)
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(self._info)
            self._conn = conn
            threading.Thread(target=self._read, args=(conn, self._proc), daemon=True, name="grammar-probe").start()
        return self._conn

    def _kill(self, pid: int) -> None:
        with self._lock:
            self._waiting.pop(pid, None)
            if self._conn is not None:
                try:
                    self._conn.send(("kill", pid))
                except OSError:
                    pass

    def _read(self, conn: Connection, proc: subprocess.Popen[bytes]) -> None:
        """The reader thread of one zygote: hands each answer to its waiting probe."""
        try:
            while True:
                msg = conn.recv()
                with self._lock:
                    entry = self._waiting.get(msg[1])
                    if msg[0] != "started":
                        self._waiting.pop(msg[1], None)
                if entry is None:
                    continue
                slot = entry[0]
                if msg[0] == "started":
                    slot.child = msg[2]
                    slot.started.set()
                    continue
                slot.outcome = (msg[0], msg[2] if len(msg) > 2 else None)
                slot.done.set()
        except (EOFError, OSError):
            pass
        with self._lock:            # the zygote is gone: its probes fail, the next probe starts a new zygote
            if self._conn is conn:
                self._conn = self._proc = None
            lost = [pid for pid, (_, on) in self._waiting.items() if on is conn]
            slots = [self._waiting.pop(pid)[0] for pid in lost]
        for slot in slots:
            slot.done.set()
        _reap(proc)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used (Linux /proc), or None if it cannot be read (it has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS          # utime, stime: fields 14 and 15 of stat(5)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Waits for the zygote to exit (it kills its children first), killing it after a grace period."""
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the zygote (python -m engine.sample.grammar_probe FD) ----------------------------------------------------

def compile_spec(compiler: Any, kind: str, value: str) -> Any:
    """A spec's compiled grammar (kind, value: a StructuredSpec's), by `compiler` (an xgrammar GrammarCompiler):
    in a probe's child, then in the engine's process (engine/sample/structured.py). Here, so that the probe's
    helper needs nothing of the module that uses it."""
    import xgrammar as xgr
    if kind == "json":
        any_object = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        return compiler.compile_grammar(str(any_object))
    if kind == "json_schema":
        # NOTE: compact separators (a model does not wander into whitespace), and strings whose
        # length the schema bounds kept free of raw control characters: xgrammar's length-bounded
        # string rule admits U+0000-U+001F, which JSON forbids unescaped.
        grammar = xgr.Grammar.from_json_schema(value, any_whitespace=False, strict_mode=True)
        ebnf = str(grammar).replace('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]')
        return compiler.compile_grammar(ebnf)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        options = json.loads(value)
        rule = " | ".join(json.dumps(o) for o in options)
        return compiler.compile_grammar(f"root ::= {rule}")
    return compiler.compile_grammar(value)


def _child(write_fd: int, compile_spec: Any, compiler: Any, kind: str, value: str) -> None:
    """In a forked child: compile, report (b"k" compiled, b"e" + message failed), exit."""
    if sys.platform == "linux":         # killed with the zygote, whatever kills it
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        compile_spec(compiler, kind, value)
        out = b"k"
    except BaseException as exc:        # noqa: BLE001 - any failure is the grammar's error, reported as text
        out = b"e" + str(exc).encode(errors="replace")[:4000]
    os.write(write_fd, out)
    os._exit(0)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def main(fd: int) -> None:
    # Ctrl-C reaches the whole foreground process group, this helper too: the server shuts down on it, and this
    # helper ends when the server closes its socket (a KeyboardInterrupt here only printed a traceback)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    info_json = conn.recv()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    sel = selectors.DefaultSelector()
    sel.register(conn.fileno(), selectors.EVENT_READ, None)
    children: dict[int, tuple[int, int]] = {}       # read fd -> (probe id, child pid)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    for _, child in children.values():
                        os.kill(child, signal.SIGKILL)
                    return
                if msg[0] == "probe":
                    r, w = os.pipe()
                    child = os.fork()
                    if child == 0:
                        os.close(r)
                        conn.close()
                        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                        _child(w, compile_spec, compiler, msg[2], msg[3])
                    os.close(w)
                    children[r] = (msg[1], child)
                    sel.register(r, selectors.EVENT_READ, msg[1])
                    conn.send(("started", msg[1], child))
                elif msg[0] == "kill":
                    for pid, child in children.values():
                        if pid == msg[1]:
                            os.kill(child, signal.SIGKILL)
            else:
                pid, child = children.pop(key.fd)
                sel.unregister(key.fd)
                out = _read_all(key.fd)
                os.close(key.fd)
                os.waitpid(child, 0)
                if out[:1] == b"k":
                    conn.send(("done", pid, None))
                elif out[:1] == b"e":
                    conn.send(("done", pid, out[1:].decode(errors="replace")))
                else:
                    conn.send(("killed", pid))


if __name__ == "__main__":
    main(int(sys.argv[1]))
