"""Snapshots of one queue half: a JSON-able dict, built the same way for both implementations, and a
text table.

``driver_snapshot(q)`` / ``device_snapshot(q)`` read the queue's private counters through a small
interface and decode the ring memory itself. ``rings.reference`` and ``rings.virtq`` both provide it:

* ``q.layout`` (QueueLayout), ``q.features`` (int), ``q.in_order`` (bool), ``q.broken`` (None or RingError)
* ``q.mem``: the MemoryTable, or an object holding it as ``.table``
* ``q.state()``: a dict of ints with at least
  driver: next_avail, avail_wrap, last_used, used_wrap, num_free, inflight, kick_added;
  device: last_avail, avail_wrap, used_idx, used_wrap, call_added, inflight, shadow_count
* ``q.id_inflight`` (per buffer id, non-zero while the buffer is in flight; on the device: polled, completed
  or not, and not yet flushed), ``q.id_ndesc`` (ring descriptors of that buffer)
* driver only: ``q.free_next`` (split normal variant: a chain's descriptors are linked head to tail there)

The dict (keys in this order)::

    format        'split' | 'packed'
    size          queue size
    side          'driver' | 'device'
    variant       'normal' | 'in_order'
    features      negotiated feature mask (int)
    feature_names layout.feature_names(features)
    indices       split driver:  next_avail, last_used, avail.idx, used.idx  (the last two read from memory)
                  packed driver: next_avail, avail_wrap, last_used, used_wrap
                  split device:  last_avail, used_idx (private shadow), avail.idx, used.idx (memory)
                  packed device: last_avail, avail_wrap, used_idx, used_wrap
    counts        driver: num_free (descriptors), inflight (buffers)
                  device: inflight (buffers polled and not flushed), shadow (used entries not flushed)
    notify        split:  avail.flags, used.flags, used_event, avail_event (memory), kick_added | call_added
                  packed: driver_event, device_event as {off, wrap, flags, mode}, kick_added | call_added;
                          mode is ENABLE, DISABLE, DESC or RESERVED
    broken        None | {'error': class name, 'message': str}
    descriptors   one dict per ring slot: index, addr, len, flags, flag_names (layout.desc_flag_names),
                  next (split) | id (packed), owner ('driver' | 'device')

Owner. Split: a descriptor is the device's iff it is a ring descriptor of a chain that is in flight (driver:
added and not reclaimed; device: polled and not flushed, or made available and not yet polled).
Packed: from the AVAIL/USED bits and the wrap counters. Driver: the in-flight slots are the
``size - num_free`` slots from ``last_used``; one of them is the device's unless its bits say used in
the lap the driver wrote it.
Device: the slots from ``used_idx`` to ``last_avail`` (polled, no used descriptor written yet), then the
consecutive slots from ``last_avail`` that are available in the expected lap.
"""
import struct

from .layout import (RING_EVENT_FLAGS_DESC, RING_EVENT_FLAGS_DISABLE, RING_EVENT_FLAGS_ENABLE,
                     VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, area_sizes, desc_flag_names,
                     feature_names)

_DESC = struct.Struct("<QIHH")  # split: addr len flags next; packed: addr len id flags
_U16 = struct.Struct("<H")
_EVENT_MODES = {RING_EVENT_FLAGS_ENABLE: "ENABLE", RING_EVENT_FLAGS_DISABLE: "DISABLE",
                RING_EVENT_FLAGS_DESC: "DESC"}


def driver_snapshot(q):
    st = q.state()
    snap, ring = _common(q, "driver")
    n = q.layout.size
    if q.layout.packed:
        snap["indices"] = {k: st[k] for k in ("next_avail", "avail_wrap", "last_used", "used_wrap")}
        inflight = [(st["last_used"] + k) % n for k in range(n - st["num_free"])]
        owned = {i for i in inflight if not _used_in_lap(ring.desc_flags(i), _lap(i, st))}
    else:
        snap["indices"] = {"next_avail": st["next_avail"], "last_used": st["last_used"],
                           "avail.idx": ring.u16(ring.avail, 2), "used.idx": ring.u16(ring.used, 2)}
        owned = set()
        for head in range(n):
            if q.id_inflight[head]:
                owned.update(_driver_chain_split(q, head))
    snap["counts"] = {"num_free": st["num_free"], "inflight": st["inflight"]}
    snap["notify"] = ring.notify("kick_added", st["kick_added"])
    return _finish(snap, q, ring, owned)


def device_snapshot(q):
    st = q.state()
    snap, ring = _common(q, "device")
    n = q.layout.size
    if q.layout.packed:
        snap["indices"] = {k: st[k] for k in ("last_avail", "avail_wrap", "used_idx", "used_wrap")}
        polled = (st["last_avail"] - st["used_idx"]) % n
        if polled == 0 and st["avail_wrap"] != st["used_wrap"]:
            polled = n
        owned = {(st["used_idx"] + k) % n for k in range(polled)}
        slot, wrap = st["last_avail"], st["avail_wrap"]
        for _ in range(n - polled):  # made available, not yet polled
            flags = ring.desc_flags(slot)
            if bool(flags & VIRTQ_DESC_F_AVAIL) != wrap or bool(flags & VIRTQ_DESC_F_USED) == wrap:
                break
            owned.add(slot)
            slot, wrap = (0, wrap ^ 1) if slot == n - 1 else (slot + 1, wrap)
    else:
        avail_idx = ring.u16(ring.avail, 2)
        snap["indices"] = {"last_avail": st["last_avail"], "used_idx": st["used_idx"],
                           "avail.idx": avail_idx, "used.idx": ring.u16(ring.used, 2)}
        heads = [h for h in range(n) if q.id_inflight[h]]
        not_polled = min((avail_idx - st["last_avail"]) & 0xFFFF, n)
        heads += [ring.u16(ring.avail, 4 + 2 * ((st["last_avail"] + k) % n)) for k in range(not_polled)]
        owned = set()
        for head in heads:
            owned.update(ring.chain_split(head))
    snap["counts"] = {"inflight": st["inflight"], "shadow": st["shadow_count"]}
    snap["notify"] = ring.notify("call_added", st["call_added"])
    return _finish(snap, q, ring, owned)


def format_snapshot(d):
    """Render a snapshot dict as text: header lines, then one row per descriptor."""
    feats = "|".join(d["feature_names"]) or "-"
    lines = [f"{d['format']} {d['side']} queue, size {d['size']}, {d['variant']}, "
             f"features {d['features']:#x} ({feats})",
             "indices: " + _pairs(d["indices"]),
             "counts:  " + _pairs(d["counts"]),
             "notify:  " + _pairs(d["notify"])]
    if d["broken"]:
        lines.append(f"BROKEN:  {d['broken']['error']}: {d['broken']['message']}")
    link = "next" if d["format"] == "split" else "id"
    lines.append(f"{'slot':>5}  {'owner':6}  {'addr':>18}  {'len':>10}  {'flags':>6}  {link:>5}  flag names")
    for r in d["descriptors"]:
        lines.append(f"{r['index']:5d}  {r['owner']:6}  {r['addr']:#018x}  {r['len']:10d}  "
                     f"{r['flags']:#06x}  {r[link]:5d}  {r['flag_names']}")
    return "\n".join(lines)


def _pairs(d):
    return " ".join(f"{k}=({_pairs(v)})" if isinstance(v, dict) else f"{k}={v}" for k, v in d.items())


class _Ring:
    """Read-only access to the ring areas of a queue."""

    def __init__(self, q):
        mem = getattr(q.mem, "table", q.mem)
        lay = q.layout
        dsz, drv, dev = area_sizes(lay.fmt, lay.size)
        self.size = lay.size
        self.packed = lay.packed
        self.desc = mem.view(lay.desc, dsz)
        self.avail = mem.view(lay.driver, drv)  # packed: driver event suppression
        self.used = mem.view(lay.device, dev)   # packed: device event suppression

    @staticmethod
    def u16(view, off):
        return _U16.unpack_from(view, off)[0]

    def desc_flags(self, i):
        return self.u16(self.desc, 16 * i + 14)

    def chain_split(self, head):
        """Ring descriptors of the chain at head, following NEXT while it stays in range (no checks)."""
        i, seen = head, []
        while i < self.size and len(seen) < self.size:
            seen.append(i)
            _, _, flags, nxt = _DESC.unpack_from(self.desc, 16 * i)
            if not flags & VIRTQ_DESC_F_NEXT:
                break
            i = nxt
        return seen

    def notify(self, added_name, added):
        n = self.size
        if self.packed:
            state = {"driver_event": _event(self.avail), "device_event": _event(self.used)}
        else:
            state = {"avail.flags": self.u16(self.avail, 0), "used.flags": self.u16(self.used, 0),
                     "used_event": self.u16(self.avail, 4 + 2 * n),
                     "avail_event": self.u16(self.used, 4 + 8 * n)}
        state[added_name] = added
        return state


def _event(view):
    off_wrap, flags = struct.unpack_from("<HH", view, 0)
    return {"off": off_wrap & 0x7FFF, "wrap": off_wrap >> 15, "flags": flags,
            "mode": _EVENT_MODES.get(flags, "RESERVED")}


def _lap(slot, st):
    """The driver wrap counter of the last lap in which the driver made this slot available."""
    return st["avail_wrap"] if slot < st["next_avail"] else st["avail_wrap"] ^ 1


def _used_in_lap(flags, wrap):
    return bool(flags & VIRTQ_DESC_F_AVAIL) == wrap and bool(flags & VIRTQ_DESC_F_USED) == wrap


def _driver_chain_split(q, head):
    """The driver's own record of a chain: ring order (IN_ORDER) or its links in the free list."""
    n, k = q.layout.size, int(q.id_ndesc[head])
    if q.in_order:
        return [(head + j) % n for j in range(k)]
    chain = [head]
    for _ in range(k - 1):
        chain.append(int(q.free_next[chain[-1]]))
    return chain


def _common(q, side):
    lay = q.layout
    return {"format": lay.fmt, "size": lay.size, "side": side,
            "variant": "in_order" if q.in_order else "normal",
            "features": int(q.features), "feature_names": feature_names(int(q.features))}, _Ring(q)


def _finish(snap, q, ring, owned):
    b = q.broken
    snap["broken"] = None if b is None else {"error": type(b).__name__, "message": str(b)}
    link = "id" if ring.packed else "next"
    rows = []
    for i in range(ring.size):
        addr, length, a, b = _DESC.unpack_from(ring.desc, 16 * i)
        flags, other = (b, a) if ring.packed else (a, b)
        rows.append({"index": i, "addr": addr, "len": length, "flags": flags,
                     "flag_names": desc_flag_names(flags), link: other,
                     "owner": "device" if i in owned else "driver"})
    snap["descriptors"] = rows
    return snap
