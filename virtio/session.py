"""The driver's vhost-user session across backend restarts: reconnect (client) and server mode.

``Session`` owns the frontend (virtio/frontend.py) and, in server mode, the listening socket. It brings a
backend up (``establish``: connect or accept, negotiate the same features as the first time, GET_INFLIGHT_FD
once), starts the rings at the driver's own positions (``start``) and, when the backend goes away
(``lost``), drops only the connection: rings, buffers, eventfds and the inflight area stay with the driver.

* client (default): connect to ``path``. With ``reconnect`` a lost backend is looked for again with capped
  exponential backoff (``BACKOFF_MIN`` .. ``BACKOFF_MAX``) until the deadline;
* server (``server=True``, as DPDK virtio_user's ``server=1``): listen on ``path`` (mode 0600) and let the
  backend connect (``vring vhost --client``, DPDK ``net_vhost,client=1``); a lost backend is replaced by the
  next one that connects.

Vring bases come from the driver's own state, after everything the old backend published has been consumed:
split: the used index (== used->idx in memory; a backend resumes taking avail entries there, plus what the
inflight area says it had taken); packed with the inflight area: the used slot | used wrap counter << 15 (the
successor takes the chains in flight again from the area's copies). Packed without it (DPDK net_vhost), the
ring is laid out afresh and the packets in flight are sent again (``NetQueues.reset_rings``): the old device
may have left used descriptors it never published (a batch without its head's flags), which no successor
could get past.
"""
from __future__ import annotations

import os
import time

import numpy as np

from rings import vhost_user as vu
from rings.errors import ConfigError, FeatureRefused, PeerGone, ProtocolError, ProtocolTimeout

from .frontend import VhostUserFrontend

BACKOFF_MIN = 0.01
BACKOFF_MAX = 0.05   # a relaunched backend is found within this of listening (a refused connect is cheap)


class Session:
    def __init__(self, path, want, *, server=False, reconnect=False, timeout=5.0, inflight=True, events=None):
        """``want``: the feature mask; ``events(name, **fields)``: called on connect/lost (or None)."""
        self.path = os.fspath(path)
        self.want = want
        self.server = server
        self.reconnect = reconnect or server
        self.timeout = timeout
        self.fe = VhostUserFrontend(self.path, timeout=timeout, inflight=inflight)
        self.features = None       # negotiated with the first backend; every later one must agree
        self.listener = None
        self._sock_ino = None
        self.connections = 0
        self.events = events or (lambda name, **kw: None)

    # -- sockets -----------------------------------------------------------------------------------

    def open(self):
        if self.server and self.listener is None:
            self.listener = vu.listen_unix(self.path, backlog=1)
            self._sock_ino = os.lstat(self.path).st_ino
        return self

    @property
    def sock(self):
        """The connection's socket (watched for the backend going away), or None."""
        return self.fe.conn.sock if self.fe.conn is not None else None

    def _connect_once(self, wait):
        """One attempt to get a backend within ``wait`` seconds; True when connected."""
        if self.server:
            try:
                self.fe.attach(vu.accept_unix(self.listener, timeout=max(wait, 0.0)))
            except ProtocolTimeout:
                return False
            return True
        try:
            self.fe.connect()
        except (PeerGone, ProtocolTimeout, ProtocolError):
            time.sleep(max(wait, 0.0))
            return False
        return True

    def establish(self, deadline=float("inf"), stop=lambda: False):
        """Get a backend and negotiate. A client without ``reconnect`` tries once (as before: PeerGone if nobody
        listens); otherwise attempts go on until ``deadline`` (time.monotonic) or ``stop()``. A backend that
        dies during the handshake is retried too. Returns the negotiated features."""
        backoff = BACKOFF_MIN
        while True:
            if stop():
                raise PeerGone(f"stopped while waiting for a backend on {self.path}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerGone(f"no backend on {self.path} before the deadline")
            if not self.reconnect and not self.server:
                self.fe.connect()
                return self._negotiate()
            if self._connect_once(min(backoff, left)):
                try:
                    return self._negotiate()
                except (PeerGone, ProtocolTimeout) as e:   # died during the handshake: next one
                    self.events("handshake_failed", reason=str(e))
                    self.fe.disconnect()
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _negotiate(self):
        features = self.fe.negotiate(self.want)
        if self.features is not None and features != self.features:
            raise FeatureRefused(f"backend at {self.path} negotiated features {features:#x}, the rings were "
                                 f"built for {self.features:#x}")
        self.features = features
        self.connections += 1
        self.events("connected", connection=self.connections, server=self.server,
                    inflight=self.fe.has_inflight)
        return features

    def start(self, nq):
        """Memory table, inflight area, the vrings at the driver's own positions, enable, DRIVER_OK."""
        self.fe.get_inflight(nq.size)
        self.fe.start(nq.mem, nq.layouts(), bases=own_bases(nq))

    def try_start(self, nq):
        """``start``; a backend that dies (or stalls) before the rings are up is dropped like one that dies during
        the handshake (True: started; False: connection lost, establish again). Without ``reconnect`` it raises."""
        try:
            self.start(nq)
            return True
        except (PeerGone, ProtocolTimeout) as e:
            if not self.reconnect:
                raise
            self.events("handshake_failed", reason=str(e))
            self.fe.disconnect()
            return False

    def bring_up(self, nq, deadline=float("inf"), stop=lambda: False):
        """The first start of the rings (the backend is established): retried with the next backend until it
        succeeds, ``deadline`` or ``stop()`` (PeerGone)."""
        while not self.try_start(nq):
            self.establish(deadline, stop)

    def replace_backend(self, nq, why, deadline, stop, burst, record):
        """The backend went away: wait for the next one (until ``deadline`` or ``stop()``: PeerGone), consume what
        the old one published (Tx cleanup; every used Rx entry, so that our used position is the device's) and
        start the rings at our positions. Returns the Rx bursts received meanwhile, [(idx, lens)], for the
        caller to handle; ``record`` gets ``down_s`` and ``held``."""
        t0 = time.monotonic()
        self.lost(why)
        held, resend = [], None
        while True:   # until a backend is up: one may die before the rings are (try_start)
            self.establish(deadline, stop)
            nq.tx.cleanup(0)
            while True:
                idx, lens = nq.rx.burst(burst)
                if len(idx) == 0:
                    break
                held.append((idx.copy(), lens.copy()))
            # see DriverQueue.reset; an area no backend kept since the last one (dropped by frontend.start) is
            # fresh and holds no copies of the chains in flight either
            if nq.fmt == "packed" and not (self.fe.has_inflight and self.fe.inflight is not None):
                again = nq.reset_rings()   # after a failed start: nothing of ours was sent to the fresh rings
                resend = again if resend is None else (np.concatenate((resend[0], again[0])),
                                                       np.concatenate((resend[1], again[1])), resend[2] + again[2])
                record.update(ring_reset=True, resent=len(resend[0]), partial_dropped=resend[2])
            if self.try_start(nq):
                break
        if resend is not None and len(resend[0]):
            sent = nq.tx.burst(resend[0], resend[1])
            if sent < len(resend[0]):   # cannot happen: they were in this ring a moment ago
                nq.pool.free(resend[0][sent:])
                nq.tx.c.dropped += len(resend[0]) - sent
        record.update(down_s=round(time.monotonic() - t0, 6), held=sum(len(i) for i, _ in held))
        self.events("resumed", **{k: v for k, v in record.items() if k != "gone_t"})
        return held

    def lost(self, reason):
        """The backend went away: drop the connection, keep everything else."""
        self.fe.disconnect()
        self.events("backend_gone", reason=reason)

    def close(self):
        self.fe.close()
        if self.listener is not None:
            vu.close_listener(self.listener, self.path, self._sock_ino)
            self.listener = None


def own_bases(nq):
    """SET_VRING_BASE of each vring from the driver's ring state (call after consuming every used entry)."""
    out = []
    for q in (nq.rx.vq, nq.tx.vq):
        c = q.c
        if q.layout.packed:
            if c.last_used >= q.size or c.used_wrap > 1:
                raise ConfigError(f"driver ring state out of range: last_used {c.last_used} wrap {c.used_wrap}")
            out.append(c.last_used | c.used_wrap << 15)
        else:
            out.append(c.last_used)
    return out
