"""A small local control socket for ring dumps: a running process registers its queues by name and
`vring dump --ctl SOCKET` asks for them.

Server: ``ControlServer(path).register("tx0", queue).start()`` ... ``.close()``. ``queue`` is a queue half
(rings.virtq / rings.reference DriverQueue or DeviceQueue, or anything with the interface rings.snapshot
reads), an object holding one as ``.vq`` (virtio's TxQueue/RxQueue), or a zero-argument callable returning
either (or None while it does not exist), for queues that are created or replaced later. Register and
unregister at any time, from any thread.

Protocol: AF_UNIX stream socket, mode 0600, one JSON object per line each way. Requests:

    {"cmd": "list"}                  -> {"ok": true, "queues": [{"name", "format", "side", "size"}, ...],
                                         "no_ring": [names registered whose ring is not there now]}
    {"cmd": "snapshot", "name": N}   -> {"ok": true, "name": N, "time": t, "snapshot": {...}}
    {"cmd": "raw", "name": N}        -> {"ok": true, "name": N, "time": t, "raw": base64 of the raw file}
    {"cmd": "raw", "name": N, "path": P} -> the server writes the raw snapshot file at P: {"ok": true, "path": P}

Errors: {"ok": false, "error": "..."}. The plain-text forms ``list``, ``snapshot NAME``, ``raw NAME`` are
accepted too (handy with socat). The server reads ring memory and private counters without locks while
the data path runs: it copies them first (rings.rawdump.capture) and decodes the copy.
"""
import base64
import errno
import json
import logging
import os
import select
import socket
import stat
import threading
import time

from . import rawdump
from .errors import VringError
from .vhost_user import listen_unix

log = logging.getLogger("vring.ctl")

MAX_REQUEST = 1 << 16
MAX_REPLY = 1 << 26    # a raw snapshot of the largest packed ring is ~2 MiB in base64


class ControlServer:
    def __init__(self, path):
        self.path = os.fspath(path)
        self._queues = {}
        self._lock = threading.Lock()
        self._sock = None
        self._thread = None
        self._closing = threading.Event()
        self._ino = None
        self._wake = None   # (read, write) pipe

    def register(self, name, queue):
        with self._lock:
            self._queues[str(name)] = queue
        return self

    def unregister(self, name):
        with self._lock:
            self._queues.pop(str(name), None)
        return self

    def names(self):
        with self._lock:
            return sorted(self._queues)

    def _queue(self, name):
        """The queue registered as ``name``: KeyError if none is, _NoRing if it has no ring now."""
        with self._lock:
            q = self._queues.get(name)
            known = name in self._queues
        if q is not None and callable(q) and not hasattr(q, "state"):
            q = q()
        if q is not None and not hasattr(q, "state") and hasattr(q, "vq"):
            q = q.vq  # a wrapper holding its ring queue (virtio's TxQueue / RxQueue)
        if q is None:
            raise (_NoRing if known else KeyError)(name)
        return q

    def start(self):
        """Bind (replacing a stale socket file, never a live one: ConfigError), listen, and serve in a daemon
        thread."""
        if self._sock is not None:
            return self
        s = listen_unix(self.path, backlog=8)   # mode 0600
        self._ino = os.lstat(self.path).st_ino
        s.setblocking(False)
        self._sock = s
        self._wake = os.pipe2(os.O_CLOEXEC)   # close() ends the accept loop's wait at once
        self._thread = threading.Thread(target=self._serve, name=f"vring-ctl {self.path}", daemon=True)
        self._thread.start()
        return self

    def close(self):
        self._closing.set()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        if self._sock is not None:
            self._sock.close()
            try:   # our socket file, not one somebody else bound there since
                st = os.lstat(self.path)
                if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._ino:
                    os.unlink(self.path)
            except OSError:
                pass
        self._sock = self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _serve(self):
        waits = select.poll()   # (not select: no limit on the fds' numbers)
        waits.register(self._sock, select.POLLIN)
        waits.register(self._wake[0], select.POLLIN)
        wake = select.poll()
        wake.register(self._wake[0], select.POLLIN)
        short = False
        while not self._closing.is_set():
            try:
                waits.poll()
                conn, _ = self._sock.accept()
            except BlockingIOError:   # the wake pipe, or a client that gave up before we accepted it
                continue
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return   # the listener closed under us
                if not short:   # out of fds for now: the client waits in the backlog; try again soon
                    log.warning("control socket %s: cannot accept a client (%s); retrying", self.path, e.strerror)
                    short = True
                wake.poll(100)   # (the listener stays readable: waiting on it would spin)
                continue
            except ValueError:
                return
            short = False
            conn.setblocking(True)
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn):
        conn.settimeout(10)
        try:
            f = conn.makefile("rwb")
            while not self._closing.is_set():
                line = f.readline(MAX_REQUEST)
                if not line:
                    return
                if not line.endswith(b"\n") and len(line) >= MAX_REQUEST:
                    reply = {"ok": False, "error": "request too long"}
                else:
                    reply = self.handle(line)
                f.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
                f.flush()
        except OSError:
            pass
        finally:
            conn.close()

    def handle(self, line):
        """One request (bytes or str of JSON or plain text) -> the reply dict."""
        try:
            req = _parse(line)
            cmd = req.get("cmd")
            if cmd == "list":
                out, no_ring = [], []
                for name in self.names():
                    try:
                        q = self._queue(name)
                        out.append({"name": name, "format": q.layout.fmt, "side": q.side, "size": q.layout.size})
                    except _NoRing:
                        no_ring.append(name)
                    except KeyError:  # unregistered meanwhile
                        pass
                return {"ok": True, "queues": out, "no_ring": no_ring}
            if cmd in ("snapshot", "raw"):
                name = req.get("name")
                if not isinstance(name, str):
                    return {"ok": False, "error": f"{cmd}: a queue name is needed"}
                try:
                    q = self._queue(name)
                except _NoRing:
                    return {"ok": False, "error": f"queue {name!r} has no ring now (no peer connected, or its vring "
                                                  f"not started)"}
                except KeyError:
                    return {"ok": False, "error": f"no queue named {name!r} (have: {', '.join(self.names())})"}
                raw = rawdump.capture(q, meta={"name": name, "pid": os.getpid()})
                fault = q.memory_fault() if hasattr(q, "memory_fault") else None
                if fault is not None:   # a view over memory its owner truncated: the dump read zeros
                    return {"ok": False, "error": f"{type(fault).__name__}: {fault}"}
                if cmd == "snapshot":
                    return {"ok": True, "name": name, "time": raw.time, "snapshot": raw.snapshot()}
                if req.get("path"):
                    return {"ok": True, "name": name, "time": raw.time, "path": raw.save(req["path"])}
                return {"ok": True, "name": name, "time": raw.time,
                        "raw": base64.b64encode(raw.dumps()).decode()}
            return {"ok": False, "error": f"unknown command {cmd!r} (list, snapshot NAME, raw NAME)"}
        except Exception as e:  # noqa: BLE001 - a debugging aid answers every request, whatever a queue does
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}


class _NoRing(LookupError):
    """A registered queue with no ring at the moment (a backend before a frontend has started the vring)."""


def _parse(line):
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if line.startswith("{"):
        req = json.loads(line)
        if not isinstance(req, dict):
            raise ValueError("a request is a JSON object")
        return req
    words = line.split()
    if not words:
        raise ValueError("empty request")
    req = {"cmd": words[0]}
    if len(words) > 1:
        req["name"] = words[1]
    return req


class ControlClient:
    """A connection to a ControlServer; ``request(cmd, **args)`` returns the reply dict."""

    def __init__(self, path, timeout=10.0):
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.connect(os.fspath(path))
                break
            except BlockingIOError as e:   # the server's backlog is full: a unix socket says EAGAIN at once
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                err = e
            except OSError as e:
                err = e
            self.sock.close()
            raise ConnectionError(f"cannot connect to control socket {path}: {err}") from None
        self._buf = bytearray()   # what came after the last reply's end of line

    def _reply_line(self):
        """One reply line, within ``timeout`` for the WHOLE line: a timeout per read would let a server that
        trickles a byte at a time keep us for ever."""
        deadline = time.monotonic() + self.timeout
        buf, scanned = self._buf, 0
        while (end := buf.find(b"\n", scanned)) < 0:
            if len(buf) > MAX_REPLY:
                raise ControlError(f"control socket sent a reply longer than {MAX_REPLY} bytes")
            scanned = len(buf)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError(f"control socket: no whole reply within {self.timeout:g} s") from None
            if not chunk:
                if buf:
                    raise ControlError("control socket cut its reply short")
                raise ConnectionError("control socket closed the connection")
            buf += chunk
        line = bytes(buf[:end])
        del buf[:end + 1]
        return line

    def request(self, cmd, **args):
        """The reply dict. The server is another process: a reply that is not one line of JSON holding an object
        (or is longer than MAX_REPLY) raises ControlError, never an untyped exception; one that takes longer than
        ``timeout`` in all raises TimeoutError."""
        self.sock.settimeout(self.timeout)
        self.sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        line = self._reply_line()
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ControlError(f"control socket sent a malformed reply: {str(e)[:200]}") from None
        if not isinstance(reply, dict):
            raise ControlError(f"control socket sent a {type(reply).__name__}, not a JSON object")
        return reply

    def list(self, no_ring=None):
        """The queues with a ring now; ``no_ring``, a list, gets the names of those registered without one."""
        reply = _ok(self.request("list"))
        queues, waiting = reply.get("queues"), reply.get("no_ring", [])
        if not isinstance(queues, list) or not all(isinstance(q, dict) and isinstance(q.get("name"), str)
                                                   for q in queues) \
                or not isinstance(waiting, list) or not all(isinstance(n, str) for n in waiting):
            raise ControlError("control socket sent a malformed queue list")
        if no_ring is not None:
            no_ring.extend(waiting)
        return queues

    def snapshot(self, name):
        """(time, snapshot dict)."""
        r = _ok(self.request("snapshot", name=name))
        if "time" not in r or not isinstance(r.get("snapshot"), dict):
            raise ControlError(f"control socket sent a malformed snapshot for {name!r}")
        return r["time"], r["snapshot"]

    def raw(self, name):
        """The queue as a rawdump.RawSnapshot (copied in the server, decoded here)."""
        raw = _ok(self.request("raw", name=name)).get("raw")
        if not isinstance(raw, str):
            raise ControlError(f"control socket sent no raw snapshot for {name!r}")
        return rawdump.loads(base64.b64decode(raw))

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ControlError(VringError):
    """The control server answered a request with an error."""


def _ok(reply):
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error", "request failed"))[:500])
    return reply


def request(path, cmd, timeout=10.0, **args):
    """One request on a fresh connection: ``request(path, "snapshot", name="tx0")``."""
    with ControlClient(path, timeout) as c:
        return c.request(cmd, **args)


def query(path, name=None, timeout=10.0):
    """The client function: the list of queues (name None) or one queue's RawSnapshot."""
    with ControlClient(path, timeout) as c:
        return c.list() if name is None else c.raw(name)

