"""Deliberately wrong peers for the `vring conform` negative tests: each breaks one spec rule on purpose.

* ``FaultyDevice``: a vhost-user backend built from the conform device harness (conform/driver.py) whose
  sessions complete Tx buffers wrongly: ``reorder`` (IN_ORDER negotiated, used entries written last buffer
  first, one per buffer) or ``double`` (a second used entry for a buffer already used). It produces no Rx
  traffic (population 0), so `vring conform device` checks its Tx side only.
* ``FaultyDriver``: a forwarding frontend (vhost.testing.ScriptedFrontend) whose Tx queue breaks a driver
  rule: ``reoffer`` (a head that is in flight is put in the avail ring again, in the same publication) or
  ``late-write`` (the length of a published descriptor is changed a few ms later, while the device holds it).
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from conform.driver import TX, DriverHarness, DriverOptions, Session
from conform.ringview import SplitView
from rings.errors import PeerGone, ProtocolError
from vhost.testing import HDR, ScriptedFrontend


class _ReorderSession(Session):
    """IN_ORDER was negotiated, but Tx buffers are completed last first, one used entry each."""

    def __init__(self, h, dev):
        super().__init__(h, dev)
        self.q[TX].dq.c.in_order = 0   # the DeviceQueue no longer holds back out-of-order completions

    def flush(self, q, ids, lens, batch):
        if q.index == TX:
            ids, lens = ids[::-1], lens[::-1]
        super().flush(q, ids, lens, batch)


class _DoubleSession(Session):
    """After its first Tx completion, writes a second used entry for the same buffer."""

    doubled = False

    def flush(self, q, ids, lens, batch):
        nd = q.held[ids[-1]].ndesc if ids else 0
        super().flush(q, ids, lens, batch)
        if q.index != TX or self.doubled or not ids:
            return
        self.doubled = True
        c, v = q.dq.c, q.view
        if q.packed:
            d = v.desc[int(c.used_idx)]
            d["id"], d["len"], d["flags"] = ids[-1], 0, 0x8080 if c.used_wrap else 0
            c.used_idx = int(c.used_idx) + nd
            if c.used_idx >= q.size:
                c.used_idx -= q.size
                c.used_wrap ^= 1
        else:
            v.used_raw[int(c.used_idx) % q.size] = (ids[-1], 0)
            c.used_idx = (int(c.used_idx) + 1) & 0xFFFF
            v.used_hdr[1] = c.used_idx
        q.take_device_shadow()


class FaultyDevice:
    """A backend listening on ``sock`` (in a thread) that completes Tx buffers with ``fault``."""

    SESSIONS = {"reorder": _ReorderSession, "double": _DoubleSession}

    def __init__(self, sock, fault):
        harness = DriverHarness(DriverOptions(socket=sock, seconds=60, wait=20, population=0, phases=("batches",)))
        harness.session_class = self.SESSIONS[fault]
        self.harness = harness
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.harness.run()
        except BaseException as e:   # surfaced by join()
            self.error = e

    def join(self, timeout=30):
        self.thread.join(timeout)
        return not self.thread.is_alive()


class FaultyDriver:
    """A frontend that forwards every frame it receives, connecting to ``sock`` (in a thread), with ``fault``
    on its Tx queue (split rings, 64 entries, no MRG_RXBUF)."""

    def __init__(self, sock, fault, in_order=True, seconds=15):
        self.sock, self.fault, self.in_order, self.seconds = sock, fault, in_order, seconds
        self.error = None
        self.faults = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self._loop()
        except (PeerGone, ProtocolError):
            pass   # the harness ended the run
        except BaseException as e:
            self.error = e

    def _loop(self):
        fe = ScriptedFrontend(self.sock, packed=False, in_order=self.in_order, mrg_rxbuf=False, queue_size=64)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    fe.connect()
                    break
                except (PeerGone, ProtocolError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            fe.negotiate()
            fe.start()
            fe.post_rx(64)
            end = time.monotonic() + self.seconds
            while not self.stop.is_set() and time.monotonic() < end:
                got = fe.receive()
                fe.reclaim_tx()
                if got:
                    frames = [data[HDR:] for data, _n in got]
                    if self.fault == "reoffer" and len(fe.pkt_free) > 8:
                        self._send_with_duplicate(fe, frames[0])
                        frames = frames[1:]
                    if frames:
                        fe.send(frames)
                        if self.fault == "late-write":
                            self._late_write(fe)
                    fe.post_rx(len(got))
                else:
                    time.sleep(0.0002)
        finally:
            fe.close()

    def _send_with_duplicate(self, fe, frame):
        """One frame, and its head once more in the next avail slot, published together (SPLIT-D-13)."""
        q, n = fe.txq, fe.size
        slot = fe.pkt_free.pop()
        gpa = fe._gpa(slot)
        fe.mem.write(gpa, bytes(HDR) + frame)
        start = int(q.c.next_avail)
        q.add(np.array([gpa], np.uint64), np.array([HDR + len(frame)], np.uint32), np.array([1], np.uint16),
              np.array([0], np.uint16), np.array([slot], np.uint64))
        v = SplitView(fe.mem, fe.layouts[1])
        v.avail[2 + (start + 1) % n] = v.avail_ring(start)
        q.c.next_avail = (start + 2) & 0xFFFF
        q.publish()
        os.eventfd_write(fe.kickfds[1], 1)
        self.faults += 1
        self.stop.wait(self.seconds)   # the device must now refuse the ring: stay connected until told to go

    def _late_write(self, fe):
        """Change the length of the descriptor just published, once the device has had time to read it."""
        time.sleep(0.003)
        v = SplitView(fe.mem, fe.layouts[1])
        v.desc[v.avail_ring(v.avail_idx - 1)]["len"] -= 1
        self.faults += 1

    def join(self, timeout=30):
        self.stop.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()
