"""The relay: a transparent vhost-user proxy between one frontend and one backend at a time.

Each side is reached by listening on a path (the peer connects: a client frontend such as DPDK's
virtio_user, or a client backend such as net_vhost with ``client=1``) or by connecting to a path (the peer
listens: net_vhost, or virtio_user with ``server=1``). A session pairs one connection to each side; every
message read on one side goes out on the other unchanged (header, payload, fds; replies included), in the
order it came, after the tap has looked at it (picture, log, ``--notify-tap``). A message that breaks the
protocol is still passed on, for the peer to judge as it would without the tap; only a message the tap
cannot frame (a header announcing more than the wire format's limit, more than 8 fds) ends the session.
When either peer leaves, the tap closes the other side too, as the peer would have seen it without the
tap, and waits for the next pair (a client peer that reconnects, a server peer that comes back).

Kick and call eventfds pass straight through by default: the data path never involves the tap.
"""
import logging
import os
import threading
import time

from rings import vhost_user as vu
from rings.errors import PeerGone, ProtocolError, ProtocolTimeout, VringError
from rings.interrupts import readable

from .msglog import decode_payload, describe_fd

log = logging.getLogger("tap")
R = vu.VhostUserRequest
MSG_TIMEOUT = 5.0       # once a message starts, the rest must come within this
RETRY_S = 0.5           # connect retries (a server peer that is not up yet)


class Endpoint:
    """One side: ``listen`` (the peer connects to ``path``) or connect (the peer listens at ``path``)."""

    def __init__(self, role, path, listen):
        self.role, self.path, self.listen = role, os.fspath(path), listen
        self.listener = None
        self._ino = None

    def open(self):
        if self.listen and self.listener is None:
            self.listener = vu.listen_unix(self.path, backlog=4)
            self._ino = os.lstat(self.path).st_ino
        return self

    def get(self, stop, timeout=None):
        """The next connection to this peer, or None if ``stop`` was set or ``timeout`` s passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            if self.listen:
                if readable([self.listener], 0.2):
                    try:
                        return vu.accept_unix(self.listener, timeout=0)
                    except (ProtocolTimeout, OSError):
                        continue
            else:
                try:
                    return vu.connect_unix(self.path, timeout=1.0)
                except (PeerGone, ProtocolTimeout, ProtocolError):
                    stop.wait(RETRY_S)
        return None

    def close(self):
        if self.listener is not None:
            vu.close_listener(self.listener, self.path, self._ino)
            self.listener = None

    def __str__(self):
        return f"{self.role} {'listen' if self.listen else 'connect'} {self.path}"


class Tap:
    """``Tap(frontend, backend, picture, log=None, notify=None).serve(stop)``."""

    def __init__(self, frontend, backend, picture, log=None, notify=None, peer_timeout=30.0):
        self.frontend, self.backend = frontend, backend
        self.picture, self.log, self.notify = picture, log, notify
        self.peer_timeout = peer_timeout
        self.sessions = 0
        self.messages = 0

    def serve(self, stop=None, max_sessions=None):
        stop = stop or threading.Event()
        self.frontend.open()
        self.backend.open()
        try:
            while not stop.is_set() and (max_sessions is None or self.sessions < max_sessions):
                fe = self.frontend.get(stop)
                if fe is None:
                    break
                be = self.backend.get(stop, self.peer_timeout)
                if be is None:
                    self._event("no backend", frontend=str(self.frontend), backend=str(self.backend),
                                why=f"nobody at the backend side within {self.peer_timeout:g} s")
                    fe.close()
                    continue
                self.sessions += 1
                self.session(fe, be, stop)
        finally:
            self.frontend.close()
            self.backend.close()

    def _event(self, event, **kw):
        log.info("%s %s", event, kw)
        if self.log is not None:
            self.log.write({"conn": self.picture.conn, "event": event, **kw})

    def session(self, fe, be, stop):
        conn = self.picture.session_start()
        self._event("connected", frontend=str(self.frontend), backend=str(self.backend))
        names = {fe: ("frontend", "F>B", be), be: ("backend", "B>F", fe)}
        why = "tap stopping"
        try:
            while not stop.is_set():
                try:
                    ready = readable([fe.sock, be.sock], 0.2)
                except (OSError, ValueError):
                    why = "socket closed"
                    break
                done = None
                for c in (fe, be):
                    if c.sock not in ready:
                        continue
                    side, direction, other = names[c]
                    try:
                        msg = c.recv(timeout=MSG_TIMEOUT, strict=False)
                    except PeerGone as e:
                        done = f"{side} left ({e})"
                        break
                    except ProtocolError as e:
                        done = f"{side} sent what the tap cannot frame: {e}"
                        break
                    try:
                        self.relay(conn, direction, msg, other)
                    except (PeerGone, ProtocolError, VringError) as e:
                        done = f"cannot pass {msg.name} on to the {names[other][0]}: {e}"
                        break
                if done:
                    why = done
                    break
        finally:
            fe.close()
            be.close()
            if self.notify is not None:
                self.notify.clear()
            self.picture.session_end()
            self._event("disconnected", why=why, messages=self.messages)

    def relay(self, conn, direction, msg, dst):
        """Look at one message, then send it on unchanged (but for --notify-tap's eventfds)."""
        reply = direction == "B>F"
        value, error = decode_payload(msg, reply)
        received = list(msg.fds)
        fds = [describe_fd(fd) for fd in received] if self.log is not None else None
        keep, sent = set(), None
        try:
            if error is None:
                if reply:
                    self.picture.learn_reply(msg, value)
                else:
                    self.picture.learn_request(msg, value)
                    # only an eventfd is relayed: the relay's reads and writes of anything else could block it
                    # (a pty, a pipe nobody drains); another fd goes on as it came, for the backend to judge
                    if self.notify is not None and msg.request in (R.SET_VRING_KICK, R.SET_VRING_CALL) \
                            and not value.nofd and received and vu.fd_kind(received[0]) == vu.EVENTFD:
                        kind = "kick" if msg.request == R.SET_VRING_KICK else "call"
                        own = self.notify.interpose(kind, value.index, received[0], conn)
                        keep.add(received[0])
                        msg.fds = [own]
                        sent = [f"eventfd ({kind})"]
            if self.log is not None:
                self.log.message(conn, direction, msg, value, error, fds, sent, packed=self.picture.packed)
            dst.send(msg, timeout=MSG_TIMEOUT)
            self.messages += 1
        finally:
            for fd in received:
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
