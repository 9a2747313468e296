"""Move numbered buffers through one queue: a driver half and a device half, in one process or two.

Every buffer carries its sequence number in its payload; the device checks it has not seen it before and
the driver checks every token comes back exactly once, so each buffer is accounted for exactly once.
Used by `vring demo`, the two-process tests and benchmarks/ring_ops.py.
"""
import multiprocessing as mp
import os
import time

import numpy as np

from .errors import VringError
from .interrupts import held_back
from .layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, QueueLayout, bit)
from .shm import MemoryTable, ShmRegion

GPA_BASE = 0x10000000
SLOT = 64          # bytes per payload slot
PAGE = 4096


class AccountingError(VringError):
    """A buffer was lost, duplicated or corrupted on its way through the queue."""


def features_for(fmt, in_order):
    return bit(VIRTIO_F_VERSION_1) | (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | \
        (bit(VIRTIO_F_IN_ORDER) if in_order else 0)


class Setup:
    """One shared region: the ring at the start, then 2*size payload slots."""

    def __init__(self, fmt, size, in_order, region=None):
        self.fmt, self.size, self.in_order = fmt, size, in_order
        ring = -(-QueueLayout.bytes_needed(fmt, size) // PAGE) * PAGE
        self.nslots = 2 * size
        self.slots_off = ring
        nbytes = ring + self.nslots * SLOT
        self.region = region or ShmRegion.create(nbytes, prefix="vring-pair")
        self.mem = MemoryTable([(GPA_BASE, nbytes, self.region.buf)])
        self.layout = QueueLayout.contiguous(fmt, size, GPA_BASE)
        self.features = features_for(fmt, in_order)
        # payload slot i holds a little-endian u64 sequence number
        self.seq_view = np.frombuffer(self.region.buf, np.uint64, self.nslots * SLOT // 8,
                                      ring).reshape(self.nslots, SLOT // 8)[:, 0]
        self.slot_addr = GPA_BASE + ring + np.arange(self.nslots, dtype=np.uint64) * SLOT

    def params(self):
        return dict(name=self.region.name, fmt=self.fmt, size=self.size, in_order=self.in_order)

    @classmethod
    def attach(cls, name, fmt, size, in_order):
        return cls(fmt, size, in_order, region=ShmRegion.attach(name))

    def close(self):
        self.seq_view = None
        self.region.close()


class DriverSide:
    """Publishes numbered one-descriptor buffers, reclaims them, checks each comes back once."""

    def __init__(self, setup, impl, count, burst, check=True):
        self.s, self.count, self.burst, self.check = setup, count, burst, check
        self.q = impl.DriverQueue(setup.mem, setup.layout, setup.features)
        self.free_slots = list(range(setup.nslots))
        self.returned = np.zeros(count, bool)
        self.next_seq = self.done = self.kicks = 0
        self.lens = np.full(burst, 8, np.uint32)

    def step(self):
        if not self.check:
            return self._step_unchecked()
        tokens, _ = self.q.reclaim()
        if len(tokens):
            seqs = (tokens >> 16).astype(np.int64)
            if self.returned[seqs].any() or len(np.unique(seqs)) != len(seqs):
                raise AccountingError(f"driver: buffer(s) {seqs[self.returned[seqs]][:5]} returned twice")
            self.returned[seqs] = True
            self.done += len(seqs)
            self.free_slots.extend((tokens & 0xFFFF).tolist())
        n = min(self.burst, self.count - self.next_seq, len(self.free_slots))
        if n > 0:
            slots = np.array(self.free_slots[:-n - 1:-1], np.int64)  # from the end: added ones pop cleanly
            seqs = np.arange(self.next_seq, self.next_seq + n, dtype=np.uint64)
            self.s.seq_view[slots] = seqs
            added = self.q.add_simple(self.s.slot_addr[slots], self.lens[:n],
                                      (seqs << np.uint64(16)) | slots.astype(np.uint64))
            del self.free_slots[len(self.free_slots) - added:]
            self.next_seq += added
            self.q.publish()
            self.kicks += self.q.kick_prepare()
        return self.done >= self.count

    def _step_unchecked(self):
        """Ring operations only (for benchmarks): no payload writes, no bookkeeping per buffer."""
        tokens, _ = self.q.reclaim()
        self.done += len(tokens)
        n = min(self.burst, self.count - self.next_seq)
        if n > 0:
            added = self.q.add_simple(self.s.slot_addr[:n], self.lens[:n], self.s.slot_addr[:n])
            self.next_seq += added
            self.q.publish()
            self.kicks += self.q.kick_prepare()
        return self.done >= self.count

    def accounted(self):
        """Distinct buffers returned (None unchecked: nothing was tracked)."""
        return int(self.returned.sum()) if self.check else None


class DeviceSide:
    """Polls buffers, checks their sequence numbers, completes them (shuffled unless IN_ORDER)."""

    def __init__(self, setup, impl, count, burst, batch, seed=1, check=True):
        self.s, self.count, self.burst, self.check = setup, count, burst, check
        self.q = impl.DeviceQueue(setup.mem, setup.layout, setup.features, in_order_batch=batch)
        self.q.enable_kicks(False)  # polling: the driver need not kick (EVT-12)
        self.seen = np.zeros(count, bool)
        self.done = self.calls = 0
        self.rng = np.random.default_rng(seed)
        self.base = GPA_BASE + setup.slots_off
        self.zeros = np.zeros(setup.size, np.uint32)

    def step(self):
        ch = self.q.poll(self.burst)
        if ch.n == 0:
            return self.done >= self.count
        if not self.check:
            self.done += ch.n
            self.q.push_used(ch.id, self.zeros[:ch.n])
            self.q.flush()
            self.calls += self.q.call_prepare()
            return self.done >= self.count
        slots = ((ch.seg_addr[ch.seg_start] - self.base) // SLOT).astype(np.int64)
        seqs = self.s.seq_view[slots].astype(np.int64)
        if (seqs >= self.count).any() or self.seen[seqs].any() or len(np.unique(seqs)) != len(seqs):
            raise AccountingError(f"device: bad or repeated sequence numbers {seqs[:8]}")
        self.seen[seqs] = True
        self.done += ch.n
        ids = ch.id.copy()
        if not self.s.in_order:
            self.rng.shuffle(ids)  # SPLIT-D-16: completions in any order
        self.q.push_used(ids, np.zeros(ch.n, np.uint32))
        self.q.flush()
        self.calls += self.q.call_prepare()
        return self.done >= self.count

    def accounted(self):
        """Distinct sequence numbers seen (None unchecked: nothing was tracked)."""
        return int(self.seen.sum()) if self.check else None


def _impl(name):
    if name == "reference":
        from . import reference
        return reference
    from . import virtq
    return virtq


def run_one_process(fmt, size, in_order, count, burst=32, batch=True, impl="c", deadline=120.0,
                    check=True):
    """Driver and device alternating in this process. Returns a stats dict: ``returned`` and ``seen`` are the
    distinct buffers the driver got back and the device saw (None with check=False, which tracks nothing)."""
    s = Setup(fmt, size, in_order)
    try:
        drv = DriverSide(s, _impl(impl), count, burst, check=check)
        dev = DeviceSide(s, _impl(impl), count, burst, batch, check=check)
        t0 = time.perf_counter()
        while not drv.step():
            dev.step()
            if time.perf_counter() - t0 > deadline:
                raise AccountingError(f"stalled: {drv.done}/{count} returned after {deadline}s")
        dt = time.perf_counter() - t0
        if check and not (drv.returned.all() and dev.seen.all()):
            raise AccountingError("some buffers were never seen or never returned")
        return dict(buffers=count, returned=drv.accounted(), seen=dev.accounted(), seconds=dt, rate=count / dt,
                    kicks=drv.kicks, calls=dev.calls)
    finally:
        drv = dev = None
        s.close()


def _child(role, params, impl, count, burst, batch, deadline, cpu, check, conn, parent=None):
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        s = Setup.attach(**params)
        side = (DriverSide(s, _impl(impl), count, burst, check=check) if role == "driver"
                else DeviceSide(s, _impl(impl), count, burst, batch, check=check))
        conn.send("ready")
        conn.recv()  # start together
        t0 = time.perf_counter()
        steps = 0
        while not side.step():
            steps += 1
            if steps & 0xFFF == 0:   # every 4096 steps: the deadline, and whether the parent is still there
                if time.perf_counter() - t0 > deadline:
                    raise AccountingError(f"{role} stalled at {side.done}/{count} after {deadline}s")
                if parent is not None and os.getppid() != parent:
                    raise AccountingError(f"{role}: the parent process is gone")
        dt = time.perf_counter() - t0
        accounted = side.accounted()
        complete = side.done >= count if accounted is None else accounted == count
        conn.send(dict(ok=bool(complete), done=side.done, accounted=accounted, seconds=dt,
                       kicks=getattr(side, "kicks", 0), calls=getattr(side, "calls", 0)))
    except BaseException as e:  # report to the parent whatever happened
        conn.send(dict(ok=False, error=f"{type(e).__name__}: {e}"))


def run_two_processes(fmt, size, in_order, count, burst=32, batch=True, impl="c", deadline=120.0,
                      cpus=None, check=True):
    """A driver process and a device process over one shared region. Returns a stats dict (as
    run_one_process's: ``returned`` and ``seen`` counted by each process)."""
    ctx = mp.get_context("spawn")
    s = None
    procs, conns = [], []
    finished = False
    try:
        s = Setup(fmt, size, in_order)
        if cpus is None and len(os.sched_getaffinity(0)) >= 2:
            cpus = sorted(os.sched_getaffinity(0))[:2]
        for i, role in enumerate(("driver", "device")):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(role, s.params(), impl, count, burst, batch, deadline,
                                                 cpus[i] if cpus else None, check, child, os.getpid()))
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            if not c.poll(60):
                raise AccountingError("a child process did not start")
            msg = c.recv()
            if msg != "ready":
                raise AccountingError(f"child failed to start: {msg}")
        # both have it mapped: the name can go (the memory lives while mapped), so that not even a SIGKILL of
        # this process leaves the segment in /dev/shm
        s.region.unlink()
        for c in conns:
            c.send("go")
        results = [c.recv() if c.poll(deadline + 30) else dict(ok=False, error="did not finish")
                   for c in conns]
        finished = all(r.get("ok") for r in results)
        failed = [f"{role}: {r.get('error') or 'not every buffer accounted for'}"
                  for role, r in zip(("driver", "device"), results) if not r.get("ok")]
        if failed:
            raise AccountingError("; ".join(failed))
        drv, dev = results
        dt = max(drv["seconds"], dev["seconds"])
        return dict(buffers=count, returned=drv["accounted"], seen=dev["accounted"], seconds=dt, rate=count / dt,
                    kicks=drv["kicks"], calls=dev["calls"])
    finally:
        # Interrupted (Ctrl-C, or SIGTERM/SIGHUP turned into KeyboardInterrupt by the caller) or failed: the
        # children may be busy-polling for up to ``deadline`` s, so they are stopped now rather than waited for.
        # Signals are held back meanwhile, so that a second one cannot leave the children or the segment behind.
        with held_back():
            try:
                for p in procs:
                    if not finished and p.is_alive():
                        p.terminate()
                for p in procs:
                    p.join(5 if finished else 2)
                    if p.is_alive():
                        p.kill()
                        p.join(5)
            finally:
                if s is not None:
                    s.close()
