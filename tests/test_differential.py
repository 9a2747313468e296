"""Differential test: the C path and the pure-Python reference model, driven by the same random operation
sequences, must leave byte-identical ring memory after every step and return the same results.

This finds divergence between the two implementations of the contract of rings/README.md (split and packed,
normal and in-order, with and without EVENT_IDX and INDIRECT_DESC, batched and per-buffer in-order
completions), not conformance: two implementations can agree and both be wrong. The spec is checked, by
checklist ID, in tests/conformance/.
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rings import reference, virtq
from rings.layout import (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC,
                          VIRTIO_F_RING_PACKED, QueueLayout, bit)
from rings.shm import MemoryTable

BASE = 0x40000
MEMSIZE = 0x40000
INDIRECT = BASE + 0x10000
DATA = BASE + 0x30000


class Side:
    def __init__(self, impl, layout, features, batch):
        self.buf = bytearray(MEMSIZE)
        self.mem = MemoryTable([(BASE, MEMSIZE, self.buf)])
        indirect = (INDIRECT, min(4, layout.size)) if layout.size >= 2 else None
        self.drv = impl.DriverQueue(self.mem, layout, features, indirect=indirect)
        self.dev = impl.DeviceQueue(self.mem, layout, features, in_order_batch=batch)


class RingsMachine(RuleBasedStateMachine):
    @initialize(fmt=st.sampled_from(["split", "packed"]), size_exp=st.integers(0, 5),
                packed_size=st.sampled_from([1, 3, 5, 7, 13, 32]), in_order=st.booleans(),
                event_idx=st.booleans(), indirect=st.booleans(), batch=st.booleans())
    def setup(self, fmt, size_exp, packed_size, in_order, event_idx, indirect, batch):
        size = packed_size if fmt == "packed" else 1 << size_exp
        self.layout = QueueLayout.contiguous(fmt, size, BASE)
        features = ((bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0)
                    | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
                    | (bit(VIRTIO_F_EVENT_IDX) if event_idx else 0)
                    | (bit(VIRTIO_F_INDIRECT_DESC) if indirect else 0))
        self.size, self.in_order = size, in_order
        self.c = Side(virtq, self.layout, features, batch)
        self.ref = Side(reference, self.layout, features, batch)
        self.token = 0
        self.polled = []   # (id, wlen) polled by the device and not yet completed, in poll order

    def both(self, fn):
        a, b = fn(self.c), fn(self.ref)
        return a, b

    @rule(data=st.data(), nbufs=st.integers(1, 6))
    def add(self, data, nbufs):
        nread, nwrite, addrs, lens = [], [], [], []
        for _ in range(nbufs):
            r = data.draw(st.integers(0, 3))
            w = data.draw(st.integers(0 if r else 1, 3))
            nread.append(r)
            nwrite.append(w)
            for _ in range(r + w):
                addrs.append(DATA + data.draw(st.integers(0, 255)) * 16)
                lens.append(data.draw(st.integers(0, 2000)))
        if max(r + w for r, w in zip(nread, nwrite)) > self.size:
            return
        tokens = list(range(self.token, self.token + nbufs))
        self.token += nbufs
        a, b = self.both(lambda s: s.drv.add(addrs, lens, nread, nwrite, tokens))
        assert a == b

    @rule(data=st.data())
    def add_simple(self, data):
        n = data.draw(st.integers(1, 8))
        writable = data.draw(st.booleans())
        addrs = [DATA + 64 * i for i in range(n)]
        lens = [data.draw(st.integers(1, 1500)) for _ in range(n)]
        tokens = list(range(self.token, self.token + n))
        self.token += n
        a, b = self.both(lambda s: s.drv.add_simple(addrs, lens, tokens, writable=writable))
        assert a == b

    @rule(data=st.data())
    def fill(self, data):
        """Chains of mixed lengths (direct, indirect, the whole ring) until the ring refuses one: the free list
        runs empty, and packed then has fewer descriptors than ids free."""
        for _ in range(2 * self.size + 1):
            nseg = data.draw(st.sampled_from(sorted({k for k in (1, 2, 5, self.size) if k <= self.size})))
            nread = data.draw(st.integers(0, nseg - 1))
            tokens = [self.token]
            self.token += 1
            a, b = self.both(lambda s: s.drv.add([DATA] * nseg, [64] * nseg, [nread], [nseg - nread], tokens))
            assert a == b
            if not a:
                return

    @precondition(lambda self: not self.polled)
    @rule(data=st.data())
    def drain(self, data):
        """Everything published comes back (any order without IN_ORDER) and is reclaimed: the ring empties."""
        self.publish()
        self.poll(4 * self.size)
        if self.polled:
            chosen = self.polled if self.in_order else data.draw(st.permutations(self.polled))
            self.both(lambda s: s.dev.push_used([i for i, _ in chosen], [0] * len(chosen)))
            self.polled = []
        self.flush()
        self.reclaim(4 * self.size)

    @rule()
    def publish(self):
        self.both(lambda s: s.drv.publish())

    @rule()
    def kick_prepare(self):
        a, b = self.both(lambda s: s.drv.kick_prepare())
        assert a == b

    @rule(on=st.booleans())
    def enable_calls(self, on):
        self.both(lambda s: s.drv.enable_calls(on))

    @rule(on=st.booleans())
    def enable_kicks(self, on):
        self.both(lambda s: s.dev.enable_kicks(on))

    @rule(limit=st.integers(1, 40))
    def poll(self, limit):
        a, b = self.both(lambda s: s.dev.poll(limit))
        assert a.n == b.n
        for name in ("id", "ndesc", "nseg", "rlen", "wlen"):
            assert list(getattr(a, name)) == list(getattr(b, name)), name
        for i in range(a.n):
            assert a.segments(i) == b.segments(i)
        self.polled += [(int(i), int(w)) for i, w in zip(a.id, a.wlen)]

    @precondition(lambda self: self.polled)
    @rule(data=st.data())
    def complete(self, data):
        k = data.draw(st.integers(1, len(self.polled)))
        if self.in_order:
            chosen = self.polled[:k]
        else:
            chosen = data.draw(st.permutations(self.polled))[:k]
        lens = [data.draw(st.sampled_from([w, w // 2, 0])) for _, w in chosen]
        ids = [i for i, _ in chosen]
        self.both(lambda s: s.dev.push_used(ids, lens))
        self.polled = [p for p in self.polled if p not in chosen]

    @rule()
    def flush(self):
        self.both(lambda s: s.dev.flush())

    @rule()
    def call_prepare(self):
        a, b = self.both(lambda s: s.dev.call_prepare())
        assert a == b

    @rule(limit=st.integers(1, 40))
    def reclaim(self, limit):
        (ta, la), (tb, lb) = self.both(lambda s: s.drv.reclaim(limit))
        assert list(ta) == list(tb)
        assert list(la) == list(lb)

    @invariant()
    def same_memory(self):
        if hasattr(self, "c"):
            assert self.c.buf == self.ref.buf, first_difference(self.c.buf, self.ref.buf)

    @invariant()
    def free_lists_hold_what_is_free(self):
        """Normal variants: the free list, walked from its head, holds each free descriptor (split) or id (packed)
        once, ends at free_tail, and shares none with a buffer in flight (split: its chain's links)."""
        if not hasattr(self, "c") or self.in_order:
            return
        for side in (self.c, self.ref):
            q = side.drv
            n, packed = self.size, self.layout.packed
            inflight = [i for i in range(n) if q.id_inflight[i]]
            owned = set(inflight) if packed else set()
            for h in ([] if packed else inflight):
                x = h
                for j in range(int(q.id_ndesc[h])):
                    owned.add(x)
                    x = int(q.free_next[x]) if j + 1 < q.id_ndesc[h] else x
            c = q.c if hasattr(q, "c") else q
            count = n - len(inflight) if packed else int(c.num_free)
            assert len(owned) == (len(inflight) if packed else n - count), "chains overlap"
            walk, x = [], int(c.free_head)
            for k in range(count):
                walk.append(x)
                if k + 1 < count:
                    x = int(q.free_next[x])
            assert len(set(walk)) == len(walk) and set(walk).isdisjoint(owned), (walk, sorted(owned))
            assert all(0 <= x < n for x in walk), walk
            assert not walk or walk[-1] == int(c.free_tail), (walk, int(c.free_tail))

    @invariant()
    def same_state(self):
        if hasattr(self, "c"):
            for half in ("drv", "dev"):
                a = getattr(self.c, half).snapshot()
                b = getattr(self.ref, half).snapshot()
                assert a == b, half


def first_difference(a, b):
    i = next(i for i in range(len(a)) if a[i] != b[i])
    return f"first difference at guest address {BASE + i:#x}: C {a[i]:#x} vs reference {b[i]:#x}"


RingsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_c_matches_reference = RingsMachine.TestCase
