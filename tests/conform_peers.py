"""Deliberately wrong peers for the `vring conform` negative tests: each breaks one spec rule on purpose.

* ``FaultyDevice``: a vhost-user backend built from the conform device harness (conform/driver.py) whose
  sessions complete Tx buffers wrongly: ``reorder`` (IN_ORDER negotiated, used entries written last buffer
  first, one per buffer), ``reorder-apart`` (the same, each entry published on its own, 1 ms apart) or ``double`` (a second used entry for a buffer already used). It produces no Rx
  traffic (population 0), so `vring conform device` checks its Tx side only.
* ``FaultyDriver``: a forwarding frontend (vhost.testing.ScriptedFrontend) whose Tx queue breaks a driver
  rule: ``reoffer`` (a head that is in flight is put in the avail ring again, in the same publication) or
  ``late-write`` (the length of a published descriptor is changed a few ms later, while the device holds it;
  split or packed rings).
* ``LoopDevice``: a small looping backend in Python (split or packed rings, VERSION_1, IN_ORDER, MRG_RXBUF,
  EVENT_IDX offered) for the device harness's Rx rows, with one fault on: ``num-buffers+1`` / ``num-buffers-1`` (a
  merged packet's num_buffers one too high / low), ``batch-last`` (an IN_ORDER Tx batch's one used entry written at
  the batch's last used slot, used idx still moved by the batch), ``tx-len`` (a Tx buffer completed with its
  readable length as used len), ``hdr-only`` (an Rx buffer used with len header + frame, only the header written:
  the frame never is), ``stamp`` (each frame delivered with the first byte of the harness's stamp changed),
  ``stamp-run`` (one bit of the stamp's run id flipped: SPLIT-V-09 / MEM-07), ``hdr20`` / ``hdr10`` (the frame after
  a 20-byte header, the HASH_REPORT layout, or after the legacy 10-byte one, neither negotiated; num_buffers right:
  NET-02 / NET-03), ``call-early`` (the Tx used buffer notification sent 20 ms before the used entries are
  published, none after), ``call-swap`` (each queue's notifications written to the other queue's call eventfd),
  ``evt-first`` (with EVENT_IDX, a notification only when the first used index a publication writes is used_event,
  not whenever the publication crosses it; packed: the first used slot is the DESC event slot, wrap ignored),
  ``gen01`` (the rings started before DRIVER_OK: Tx frames looped into Rx buffers at once, unannounced, the Tx
  buffers used after DRIVER_OK), ``rx-desc-write`` (each used Rx buffer's descriptor gets the bytes written as its
  len: SPLIT-V-04), ``rx-avail-write`` (the avail slots the device read last are overwritten with 0xFFFF when Rx
  buffers are used: SPLIT-L-08), ``scribble`` (after each Tx completion, 8 bytes just past the end of the Tx used
  ring, memory the device was not given: SPLIT-L-02), ``rx-skip`` (IN_ORDER Rx batches: every third frame, the next
  Rx buffer is skipped, never written, inside the batch entry of the buffer that holds the frame: INORDER-10),
  ``rx-batch-len+1`` (IN_ORDER Rx batches of merged packets, every skipped buffer written whole, the batch entry's
  len one byte too long: SPLIT-V-11 / PACKED-V-12), ``rx-batch-len-1`` (the same, the batch entry's len one byte
  short of what was written), ``hdr10-len-1`` (a 10-byte header, and the last buffer's len of a merged packet one
  byte short), ``rx-len-1`` (every packet's last buffer's len one byte short, one-buffer packets included), on split
  rings ``rx-pair-short`` (no MRG_RXBUF: one used entry for every two frames' Rx buffers, the first buffer skipped
  though its frame is shorter than the buffer: INORDER-10), ``len-late`` (used entries published with the id, used
  idx moved, the len written 20 ms later: SPLIT-V-08), and on packed rings (one used descriptor per Tx buffer,
  written by hand): ``no-avail`` (on a lap with wrap counter 1 the used descriptors get USED set and AVAIL clear),
  ``adv1`` (the used position moves by 1 per buffer, whatever the length of its list), ``head-id`` (the used id read
  from the list's first descriptor, not its last) or ``short-id`` (IN_ORDER batches of 3 or more: one used
  descriptor at the batch's first slot naming its second-to-last buffer, the used position moved by the whole
  batch).
"""
from __future__ import annotations

import os
import select
import threading
import time
from collections import deque

import numpy as np

from conform import frames
from conform.driver import OFFERED_PROTOCOL, RX, TX, DriverHarness, DriverOptions, Session
from conform.ringview import PackedView, SplitView, view_for
from rings import vhost_user as vu
from rings.errors import PeerGone, ProtocolError
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_USED, bit, has)
from rings.shm import MemoryTable
from rings.virtq import DeviceQueue
from vhost.device import STATUS_DRIVER_OK, NetDevice, Refused
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


class _ReorderApartSession(_ReorderSession):
    """As _ReorderSession, but each used entry in a publication of its own, 1 ms apart: the harness first sees
    one entry naming a buffer used idx does not reach in avail order (a short batch, or out of order?)."""

    def flush(self, q, ids, lens, batch):
        if q.index != TX or len(ids) < 2:
            return super().flush(q, ids, lens, batch)
        for k in range(len(ids) - 1, -1, -1):
            Session.flush(self, q, ids[k:k + 1], lens[k:k + 1], batch)
            time.sleep(0.001)


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


class PatientSession(Session):
    """A correct (only slow) device: after each packed Tx used entry it waits up to 50 ms for the driver to fill
    the slots the entry gave back before it writes the next one. With the ring full and Tx buffers completed out
    of order, the driver then writes new descriptors over slots of buffers the device still holds, as it may:
    a used entry gives back as many slots as its buffer had descriptors, whichever buffers were published there."""

    def flush(self, q, ids, lens, batch):
        start = int(q.dq.c.used_idx)
        super().flush(q, ids, lens, batch)
        if q.index != TX or not q.packed:
            return
        back = {(start + k) % q.size for k in range((int(q.dq.c.used_idx) - start) % q.size)}
        # held buffers with slots just given back: counted on the harness (the sessions are not kept)
        self.h.overlaps += sum(1 for h in q.held.values() if back & set(h.chain.slots))
        deadline = time.monotonic() + 0.05
        while not q.avail_pending() and time.monotonic() < deadline:
            time.sleep(0.0005)


class FaultyDevice:
    """A backend listening on ``sock`` (in a thread) that completes Tx buffers with ``fault`` (``patient``:
    correctly, see PatientSession; ``phases`` and ``population`` as ``conform driver``'s)."""

    SESSIONS = {"reorder": _ReorderSession, "reorder-apart": _ReorderApartSession, "double": _DoubleSession,
                "patient": PatientSession}

    def __init__(self, sock, fault, phases=("batches",), population=0, seconds=60):
        harness = DriverHarness(DriverOptions(socket=sock, seconds=seconds, wait=20, population=population,
                                              phases=phases))
        harness.session_class = self.SESSIONS[fault]
        harness.overlaps = 0   # PatientSession
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
    on its Tx queue (split rings unless ``packed`` (``late-write`` only), 64 entries, no MRG_RXBUF)."""

    def __init__(self, sock, fault, in_order=True, seconds=15, packed=False):
        self.sock, self.fault, self.in_order, self.seconds, self.packed = sock, fault, in_order, seconds, packed
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
        fe = ScriptedFrontend(self.sock, packed=self.packed, in_order=self.in_order, mrg_rxbuf=False,
                              queue_size=64)
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
        slot = (int(fe.txq.c.next_avail) - 1) % fe.size   # packed: the last descriptor published (one a frame)
        time.sleep(0.003)
        if self.packed:
            PackedView(fe.mem, fe.layouts[1]).desc[slot]["len"] ^= 1
        else:
            v = SplitView(fe.mem, fe.layouts[1])
            v.desc[v.avail_ring(v.avail_idx - 1)]["len"] -= 1
        self.faults += 1

    def join(self, timeout=30):
        self.stop.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()


class _LoopQueues:
    """The data path of a LoopDevice: Tx frames are completed and written into Rx buffers, in Python."""

    def __init__(self, dev, fault):
        self.dev, self.fault = dev, fault
        self.hdr = frames.hdr_size(dev.features)
        self.mrg = has(dev.features, VIRTIO_NET_F_MRG_RXBUF)
        self.in_order = has(dev.features, VIRTIO_F_IN_ORDER)
        self.packed = has(dev.features, VIRTIO_F_RING_PACKED)
        self.q, self.views = [], []
        for i, v in enumerate(dev.vrings):
            layout = dev._layout(v, v.addr)
            batch = fault in ("rx-skip", "rx-batch-len+1", "rx-batch-len-1", "rx-len-1")
            q = DeviceQueue(dev.cmem, layout, dev.features, in_order_batch=batch and i == RX)
            q.set_base(v.base)
            self.q.append(q)
            self.views.append(view_for(dev.mem, layout))
        self.rx_free = deque()    # (id, writable segments, writable length) in poll order
        self.frames = deque()     # frames waiting for Rx buffers
        self.faults = 0
        self.nframes = 0
        self.held_tx = []         # gen01: Tx completions held until DRIVER_OK
        self.pair_ids = []        # rx-pair-short: the buffers pushed and not yet published

    def _early(self):
        """gen01: running before DRIVER_OK."""
        return self.fault == "gen01" and not self.dev.status & STATUS_DRIVER_OK

    def step(self):
        """One poll of both queues. Returns True when something moved."""
        rx, tx = self.q
        ch = tx.poll()
        n = ch.n
        if n:
            ids = [int(x) for x in ch.id[:n]]
            lens = [int(ch.rlen[k]) if self.fault == "tx-len" else 0 for k in range(n)]
            for k in range(n):
                data = b"".join(self.dev.mem.read(a, ln) for a, ln, w in ch.segments(k) if not w)
                self.frames.append(data[self.hdr:])
            if self._early():   # the frames are looped now, their Tx buffers used only after DRIVER_OK
                self.held_tx.append((ids, lens))
                self.faults += 1
            else:
                self._complete_tx(ids, lens)
        if self.held_tx and not self._early():
            for ids, lens in self.held_tx:
                self._complete_tx(ids, lens)
            self.held_tx = []
        ch = rx.poll()
        for k in range(ch.n):
            segs = [(a, ln) for a, ln, w in ch.segments(k) if w]
            self.rx_free.append((int(ch.id[k]), segs, int(ch.wlen[k])))
        while self.frames and self._receive(self.frames[0]):
            self.frames.popleft()
        return bool(n or ch.n)

    def _call(self, index):
        swap = self.fault == "call-swap"   # the right decision, the other queue's eventfd
        q, fd = self.q[index], self.dev.vrings[index ^ 1 if swap else index].callfd
        old = int(q.c.used_idx) - int(q.c.call_added)   # the used idx / slot before what this call is for
        want = q.call_prepare()
        v = self.views[index]
        if self.fault == "evt-first" and not self.packed:   # EVENT_IDX done naively: only when the first index
            naive = int(v.avail[2 + q.size]) == old & 0xFFFF   # written is used_event
            self.faults += naive != want
            want = naive
        if self.fault == "evt-first" and self.packed and int(v.driver_event[1]) == 2:   # DESC: the first used
            naive = int(v.driver_event[0]) & 0x7FFF == old % q.size   # slot written is the event slot (no wrap)
            self.faults += naive != want
            want = naive
        if self._early():   # nothing announced before DRIVER_OK
            return
        if fd >= 0 and want:
            os.eventfd_write(fd, 1)
            self.faults += swap

    def _complete_tx(self, ids, lens):
        tx, k = self.q[TX], len(ids)
        tx.push_used(np.array(ids, np.uint32), np.array(lens, np.uint32))
        if self.fault == "call-early":   # the call for these buffers, then (a while later) their used entries
            fd = self.dev.vrings[TX].callfd
            v = self.views[TX]   # notifications asked for: split flags 0, packed not DISABLE (1)
            if fd >= 0 and not (int(v.driver_event[1]) == 1 if self.packed else v.avail[0] & 1):
                os.eventfd_write(fd, 1)
            time.sleep(0.02)
            tx.flush()
            self.faults += 1
            return
        if self.packed and (self.fault in ("no-avail", "adv1", "head-id") or
                            self.fault == "short-id" and self.in_order and k >= 3):
            self._used_by_hand(tx, ids)
        elif self.fault == "batch-last" and self.in_order and k > 1:
            # one entry for the batch, as a batching device writes it, but at the batch's last used slot
            # (INORDER-08 puts it at the first)
            self._split_used_by_hand(TX, ids, [(k - 1, ids[-1], lens[-1])])
            self.faults += 1
        elif self.fault == "len-late" and not self.packed:
            self._len_late(TX, ids, lens)
        else:
            tx.flush()
            if self.fault == "tx-len":
                self.faults += 1
        if self.fault == "scribble":   # the used ring ends at avail_event, 6 + 8 * size bytes in
            self.dev.mem.write(tx.layout.device + 6 + 8 * tx.size, b"\xde\xad\xbe\xef" * 2)
            self.faults += 1
        self._call(TX)

    def _used_by_hand(self, tx, ids):
        """Packed Tx: the used descriptors written with this LoopDevice's fault (len 0), the queue's state moved
        as its flush would move it (adv1: its used position by 1 a buffer, its slot count right)."""
        c, v, size = tx.c, self.views[TX], tx.size
        used, wrap = int(c.used_idx), int(c.used_wrap)
        ndesc = [int(tx.id_ndesc[i]) for i in ids]
        heads = used + np.cumsum([0] + ndesc[:-1])   # the lists, polled just now, follow the used position
        if self.fault == "short-id":   # one descriptor for the batch, at its first slot, but not its last id
            entries = [(used, ids[-2])]
        elif self.fault == "adv1":
            entries = list(zip(used + np.arange(len(ids)), ids))
        elif self.fault == "head-id":   # read before any is overwritten
            entries = [(h, int(v.desc[h % size]["id"])) for h in heads]
        else:
            entries = list(zip(heads, ids))
        flags = [VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED if wrap ^ int(p >= size) else 0 for p, _u in entries]
        if self.fault == "no-avail":
            flags = [f & ~VIRTQ_DESC_F_AVAIL for f in flags]
        for (pos, uid), f in zip(entries, flags):
            d = v.desc[pos % size]
            d["id"], d["len"] = uid, 0
            d["flags"] = f   # after id and len
        self.faults += {"no-avail": sum(f == VIRTQ_DESC_F_USED for f in flags), "short-id": 1,
                        "adv1": sum(x > 1 for x in ndesc),
                        "head-id": sum(u != i for (_p, u), i in zip(entries, ids))}[self.fault]
        adv = len(ids) if self.fault == "adv1" else sum(ndesc)
        tx.id_inflight[ids] = 0
        c.inflight = int(c.inflight) - len(ids)
        c.inflight_slots = int(c.inflight_slots) - sum(ndesc)
        c.call_added = (int(c.call_added) + adv) & 0xFFFF
        c.shadow_count = 0
        c.used_idx = (used + adv) % size
        c.used_wrap = wrap ^ int(used + adv >= size)

    def _split_used_by_hand(self, index, ids, entries):
        """Split: publish the pushed (not flushed) buffers ``ids`` by hand: ``entries`` [(offset from used idx, id, len or
        None: left as it is)] written, used idx moved by all of ``ids``; the queue's own state moves as its flush
        would move it. Returns the used idx before."""
        q, v = self.q[index], self.views[index]
        c, size, k = q.c, q.size, len(ids)
        pos = int(c.used_idx)
        for off, i, ln in entries:
            v.used_raw[(pos + off) % size, 0] = i
            if ln is not None:
                v.used_raw[(pos + off) % size, 1] = ln
        q.id_inflight[ids] = 0
        c.inflight = int(c.inflight) - k
        c.shadow_count = 0
        c.call_added = (int(c.call_added) + k) & 0xFFFF
        c.used_idx = (pos + k) & 0xFFFF
        v.used_hdr[1] = c.used_idx
        return pos

    def _len_late(self, index, ids, lens):
        """len-late (split): one used entry per buffer with its id only, used idx moved; the lens 20 ms later
        (until then the slots keep what the harness wrote there: its canary)."""
        pos = self._split_used_by_hand(index, ids, [(j, i, None) for j, i in enumerate(ids)])
        time.sleep(0.02)
        for j, ln in enumerate(lens):
            self.views[index].used_raw[(pos + j) % self.q[index].size, 1] = ln
        self.faults += 1

    def _receive(self, frame):
        """Write one frame into the Rx buffers at hand (merged with MRG_RXBUF). False: not enough buffers yet."""
        hsize = {"hdr20": 20, "hdr10": 10, "hdr10-len-1": 10}.get(self.fault, self.hdr)   # another header size
        need = hsize + len(frame)
        skip = 1 if self.fault == "rx-skip" and self.in_order and self.nframes % 3 == 2 else 0
        take, room = 0, 0
        while room < need and skip + take < len(self.rx_free) and (self.mrg or take == 0):
            room += self.rx_free[skip + take][2]
            take += 1
        if room < need:
            if not self.mrg and len(self.rx_free) > skip:   # too big for one buffer: dropped, as a device may
                return True
            return False
        self.nframes += 1
        ids, lens, off = [], [], 0
        if skip:   # used as if written completely, never written: the batch entry names the next buffer
            bid, _segs, wlen = self.rx_free.popleft()
            ids.append(bid)
            lens.append(wlen)
            self.faults += 1
        bufs = [self.rx_free.popleft() for _ in range(take)]
        nb = take + {"num-buffers+1": 1, "num-buffers-1": -1}.get(self.fault, 0) if take > 1 else take
        self.faults += nb != take
        hdr = (frames.net_hdr(num_buffers=nb) + bytes(8))[:hsize]   # (num_buffers right, where there is one)
        self.faults += hsize != self.hdr
        if self.fault == "stamp" and len(frame) > frames.STAMP_OFF:   # one byte of the harness's stamp changed
            frame = frame[:frames.STAMP_OFF] + bytes([frame[frames.STAMP_OFF] ^ 0xFF]) + frame[frames.STAMP_OFF + 1:]
            self.faults += 1
        if self.fault == "stamp-run" and len(frame) > frames.STAMP_OFF + 4:   # one bit of the stamp's run id
            j = frames.STAMP_OFF + 4
            frame = frame[:j] + bytes([frame[j] ^ 0x01]) + frame[j + 1:]
            self.faults += 1
        data = hdr + frame
        if self.fault == "hdr-only":   # used len covers header + frame, but only the header is ever written
            data = data[:self.hdr]
            self.faults += 1
        for bid, segs, wlen in bufs:
            used = min(wlen, need - off)
            ids.append(bid)
            lens.append(used)
            left = used
            for a, ln in segs:
                part = min(ln, left)
                if not part:
                    break
                if data[off:off + part]:   # (hdr-only: nothing past the header)
                    self.dev.mem.write(a, data[off:off + part])
                off += part
                left -= part
        rx = self.q[RX]
        if self.fault == "rx-batch-len+1" and len(ids) > 1 and lens[-1] < bufs[-1][2]:
            lens[-1] += 1   # the batch entry (the last buffer's): one byte more than was written
            self.faults += 1
        if (self.fault in ("rx-batch-len-1", "hdr10-len-1") and len(ids) > 1 or self.fault == "rx-len-1") \
                and lens[-1] > 1:
            lens[-1] -= 1   # the batch entry (the last buffer's): one byte less than was written
            self.faults += 1
        if self.fault == "rx-desc-write":    # the bytes written stored in each used buffer's descriptor
            self.views[RX].desc["len"][ids] = lens
            self.faults += 1
        if self.fault == "rx-avail-write":   # the avail slots read last cleared, one per buffer used
            for k in range(len(ids)):
                self.views[RX].avail[2 + (int(rx.c.last_avail) - 1 - k) % rx.size] = 0xFFFF
            self.faults += 1
        rx.push_used(np.array(ids, np.uint32), np.array(lens, np.uint32))
        if self.fault == "len-late" and not self.packed:
            self._len_late(RX, ids, lens)
        elif self.fault == "rx-pair-short" and not self.packed:
            self.pair_ids += ids
            if len(self.pair_ids) >= 2:   # one entry for two frames' buffers: the first, short, is skipped
                self._split_used_by_hand(RX, self.pair_ids, [(0, ids[-1], lens[-1])])
                self.pair_ids = []
                self.faults += 1
        else:
            rx.flush()
        self._call(RX)
        return True


class _LoopNetDevice(NetDevice):
    """vhost's control plane; the data path is a _LoopQueues."""

    memory_table = MemoryTable   # its rings are read through numpy views (conform.ringview)

    def __init__(self, fault, packed=False):
        super().__init__(features=bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_IN_ORDER) | bit(VIRTIO_NET_F_MRG_RXBUF)
                         | bit(VIRTIO_F_EVENT_IDX) | bit(VHOST_USER_F_PROTOCOL_FEATURES)
                         | (bit(VIRTIO_F_RING_PACKED) if packed else 0), protocol_features=OFFERED_PROTOCOL)
        self.fault = fault
        self.loop = None
        self.faults = 0

    def ready(self):
        if self.fault == "gen01":   # starts once the rings are set, without waiting for DRIVER_OK
            status, self.status = self.status, self.status | STATUS_DRIVER_OK
            try:
                return super().ready()
            finally:
                self.status = status
        return super().ready()

    def update(self):
        if self.ready():
            if self.loop is None:
                self.loop = _LoopQueues(self, self.fault)
        else:
            self._stop("not ready")

    def _stop(self, why):
        lp, self.loop = self.loop, None
        if lp is not None:
            self.faults += lp.faults
            for v, q in zip(self.vrings, lp.q):
                v.base = int(q.c.used_idx) | (int(q.c.used_wrap) << 15 if lp.packed else 0)


class LoopDevice:
    """A looping backend listening on ``sock`` (in a thread) with ``fault`` on, offering packed rings if
    ``packed``; ``faults``: how often it struck."""

    def __init__(self, sock, fault, seconds=60, packed=False):
        self.sock, self.fault, self.seconds, self.packed = sock, fault, seconds, packed
        self.error = None
        self.faults = 0
        self.listener = vu.listen_unix(sock)
        self.ino = os.lstat(sock).st_ino
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        dev = conn = None
        try:
            conn = vu.accept_unix(self.listener, timeout=20)
            dev = _LoopNetDevice(self.fault, self.packed)
            end = time.monotonic() + self.seconds
            while not self.stop.is_set() and time.monotonic() < end:
                if not self._serve(conn, dev):
                    break
                if dev.loop is not None and not dev.loop.step():
                    time.sleep(0.0002)
        except PeerGone:
            pass
        except BaseException as e:   # surfaced by join()
            self.error = e
        finally:
            if dev is not None:
                dev._stop("end")
                self.faults = dev.faults
                dev.close()
            if conn is not None:
                conn.close()
            vu.close_listener(self.listener, self.sock, self.ino)

    @staticmethod
    def _serve(conn, dev):
        """At most one control message; False when the frontend left."""
        r, _, _ = select.select([conn.sock], [], [], 0 if dev.loop is not None else 0.02)
        if not r:
            return True
        try:
            msg = conn.recv(timeout=5)
        except PeerGone:
            return False
        value = vu.decode(msg)
        try:
            payload = dev.handle(msg, value)
        except Refused:
            if msg.need_reply:
                conn.send(vu.ack(msg, ok=False), timeout=5)
                return True
            return False
        if vu.has_reply(msg.request):
            conn.send(vu.reply(msg, payload or b""), timeout=5)
        elif vu.wants_ack(msg):
            conn.send(vu.ack(msg, True), timeout=5)
        return True

    def join(self, timeout=30):
        self.stop.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()
