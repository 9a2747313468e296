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
                  slots (ring descriptors, in chain order), owner, state (words:
                  'added, not published', 'available', 'used, not reclaimed', 'available, not polled',
                  'polled', 'completed, not flushed', ...)
    descriptors   one dict per ring slot: index, addr, len, flags, flag_names (layout.desc_flag_names),
                  next (split) | id (packed), owner

Owner: one vocabulary for both formats and every side, from the spec's rule that the driver makes a buffer
available and the device gives it back (§2.7.13/§2.7.14 split; §2.8.1 and §2.8.6-§2.8.8 packed, where the
flags decide):

    device   made available (split: avail.idx published past it; packed: its list's head flags say available
             in its lap) and not yet given back (split: used.idx not yet past it; packed: the device has
             neither written a used descriptor on the slot nor skipped it). Polled, completed but not
             flushed: still the device's.
    driver   everything else: free, added but not published (the device cannot see it yet), used and not
             yet reclaimed. Packed: one used descriptor gives back its whole list, with IN_ORDER its whole
             batch; the slots it skips are the driver's although their flags still read available.
    unknown  memory-only snapshots, where memory cannot tell (split without IN_ORDER: which chains are in
             flight; packed without IN_ORDER: how far the newest used descriptor skipped, which is the length
             of its buffer; packed with no used descriptor left in the ring: whether one the driver has since
             overwritten skipped into the slots that read available).

Packed ownership is positional: the ring slots from the device's used position up to the driver's published
position are the device's, whichever buffers they held; a chain's owner is that of its slots. A chain is a
run of slots as the ring shows it (a used descriptor and what it skips, or an available list).

``memory_snapshot(mem, layout, features)`` decodes ring memory alone (no private state: a region attached
by name, or a peer's memory). Same keys with side 'memory', plus ``inferred`` (values deduced from memory)
and ``unknown`` (what only the queue's owner knows). Split: indices avail.idx and used.idx, counts.inflight
= avail.idx - used.idx (made available, not yet used); chains are the heads in flight (the last ``inflight``
avail positions with IN_ORDER; without it a guess from the used entries, see _split_inflight_guess, and
owner is 'unknown'). Packed (_memory_packed): indices next_avail, avail_wrap (the driver's published
position, from the AVAIL bits: PACKED-D-02/03), used_idx, used_wrap (the device's used position, from the
newest used descriptor and what it skips; None where unknown); counts available_descs, available_chains,
unknown_descs; chains in ring order from the oldest published slot: used descriptors, the slots they
cover, available lists (a list never runs into a used descriptor), and a list written but not published
(head flags kept back).
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


DEVICE, DRIVER, UNKNOWN = "device", "driver", "unknown"


def driver_snapshot(q):
    st = q.state()
    snap, ring = _common(q, "driver")
    n = q.layout.size
    if q.layout.packed:
        snap["indices"] = {k: st[k] for k in ("next_avail", "avail_wrap", "last_used", "used_wrap")}
        chains = _driver_chains_packed(q, ring, st)
    else:
        avail_idx, used_idx = ring.u16(ring.avail, 2), ring.u16(ring.used, 2)
        snap["indices"] = {"next_avail": st["next_avail"], "last_used": st["last_used"],
                           "avail.idx": avail_idx, "used.idx": used_idx}
        inflight = [(head, _driver_chain_split(q, head)) for head in range(n) if q.id_inflight[head]]
        chains = _driver_states_split(q, ring, st, inflight, avail_idx, used_idx)
    snap["counts"] = {"num_free": st["num_free"], "inflight": st["inflight"]}
    snap["notify"] = ring.notify("kick_added", st["kick_added"])
    return _finish(snap, q, ring, chains)


def device_snapshot(q):
    """Everything the device has taken and not yet returned is its own: polled, completed but not flushed,
    and (read from memory) made available but not yet polled."""
    st = q.state()
    snap, ring = _common(q, "device")
    n = q.layout.size
    chains = []
    if q.layout.packed:
        snap["indices"] = {k: st[k] for k in ("last_avail", "avail_wrap", "used_idx", "used_wrap")}
        polled = (st["last_avail"] - st["used_idx"]) % n
        if polled == 0 and st["avail_wrap"] != st["used_wrap"]:
            polled = n
        # positions, not buffers: the slots from used_idx are the device's until it writes or skips them
        for slots in ring.next_runs(st["used_idx"], polled):
            id = ring.desc_id(slots[-1])
            state = _DEVICE_STATES.get(int(q.id_inflight[id]) if id < n else -1, "polled, used elsewhere")
            chains.append((slots[0], id, slots, state, DEVICE))
        slot, wrap, fresh = st["last_avail"], st["avail_wrap"], 0
        for _ in range(n - polled):  # made available, not yet polled
            if not _avail_in_lap(ring.desc_flags(slot), wrap):
                break
            fresh += 1
            slot, wrap = (0, wrap ^ 1) if slot == n - 1 else (slot + 1, wrap)
        for slots in ring.next_runs(st["last_avail"], fresh):
            chains.append((slots[0], ring.desc_id(slots[-1]), slots, "available, not polled", DEVICE))
    else:
        avail_idx = ring.u16(ring.avail, 2)
        snap["indices"] = {"last_avail": st["last_avail"], "used_idx": st["used_idx"],
                           "avail.idx": avail_idx, "used.idx": ring.u16(ring.used, 2)}
        heads = [(h, _DEVICE_STATES.get(int(q.id_inflight[h]), "polled")) for h in range(n) if q.id_inflight[h]]
        not_polled = min((avail_idx - st["last_avail"]) & 0xFFFF, n)
        heads += [(ring.u16(ring.avail, 4 + 2 * ((st["last_avail"] + k) % n)), "available, not polled")
                  for k in range(not_polled)]
        claimed = set()
        chains = [(head, head, ring.chain_split(head, claimed), state, DEVICE) for head, state in heads]
    snap["counts"] = {"inflight": st["inflight"], "shadow": st["shadow_count"]}
    snap["notify"] = ring.notify("call_added", st["call_added"])
    return _finish(snap, q, ring, chains)


def memory_snapshot(mem, layout, features):
    """Decode ring memory without the queue's private state (see the module docstring)."""
    q = _MemoryOnly(mem, layout, features)
    snap, ring = _common(q, "memory")
    if layout.packed:
        m = _memory_packed(ring, q.in_order)
        snap["indices"], snap["counts"], chains, default = m.indices, m.counts, m.chains, m.default
        inferred = dict(m.indices)
        unknown = ["driver: last_used, used_wrap, num_free, kick_added, buffer ids in flight",
                   "device: last_avail, avail_wrap (what it has polled), call_added, shadow used entries"]
        unknown += m.unknown
    else:
        n = layout.size
        avail_idx, used_idx = ring.u16(ring.avail, 2), ring.u16(ring.used, 2)
        pending = (avail_idx - used_idx) & 0xFFFF
        snap["indices"] = {"avail.idx": avail_idx, "used.idx": used_idx}
        snap["counts"] = {"inflight": pending}
        inferred, chains = {}, []
        exact = q.in_order
        if exact:  # in order: the buffers in flight are the last `pending` made available
            found = [(used_idx + k) & 0xFFFF for k in range(min(pending, n))]
        else:
            found = _split_inflight_guess(ring, avail_idx, used_idx, pending)
        claimed = set()
        for pos in found:
            head = ring.u16(ring.avail, 4 + 2 * (pos % n))
            slots = ring.chain_split(head, claimed)
            if exact:
                chains.append((head, head, slots, f"in flight: made available at avail position {pos}", DEVICE))
            else:
                chains.append((head, head, slots, f"probably in flight: made available at avail position {pos}, "
                                                  f"no used entry matches it", UNKNOWN))
        default = DRIVER if exact else UNKNOWN
        unknown = ["driver: next_avail (unpublished buffers), last_used, num_free, kick_added",
                   "device: last_avail (polled or not), used_idx shadow, call_added, shadow used entries"]
        if not exact:
            unknown.append("which descriptors are in flight (without IN_ORDER): owner is 'unknown'")
    snap["notify"] = ring.notify(None, None)
    snap = _finish(snap, q, ring, chains, default)
    snap["inferred"] = inferred
    snap["unknown"] = unknown
    return snap


class _Decoded:
    def __init__(self, indices, counts, chains, default, unknown):
        self.indices, self.counts, self.chains, self.default, self.unknown = indices, counts, chains, default, unknown


def infer_published_packed(flags):
    """Where the driver's published descriptors end, from the flags alone: (next_avail, wrap, unpublished) or
    None. The driver writes slots in ring order with AVAIL = its wrap counter, so the AVAIL bits are wrap up
    to next_avail and the other value after it (PACKED-D-02/03); the device writes AVAIL = USED = the same
    lap (PACKED-V-02), which keeps that picture. A list added and not yet published shows as one slot still
    holding the previous lap (its head, whose flags are written last, PACKED-D-12) followed by `unpublished
    - 1` slots already available in the new lap. (A driver that has rewritten the whole ring without
    publishing any of it reads as having published it: memory cannot tell the two apart.)"""
    n = len(flags)
    avail = [bool(f & VIRTQ_DESC_F_AVAIL) for f in flags]
    k = next((i for i in range(1, n) if avail[i] != avail[0]), n)
    if all(b != avail[0] for b in avail[k:]):
        return (0, int(not avail[0]), 0) if k == n else (k, int(avail[0]), 0)
    edges = [p for p in range(n) if avail[p] != avail[(p + 1) % n]]  # a kept head is next to a lap edge
    found = []
    for p in sorted({(e + j) % n for e in edges for j in (0, 1)}) if len(edges) <= 4 else ():
        wrap = int(not avail[p])  # the kept head still shows the lap before
        mismatch = [i for i in range(n) if avail[i] != (wrap if i < p else wrap ^ 1)]
        length = len(mismatch) + 1
        if length < n and mismatch == [(p + 1 + j) % n for j in range(length - 1)] \
                and all(bool(flags[i] & VIRTQ_DESC_F_USED) != avail[i] for i in mismatch):
            found.append((p, wrap, length))
    if len(found) > 1:
        return "ambiguous"  # two places where a list could be kept back: memory cannot choose
    return found[0] if found else None


def _memory_packed(ring, in_order):
    """Packed ring memory alone. Ownership is positional and read from the flags (§2.8.1, §2.8.6-2.8.8): the
    published window holds, oldest first, the slots the device has passed (each either a used descriptor or
    skipped by one: a used descriptor covers its whole list, and with IN_ORDER its whole batch), then the
    slots still available to the device. Everything up to the newest used descriptor has been passed; how
    far that descriptor skips is read from the ring where the spec makes it readable (IN_ORDER: up to the
    list ending in its buffer id, INORDER-12/14), and is 'unknown' where only the driver's private list
    lengths could tell."""
    n = ring.size
    flags = [ring.desc_flags(i) for i in range(n)]
    inferred = infer_published_packed(flags)
    if not isinstance(inferred, tuple):  # no single lap boundary: nothing can be said about ownership
        why = ("lap unknown: the AVAIL bits fit two places where a list may be kept back unpublished"
               if inferred == "ambiguous" else "lap unknown: the AVAIL bits do not show where the driver is")
        chains = [(r[0], ring.desc_id(r[-1]), r, why, UNKNOWN) for r in ring.next_runs(0, n)
                  if not ring.zero(r[0])]
        return _Decoded({"next_avail": None, "avail_wrap": None, "used_idx": None, "used_wrap": None},
                        {"available_descs": None, "available_chains": None, "unknown_descs": n}, chains,
                        UNKNOWN, ["owner: the lap of each slot (" + why.split(": ", 1)[1] + ")"])
    p, wrap, unpublished = inferred
    lap = lambda i: wrap if i < p else wrap ^ 1  # noqa: E731 - the lap in which slot i was last written

    window = [(p + unpublished + k) % n for k in range(n - unpublished)]  # oldest first
    runs, cur = [], []  # [slots, kind]: 'used', 'zero' (never written), 'avail', 'cut' (NEXT into a used slot)
    for i in window:
        if bool(flags[i] & VIRTQ_DESC_F_USED) == lap(i):  # AVAIL == USED == lap: a used descriptor
            if cur:  # an available list does not run into a used descriptor: the device has passed it
                runs.append([cur, "cut"])
                cur = []
            runs.append([[i], "zero" if ring.zero(i) else "used"])
            continue
        cur.append(i)
        if not flags[i] & VIRTQ_DESC_F_NEXT:
            runs.append([cur, "avail"])
            cur = []
    if cur:
        runs.append([cur, "avail"])  # NEXT on the newest published slot (PACKED-D-12 broken)
    newest = max((k for k, (_, kind) in enumerate(runs) if kind in ("used", "zero")), default=None)

    chains, states = [], {}
    for k, (slots, kind) in enumerate(runs[:newest + 1] if newest is not None else ()):
        if kind == "used":
            states[k] = ("used", DRIVER)
            for j in _batch_runs(ring, runs, k) if in_order else ():
                states[j] = (f"used: covered by the used descriptor at slot {slots[0]}", DRIVER)
        elif k not in states and kind != "zero":
            states[k] = ("passed by the device (a used descriptor follows): the tail of a used buffer, or "
                         "skipped by one", DRIVER)
    rest = [j for j in range(newest + 1 if newest is not None else 0, len(runs)) if j not in states]
    # How far the newest used descriptor skipped: nothing after a never-written slot; with IN_ORDER, up to the
    # list ending in its id (covered above). Without IN_ORDER it is the length of its buffer, which memory does
    # not keep (its head may be the slot the used descriptor overwrote); with no used descriptor left in the
    # ring, one the driver has since overwritten may have skipped into it.
    ambiguous = bool(rest) and (newest is None or (runs[newest][1] == "used" and not in_order))
    if newest is None:
        why = "available, or skipped by a used descriptor the driver has since overwritten"
    elif ambiguous:
        q_slot = runs[newest][0][0]
        why = (f"available, or skipped by the used descriptor at slot {q_slot} (how far it skips is the "
               f"length of buffer {ring.desc_id(q_slot)}, which only the driver knows)")
    for j in rest:
        states[j] = (why, UNKNOWN) if ambiguous else ("available", DEVICE)
    for k, (slots, kind) in enumerate(runs):
        if kind != "zero":
            state, owner = states[k]
            if kind == "cut":
                state = "available flags, list cut by a used descriptor: " + state
            chains.append((slots[0], ring.desc_id(slots[-1]), slots, state, owner))
    if unpublished:
        slots = [(p + j) % n for j in range(unpublished)]
        chains.insert(0, (p, ring.desc_id(slots[-1]), slots,
                          f"written, not published: the head flags at slot {p} are kept back", DRIVER))
    device = [c for c in chains if c[4] == DEVICE]
    unknown_descs = sum(len(c[2]) for c in chains if c[4] == UNKNOWN)
    used_at = None
    if not ambiguous:  # the device's next used position: the first slot it still owns (or next_avail)
        used_at = (device[0][0], lap(device[0][0])) if device else (p, wrap)
    indices = {"next_avail": p, "avail_wrap": wrap, "used_idx": used_at and used_at[0],
               "used_wrap": used_at and used_at[1]}
    notes = []
    if ambiguous:
        notes.append("device: used_idx, used_wrap (which slots a used descriptor skipped, owner 'unknown')")
    return _Decoded(indices, {"available_descs": sum(len(c[2]) for c in device),
                              "available_chains": len(device), "unknown_descs": unknown_descs},
                    chains, DRIVER, notes)


def _batch_runs(ring, runs, k):
    """IN_ORDER: the run indices after the used descriptor runs[k] that its batch covers: up to the first list
    whose last descriptor has its buffer id (INORDER-11..14); none if no such list follows before the next used
    descriptor (then it covered its own list's head only)."""
    x, out = ring.desc_id(runs[k][0][0]), []
    for j in range(k + 1, len(runs)):
        if runs[j][1] not in ("avail", "cut"):
            break
        out.append(j)
        if ring.desc_id(runs[j][0][-1]) == x:
            return out
    return []


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


def _driver_states_split(q, ring, st, inflight, avail_idx, used_idx):
    """Split driver: which in-flight chains are unpublished, available (the device's), or used and not
    reclaimed. ``inflight``: [(head, slots)]."""
    n = q.layout.size
    unpublished = {ring.u16(ring.avail, 4 + 2 * ((avail_idx + k) % n))
                   for k in range((st["next_avail"] - avail_idx) & 0xFFFF) if k < n}
    pending = (used_idx - st["last_used"]) & 0xFFFF
    heads = {head for head, _ in inflight}
    used, bad = set(), []
    if 0 < pending <= n:
        if q.in_order:  # the oldest `pending` buffers in flight, in avail order
            count = st["inflight"]
            used = {ring.u16(ring.avail, 4 + 2 * ((st["next_avail"] - count + k) % n))
                    for k in range(min(pending, count))}
            entries = [st["last_used"]]  # the entry the driver reads next (later ones may be skipped)
        else:
            entries = [(st["last_used"] + k) & 0xFFFF for k in range(pending)]
            used = {ring.u32(ring.used, 4 + 8 * (pos % n)) for pos in entries}
        for pos in entries:
            id = ring.u32(ring.used, 4 + 8 * (pos % n))
            if id not in heads:
                bad.append((id, pos))
    out = []
    for head, slots in inflight:
        if head in used:
            out.append((head, head, slots, "used, not reclaimed", DRIVER))
        elif head in unpublished:
            out.append((head, head, slots, "added, not published", DRIVER))
        else:
            out.append((head, head, slots, "available", DEVICE))
    for id, pos in bad:
        out.append((id, id, [], f"used, id not in flight (used.ring[{pos % n}], used position {pos})", DRIVER))
    return out


def _driver_chains_packed(q, ring, st):
    """Packed driver: walk the in-flight slots from last_used the way reclaim would. A used descriptor and
    the slots it skips (the rest of its list, with IN_ORDER the rest of its batch) are the driver's; the
    slots from there are the device's while their list is published."""
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
            chains.append((slot, id, [(slot + j) % n for j in range(k)], state, DRIVER))
        else:
            lap = _lap(slot, st)
            if not _avail_in_lap(flags, lap):
                unpublished = True  # the kept head: nothing after it is visible to the device
            # a list ends at a descriptor without NEXT, and never runs into a used descriptor
            slots = next(iter(ring.next_runs(slot, left, stop=lambda i: _used_in_lap(ring.desc_flags(i),
                                                                                      _lap(i, st)))))
            id = ring.desc_id(slots[-1])
            state, owner = ("added, not published", DRIVER) if unpublished else ("available", DEVICE)
            if id >= n or not q.id_inflight[id] or id in used_ids:
                state = f"{state}: stale slot, buffer {id} is not in flight or already used"
            chains.append((slots[0], id, slots, state, owner))
        left -= len(chains[-1][2])
        slot = (slot + len(chains[-1][2])) % n
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

    def zero(self, i):
        """True if slot i was never written (all 16 bytes zero: the zero-initialized ring, PACKED-L-05)."""
        return not any(self.desc[16 * i:16 * i + 16])

    def next_runs(self, start, count, stop=None):
        """Packed: consecutive slots from start, cut into runs that end at a descriptor without NEXT
        (the last run may be cut short at count, or before a slot for which ``stop(slot)`` is true)."""
        run, slot = [], start
        for _ in range(count):
            if run and stop is not None and stop(slot):
                yield run
                run = []
            run.append(slot)
            if not self.desc_flags(slot) & VIRTQ_DESC_F_NEXT:
                yield run
                run = []
            slot = (slot + 1) % self.size
        if run:
            yield run

    def chain_split(self, head, claimed=None):
        """Ring descriptors of the chain at head, following NEXT while it stays in range (no checks). With a set
        ``claimed`` (the slots of the chains listed before), the chain ends before a slot another chain holds:
        chains of a valid ring never share a descriptor, and listing a shared tail once per head made the
        decode of a ring whose every head leads into one long chain quadratic in the ring size."""
        i, seen = head, []
        while i < self.size and len(seen) < self.size:
            if claimed is not None:
                if i in claimed:
                    break
                claimed.add(i)
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


def _avail_in_lap(flags, wrap):
    """PACKED-V-04/18: available in the lap with driver wrap counter ``wrap``: AVAIL == wrap, USED != wrap."""
    return bool(flags & VIRTQ_DESC_F_AVAIL) == wrap and bool(flags & VIRTQ_DESC_F_USED) != wrap


def _driver_chain_split(q, head):
    """The driver's own record of a chain: ring order (IN_ORDER) or its links in the free list (cut short at a
    link outside the table: a damaged snapshot must decode, not crash)."""
    n = q.layout.size
    k = min(max(int(q.id_ndesc[head]), 1), n)
    if q.in_order:
        return [(head + j) % n for j in range(k)]
    chain = [head]
    for _ in range(k - 1):
        nxt = int(q.free_next[chain[-1]])
        if nxt >= n:
            break
        chain.append(nxt)
    return chain


def _common(q, side):
    lay = q.layout
    return {"format": lay.fmt, "size": lay.size, "side": side,
            "variant": "in_order" if q.in_order else "normal",
            "features": int(q.features), "feature_names": feature_names(int(q.features))}, _Ring(q)


def _finish(snap, q, ring, chains, default=DRIVER):
    """Chains are (head, id, slots, state, owner); a descriptor's owner is that of the chain holding it
    (``default`` for the others, 'unknown' if two chains disagree)."""
    b = q.broken
    snap["broken"] = None if b is None else {"error": type(b).__name__, "message": str(b)}
    snap["chains"] = [{"head": head, "id": id, "slots": slots, "state": state, "owner": owner}
                      for head, id, slots, state, owner in chains]
    owners = {}
    for _, _, slots, _, owner in chains:
        for i in slots:
            owners[i] = owner if owners.get(i, owner) == owner else UNKNOWN
    link = "id" if ring.packed else "next"
    rows = []
    for i in range(ring.size):
        addr, length, a, b = _DESC.unpack_from(ring.desc, 16 * i)
        flags, other = (b, a) if ring.packed else (a, b)
        rows.append({"index": i, "addr": addr, "len": length, "flags": flags,
                     "flag_names": desc_flag_names(flags), link: other, "owner": owners.get(i, default)})
    snap["descriptors"] = rows
    return snap
