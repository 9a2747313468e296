"""A vhost-user backend for notification tests: it speaks the protocol through vhost.device.NetDevice but runs
no data path of its own. Its thread sleeps in select() on the control socket and the kick eventfds, and touches
the rings only when woken by a kick (``kicks=True``) or, with kicks suppressed, on a 2 ms poll timer. It
counts what the eventfds carry, completes Tx buffers, sends ``rx_frames`` frames into Rx (bursts of 4 every
10 ms) and calls through the call eventfds when the driver's suppression fields ask for it.
"""
import os
import select
import threading
import time

import numpy as np

from rings import vhost_user as vu
from rings.errors import PeerGone, ProtocolError
from rings.virtq import DeviceQueue
from vhost.device import STATUS_DRIVER_OK, NetDevice, Refused

R = vu.VhostUserRequest
RXQ, TXQ = 0, 1
HDR = 12


class _Device(NetDevice):
    """Protocol only: the peer drives the rings itself."""

    def update(self):
        pass


def _drain(fd):
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


class SleepingBackend:
    def __init__(self, path, kicks=True, rx_frames=0):
        self.path, self.kicks_on, self.rx_left = path, kicks, rx_frames
        self.listener = vu.listen_unix(path)
        self.dev = _Device()
        self.q = [None, None]
        self.kicks = [0, 0]            # sum of the kick eventfd counts read, per vring
        self.kick_wakeups = [0, 0]
        self.kicks_before_driver_ok = None
        self.calls = [0, 0]            # calls sent, per vring
        self.tx_done = self.rx_sent = 0
        self.stopped = False
        self.error = None
        self._stop = False
        self._next_rx = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    # ---- control plane -------------------------------------------------------------------------

    def _handle(self, conn):
        msg = conn.recv(timeout=5.0)
        value = vu.decode(msg)
        if msg.request == R.SET_STATUS and value & STATUS_DRIVER_OK and self.q[0] is None:
            # NOTIF-08: whatever the kick eventfds hold now was sent before DRIVER_OK
            self.kicks_before_driver_ok = sum(_drain(v.kickfd) for v in self.dev.vrings if v.kickfd >= 0)
        try:
            payload = self.dev.handle(msg, value)
        except Refused:
            conn.send(vu.ack(msg, ok=False), timeout=5.0)
            return
        if msg.request == R.SET_STATUS and value & STATUS_DRIVER_OK and self.q[0] is None:
            self._start()   # before the ack: the driver's first kick finds the suppression set up
        if msg.request == R.GET_VRING_BASE:
            self.stopped = True   # the vring stops (its fds are closed): no more ring work
        if vu.has_reply(msg.request):
            conn.send(vu.reply(msg, payload or b""), timeout=5.0)
        elif vu.wants_ack(msg):
            conn.send(vu.ack(msg, True), timeout=5.0)

    def _start(self):
        for v in self.dev.vrings:
            q = DeviceQueue(self.dev.cmem, self.dev._layout(v, v.addr), self.dev.features)
            q.enable_kicks(self.kicks_on)
            self.q[v.index] = q

    # ---- data plane ----------------------------------------------------------------------------

    def _call(self, i):
        if self.q[i].call_prepare():
            fd = self.dev.vrings[i].callfd
            if fd >= 0:
                os.eventfd_write(fd, 1)
                self.calls[i] += 1

    def _serve(self):
        tx = self.q[TXQ]
        ch = tx.poll()
        if ch.n:
            self.tx_done += ch.n
            tx.push_used(ch.id, np.zeros(ch.n, np.uint32))
            tx.flush()
            self._call(TXQ)
        if self.rx_left and time.monotonic() >= self._next_rx:
            self._next_rx = time.monotonic() + 0.01
            rx = self.q[RXQ]
            ch = rx.poll(min(4, self.rx_left))
            lens = []
            for i in range(ch.n):
                addr, length, _ = ch.segments(i)[0]
                hdr = bytearray(HDR)
                hdr[10] = 1   # num_buffers
                frame = bytes(hdr) + bytes.fromhex("020000000001020000000002") + b"\x08\x00" + bytes(46)
                self.dev.mem.write(addr, frame[:length])
                lens.append(min(len(frame), length))
            if ch.n:
                rx.push_used(ch.id, lens)
                rx.flush()
                self.rx_left -= ch.n
                self.rx_sent += ch.n
                self._call(RXQ)

    def _run(self):
        try:
            conn = vu.accept_unix(self.listener, timeout=30.0)
        except BaseException as e:
            self.error = e
            return
        try:
            while not self._stop:
                started = self.q[0] is not None and not self.stopped
                kickfds = [v.kickfd for v in self.dev.vrings] if started else []
                watch = [conn.sock] + ([fd for fd in kickfds if fd >= 0] if self.kicks_on else [])
                timeout = 0.002 if started and (not self.kicks_on or self.rx_left) else 0.5
                r, _, _ = select.select(watch, [], [], timeout)
                if conn.sock in r:
                    self._handle(conn)
                    if self.stopped:
                        continue
                woken = False
                for i, fd in enumerate(kickfds):
                    if fd >= 0 and fd in r:
                        self.kicks[i] += _drain(fd)
                        self.kick_wakeups[i] += 1
                        woken = True
                    elif fd >= 0 and not self.kicks_on:
                        self.kicks[i] += _drain(fd)   # none should come: counted all the same
                if started and (woken or not self.kicks_on or self.rx_left):
                    self._serve()
        except (PeerGone, ProtocolError):
            pass   # the driver went away: done
        except BaseException as e:
            self.error = e
        finally:
            conn.close()

    def close(self):
        self._stop = True
        self.thread.join(10)
        self.listener.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.q = [None, None]
        self.dev.close()
        if self.error is not None:
            raise self.error
