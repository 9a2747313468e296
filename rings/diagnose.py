"""What looks wrong with a queue, in words, from one snapshot dict (rings.snapshot) or from two taken a
time apart (``prev`` at least ``elapsed`` seconds before ``snap``; the stuck-queue findings need both).

``diagnose(snap, prev=None, elapsed=None)`` returns a list of findings, each a dict
``{"level": "error" | "warning" | "info", "code": str, "text": str}``. Codes (stable, for tests and tools):

    broken            the queue is in the sticky broken state
    avail_idx_jump    avail.idx is more than the queue size ahead of the device (split)
    used_idx_jump     used.idx is more than the queue size ahead of the driver (split)
    bad_head          an avail ring entry the device has still to read is outside the queue (split)
    used_not_inflight a used entry the driver has still to reclaim names a buffer that is not in flight
    ring_full         every descriptor is in flight and the device has returned none
    unpublished       buffers added but not published (split: idx not stored; packed: head flags kept)
    device_stalled    buffers are available and the device has consumed (device side) or returned (driver
                      side, memory) none for T s
    device_not_polling  ... and the device suppressed kicks: it promised to poll and does not (info when
                      buffers wait on one sample: the device must be polling)
    kick_missing      ... and the device asked for kicks: the driver did not kick (or the kick was lost)
    driver_stalled    used buffers wait and the driver has reclaimed none for T s
    calls_suppressed  used buffers wait while the driver suppressed used-buffer notifications
    call_missing      ... the driver asked for calls: the device did not call (or the call was lost)
    shadow_unflushed  completions sit in the device's shadow used array (for T s)
    avail_bits        packed ring memory whose AVAIL bits do not form the two runs of one lap boundary
    event_reserved    packed event suppression flags hold the reserved value 3
    event_desc_without_event_idx  DESC mode set without EVENT_IDX negotiated (read as ENABLE)
"""
from .layout import VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_USED_F_NO_NOTIFY

EVENT_IDX_BIT = 29


def diagnose(snap, prev=None, elapsed=None):
    f = _Findings(snap, prev, elapsed)
    b = snap.get("broken")
    if b:
        f.add("error", "broken", f"queue broken: {b['error']}: {b['message']}")
    side = snap["side"]
    if snap["format"] == "split":
        _split(f, snap, side)
    else:
        _packed(f, snap, side)
    return f.items


def format_findings(items):
    if not items:
        return "diagnosis: nothing looks wrong"
    return "\n".join(f"{i['level'].upper()}: {i['text']}" for i in items)


class _Findings:
    def __init__(self, snap, prev, elapsed):
        self.snap, self.items = snap, []
        same = prev is not None and prev.get("format") == snap["format"] and prev.get("side") == snap["side"]
        self.prev = prev if same else None
        self.elapsed = elapsed

    def add(self, level, code, text):
        self.items.append({"level": level, "code": code, "text": text})

    def still(self, *keys):
        """True if a previous sample exists and none of these index/count values moved since."""
        if self.prev is None:
            return False
        for k in keys:
            group, name = k.split(":")
            if self.prev[group].get(name) != self.snap[group].get(name):
                return False
        return True

    def since(self):
        return f"{self.elapsed:.1f} s" if self.elapsed is not None else "the previous sample"


def _far(event, idx):
    """EVENT_IDX: an event index half the counter space away from idx (x + 0x7fff, as enable_kicks(False) and
    enable_calls(False) write it) means: notifications off."""
    return 0x4000 <= ((event - idx) & 0xFFFF) < 0xC000


def _chains(snap, state):
    return [c for c in snap.get("chains", ()) if c["state"].startswith(state)]


def _event_idx(snap):
    return bool(snap["features"] >> EVENT_IDX_BIT & 1)


def _split(f, snap, side):
    n, ix, nt = snap["size"], snap["indices"], snap["notify"]
    avail_idx, used_idx = ix["avail.idx"], ix["used.idx"]
    ev = _event_idx(snap)
    # What the device has to do: available and not consumed
    if side == "device":
        ahead = (avail_idx - ix["last_avail"]) & 0xFFFF
        base, base_name = ix["last_avail"], "the device's last_avail"
    else:
        ahead = (avail_idx - used_idx) & 0xFFFF
        base, base_name = used_idx, "used.idx"
    if side in ("device", "memory") and ahead > n:
        f.add("error", "avail_idx_jump", f"avail.idx={avail_idx} is {ahead} ahead of {base_name}={base}, "
              f"more than the queue size {n}: the device will reject the ring (SPLIT-V-13)")
    if side in ("device", "memory") and ahead <= n:
        for c in _chains(snap, "available, not polled") + _chains(snap, "in flight") + _chains(snap, "probably"):
            if c["head"] >= n:
                f.add("error", "bad_head", f"an avail ring entry the device has still to read holds head "
                      f"{c['head']}, outside the queue (size {n})")
    if side == "driver":
        pending_used = (used_idx - ix["last_used"]) & 0xFFFF
        if pending_used > n:
            f.add("error", "used_idx_jump", f"used.idx={used_idx} is {pending_used} ahead of the driver's "
                  f"last_used={ix['last_used']}, more than the queue size {n} (SPLIT-D-17)")
            pending_used = 0
        _used_ids_split(f, snap, pending_used)
        unpublished = (ix["next_avail"] - avail_idx) & 0xFFFF
        if unpublished and unpublished <= n:
            f.add("warning" if f.still("indices:next_avail", "indices:avail.idx") else "info", "unpublished",
                  f"{unpublished} buffers added but not published: avail.idx={avail_idx}, "
                  f"next_avail={ix['next_avail']}" + (f", unchanged for {f.since()}"
                                                      if f.still("indices:next_avail") else ""))
        counts = snap["counts"]
        if counts["num_free"] == 0 and pending_used == 0:
            f.add("warning", "ring_full", f"ring full: all {n} descriptors are in flight "
                  f"({counts['inflight']} buffers) and none is used")
        calls_off = (nt["avail.flags"] & VIRTQ_AVAIL_F_NO_INTERRUPT) if not ev else \
            _far(nt["used_event"], ix["last_used"])
        if pending_used:
            stuck = f.still("indices:last_used", "indices:used.idx")
            what = (f"{pending_used} used buffers wait to be reclaimed (used.idx={used_idx}, "
                    f"last_used={ix['last_used']})")
            how = "NO_INTERRUPT" if not ev else f"used_event={nt['used_event']} far from last_used"
            _used_waiting(f, what, stuck, calls_off and how)
        waiting = len(_chains(snap, "available"))
        stuck = waiting and not pending_used and f.still("indices:last_used", "indices:used.idx")
    else:
        waiting = ahead if ahead <= n else 0
        key = "indices:last_avail" if side == "device" else "indices:used.idx"
        stuck = f.still(key, "indices:avail.idx") if side == "device" else f.still(key)
    kick_base = {"device": base, "memory": base, "driver": avail_idx}[side]
    kicks_off = (nt["used.flags"] & VIRTQ_USED_F_NO_NOTIFY) if not ev else \
        _far(nt["avail_event"], kick_base)
    how_off = "NO_NOTIFY" if not ev else f"avail_event={nt['avail_event']}"
    how_on = "used.flags=0" if not ev else f"avail_event={nt['avail_event']}"
    _device_waiting(f, side, waiting, stuck, kicks_off, how_off, how_on)
    if side == "device":
        _shadow(f, snap)


def _used_ids_split(f, snap, pending_used):
    for c in _chains(snap, "used, id not in flight"):
        f.add("error", "used_not_inflight", f"a descriptor is marked used but is not in flight: "
              f"{c['state'].split('(')[1].rstrip(')')} names id {c['id']}")
    if snap["variant"] == "in_order" and pending_used > snap["counts"]["inflight"]:
        f.add("error", "used_not_inflight", f"{pending_used} buffers marked used but only "
              f"{snap['counts']['inflight']} in flight")


def _packed(f, snap, side):
    n, ix, nt = snap["size"], snap["indices"], snap["notify"]
    ev = _event_idx(snap)
    for name in ("driver_event", "device_event"):
        e = nt[name]
        if e["mode"] == "RESERVED":
            f.add("error", "event_reserved", f"{name}.flags={e['flags']} is the reserved value")
        elif e["mode"] == "DESC" and not ev:
            f.add("info", "event_desc_without_event_idx", f"{name} asks for DESC mode but EVENT_IDX was not "
                  f"negotiated: it reads as ENABLE")
    calls_off = nt["driver_event"]["mode"] == "DISABLE"
    kicks_off = nt["device_event"]["mode"] == "DISABLE"
    if side == "driver":
        used = _chains(snap, "used, not reclaimed")
        for c in _chains(snap, "used, id not in flight"):
            f.add("error", "used_not_inflight", f"a descriptor is marked used but is not in flight: slot "
                  f"{c['head']} holds used id {c['id']}")
        pending = [c for c in snap["chains"] if c["state"] == "added, not published"]
        if pending:
            f.add("warning" if f.still("indices:next_avail") else "info", "unpublished",
                  f"{len(pending)} buffers added but not published (the head flags at slot "
                  f"{pending[0]['head']} are kept back until publish())")
        if snap["counts"]["num_free"] == 0 and not used:
            f.add("warning", "ring_full", f"ring full: all {n} descriptors are in flight "
                  f"({snap['counts']['inflight']} buffers) and none is used")
        if used:
            stuck = f.still("indices:last_used", "indices:used_wrap")
            what = f"{len(used)} used buffers wait to be reclaimed from slot {ix['last_used']}"
            _used_waiting(f, what, stuck, calls_off and "driver_event DISABLE")
        waiting = [c for c in snap["chains"] if c["state"] == "available"]
        stuck = not used and f.still("indices:last_used", "indices:used_wrap")
    else:
        if side == "memory" and ix.get("next_avail") is None:
            if any("kept back" in c["state"] for c in snap["chains"]):
                f.add("info", "avail_bits", "the AVAIL bits fit two places where the driver may keep a list "
                      "back unpublished: where it is cannot be read from memory")
            else:
                f.add("error", "avail_bits", "the AVAIL bits of the descriptors do not form two runs (one lap "
                      "boundary): ring memory is corrupt or the driver does not write slots in order")
        unpublished = [c for c in snap["chains"] if c["state"].startswith("written, not published")]
        if unpublished:
            c = unpublished[0]
            f.add("warning" if f.prev is not None and f.prev.get("descriptors") == snap["descriptors"] else "info",
                  "unpublished", f"{len(c['slots'])} descriptors written but not published: the head flags at "
                  f"slot {c['head']} are kept back")
        if side == "device":
            waiting = _chains(snap, "available, not polled")
            stuck = f.still("indices:last_avail", "indices:avail_wrap")
            _shadow(f, snap)
        else:
            waiting = [c for c in snap["chains"] if c["state"] == "available"]
            stuck = f.prev is not None and f.prev.get("descriptors") == snap["descriptors"]
    mode = nt["device_event"]["mode"]
    _device_waiting(f, side, len(waiting), stuck, kicks_off, "device_event DISABLE", f"device_event {mode}")


def _device_waiting(f, side, waiting, stuck, kicks_off, how_off, how_on):
    """Buffers the device has to consume: has it stopped, and is it waiting for a kick or not polling?"""
    if not waiting:
        return
    if side == "driver":
        what = f"{waiting} buffers are available to the device"
        stalled = f"{what} and none came back for {f.since()}"
    else:
        what = f"device has {waiting} buffers available"
        stalled = f"{what} and has not {'consumed' if side == 'device' else 'returned'} any for {f.since()}"
    if stuck:
        f.add("warning", "device_stalled", stalled)
        if kicks_off:
            f.add("warning", "device_not_polling", f"device suppressed kicks ({how_off}) and "
                  + ("the driver is waiting for used buffers" if side == "driver" else "buffers are waiting")
                  + ": the device is not polling")
        else:
            f.add("warning", "kick_missing", f"the device asked for kicks ({how_on}) and is waiting for one: "
                  f"the driver did not kick, or the kick was lost")
    elif kicks_off:
        f.add("info", "device_not_polling", f"{what} and the device suppressed kicks: it must be polling")


def _shadow(f, snap):
    k = snap["counts"]["shadow"]
    if k:
        stuck = f.still("counts:shadow", "indices:used_idx")
        f.add("warning" if stuck else "info", "shadow_unflushed",
              f"{k} completions wait in the device's shadow used array, not flushed"
              + (f" for {f.since()}" if stuck else ""))


def _used_waiting(f, what, stuck, suppressed):
    """Used buffers the driver has not reclaimed: with calls suppressed (``suppressed`` says how) that is
    the driver's polling to blame; with calls enabled and nothing moving, a call went missing."""
    if suppressed:
        f.add("warning" if stuck else "info", "calls_suppressed",
              f"driver suppressed used-buffer notifications ({suppressed}) and {what}"
              + (f"; none reclaimed for {f.since()}: the driver is not polling" if stuck else ""))
    elif stuck:
        f.add("warning", "call_missing", f"{what} for {f.since()} with used-buffer notifications "
              f"enabled: the device did not call, the call was lost, or the driver ignores it")
