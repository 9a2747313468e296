"""`vring tap --pcap FILE`: the frames crossing the peers' rings, read passively from the mapped memory.

One thread polls every started vring. It follows the driver's side of each ring (split: avail.idx and the
avail ring; packed: the descriptors made available, slot by slot with the driver's wrap counter) and
records each buffer's segments as it is published; when the device's used entry for a buffer appears
(split: used.idx moves, with IN_ORDER a batch per entry, INORDER-06..09; packed: a used descriptor at the
device's position, IN_ORDER batches by the last id, INORDER-11..14), the buffer's bytes are read at once,
the virtio-net header stripped (mergeable Rx buffers joined by num_buffers, NET-29..32) and the frame
written, timestamped when the tap saw the used entry. vring 2k is the driver's Rx queue (the device wrote
the frame), 2k+1 its Tx queue (the driver did).

The tap is a bystander: it never blocks either peer, so it can fall behind. What it may miss is counted
per vring and said (``vring dump --ctl`` notes, the tap's exit line):

* ``lapped``: split entries the ring overwrote before the tap looked (the index moved more than the ring
  size between two looks; a lower bound: an index that moves by 65536 or more looks unmoved);
* ``lost``: buffers whose publication or completion the tap did not see in order (packed: the tap's
  cursors no longer match the ring, or a slot it follows was made available again, a lap on; it starts
  again from the driver's published position, and the buffers in flight then are not captured); and a
  mergeable Rx frame the tap came into in the middle (it cannot tell where frames begin after starting
  again behind buffers in flight, or after missing a buffer: it waits for one used short of its length,
  which ends a frame, NET-30);
* ``unreadable``: a buffer whose descriptors or bytes lie outside the memory table, a runt frame, a
  mergeable frame whose buffers do not match its num_buffers (NET-29/30) or with a buffer missing;
* ``not_seen_published``: a used entry for a buffer the tap never saw published.

A peer that reuses a buffer faster than the tap reads it can change the bytes under the tap: the frames
are what the memory held when the tap saw the used entry. A ring that goes round twice between two looks
can also look unchanged (the packed wrap counter is one bit).
"""
import logging
import struct
import threading
import time
import weakref
from collections import defaultdict, deque

from rings.errors import GuestMemoryFault, VringError
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_NET_F_MRG_RXBUF, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT,
                          VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE, area_sizes, has,
                          virtio_net_hdr_size)
from rings.snapshot import infer_published_packed

log = logging.getLogger("tap")

_DESC = struct.Struct("<QIHH")
_U16 = struct.Struct("<H")
MAX_FRAME = 65536 + 64


#: the buffers a packed observer follows from the driver's side in one look: a look stays short, so the device's
#: side is read before the driver laps it
LISTS_PER_LOOK = 64


def _writable(segs):
    """The bytes a buffer offers the device (its writable segments; 0 for an unreadable one)."""
    return sum(seg_len for _, seg_len, write in segs or () if write)


def _is_avail(flags, wrap):
    """A packed descriptor made available in the lap whose wrap counter is ``wrap`` (PACKED-D-02/03)."""
    return bool(flags & VIRTQ_DESC_F_AVAIL) == wrap and bool(flags & VIRTQ_DESC_F_USED) != wrap


#: the counters of every observer (and of the totals, also when no queue was ever captured)
STAT_KEYS = ("frames", "lapped", "lost", "unreadable", "not_seen_published")

class _Ring:
    """Common to both formats: memory views, the frame assembly, the counters."""

    def __init__(self, layout, ring_mem, buf_mem, features, rx):
        self.n = layout.size
        dsz, drv, dev = area_sizes(layout.fmt, layout.size)
        self.desc = ring_mem.view(layout.desc, dsz)
        self.avail = ring_mem.view(layout.driver, drv)
        self.used = ring_mem.view(layout.device, dev)
        self.buf_mem, self.rx = buf_mem, rx
        self.in_order = has(features, VIRTIO_F_IN_ORDER)
        self.hdr = virtio_net_hdr_size(features)
        self.mrg = rx and has(features, VIRTIO_NET_F_MRG_RXBUF)
        self.pending = None          # Rx, mergeable: [frame bytes so far (None: a buffer missed), buffers to come]
        self.aligned = True          # Rx, mergeable: the next used buffer begins a frame (False: not known)
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    def u16(self, view, off):
        return _U16.unpack_from(view, off)[0]

    def _table(self, addr, length):
        """An indirect table's entries as (addr, len, flags, next)."""
        if length == 0 or length % 16 or length // 16 > self.n:
            raise VringError(f"indirect table of {length} bytes")
        t = self.buf_mem.read(addr, length)
        return [_DESC.unpack_from(t, 16 * j) for j in range(length // 16)]

    def buffer(self, segs, length, when, out):
        """One used buffer: segments [(addr, len, write)] and the used length (Rx); writes a frame when one
        is complete."""
        if self.mrg:
            # NET-30: every buffer of a frame but the last is used to its full length, so one used shorter ends
            # a frame; where the tap does not know where frames begin, it waits for one
            last = length < _writable(segs)
            if not self.aligned:
                if last:
                    self.aligned = True
                    self.stats["lost"] += 1  # the frame the tap came into in the middle
                return
        try:
            # at most MAX_FRAME bytes a frame, whatever the segments say (a peer's chain of many long ones)
            room = MAX_FRAME
            if self.pending is not None:  # what the frame so far leaves (none: a buffer of it was missed)
                room = MAX_FRAME - len(self.pending[0]) if self.pending[0] is not None else 0
            data, left = bytearray(), min(length, room) if self.rx else room
            for addr, seg_len, write in segs:
                if write == self.rx and left > 0:
                    take = min(seg_len, left)
                    data += self.buf_mem.read(addr, take)
                    left -= take
        except VringError:
            self.missed(last=self.mrg and last)
            return
        if self.pending is not None:  # a later buffer of a mergeable Rx packet: no header of its own (NET-32)
            frame = self.pending[0]
            if frame is not None:
                frame += data
            self.pending[1] -= 1
            more = self.pending[1]
            if more > 0 and not last:
                return
            self.pending = None
            if more > 0:  # used short before num_buffers of them (NET-30): not the frame its header announced
                self.stats["unreadable"] += 1
            elif frame is not None:  # (None: a buffer of it was missed, and counted)
                self._write(bytes(frame), when, out)
            return
        if len(data) < self.hdr:
            self.stats["unreadable"] += 1
            return
        more = _U16.unpack_from(data, 10)[0] - 1 if self.mrg and self.hdr >= 12 else 0
        if more > 0:  # NET-29: num_buffers buffers, all in the ring together (NET-31)
            if last or more >= self.n:  # used short yet more to come (NET-30), or more than the ring holds
                self.stats["unreadable"] += 1
                self.aligned = last
                return
            self.pending = [bytearray(data[self.hdr:]), more]
            return
        self._write(bytes(data[self.hdr:]), when, out)

    def missed(self, why="unreadable", last=False):
        """A used buffer whose bytes the tap cannot have (unreadable, or never seen made available), counted under
        ``why``. ``last``: its used length shows that it ends a frame (NET-30)."""
        self.stats[why] += 1
        if self.pending is not None:  # a later buffer of a mergeable frame: that frame cannot be whole
            self.pending[0] = None
            self.pending[1] -= 1
            if self.pending[1] <= 0 or last:
                self.pending = None
        elif self.mrg and not last:  # it may begin a frame whose other buffers come next
            self.aligned = False

    def _write(self, frame, when, out):
        fault = self.buf_mem.vanished()
        if fault is not None:   # the frontend truncated its memory: this frame may be zeros, not what it sent
            raise fault
        if len(frame) < 14:
            self.stats["unreadable"] += 1
            return
        if out.write(frame, when):
            self.stats["frames"] += 1


class SplitObserver(_Ring):
    def __init__(self, *args):
        super().__init__(*args)
        self._avail_ring = struct.Struct(f"<{self.n}H")  # one read of the whole avail ring
        self._used_ring = struct.Struct(f"<{2 * self.n}I")  # one copy of the whole used ring: (id, len) pairs
        self.resync()

    def resync(self):
        """Start again from what is in flight now: the avail positions from used.idx on are read afresh."""
        self.last_used = self.u16(self.used, 2)
        self.last_avail = self.last_used
        self.recs = defaultdict(deque)   # head -> segment lists, oldest first (a head can come back)
        self.fifo = deque()              # IN_ORDER: (head, segments) in avail order
        self.pending = None
        self.aligned = True              # used.idx moves by whole frames (NET-31)

    def _record(self, k):
        """The k buffers published from last_avail on, their chains read now, while they are in flight."""
        if not k:
            return
        start = self.last_avail % self.n
        ring = self._avail_ring.unpack_from(self.avail, 4)
        for head in (ring[start:] + ring[:start])[:k]:
            segs = self._chain(head)
            if self.in_order:
                self.fifo.append((head, segs))
            else:
                self.recs[head].append(segs)
        self.last_avail = (self.last_avail + k) & 0xFFFF

    def _chain(self, head):
        try:
            return self.chain(head)
        except VringError:
            return None

    def chain(self, head):
        """The segments of the chain at head (following next, and an indirect table)."""
        if head >= self.n:
            raise VringError(f"head {head}")
        segs, i, table, hops = [], head, None, 0
        while True:
            hops += 1
            if hops > self.n:
                raise VringError("chain loops")
            addr, length, flags, nxt = table[i] if table is not None else _DESC.unpack_from(self.desc, 16 * i)
            if flags & VIRTQ_DESC_F_INDIRECT and table is None:
                table, i, hops = self._table(addr, length), 0, 0
                continue
            segs.append((addr, length, bool(flags & VIRTQ_DESC_F_WRITE)))
            if not flags & VIRTQ_DESC_F_NEXT:
                return segs
            i = nxt
            if i >= (len(table) if table is not None else self.n):
                raise VringError(f"next {i}")

    def poll(self, out):
        n = self.n
        # used.idx before avail.idx: the device uses only what was published, so every used entry up to this
        # used.idx is for a buffer the avail read below records (the other order takes the buffers published
        # and used between the two reads for buffers never seen published)
        used_idx = self.u16(self.used, 2)
        m = (used_idx - self.last_used) & 0xFFFF
        if 0 < m <= n:
            # the entries copied at once, then used.idx read again: had the device gone round onto the oldest
            # (position last_used + n written), an (id, len) could be a later buffer's, and the length of one
            # buffer with the bytes of another makes a frame nobody sent
            used = self._used_ring.unpack_from(self.used, 4)
            if (self.u16(self.used, 2) - self.last_used) & 0xFFFF > n:
                self.stats["lapped"] += m
                self.resync()
                return 1  # not idle: look again at once
        avail_idx = self.u16(self.avail, 2)
        k = (avail_idx - self.last_avail) & 0xFFFF
        if k > n:  # the driver published more than a ring's worth since the last look
            self.stats["lost"] += 1
            self.resync()
            return 1
        self._record(k)
        if m == 0:
            return k  # idle (the capture thread sleeps) only when neither index moved
        if m > n:
            self.stats["lapped"] += m - n
            self.resync()
            return 1
        when = time.time_ns()
        pos, left, look = self.last_used, m, 32
        while left:
            look -= 1
            if not look:  # a long look: has the device gone round onto the entries still to read? (their
                # buffers are the driver's again, to be filled with other bytes)
                look = 32
                if (self.u16(self.used, 2) - pos) & 0xFFFF >= n:
                    self.stats["lapped"] += left
                    self.resync()
                    return m
            id, length = used[2 * (pos % n)], used[2 * (pos % n) + 1]
            if self.in_order:  # one entry for a batch: the buffers up to the one whose head is id (INORDER-06)
                batch = []
                while self.fifo and len(batch) < left:
                    batch.append(self.fifo.popleft())
                    if batch[-1][0] == id:
                        break
                if not batch or batch[-1][0] != id:
                    self.stats["lost"] += left
                    self.resync()
                    return m
                for k, (_, segs) in enumerate(batch):
                    last = k == len(batch) - 1
                    self._one(segs, length if last else _writable(segs), when, out)
                pos, left = (pos + len(batch)) & 0xFFFF, left - len(batch)
            else:
                q = self.recs.get(id)
                if not q:
                    self.missed("not_seen_published")
                else:
                    self._one(q.popleft(), length, when, out)
                pos, left = (pos + 1) & 0xFFFF, left - 1
        self.last_used = used_idx
        return m

    def _one(self, segs, length, when, out):
        if segs is None:
            self.missed()
        else:
            self.buffer(segs, length, when, out)


class PackedObserver(_Ring):
    def __init__(self, *args):
        super().__init__(*args)
        self._all_flags = struct.Struct("<" + "14xH" * self.n)  # one read of every descriptor's flags
        self.resync()

    def flags(self, slot):
        return self.u16(self.desc, 16 * slot + 14)

    def resync(self):
        """Start from the driver's published position (read from the AVAIL bits): buffers in flight now are
        not followed; the device's used position meets this one once they are done."""
        flags = self._all_flags.unpack_from(self.desc, 0)
        found = infer_published_packed(flags)
        self.avail_at = self.used_at = found[:2] if isinstance(found, tuple) else None
        self.recs = defaultdict(deque)   # id -> (ndesc, segments)
        self.fifo = deque()              # IN_ORDER: (id, ndesc, segments)
        self.outstanding = 0             # descriptors recorded and not yet seen used
        self.pending = None
        self.aligned = True
        if self.mrg and self.avail_at is not None:
            # the slot before the start still made available, in its lap: the device may begin a frame in the
            # buffers in flight there and go on into the ones followed from here (NET-31: used together)
            slot, wrap = self.avail_at
            prev, lap = (slot - 1, wrap) if slot else (self.n - 1, wrap ^ 1)
            self.aligned = not _is_avail(flags[prev], lap)

    def _step(self, at, k):
        slot, wrap = at
        slot += k
        while slot >= self.n:
            slot, wrap = slot - self.n, wrap ^ 1
        return slot, wrap

    def _avail(self, at):
        return _is_avail(self.flags(at[0]), at[1])

    def _used(self, at):
        f = self.flags(at[0])
        return bool(f & VIRTQ_DESC_F_AVAIL) == at[1] and bool(f & VIRTQ_DESC_F_USED) == at[1]

    def _list(self):
        """The list at the avail cursor: (id, ndesc, segments or None)."""
        segs, at, ndesc = [], self.avail_at, 0
        while True:
            if ndesc and not self._avail(at):  # PACKED-D-12: the head is published last, so this is torn
                return None
            addr, length, id, flags = _DESC.unpack_from(self.desc, 16 * at[0])
            ndesc += 1
            at = self._step(at, 1)
            if flags & VIRTQ_DESC_F_INDIRECT:
                try:
                    segs += [(a, ln, bool(f & VIRTQ_DESC_F_WRITE)) for a, ln, _, f in self._table(addr, length)]
                except VringError:
                    segs = None
            elif segs is not None:
                segs.append((addr, length, bool(flags & VIRTQ_DESC_F_WRITE)))
            if not flags & VIRTQ_DESC_F_NEXT or ndesc >= self.n:
                return id, ndesc, segs

    def poll(self, out):
        if self.avail_at is None:
            self.resync()
            if self.avail_at is None:
                return 0
        added = 0
        while added < LISTS_PER_LOOK and self._avail(self.avail_at):  # short: the used side is read in time
            found = self._list()
            if found is None:
                break
            id, ndesc, segs = found
            if self.in_order:
                self.fifo.append(found)
            else:
                self.recs[id].append((ndesc, segs))
            self.avail_at = self._step(self.avail_at, ndesc)
            self.outstanding += ndesc
            added += 1
            if self.outstanding > self.n:  # the device's used position never came to ours
                return self._lost(1)
        when, done = None, 0
        while self.used_at != self.avail_at:
            f = self.flags(self.used_at[0])
            if bool(f & VIRTQ_DESC_F_AVAIL) != self.used_at[1]:
                # the device's next used descriptor goes where the tap saw a list made available in this lap:
                # the driver made it available again, so the ring went round past the tap (waiting on would take
                # a used descriptor two laps on for this one)
                return self._lost(1)
            if bool(f & VIRTQ_DESC_F_USED) != self.used_at[1]:
                break
            when = when or time.time_ns()
            _, length, id, _ = _DESC.unpack_from(self.desc, 16 * self.used_at[0])
            if self.in_order:  # the buffers up to the one with this id (INORDER-11..14)
                batch = []
                while self.fifo:
                    batch.append(self.fifo.popleft())
                    if batch[-1][0] == id:
                        break
                if not batch or batch[-1][0] != id:
                    return self._lost(len(batch) or 1)
            else:
                q = self.recs.get(id)
                if not q:
                    return self._lost(1)
                ndesc, segs = q.popleft()
                batch = [(id, ndesc, segs)]
            for k, (_, _, segs) in enumerate(batch):
                if segs is None:
                    self.missed()
                else:
                    self.buffer(segs, length if k == len(batch) - 1 else _writable(segs), when, out)
            self.used_at = self._step(self.used_at, sum(b[1] for b in batch))
            self.outstanding -= sum(b[1] for b in batch)
            done += len(batch)
        if self.used_at == self.avail_at and self._used(self.avail_at):
            return self._lost(1)  # the device used slots the tap never saw made available
        return done + added  # idle (the capture thread sleeps) only when nothing moved

    def _lost(self, k):
        self.stats["lost"] += k
        self.resync()
        return 1  # not idle: look again at once


class Capture:
    """The capture thread: ``Capture(picture, writer).start()`` ... ``stop()``."""

    def __init__(self, picture, writer, idle_s=0.0002):
        self.picture, self.writer, self.idle_s = picture, writer, idle_s
        self.observers = {}   # (conn, vring) -> observer
        self.vanished = {}    # (conn, vring) -> weakref to the buffer table the frontend truncated: not read again
        self.totals = defaultdict(int)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vring-tap capture", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.writer.close()

    def _refresh(self):
        p = self.picture
        with p.lock:
            started = {(v.conn, i) for i, v in p.vrings.items() if v.state == "started" and v.conn == p.conn}
        for key in list(self.observers):
            if key not in started:
                self._retire(key)
        for key in started:
            try:
                layout, ring_mem, buf_mem, features = p.ring(key[1])
            except VringError:
                continue
            source = (layout, buf_mem.ident, features)
            obs = self.observers.get(key)
            if obs is not None and obs.source == source:
                continue   # (a memory table sent again, the same files at the same places: its buffers in flight)
            if obs is not None:   # new memory or a new layout for a started vring: look anew
                self._retire(key)
            gone = self.vanished.get(key)
            if gone is not None and gone() is buf_mem:
                continue
            try:
                cls = PackedObserver if layout.packed else SplitObserver
                obs = self.observers[key] = cls(layout, ring_mem, buf_mem, features, key[1] % 2 == 0)
            except VringError:
                continue
            obs.source = source

    def _memory_vanished(self, key, fault):
        """The frontend truncated the memory of this vring: stop capturing it, and say so in its dumps."""
        self.vanished[key] = weakref.ref(self._retire(key).buf_mem)
        with self.picture.lock:
            note = f"capture of vring {key[1]} stopped: {type(fault).__name__}: {fault}"
            if note not in self.picture.notes:
                self.picture.notes.append(note)
        log.error("%s", note)

    def _retire(self, key):
        obs = self.observers.pop(key)
        for k, v in obs.stats.items():
            self.totals[k] += v
        return obs

    def _publish(self):
        with self.picture.lock:
            for (conn, i), obs in self.observers.items():
                v = self.picture.vrings.get(i)
                if v is not None and v.conn == conn:
                    v.capture = dict(obs.stats)

    def _run(self):
        gen, last_publish = None, 0.0
        while not self._stop.is_set() and not self.writer.full:
            if self.picture.generation != gen:
                gen = self.picture.generation
                self._refresh()
            moved = 0
            for key, obs in list(self.observers.items()):
                before = dict(obs.stats)
                try:
                    moved += obs.poll(self.writer)
                except GuestMemoryFault:
                    pass   # raised before a frame of zeros was written: handled below
                except (VringError, ValueError, IndexError, struct.error):
                    obs.stats["lost"] += 1
                    obs.resync()
                fault = obs.buf_mem.vanished()   # the frontend truncated its memory: what this look read may be zeros
                if fault is not None:
                    obs.stats.update({k: v for k, v in before.items() if k != "frames"})   # not real losses
                    self._memory_vanished(key, fault)
                if self.writer.full:
                    break
            now = time.monotonic()
            if now - last_publish > 0.2:
                self._publish()
                self.writer.flush()
                last_publish = now
            if not moved:
                time.sleep(self.idle_s)
        self._publish()
        self.writer.flush()

    def stats(self):
        out = defaultdict(int, dict.fromkeys(STAT_KEYS, 0))   # every key, also when no queue was ever seen
        out.update(self.totals)
        for obs in list(self.observers.values()):
            for k, v in obs.stats.items():
                out[k] += v
        return {**self.writer.stats(), **out}
