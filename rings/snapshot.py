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
    chains        the buffers in flight (and, on the device, made available and not yet polled), one dict
                  each: head (first slot), id (buffer id: split head, packed id of the last descriptor),
                  slots (ring descriptors, in chain order), owner (that of the head slot), state (words:
                  'added, not published', 'available', 'used, not reclaimed', 'available, not polled',
                  'polled', 'completed, not flushed', ...)
    descriptors   one dict per ring slot: index, addr, len, flags, flag_names (layout.desc_flag_names),
                  next (split) | id (packed), owner ('driver' | 'device'; memory snapshots: also 'unknown')

``memory_snapshot(mem, layout, features)`` decodes ring memory alone (no private state: a region attached
by name, or a peer's memory). Same keys with side 'memory', plus ``inferred`` (values deduced from memory,
packed: the driver's published next_avail and avail_wrap from the AVAIL bits) and ``unknown`` (what only
the queue's owner knows). Split: indices avail.idx and used.idx, counts.inflight = avail.idx - used.idx
(made available, not yet used); chains are the heads in flight (the last ``inflight`` avail positions with
IN_ORDER; without it a guess from the used entries, see _split_inflight_guess, and owner is 'unknown').
Packed: owner from the flag bits only (AVAIL != USED: available, the device's), except that with IN_ORDER
the slots a used descriptor covers (up to the run ending in its id) are the driver's; chains are runs of
NEXT from the oldest written slot (runs starting at a never-written, all-zero slot are left out).

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
                     VIRTIO_F_IN_ORDER, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, area_sizes,
                     desc_flag_names, feature_names)

_DESC = struct.Struct("<QIHH")  # split: addr len flags next; packed: addr len id flags
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
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
        chains = _driver_chains_packed(q, ring, st)
    else:
        avail_idx, used_idx = ring.u16(ring.avail, 2), ring.u16(ring.used, 2)
        snap["indices"] = {"next_avail": st["next_avail"], "last_used": st["last_used"],
                           "avail.idx": avail_idx, "used.idx": used_idx}
        owned, chains = set(), []
        for head in range(n):
            if q.id_inflight[head]:
                slots = _driver_chain_split(q, head)
                owned.update(slots)
                chains.append((head, head, slots, None))
        chains = _driver_states_split(q, ring, st, chains, avail_idx, used_idx)
    snap["counts"] = {"num_free": st["num_free"], "inflight": st["inflight"]}
    snap["notify"] = ring.notify("kick_added", st["kick_added"])
    return _finish(snap, q, ring, owned, chains)


def device_snapshot(q):
    st = q.state()
    snap, ring = _common(q, "device")
    n = q.layout.size
    chains = []
    if q.layout.packed:
        snap["indices"] = {k: st[k] for k in ("last_avail", "avail_wrap", "used_idx", "used_wrap")}
        polled = (st["last_avail"] - st["used_idx"]) % n
        if polled == 0 and st["avail_wrap"] != st["used_wrap"]:
            polled = n
        owned = {(st["used_idx"] + k) % n for k in range(polled)}
        for slots in ring.next_runs(st["used_idx"], polled):
            id = ring.desc_id(slots[-1])
            state = _DEVICE_STATES.get(int(q.id_inflight[id]) if id < n else -1, "polled, used elsewhere")
            chains.append((slots[0], id, slots, state))
        slot, wrap = st["last_avail"], st["avail_wrap"]
        for _ in range(n - polled):  # made available, not yet polled
            flags = ring.desc_flags(slot)
            if bool(flags & VIRTQ_DESC_F_AVAIL) != wrap or bool(flags & VIRTQ_DESC_F_USED) == wrap:
                break
            owned.add(slot)
            slot, wrap = (0, wrap ^ 1) if slot == n - 1 else (slot + 1, wrap)
        fresh = len(owned) - polled
        for slots in ring.next_runs(st["last_avail"], fresh):
            chains.append((slots[0], ring.desc_id(slots[-1]), slots, "available, not polled"))
    else:
        avail_idx = ring.u16(ring.avail, 2)
        snap["indices"] = {"last_avail": st["last_avail"], "used_idx": st["used_idx"],
                           "avail.idx": avail_idx, "used.idx": ring.u16(ring.used, 2)}
        heads = [(h, _DEVICE_STATES.get(int(q.id_inflight[h]), "polled")) for h in range(n) if q.id_inflight[h]]
        not_polled = min((avail_idx - st["last_avail"]) & 0xFFFF, n)
        heads += [(ring.u16(ring.avail, 4 + 2 * ((st["last_avail"] + k) % n)), "available, not polled")
                  for k in range(not_polled)]
        owned = set()
        for head, state in heads:
            slots = ring.chain_split(head)
            owned.update(slots)
            chains.append((head, head, slots, state))
    snap["counts"] = {"inflight": st["inflight"], "shadow": st["shadow_count"]}
    snap["notify"] = ring.notify("call_added", st["call_added"])
    return _finish(snap, q, ring, owned, chains)


def memory_snapshot(mem, layout, features):
    """Decode ring memory without the queue's private state (see the module docstring)."""
    q = _MemoryOnly(mem, layout, features)
    snap, ring = _common(q, "memory")
    n = layout.size
    inferred, chains = {}, []
    if layout.packed:
        bits = [bool(ring.desc_flags(i) & VIRTQ_DESC_F_AVAIL) for i in range(n)]
        k = next((i for i in range(1, n) if bits[i] != bits[0]), n)
        if all(b == bits[0] for b in bits[:k]) and all(b != bits[0] for b in bits[k:]):
            next_avail, wrap = (0, int(not bits[0])) if k == n else (k, int(bits[0]))
            inferred = {"next_avail": next_avail, "avail_wrap": wrap}
        else:
            next_avail, wrap = 0, None  # AVAIL bits in more than two runs: no lap can be inferred
            inferred = {"next_avail": None, "avail_wrap": None}
        st = {"next_avail": next_avail, "avail_wrap": wrap}
        owned = set()
        for i in range(n):
            flags = ring.desc_flags(i)
            if bool(flags & VIRTQ_DESC_F_AVAIL) != bool(flags & VIRTQ_DESC_F_USED):
                owned.add(i)
        runs = [r for r in ring.next_runs(next_avail, n) if any(ring.desc[16 * r[0]:16 * r[0] + 16])]
        kinds = []  # per run: 'avail' (in the slot's lap), 'used', 'old' (available flags of an earlier lap)
        for slots in runs:
            flags = ring.desc_flags(slots[0])
            a, u = bool(flags & VIRTQ_DESC_F_AVAIL), bool(flags & VIRTQ_DESC_F_USED)
            lap = None if wrap is None else _lap(slots[0], st)
            kinds.append("used" if a == u else "avail" if lap is None or a == lap else "old")
        covered = _covered_by_used(ring, runs, kinds, q.in_order)
        available = 0
        for k, (slots, kind) in enumerate(zip(runs, kinds)):
            flags = ring.desc_flags(slots[0])
            if k in covered:
                state = f"used: covered by the used descriptor at slot {covered[k]}"
                owned.difference_update(slots)
            elif kind == "used":
                state = "used" if flags & VIRTQ_DESC_F_AVAIL else "used, or never made available"
            elif kind == "avail":
                state = "available"
                available += 1
            else:
                state = "available flags from an earlier lap (tail of a used buffer, or skipped by a batch)"
            chains.append((slots[0], ring.desc_id(slots[-1]), slots, state))
        snap["indices"] = {"next_avail": inferred["next_avail"], "avail_wrap": inferred["avail_wrap"],
                           "last_used": None, "used_wrap": None}
        snap["counts"] = {"available_descs": len(owned), "available_chains": available}
        unknown = ["driver: last_used, used_wrap, num_free, kick_added, unpublished head",
                   "device: last_avail, avail_wrap, used_idx, used_wrap, call_added, shadow used entries",
                   "owner is from the flag bits only (the tails of a used multi-descriptor buffer keep their "
                   "available flags)" + ("; with IN_ORDER the slots a used descriptor covers are read from "
                                         "the buffer ids" if q.in_order else "")]
    else:
        avail_idx, used_idx = ring.u16(ring.avail, 2), ring.u16(ring.used, 2)
        pending = (avail_idx - used_idx) & 0xFFFF
        snap["indices"] = {"avail.idx": avail_idx, "used.idx": used_idx}
        snap["counts"] = {"inflight": pending}
        owned = set()
        exact = q.in_order
        if exact:  # in order: the buffers in flight are the last `pending` made available
            found = [(used_idx + k) & 0xFFFF for k in range(min(pending, n))]
        else:
            found = _split_inflight_guess(ring, avail_idx, used_idx, pending)
        for pos in found:
            head = ring.u16(ring.avail, 4 + 2 * (pos % n))
            slots = ring.chain_split(head) if head < n else []
            if exact:
                owned.update(slots)
            chains.append((head, head, slots, f"in flight: made available at avail position {pos}" if exact
                           else f"probably in flight: made available at avail position {pos}, no used entry "
                                f"matches it"))
        unknown = ["driver: next_avail (unpublished buffers), last_used, num_free, kick_added",
                   "device: last_avail (polled or not), used_idx shadow, call_added, shadow used entries"]
        if not exact:
            unknown.append("which descriptors are in flight (without IN_ORDER): owner is 'unknown'")
    snap["notify"] = ring.notify(None, None)
    snap = _finish(snap, q, ring, owned, chains)
    if not layout.packed and not q.in_order:
        for row in snap["descriptors"]:
            row["owner"] = "unknown"
        for c in snap["chains"]:
            c["owner"] = "unknown"
    snap["inferred"] = inferred
    snap["unknown"] = unknown
    return snap


def _covered_by_used(ring, runs, kinds, in_order):
    """Packed, memory only, IN_ORDER: the runs that still show available flags but that a used descriptor
    covers ({run index: slot of the used descriptor}). A used descriptor with id X covers the following runs
    up to the first one whose last descriptor has id X (one used descriptor per batch, and the tails of
    multi-descriptor buffers). Without IN_ORDER drivers reuse ids at once, so nothing is inferred."""
    covered = {}
    if not in_order:
        return covered
    for i, kind in enumerate(kinds):
        if kind != "used":
            continue
        x, j = ring.desc_id(runs[i][0]), i + 1
        ahead = []
        while j < len(runs) and kinds[j] == "avail":
            ahead.append(j)
            if ring.desc_id(runs[j][-1]) == x:
                break
            j += 1
        else:
            ahead = []  # no run ending in id X follows: cover nothing
        for k in ahead:
            covered[k] = runs[i][0]
    return covered


def _split_inflight_guess(ring, avail_idx, used_idx, pending):
    """Split without IN_ORDER, from memory alone: the avail positions still in the ring (the last L) whose
    head no used entry matches, taking the last L - pending used entries as the completions of that window
    (each cancels the oldest availability of its id). Exact unless buffers made available before the
    window completed after buffers inside it."""
    n = ring.size
    window = min(n, avail_idx) if avail_idx else 0
    done = window - pending
    if pending > window or done > n:
        return []
    left = {}
    for k in range(done):
        id = ring.u32(ring.used, 4 + 8 * ((used_idx - 1 - k) % n))
        left[id] = left.get(id, 0) + 1
    found = []
    for k in range(window):
        pos = (avail_idx - window + k) & 0xFFFF
        head = ring.u16(ring.avail, 4 + 2 * (pos % n))
        if left.get(head):
            left[head] -= 1
        else:
            found.append(pos)
    return found


_DEVICE_STATES = {1: "polled", 2: "completed, not flushed", 0: "polled, used elsewhere"}


class _MemoryOnly:
    """The bits of the queue interface a memory-only snapshot needs."""

    def __init__(self, mem, layout, features):
        self.mem, self.layout, self.features = mem, layout, int(features)
        self.in_order = bool(self.features >> VIRTIO_F_IN_ORDER & 1)
        self.broken = None


def _driver_states_split(q, ring, st, chains, avail_idx, used_idx):
    """Split driver: which in-flight chains are unpublished, available, or used and not reclaimed."""
    n = q.layout.size
    unpublished = {ring.u16(ring.avail, 4 + 2 * ((avail_idx + k) % n))
                   for k in range((st["next_avail"] - avail_idx) & 0xFFFF) if k < n}
    pending = (used_idx - st["last_used"]) & 0xFFFF
    heads = {head for head, _, _, _ in chains}
    used, bad = set(), []
    if 0 < pending <= n:
        if q.in_order:  # the oldest `pending` buffers in flight, in avail order
            inflight = st["inflight"]
            used = {ring.u16(ring.avail, 4 + 2 * ((st["next_avail"] - inflight + k) % n))
                    for k in range(min(pending, inflight))}
            entries = [st["last_used"]]  # the entry the driver reads next (later ones may be skipped)
        else:
            entries = [(st["last_used"] + k) & 0xFFFF for k in range(pending)]
            used = {ring.u32(ring.used, 4 + 8 * (pos % n)) for pos in entries}
        for pos in entries:
            id = ring.u32(ring.used, 4 + 8 * (pos % n))
            if id not in heads:
                bad.append((id, pos))
    out = []
    for head, id, slots, _ in chains:
        state = ("used, not reclaimed" if head in used else
                 "added, not published" if head in unpublished else "available")
        out.append((head, id, slots, state))
    for id, pos in bad:
        out.append((id, id, [], f"used, id not in flight (used.ring[{pos % n}], used position {pos})"))
    return out


def _driver_chains_packed(q, ring, st):
    """Packed driver: walk the in-flight slots from last_used the way reclaim would."""
    n = q.layout.size
    chains, slot, left, unpublished = [], st["last_used"], n - st["num_free"], False
    used_ids = set()
    while left > 0:
        flags, id = ring.desc_flags(slot), ring.desc_id(slot)
        if not unpublished and _used_in_lap(flags, _lap(slot, st)):
            if id < n and q.id_inflight[id]:
                k, h = 0, slot
                if q.in_order:  # a used entry covers the buffers from this slot up to id
                    for _ in range(n):
                        k += max(int(q.id_ndesc[h]), 1)
                        if h == id or k >= left:
                            break
                        h = (h + int(q.id_ndesc[h])) % n
                else:
                    k = max(int(q.id_ndesc[id]), 1)
                state = "used, not reclaimed"
                used_ids.add(id)
            else:
                k, state = 1, "used, id not in flight"
            k = min(k, left)
            slots = [(slot + j) % n for j in range(k)]
        else:
            if not (bool(flags & VIRTQ_DESC_F_AVAIL) == _lap(slot, st)
                    and bool(flags & VIRTQ_DESC_F_USED) != _lap(slot, st)):
                unpublished = True  # the kept head: nothing after it is visible to the device
            slots = next(iter(ring.next_runs(slot, left)))
            id = ring.desc_id(slots[-1])
            state = "added, not published" if unpublished else "available"
            if id >= n or not q.id_inflight[id] or id in used_ids:
                state = f"{state}: stale slot, buffer {id} is not in flight or already used"
        chains.append((slots[0], id, slots, state))
        left -= len(slots)
        slot = (slot + len(slots)) % n
    return chains


def format_snapshot(d):
    """Render a snapshot dict as text: header lines, the chains, then one row per descriptor."""
    feats = "|".join(d["feature_names"]) or "-"
    lines = [f"{d['format']} {d['side']} queue, size {d['size']}, {d['variant']}, "
             f"features {d['features']:#x} ({feats})",
             "indices: " + _pairs(d["indices"]),
             "counts:  " + _pairs(d["counts"]),
             "notify:  " + _pairs(d["notify"])]
    if d.get("inferred"):
        lines.append("inferred from memory: " + _pairs(d["inferred"]))
    for u in d.get("unknown", ()):
        lines.append(f"unknown: {u}")
    if d["broken"]:
        lines.append(f"BROKEN:  {d['broken']['error']}: {d['broken']['message']}")
    chains = d.get("chains", [])
    lines.append(f"chains: {len(chains)}" + (" (head id owner: slots, state)" if chains else ""))
    for c in chains:
        lines.append(f"  {c['head']:5d} {c['id']:5d} {c['owner']:7} {_slots(c['slots'])}: {c['state']}")
    link = "next" if d["format"] == "split" else "id"
    lines.append(f"{'slot':>5}  {'owner':6}  {'addr':>18}  {'len':>10}  {'flags':>6}  {link:>5}  flag names")
    for r in d["descriptors"]:
        lines.append(f"{r['index']:5d}  {r['owner']:6}  {r['addr']:#018x}  {r['len']:10d}  "
                     f"{r['flags']:#06x}  {r[link]:5d}  {r['flag_names']}")
    return "\n".join(lines)


def _slots(slots):
    if len(slots) > 8:
        return "->".join(map(str, slots[:4])) + f"->...({len(slots) - 6} more)->" + "->".join(map(str, slots[-2:]))
    return "->".join(map(str, slots)) or "(none: head out of range)"


def _pairs(d):
    return " ".join(f"{k}=({_pairs(v)})" if isinstance(v, dict) else f"{k}={'?' if v is None else v}"
                    for k, v in d.items())


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

    @staticmethod
    def u32(view, off):
        return _U32.unpack_from(view, off)[0]

    def desc_flags(self, i):
        return self.u16(self.desc, 16 * i + 14)

    def desc_id(self, i):
        """Packed: the buffer id field of slot i."""
        return self.u16(self.desc, 16 * i + 12)

    def next_runs(self, start, count):
        """Packed: consecutive slots from start, cut into runs that end at a descriptor without NEXT
        (the last run may be cut short at count)."""
        run, slot = [], start
        for _ in range(count):
            run.append(slot)
            if not self.desc_flags(slot) & VIRTQ_DESC_F_NEXT:
                yield run
                run = []
            slot = (slot + 1) % self.size
        if run:
            yield run

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
        if added_name:
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


def _finish(snap, q, ring, owned, chains):
    b = q.broken
    snap["broken"] = None if b is None else {"error": type(b).__name__, "message": str(b)}
    snap["chains"] = [{"head": head, "id": id, "slots": slots, "state": state,
                       "owner": "device" if head in owned else "driver"}
                      for head, id, slots, state in chains]
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
