"""The vhost-user server: one frontend at a time on a Unix socket, a NetDevice per connection.

Single-threaded: the loop alternates a time slice of the C data path (when the device runs) with a
non-blocking look at the sockets, so control messages and forwarding never race. One frontend at a time: a
second connection gets a busy notice (``rings.vhost_user.busy_notice``) and is closed at once (unless the one
served has hung up: then it is its successor), and a frontend
that has not asked GET_FEATURES within ``handshake_timeout`` seconds of connecting is dropped, so that a silent
one cannot block the socket.

Every message is decoded and validated (``rings.vhost_user.decode``) before the device sees it. A message that
is malformed or cannot be honoured is logged and refused: NACK (u64 1) if it asked for a reply, else the
connection is closed, as DPDK does. A frontend that leaves (or is dropped) leaves the server ready for the next one; in ``client`` mode the
server connects out and reconnects every ``reconnect_s``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket  # noqa: F401 (type hints)
import sys
import time

from rings import vhost_user as vu
from rings.errors import GuestMemoryFault, PeerGone, ProtocolError, ProtocolTimeout, VringError
from rings.interrupts import readable

from .datapath import Options, add_stats, split_stats
from .device import NetDevice, Refused, Reply

log = logging.getLogger("vhost")

MSG_TIMEOUT = 5.0   # a message that starts must complete within this (a stalled frontend is dropped)
HANDSHAKE_TIMEOUT = 5.0   # a frontend must ask GET_FEATURES within this after connecting, or it is dropped
ACCEPT_RETRY_S = 0.1   # accept() failed (out of fds): the listener is left alone this long before the next try


class _Interrupted(BaseException):
    """A stop signal came while a message was half received or half sent: that exchange is abandoned (a
    BaseException, so that no handler of a bug of ours takes it for one)."""


def _hung_up(sock):
    """The peer closed ``sock`` (whatever it left unread in it). Not a half-close (shutdown(SHUT_WR), POLLRDHUP
    alone): such a peer still reads its replies. On AF_UNIX a close shuts both directions: POLLHUP."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))


class Server:
    idle_timeout = 0.2   # the longest wait on the sockets with nothing to do (stop() from another thread: seen within)

    def __init__(self, path, options: Options | None = None, client=False, reconnect_s=1.0, budget_us=500,
                 stats_interval=0.0, json_stats=False, out=None, device_kw=None,
                 handshake_timeout=HANDSHAKE_TIMEOUT):
        self.path = os.fspath(path)
        self.options = options or Options()
        self.client = client
        self.reconnect_s = reconnect_s
        self.budget_us = budget_us
        self.stats_interval = stats_interval
        self.json_stats = json_stats
        self.out = out or sys.stdout
        self.out_error = None   # why ``out`` failed, if it did (print_stats)
        self.device_kw = device_kw or {}
        self.listener: socket.socket | None = None
        self._sock_ino = None
        self.conn: vu.Connection | None = None
        self.device: NetDevice | None = None
        self.handshake_timeout = handshake_timeout
        self._handshake_deadline = None   # set while the current frontend has not asked GET_FEATURES
        self._greeted = False             # the current connection has sent a message
        self.connections = 0              # frontends that sent at least one message
        self.refused = 0
        self.refused_busy = 0             # connections turned away while another frontend was served
        self.ring_errors = 0
        self.totals: dict = {}
        self.stopping = False
        self._exchanging = False          # inside a message's receive or reply: on_signal interrupts it
        self.wakeup = None                # a rings.interrupts.SignalWakeup: a stop signal ends every wait at once
        self._accept_retry_at = 0.0       # accept() failed (EMFILE ...): the listener is left alone until then
        self._next_connect = 0.0
        self.t0 = time.monotonic()
        self._next_stats = self.t0 + stats_interval if stats_interval > 0 else None

    # -- sockets ---------------------------------------------------------------------------------

    def open(self):
        """Server mode: create the listening socket (mode 0600) now, so a frontend can connect."""
        if not self.client and self.listener is None and not self.stopping:
            self.listener = vu.listen_unix(self.path, backlog=4, stop=lambda: self.stopping)
            if self.listener is None:   # a stop signal while it waited for the directory's lock
                return self
            self._sock_ino = os.lstat(self.path).st_ino
            log.info("listening on %s", self.path)
        return self

    def close(self):
        self._drop("server stopping")
        if self.listener is not None:
            vu.close_listener(self.listener, self.path, self._sock_ino)
            self.listener = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()

    def _connect(self, timeout):
        if self.client:
            wait = self._next_connect - time.monotonic()
            if wait > 0:
                self._readable([], min(wait, timeout))
                return
            self._next_connect = time.monotonic() + self.reconnect_s
            try:
                conn = vu.connect_unix(self.path, timeout=1.0)
            except (PeerGone, ProtocolTimeout, ProtocolError) as e:
                log.debug("connect to %s: %s", self.path, e)
                return
        else:
            r = self._readable([self.listener], timeout)
            if self.listener not in r:
                return
            sock = self._accept()
            if sock is None:
                if self._accept_retry_at:   # (out of fds: not on the listener, which would wake us at once)
                    self._readable([], self._accept_retry_at - time.monotonic())
                return
            conn = vu.Connection(sock)
        self.attach(conn)
        log.info("connection accepted")

    def _readable(self, waits, timeout):
        """``waits`` that are readable, waiting also on the signal wakeup pipe, if any. PEP 475 resumes a wait that a
        signal interrupts, so the pipe is what ends the wait; a stop signal's byte sets ``stopping`` itself, in
        case the Python handler has not run yet (it runs in the main thread, at its next bytecode)."""
        w = self.wakeup
        r = readable(waits if w is None else [*waits, w.rfd], timeout)
        if w is not None and w.rfd in r and w.stops():
            self.stopping = True
        return r

    def attach(self, conn: vu.Connection):
        """Serve this connected frontend from now on (also for tests and fuzzing: a socketpair end)."""
        self.conn = conn
        self.device = NetDevice(self.options, **self.device_kw)
        self._greeted = False
        self._handshake_deadline = time.monotonic() + self.handshake_timeout

    def _accept(self):
        """The next connection on the listener, or None. When accept() fails (out of fds: EMFILE ...) the
        listener stays readable, and every round would fail again at once: said once per spell, and the
        listener is left alone for ACCEPT_RETRY_S (``_accept_retry_at``)."""
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:   # the frontend gave up before we took it
            return None
        except OSError as e:
            if not self._accept_retry_at:
                log.warning("accept failed: %s; retrying every %g s", e, ACCEPT_RETRY_S)
            self._accept_retry_at = time.monotonic() + ACCEPT_RETRY_S
            return None
        if self._accept_retry_at:
            log.info("accepting again")
            self._accept_retry_at = 0.0
        return sock

    def _refuse_busy(self):
        """Another frontend connects while one is served: a prompt refusal (a busy notice, then close)."""
        sock = self._accept()
        if sock is None:
            return
        self.refused_busy += 1
        why = f"serving another frontend (connection {self.connections}); one at a time"
        log.warning("refused a frontend: %s", why)
        conn = vu.Connection(sock)
        try:
            conn.send(vu.busy_notice(why), timeout=0.1)
        except VringError:
            pass
        conn.close()

    def _drop(self, why):
        if self.conn is None:
            return
        dev, conn = self.device, self.conn
        try:
            dev.close()
            totals = dict(self.totals)
            add_stats(totals, dev.stats())
            self.totals = totals
        except Exception:
            log.exception("while closing the device")
        # the connection counts as gone only once its counters are in the totals (readers wait on conn)
        self.device = None
        self.conn = None
        self._handshake_deadline = None
        conn.close()
        if self._greeted:
            log.info("frontend gone (%s); ready for the next one", why)
        else:
            log.info("connection closed before any message (%s)", why)

    # -- messages --------------------------------------------------------------------------------

    def _refuse(self, msg, why):
        self.refused += 1
        if msg.need_reply:
            log.error("refused %s: %s (NACK)", msg.name, why)
            try:
                with self._exchange():
                    self.conn.send(vu.ack(msg, ok=False), timeout=MSG_TIMEOUT)
            except (ProtocolError, VringError) as e:
                self._drop(f"cannot send the NACK: {e}")
        else:
            log.error("refused %s: %s (no NEED_REPLY: closing the connection)", msg.name, why)
            self._drop(f"refused {msg.name}")

    def _serve_one(self):
        conn = self.conn
        try:
            with self._exchange():
                msg = conn.recv(timeout=MSG_TIMEOUT)
        except PeerGone as e:
            self._drop(str(e))
            return
        except ProtocolError as e:   # framing broken, or a message that stalled half-way
            self.refused += 1
            log.error("bad message: %s; closing the connection", e)
            self._drop("protocol error")
            return
        log.debug("<- %r", msg)
        if not self._greeted:
            self._greeted = True
            self.connections += 1
            log.info("frontend connected (connection %d)", self.connections)
        if msg.request == vu.VhostUserRequest.GET_FEATURES:
            self._handshake_deadline = None   # every frontend starts with it (after SET_OWNER at most)
        try:
            value = vu.decode(msg)
        except ProtocolError as e:
            self._refuse(msg, str(e))
            return
        try:
            payload = self.device.handle(msg, value)
        except GuestMemoryFault as e:   # the frontend truncated its memory: as in the data path, it is dropped
            self._drop_faulted(e)
            return
        except Refused as e:
            self._refuse(msg, str(e))
            return
        except Exception as e:   # a bug of ours must not take the server down
            log.exception("%s failed", msg.name)
            self._refuse(msg, f"internal error: {type(e).__name__}: {e}")
            return
        fds = []
        if isinstance(payload, Reply):   # a reply with fds (GET_INFLIGHT_FD): ours to close once sent
            payload, fds = payload.payload, payload.fds
        try:
            with self._exchange():
                if vu.has_reply(msg.request):
                    conn.send(vu.reply(msg, payload or b"", fds), timeout=MSG_TIMEOUT)
                elif vu.wants_ack(msg):
                    conn.send(vu.ack(msg, True), timeout=MSG_TIMEOUT)
        except (ProtocolError, VringError) as e:
            self._drop(f"cannot reply: {e}")
        finally:
            for fd in fds:
                os.close(fd)

    @contextlib.contextmanager
    def _exchange(self):
        """Around a blocking receive or send, which waits up to MSG_TIMEOUT for a frontend that stalled half-way
        through a message: a stop signal then interrupts it (``on_signal``) instead of waiting that out."""
        self._exchanging = True   # before the check: a signal between the two is seen by one or the other
        try:
            if self.stopping:
                raise _Interrupted()
            yield
        finally:
            self._exchanging = False

    # -- the loop --------------------------------------------------------------------------------

    def poll_once(self, idle_timeout=None):
        """One round: a data-path slice (if running) and at most one control message."""
        if idle_timeout is None:
            idle_timeout = self.idle_timeout
        if self.conn is None:
            self._connect(idle_timeout)
            return
        dev = self.device
        timeout = idle_timeout
        deadline = self._handshake_deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("frontend sent no GET_FEATURES within %gs of connecting; dropping it",
                          self.handshake_timeout)
                self._drop("no handshake")
                return
            timeout = min(timeout, left)
        sock = self.conn.sock
        listening = self.listener is not None and time.monotonic() >= self._accept_retry_at
        waits = [sock, self.listener] if listening else [sock]
        kick = None
        fault = dev.memory_fault()
        if fault is not None:   # found by another thread (a --ctl dump), maybe while the data path sleeps or idles
            self._drop_faulted(fault)
            return
        if dev.datapath is not None and not dev.datapath.idle:
            try:
                errors = dev.run(self.budget_us)
            except GuestMemoryFault as e:
                self._drop_faulted(e)
                return
            self.ring_errors += len(errors)
            timeout = 0
            kick = dev.sleep_fd()
            if kick is not None:   # --idle sleep: block until kicked (or a message, or time to look around)
                timeout = self._nap() if kick >= 0 else 0.001
                if kick >= 0:
                    waits.append(kick)
        try:
            r = self._readable(waits, timeout)
        except (OSError, ValueError):
            r = [sock]
        if self.stopping:   # a signal ended the wait: a message now would only be cut short
            return
        if kick is not None and kick >= 0 and kick in r:
            dev.kicked()
        if sock in r:   # first: it may be the EOF of a frontend whose successor is what the listener has
            self._serve_one()
        if self.listener is not None and self.listener in r:
            if self.conn is not None and _hung_up(self.conn.sock):   # left with messages unread: they are moot
                self._drop("peer closed the connection")
            if self.conn is not None:
                self._refuse_busy()
            # else: the successor waits in the backlog for the next round (serve() checks max_connections first)

    def _drop_faulted(self, e):
        """The frontend's memory shrank under one of our accesses: log it once, drop the connection."""
        self.ring_errors += 1
        log.error("dropping the frontend: %s: %s [%s]", type(e).__name__, e, e.spec)
        self._drop(f"{type(e).__name__}: {e}")

    def _nap(self):
        """How long a sleeping data path may block: until the next counters line, at most 0.1 s (so that stop()
        and the serve loop's checks are seen quickly)."""
        nap = 0.1
        if self._next_stats is not None:
            nap = min(nap, max(0.0, self._next_stats - time.monotonic()))
        return nap

    def serve(self, max_connections=None, until=None):
        """Serve until ``stop()`` (or a signal handler sets ``stopping``), ``max_connections`` frontends have
        come and gone, or ``until()`` returns True."""
        self.open()
        try:
            while not self.stopping:
                try:
                    self.poll_once()
                except _Interrupted:   # (the flag cleared here too: the signal may have come inside a finally
                    self._exchanging = False   # that was to clear it; a second one must not cut close() short)
                    log.info("stopped inside a message exchange")
                    break
                except Exception as e:   # a bug of ours costs the connection, never the process
                    log.exception("internal error; dropping the connection")
                    self._drop(f"internal error: {type(e).__name__}: {e}")
                self._maybe_stats()
                pcap = self.options.pcap
                if pcap is not None and pcap.pending:   # a live reader of a --pcap FIFO gets frames soon
                    pcap.flush()
                if max_connections is not None and self.connections >= max_connections and self.conn is None:
                    break
                if until is not None and until():
                    break
        finally:
            self.close()
        self.print_stats(final=True)
        return self.stats()

    def stop(self, *_):
        """Stop serving at the loop's next check (from any thread)."""
        self.stopping = True

    def on_signal(self, *_):
        """The handler of a stop signal (main thread): as ``stop()``, and a message exchange in progress is
        abandoned at once rather than waited out (up to MSG_TIMEOUT) for a frontend that stalled inside it."""
        self.stopping = True
        if self._exchanging:
            raise _Interrupted()

    # -- counters --------------------------------------------------------------------------------

    def stats(self):
        total = dict(self.totals)
        if self.device is not None:
            add_stats(total, self.device.stats())
        out = split_stats(total)
        out.update(connections=self.connections, refused=self.refused, refused_busy=self.refused_busy,
                   ring_errors=self.ring_errors, running=bool(self.device and self.device.datapath))
        return out

    def _maybe_stats(self):
        if self._next_stats is not None and time.monotonic() >= self._next_stats:
            self._next_stats += self.stats_interval
            self.print_stats()

    def print_stats(self, final=False):
        """The counters on ``out``. Stats are a by-product: an output that fails (its reader went away, EPIPE; a
        full disk) ends the stats, never the server. ``out_error`` keeps why, for the caller's exit."""
        if self.out is None:
            return
        try:
            self._write_stats(final)
        except (OSError, ValueError) as e:   # ValueError: a file object closed under us
            log.warning("stats output failed (%s: %s): no more stats", type(e).__name__, e)
            self.out, self.out_error = None, e

    def _write_stats(self, final):
        st = self.stats()
        t = round(time.monotonic() - self.t0, 3)
        if self.json_stats:
            print(json.dumps({"time": t, "final": final, **st}), file=self.out, flush=True)
            return
        head = "final" if final else f"t={t}s"
        print(f"[vhost {head}] connections={st['connections']} refused={st['refused']} "
              f"refused_busy={st['refused_busy']} ring_errors={st['ring_errors']}", file=self.out)
        for q in ("rxq0", "txq1", "intermediate"):
            print(f"  {q:12s} " + " ".join(f"{k}={v}" for k, v in st[q].items()), file=self.out)
        self.out.flush()
