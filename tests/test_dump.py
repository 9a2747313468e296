"""Ring-state dumps (issue 5, `vring dump`): snapshots of queues in known states, raw snapshot files, the
diagnoses in words, the control socket, the broken-queue hook and the command line.

Queues are rings.virtq (C) or rings.reference queues over a MemoryTable on a bytearray, or on POSIX shared
memory through the mem_factory fixture (which unlinks every segment at teardown, whatever happens).
"""
import base64
import importlib
import json
import os
import socket
import stat

import numpy as np
import pytest

from rings import ctl, errors, rawdump
from rings.diagnose import diagnose, format_findings
from rings.layout import (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, QueueLayout, avail_dtype, bit, packed_desc_dtype,
                          split_desc_dtype, used_dtype)
from rings.shm import MemoryTable, ShmRegion
from rings.snapshot import format_snapshot, memory_snapshot
from vring import cli

BASE = 0x100000
MEMSIZE = 1 << 18
DATA = BASE + 0x20000


@pytest.fixture(params=["c", "reference"])
def impl(request):
    return importlib.import_module("rings.virtq" if request.param == "c" else "rings.reference")


@pytest.fixture(autouse=True)
def no_snapshot_dir(monkeypatch):
    """Tests start with the broken-queue hook off and leave it off."""
    monkeypatch.delenv(rawdump.ENV, raising=False)
    rawdump.set_snapshot_dir(None)
    yield
    rawdump.set_snapshot_dir(None)


class Q:
    """Both halves of one queue, and numpy views of its areas."""

    def __init__(self, impl, mem, fmt, size, *bits, batch=False):
        self.mem, self.size, self.fmt = mem, size, fmt
        self.layout = QueueLayout.contiguous(fmt, size, BASE)
        self.features = (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | sum(bit(b) for b in bits)
        self.drv = impl.DriverQueue(mem, self.layout, self.features)
        self.dev = impl.DeviceQueue(mem, self.layout, self.features, in_order_batch=batch)
        lay = self.layout
        if fmt == "split":
            self.desc = np.frombuffer(mem.view(lay.desc, 16 * size), split_desc_dtype)
            self.avail = np.frombuffer(mem.view(lay.driver, avail_dtype(size).itemsize), avail_dtype(size))[0]
            self.used = np.frombuffer(mem.view(lay.device, used_dtype(size).itemsize), used_dtype(size))[0]
        else:
            self.desc = np.frombuffer(mem.view(lay.desc, 16 * size), packed_desc_dtype)
            self.driver_event = np.frombuffer(mem.view(lay.driver, 4), "<u2")
            self.device_event = np.frombuffer(mem.view(lay.device, 4), "<u2")

    def add(self, nsegs, writable=True, publish=True):
        """Buffers of the given descriptor counts (all writable, 100 bytes a segment); tokens 0.."""
        nsegs = list(nsegs)
        k = sum(nsegs)
        w = np.array(nsegs) if writable else np.zeros(len(nsegs), int)
        added = self.drv.add(DATA + 128 * np.arange(k), np.full(k, 100), np.array(nsegs) - w, w,
                             np.arange(len(nsegs)))
        assert added == len(nsegs)
        if publish:
            self.drv.publish()

    def cycle(self, nbufs):
        """nbufs one-descriptor buffers all the way round (add, poll, complete, reclaim)."""
        for _ in range(nbufs):
            self.add([1])
            ch = self.dev.poll()
            self.dev.push_used(ch.id, ch.wlen)
            self.dev.flush()
            assert len(self.drv.reclaim()[0]) == 1

    def mem_snap(self):
        return memory_snapshot(self.mem, self.layout, self.features)


@pytest.fixture
def make_q(mem_factory):
    def make(impl, fmt, size=8, *bits, shm=False, batch=False):
        return Q(impl, mem_factory(MEMSIZE, BASE, shm=shm), fmt, size, *bits, batch=batch)
    return make


def codes(findings):
    return {f["code"] for f in findings}


def chains(snap):
    return [(c["head"], c["slots"], c["owner"], c["state"]) for c in snap["chains"]]


# --- known states --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_empty_queue(impl, make_q, fmt):
    q = make_q(impl, fmt, 8, shm=True)
    for snap in (q.drv.snapshot(), q.dev.snapshot(), q.mem_snap()):
        assert snap["chains"] == []
        assert json.loads(json.dumps(snap)) == snap
        assert diagnose(snap) == []
        assert "diagnosis: nothing looks wrong" == format_findings(diagnose(snap))
    m = q.mem_snap()
    assert m["side"] == "memory" and m["unknown"]
    if fmt == "packed":  # the zero-initialized ring: every slot reads as used in lap 0, all the driver's
        assert m["inferred"] == {"next_avail": 0, "avail_wrap": 1, "used_idx": 0, "used_wrap": 1}
        assert all(r["owner"] == "driver" for r in m["descriptors"])
    else:
        assert m["indices"] == {"avail.idx": 0, "used.idx": 0} and m["counts"] == {"inflight": 0}
        assert all(r["owner"] == "unknown" for r in m["descriptors"])  # no IN_ORDER: unknown from memory


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_full_queue(impl, make_q, fmt):
    """Every descriptor in flight (two 2-descriptor chains and four single ones), none used."""
    q = make_q(impl, fmt, 8)
    q.add([2, 2, 1, 1, 1, 1])
    d = q.drv.snapshot()
    assert d["counts"] == {"num_free": 0, "inflight": 6}
    assert [(h, s, o, st) for h, s, o, st in chains(d)] == [
        (0, [0, 1], "device", "available"), (2, [2, 3], "device", "available"),
        (4, [4], "device", "available"), (5, [5], "device", "available"),
        (6, [6], "device", "available"), (7, [7], "device", "available")]
    assert [c["id"] for c in d["chains"]] == ([0, 2, 4, 5, 6, 7] if fmt == "split" else [0, 1, 2, 3, 4, 5])
    assert "ring_full" in codes(diagnose(d))
    assert "ring full: all 8 descriptors are in flight (6 buffers) and none is used" in format_findings(diagnose(d))
    v = q.dev.snapshot()
    assert [c["state"] for c in v["chains"]] == ["available, not polled"] * 6
    assert all(r["owner"] == "device" for r in v["descriptors"])
    m = q.mem_snap()
    assert [c["slots"] for c in m["chains"]] == [[0, 1], [2, 3], [4], [5], [6], [7]]
    if fmt == "packed":
        assert m["inferred"] == {"next_avail": 0, "avail_wrap": 0,  # a whole lap written: wrap toggled
                                 "used_idx": None, "used_wrap": None}
        # no used descriptor left in the ring and lists of two descriptors: memory cannot tell these slots
        # from the tail of a list that a used descriptor since overwritten had skipped
        assert all(r["owner"] == "unknown" and r["flag_names"].endswith("AVAIL") for r in m["descriptors"])
        assert m["counts"] == {"available_descs": 0, "available_chains": 0, "unknown_descs": 8}
    else:
        assert m["counts"] == {"inflight": 6}
    q.dev.poll()
    v = q.dev.snapshot()
    assert [c["state"] for c in v["chains"]] == ["polled"] * 6


def test_wrapped_packed_chain_across_the_end(impl, make_q):
    """After 6 descriptors went round, a 3-descriptor chain takes slots 6, 7 and 0 (the wrap counter toggles
    inside it): the dumps group it as one chain, and the AVAIL bits tell the lap."""
    q = make_q(impl, "packed", 8, shm=True)
    q.cycle(6)
    q.add([3])
    d = q.drv.snapshot()
    assert d["indices"] == {"next_avail": 1, "avail_wrap": 0, "last_used": 6, "used_wrap": 1}
    assert chains(d) == [(6, [6, 7, 0], "device", "available")]
    assert [r["flag_names"] for r in d["descriptors"][6:8]] == ["NEXT|WRITE|AVAIL"] * 2
    assert d["descriptors"][0]["flag_names"] == "WRITE|USED"  # lap 2: AVAIL=0, USED=1
    m = q.mem_snap()
    # Memory alone: slots 1..5 hold used descriptors (the driver's). Whether the used descriptor at slot 5
    # skipped 6, 7 and 0 depends on the length of its buffer (id 0, like the new list's), which only the
    # driver knows: the device may have completed that list out of order over a one-slot buffer at 5.
    assert m["inferred"] == {"next_avail": 1, "avail_wrap": 0, "used_idx": None, "used_wrap": None}
    assert [(c["head"], c["slots"], c["owner"]) for c in m["chains"]][-1] == (6, [6, 7, 0], "unknown")
    assert [r["owner"] for r in m["descriptors"]] == ["unknown"] + ["driver"] * 5 + ["unknown"] * 2
    assert m["counts"] == {"available_descs": 0, "available_chains": 0, "unknown_descs": 3}
    v = q.dev.snapshot()
    assert chains(v) == [(6, [6, 7, 0], "device", "available, not polled")]
    ch = q.dev.poll()
    q.dev.push_used(ch.id, ch.wlen)
    q.dev.flush()
    d = q.drv.snapshot()
    assert chains(d) == [(6, [6, 7, 0], "driver", "used, not reclaimed")]
    q.drv.reclaim()
    d = q.drv.snapshot()
    assert d["indices"] == {"next_avail": 1, "avail_wrap": 0, "last_used": 1, "used_wrap": 0}
    assert d["chains"] == [] and diagnose(d) == []


def test_wrapped_split_indices(impl, make_q):
    """Split: the free-running indices pass the ring size; chains are followed through next."""
    q = make_q(impl, "split", 4)
    q.cycle(9)
    q.add([3])
    d = q.drv.snapshot()
    assert d["indices"] == {"next_avail": 10, "last_used": 9, "avail.idx": 10, "used.idx": 9}
    (head, slots, owner, state), = chains(d)
    assert len(slots) == 3 and owner == "device" and state == "available"
    assert d["descriptors"][slots[0]]["next"] == slots[1]
    m = q.mem_snap()
    assert m["indices"] == {"avail.idx": 10, "used.idx": 9}
    assert [(c["head"], c["slots"]) for c in m["chains"]] == [(head, slots)]
    assert m["chains"][0]["state"].startswith("probably in flight: made available at avail position 9")


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_mid_batch_in_order(impl, make_q, fmt):
    """IN_ORDER with batching: 4 buffers polled; 2 completed but not flushed (the device's shadow), then one
    batched used entry covers the first three; the fourth is still the device's."""
    q = make_q(impl, fmt, 8, VIRTIO_F_IN_ORDER, batch=True)
    q.add([2, 1, 1, 2])
    ch = q.dev.poll()
    q.dev.push_used(ch.id[:2], ch.wlen[:2])
    v = q.dev.snapshot()
    assert v["counts"]["shadow"] == 2
    assert [c["state"] for c in v["chains"]] == ["completed, not flushed"] * 2 + ["polled"] * 2
    assert "shadow_unflushed" in codes(diagnose(v))
    q.dev.push_used(ch.id[2:3], ch.wlen[2:3])
    q.dev.flush()
    d = q.drv.snapshot()
    if fmt == "split":  # used.idx moved by 3: the three oldest buffers are used
        assert d["indices"]["used.idx"] == 3
        assert chains(d) == [(0, [0, 1], "driver", "used, not reclaimed"), (2, [2], "driver", "used, not reclaimed"),
                             (3, [3], "driver", "used, not reclaimed"), (4, [4, 5], "device", "available")]
        assert tuple(q.used["ring"][0]) == (3, 100)  # one entry: the id of the batch's last buffer
    else:  # one used descriptor at slot 0 with id 3 covers slots 0..3
        assert chains(d) == [(0, [0, 1, 2, 3], "driver", "used, not reclaimed"), (4, [4, 5], "device", "available")]
        assert d["chains"][0]["id"] == 3
    assert diagnose(d) == []
    m = q.mem_snap()
    if fmt == "split":  # IN_ORDER: exact from memory alone
        assert chains(m) == [(4, [4, 5], "device", "in flight: made available at avail position 3")]
    else:  # the used descriptor's id says which slots that still show available flags it covers
        covered = "used: covered by the used descriptor at slot 0"
        assert chains(m) == [(0, [0], "driver", "used"), (1, [1], "driver", covered), (2, [2], "driver", covered),
                             (3, [3], "driver", covered), (4, [4, 5], "device", "available")]
        assert m["counts"] == {"available_descs": 2, "available_chains": 1, "unknown_descs": 0}
        assert m["inferred"] == {"next_avail": 6, "avail_wrap": 1, "used_idx": 4, "used_wrap": 1}
    v = q.dev.snapshot()
    assert [(c["head"], c["state"]) for c in v["chains"]] == [(4, "polled")]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_broken_queue(impl, make_q, fmt):
    q = make_q(impl, fmt, 8)
    q.add([1])
    if fmt == "split":
        q.avail["idx"] = 100  # SPLIT-V-13
        err = errors.AvailIdxJump
    else:
        q.dev.poll()
        q.desc[1] = (DATA, 64, 99, VIRTQ_DESC_F_AVAIL)  # PACKED-D-23: id out of range
        err = errors.PackedIdOutOfRange
    with pytest.raises(err):
        q.dev.poll()
    v = q.dev.snapshot()
    assert v["broken"]["error"] == err.__name__
    found = diagnose(v)
    assert found[0]["code"] == "broken" and found[0]["level"] == "error"
    assert found[0]["text"].startswith(f"queue broken: {err.__name__}: ")
    assert "BROKEN:  " + err.__name__ in format_snapshot(v)
    if fmt == "split":
        assert "avail_idx_jump" in codes(found)
        assert "avail_idx_jump" in codes(diagnose(q.mem_snap()))
    assert rawdump.loads(rawdump.capture(q.dev).dumps()).snapshot() == v


# --- raw snapshots ---------------------------------------------------------------------------------------------

def _states(q):
    """Yield after each step of a little workload."""
    yield
    q.add([2, 1, 3])
    yield
    ch = q.dev.poll()
    yield
    q.dev.push_used(ch.id[:1], ch.wlen[:1])
    yield
    q.dev.flush()
    q.add([1], publish=False)
    yield
    q.drv.reclaim()
    q.drv.enable_calls(False)
    q.dev.enable_kicks(False)
    yield


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("bits", [(), (VIRTIO_F_IN_ORDER,), (VIRTIO_F_EVENT_IDX,)])
def test_raw_round_trip(impl, make_q, tmp_path, fmt, bits):
    """A raw snapshot decodes to the same dict as the live queue, for both halves and for memory alone."""
    q = make_q(impl, fmt, 8, *bits)
    for step, _ in enumerate(_states(q)):
        for half in (q.drv, q.dev):
            raw = rawdump.capture(half, meta={"name": "q0"})
            live = half.snapshot()
            assert raw.snapshot() == live
            back = rawdump.loads(raw.dumps())
            assert back.snapshot() == live
            assert back.meta == {"name": "q0"} and back.time == raw.time
            path = rawdump.save(half, tmp_path / f"{half.side}{step}.raw")
            assert rawdump.load(path).snapshot() == live
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        m = rawdump.capture_memory(q.mem, q.layout, q.features)
        assert rawdump.loads(m.dumps()).snapshot() == q.mem_snap()


def test_raw_file_format_is_documented_and_checked(make_q):
    q = make_q(importlib.import_module("rings.virtq"), "split", 8)
    data = rawdump.capture(q.drv).dumps()
    magic, header, rest = data.split(b"\n", 2)
    assert magic == b"VRING-RAW 1"
    h = json.loads(header)
    assert h["kind"] == "driver" and h["layout"]["size"] == 8
    assert [b["name"] for b in h["blobs"]] == ["desc", "driver", "device", "id_inflight", "id_ndesc", "id_wlen",
                                               "free_next", "id_token"]
    sizes = [b["count"] * np.dtype(b["dtype"]).itemsize for b in h["blobs"]]
    assert sum(sizes) == len(rest)
    for bad in (b"nope", data[:-3], data.replace(b'"kind":"driver"', b'"kind":"other!"')):
        with pytest.raises(errors.ConfigError):
            rawdump.loads(bad)


# --- diagnoses on arranged rings ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_device_stalled_waiting_for_a_kick(impl, make_q, fmt):
    q = make_q(impl, fmt, 8)
    q.add([1, 1, 1, 1])
    a = q.dev.snapshot()
    assert "device_stalled" not in codes(diagnose(a))  # one sample: nothing to say about time
    b = q.dev.snapshot()
    found = diagnose(b, a, 2.0)
    assert "device has 4 buffers available and has not consumed any for 2.0 s" in [f["text"] for f in found]
    assert codes(found) == {"device_stalled", "kick_missing"}
    m1, m2 = q.mem_snap(), q.mem_snap()
    assert {"device_stalled", "kick_missing"} <= codes(diagnose(m2, m1, 3.0))
    q.dev.poll()
    assert "device_stalled" not in codes(diagnose(q.dev.snapshot(), b, 2.0))  # it moved


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("event_idx", [False, True])
def test_device_suppressed_kicks_and_is_not_polling(impl, make_q, fmt, event_idx):
    q = make_q(impl, fmt, 8, *([VIRTIO_F_EVENT_IDX] if event_idx else []))
    q.dev.enable_kicks(False)
    q.add([1, 1])
    a, b = q.dev.snapshot(), q.dev.snapshot()
    assert codes(diagnose(a)) == {"device_not_polling"}  # info: it must poll
    found = diagnose(b, a, 1.5)
    assert codes(found) == {"device_stalled", "device_not_polling"}
    assert any(f["text"].startswith("device suppressed kicks") and f["level"] == "warning" for f in found)
    # the driver's side of the same story
    a, b = q.drv.snapshot(), q.drv.snapshot()
    found = diagnose(b, a, 1.5)
    assert codes(found) == {"device_stalled", "device_not_polling"}
    assert "2 buffers are available to the device and none came back for 1.5 s" in [f["text"] for f in found]
    assert any("the driver is waiting for used buffers: the device is not polling" in f["text"] for f in found)
    q.dev.enable_kicks(True)
    assert codes(diagnose(q.drv.snapshot(), a, 1.5)) == {"device_stalled", "kick_missing"}


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("event_idx", [False, True])
def test_driver_suppressed_calls_with_used_buffers_waiting(impl, make_q, fmt, event_idx):
    q = make_q(impl, fmt, 8, *([VIRTIO_F_EVENT_IDX] if event_idx else []))
    q.drv.enable_calls(False)
    q.add([1, 2])
    ch = q.dev.poll()
    q.dev.push_used(ch.id, ch.wlen)
    q.dev.flush()
    a, b = q.drv.snapshot(), q.drv.snapshot()
    found = diagnose(b, a, 2.5)
    assert codes(found) == {"calls_suppressed"}
    assert "driver suppressed used-buffer notifications" in found[0]["text"]
    assert "2 used buffers wait to be reclaimed" in found[0]["text"]
    assert "none reclaimed for 2.5 s" in found[0]["text"]
    q.drv.enable_calls(True)
    assert codes(diagnose(q.drv.snapshot(), a, 2.5)) == {"call_missing"}


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_used_descriptor_not_in_flight(impl, make_q, fmt):
    """A hostile device marks a buffer used that the driver never made available."""
    q = make_q(impl, fmt, 8)
    q.add([1])
    if fmt == "split":
        q.used["ring"][0] = (5, 0)
        q.used["idx"] = 1
    else:
        q.desc[0] = (DATA, 0, 6, VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED)
    d = q.drv.snapshot()
    found = diagnose(d)
    assert "used_not_inflight" in codes(found)
    text = next(f["text"] for f in found if f["code"] == "used_not_inflight")
    assert text.startswith("a descriptor is marked used but is not in flight")
    assert ("names id 5" if fmt == "split" else "slot 0 holds used id 6") in text
    with pytest.raises(errors.UsedIdNotInFlight):
        q.drv.reclaim()


def test_split_avail_idx_ahead_and_bad_head(impl, make_q):
    q = make_q(impl, "split", 8)
    q.avail["idx"] = 9
    assert "avail_idx_jump" in codes(diagnose(q.dev.snapshot()))
    q.avail["idx"] = 1
    q.avail["ring"][0] = 77
    found = diagnose(q.dev.snapshot())
    assert codes(found) == {"bad_head"}
    assert "bad_head" in codes(diagnose(q.mem_snap()))


@pytest.mark.parametrize("in_order", [False, True])
def test_split_heads_sharing_one_chain_listed_once(make_q, in_order):
    """A hostile split ring: every avail entry names a head of one chain that runs through the whole table.
    Each descriptor is listed once, in the chain that reaches it first (listing the shared tail once per head
    took 25 ms per snapshot at 256 entries, found as a fuzz timeout), and the decode stays linear."""
    n = 256
    q = make_q(importlib.import_module("rings.virtq"), "split", n, *([VIRTIO_F_IN_ORDER] if in_order else []))
    q.desc["flags"][:] = VIRTQ_DESC_F_NEXT
    q.desc["flags"][n - 1] = 0
    q.desc["next"][:] = (np.arange(n) + 1) % n
    q.avail["ring"][:] = np.arange(n)[::-1]
    q.avail["idx"] = n
    for snap in (q.mem_snap(), q.dev.snapshot()):
        listed = [slot for c in snap["chains"] for slot in c["slots"]]
        assert sorted(listed) == list(range(n)) or not listed, snap["side"]
    assert len(q.mem_snap()["chains"]) == n


def test_packed_memory_inconsistent_avail_bits_and_reserved_event(make_q):
    q = make_q(importlib.import_module("rings.virtq"), "packed", 8)
    q.desc["flags"][[1, 3]] = VIRTQ_DESC_F_AVAIL
    q.driver_event[1] = 3
    m = q.mem_snap()
    assert m["inferred"] == {"next_avail": None, "avail_wrap": None, "used_idx": None, "used_wrap": None}
    assert {r["owner"] for r in m["descriptors"]} == {"unknown"}
    assert {"avail_bits", "event_reserved"} <= codes(diagnose(m))
    assert "inferred from memory: next_avail=? avail_wrap=?" in format_snapshot(m)


def test_unpublished_buffers(impl, make_q):
    for fmt in ("split", "packed"):
        q = make_q(impl, fmt, 8)
        q.add([1, 1], publish=False)
        d = q.drv.snapshot()
        assert [c["state"] for c in d["chains"]] == ["added, not published"] * 2
        assert codes(diagnose(d)) == {"unpublished"}
        assert diagnose(d)[0]["level"] == "info"
        assert diagnose(q.drv.snapshot(), d, 1.0)[0]["level"] == "warning"


# --- control socket -------------------------------------------------------------------------------------------

@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "ctl.sock")


def test_control_socket_round_trip(impl, make_q, sock_path):
    q = make_q(impl, "packed", 8, shm=True)
    q.add([2, 1])
    holder = {"rx": None}
    server = ctl.ControlServer(sock_path).register("tx0", q.drv).register("dev0", q.dev)
    server.register("rx0", lambda: holder["rx"])  # created later
    server.register("wrapped", type("TxQueue", (), {"vq": q.drv})())  # a wrapper holding .vq
    with server.start():
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
        assert ctl.query(sock_path) == [{"name": "dev0", "format": "packed", "side": "device", "size": 8},
                                        {"name": "tx0", "format": "packed", "side": "driver", "size": 8},
                                        {"name": "wrapped", "format": "packed", "side": "driver", "size": 8}]
        with ctl.ControlClient(sock_path) as c:
            t, snap = c.snapshot("tx0")
            assert snap == q.drv.snapshot() and t > 0
            raw = c.raw("dev0")
            assert raw.snapshot() == q.dev.snapshot() and raw.meta["name"] == "dev0"
            r = c.request("raw", name="tx0")
            assert rawdump.loads(base64.b64decode(r["raw"])).snapshot() == q.drv.snapshot()
            assert c.request("snapshot", name="nope") == {
                "ok": False, "error": "no queue named 'nope' (have: dev0, rx0, tx0, wrapped)"}
            assert c.request("snapshot", name="rx0") == {  # registered, not there yet: said so, not "no queue"
                "ok": False, "error": "queue 'rx0' has no ring now (no peer connected, or its vring not started)"}
            assert c.snapshot("wrapped")[1] == q.drv.snapshot()
            holder["rx"] = q.dev
            assert c.snapshot("rx0")[1] == q.dev.snapshot()
            assert not c.request("frobnicate")["ok"]
            with pytest.raises(ctl.ControlError):
                c.snapshot("nope")
        with socket.socket(socket.AF_UNIX) as s:  # the plain-text form
            s.connect(sock_path)
            s.sendall(b"snapshot tx0\n")
            f = s.makefile("rb")
            assert json.loads(f.readline())["snapshot"] == q.drv.snapshot()
        out = server.handle(json.dumps({"cmd": "raw", "name": "tx0", "path": sock_path + ".raw"}))
        assert out["ok"] and rawdump.load(out["path"]).snapshot() == q.drv.snapshot()
    assert not os.path.exists(sock_path)


def test_control_socket_while_the_data_path_runs(make_q, sock_path):
    """Snapshots taken from another thread while the queue moves buffers: never an exception."""
    q = make_q(importlib.import_module("rings.virtq"), "split", 64)
    with ctl.ControlServer(sock_path).register("q", q.drv).start(), ctl.ControlClient(sock_path) as c:
        import threading
        stop = threading.Event()
        seen = []

        def ask():
            while not stop.is_set():
                seen.append(c.snapshot("q")[1]["indices"]["next_avail"])
        t = threading.Thread(target=ask)
        t.start()
        try:
            q.cycle(2000)
        finally:
            stop.set()
            t.join()
        assert seen and all(0 <= x <= 2000 for x in seen)


# --- broken-queue hook -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_broken_queue_writes_a_snapshot_and_names_it(impl, make_q, tmp_path, fmt):
    q = make_q(impl, fmt, 8)
    q.add([1])
    if fmt == "split":
        q.avail["idx"] = 100
    else:
        q.dev.poll()
        q.desc[1] = (DATA, 64, 99, VIRTQ_DESC_F_AVAIL)
    rawdump.set_snapshot_dir(tmp_path / "snaps")
    with pytest.raises(errors.RingError) as ei:
        q.dev.poll()
    err = ei.value
    assert err.snapshot_path and os.path.dirname(err.snapshot_path) == str(tmp_path / "snaps")
    assert str(err).endswith(f" (ring snapshot: {err.snapshot_path})")
    raw = rawdump.load(err.snapshot_path)
    snap = raw.snapshot()
    assert snap["broken"]["error"] == type(err).__name__
    assert raw.kind == "device" and raw.meta["error"] == type(err).__name__
    assert os.listdir(tmp_path / "snaps") == [os.path.basename(err.snapshot_path)]
    with pytest.raises(errors.RingError) as again:  # sticky: the same error, no second file
        q.dev.poll()
    assert again.value is err and len(os.listdir(tmp_path / "snaps")) == 1


def test_broken_hook_is_off_by_default_and_env_turns_it_on(impl, make_q, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    q = make_q(impl, "split", 8)
    q.add([1])
    q.used["ring"][0] = (5, 0)
    q.used["idx"] = 1
    with pytest.raises(errors.UsedIdNotInFlight) as ei:
        q.drv.reclaim()
    assert ei.value.snapshot_path is None and "ring snapshot" not in str(ei.value)
    assert os.listdir(tmp_path) == []
    q2 = make_q(impl, "split", 8)
    q2.add([1])
    q2.used["ring"][0] = (5, 0)
    q2.used["idx"] = 1
    monkeypatch.setenv(rawdump.ENV, str(tmp_path / "env"))
    with pytest.raises(errors.UsedIdNotInFlight) as ei:
        q2.drv.reclaim()
    assert ei.value.snapshot_path.startswith(str(tmp_path / "env"))
    assert "used_not_inflight" in codes(diagnose(rawdump.load(ei.value.snapshot_path).snapshot()))


def test_broken_hook_failure_does_not_hide_the_error(make_q, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rawdump.set_snapshot_dir(blocker)
    q = make_q(importlib.import_module("rings.virtq"), "split", 8)
    q.avail["idx"] = 100
    with pytest.raises(errors.AvailIdxJump) as ei:
        q.dev.poll()
    assert "(ring snapshot failed: " in str(ei.value) and ei.value.snapshot_path is None


# --- the command line -------------------------------------------------------------------------------------------

def test_cli_from_file_text_and_json(make_q, tmp_path, capsys):
    q = make_q(importlib.import_module("rings.virtq"), "packed", 8)
    q.add([2, 1, 1, 1, 1, 1, 1])
    path = rawdump.save(q.drv, tmp_path / "a.raw", meta={"name": "tx0"})
    assert cli.main(["dump", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== tx0 at ")
    assert "packed driver queue, size 8, normal" in out
    assert "chains: 7 (head id owner: slots, state)" in out
    assert "      0     0 device  0->1: available" in out
    assert "WARNING: ring full: all 8 descriptors are in flight (7 buffers) and none is used" in out
    assert "    1  device  0x0000000000120080         100  0x0082      0  WRITE|AVAIL" in out
    assert cli.main(["dump", "--from", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["snapshot"] == q.drv.snapshot() and doc["name"] == "tx0"
    assert [f["code"] for f in doc["diagnosis"]] == ["ring_full"]
    assert cli.main(["dump", "--from", str(path), "--no-descriptors"]) == 0
    assert "flag names" not in capsys.readouterr().out


@pytest.fixture
def shm_region():
    """One POSIX shared-memory region, closed and unlinked at teardown whatever the test did."""
    region = ShmRegion.create(MEMSIZE)
    try:
        yield region
    finally:
        region.close()
    assert not os.path.exists("/dev/shm" + region.name)


def test_cli_shm_attaches_read_only(shm_region, tmp_path, capsys):
    q = Q(importlib.import_module("rings.virtq"), MemoryTable([(BASE, MEMSIZE, shm_region.buf)]), "packed", 8)
    q.cycle(6)
    q.add([3])
    name = shm_region.name
    before = bytes(q.mem.view(BASE, MEMSIZE))
    args = ["dump", "--shm", name, "--fmt", "packed", "--size", "8", "--gpa", hex(BASE), "--features", "400000000"]
    assert cli.main(args + ["--raw", str(tmp_path / "m.raw")]) == 0
    out = capsys.readouterr().out
    assert "packed memory queue, size 8, normal" in out
    assert "inferred from memory: next_avail=1 avail_wrap=0" in out
    assert "      6     6 unknown 6->7->0: available, or skipped by the used descriptor at slot 5" in out
    assert "unknown: device: last_avail" in out
    assert bytes(q.mem.view(BASE, MEMSIZE)) == before
    assert rawdump.load(tmp_path / "m.raw").snapshot() == q.mem_snap()
    lay = q.layout
    assert cli.main(["dump", "--shm", name, "--fmt", "packed", "--size", "8", "--gpa", hex(BASE),
                     "--desc", hex(lay.desc), "--driver", hex(lay.driver), "--device", hex(lay.device),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["snapshot"] == q.mem_snap()
    with pytest.raises(SystemExit, match="cannot open shared memory"):
        cli.main(["dump", "--shm", "/vring-no-such-segment", "--fmt", "split", "--size", "8"])
    assert cli.main(["dump", "--shm", name, "--fmt", "split", "--size", "8", "--desc", "0"]) == 2   # usage
    assert "give all of --desc, --driver, --device" in capsys.readouterr().err


def test_cli_ctl_and_watch(make_q, sock_path, capsys):
    q = make_q(importlib.import_module("rings.virtq"), "split", 8)
    q.add([1, 1, 1])
    with ctl.ControlServer(sock_path).register("tx0", q.drv).register("dev0", q.dev).start():
        assert cli.main(["dump", "--ctl", sock_path, "dev0"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("== dev0 at ") and "split device queue, size 8" in out
        assert "available, not polled" in out
        assert cli.main(["dump", "--ctl", sock_path, "--json"]) == 0
        docs = json.loads(capsys.readouterr().out)
        assert [d["name"] for d in docs] == ["dev0", "tx0"]
        assert docs[1]["snapshot"] == q.drv.snapshot()
        assert cli.main(["dump", "--ctl", sock_path, "dev0", "--watch", "0.05", "--count", "3",
                         "--no-descriptors"]) == 0
        out = capsys.readouterr().out
        assert out.count("== dev0 at ") == 3
        assert "WARNING: device has 3 buffers available and has not consumed any for 0." in out
        assert "the device asked for kicks (used.flags=0) and is waiting for one" in out
        assert cli.main(["dump", "--ctl", sock_path, "dev0", "--watch", "0.02", "--count", "2", "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and [json.loads(x)[0]["name"] for x in lines] == ["dev0", "dev0"]
    with pytest.raises(SystemExit, match="cannot connect"):
        cli.main(["dump", "--ctl", sock_path])



def test_cli_ctl_backend_with_no_frontend_says_its_queues_have_no_ring(sock_path):
    """`vring dump --ctl` (every queue) on `vring vhost --ctl` before a frontend started its vrings: 4718d1c made
    `dump --ctl SOCK rx` say "has no ring now", but every-queue asked `list`, which skips those, and said "no
    queues registered" with rx and tx registered. The list reply names them (no_ring) and the dump says so."""
    server = ctl.ControlServer(sock_path).register("rx", lambda: None).register("tx", lambda: None)
    with server.start():
        assert server.handle("list") == {"ok": True, "queues": [], "no_ring": ["rx", "tx"]}
        with pytest.raises(SystemExit, match=r"no queue at .* has a ring now \(rx, tx registered: no peer "
                                             r"connected, or its vring not started\)"):
            cli.main(["dump", "--ctl", sock_path])
    with ctl.ControlServer(sock_path).start():
        with pytest.raises(SystemExit, match="no queues registered at"):
            cli.main(["dump", "--ctl", sock_path])


def test_cli_diff(impl, make_q, tmp_path, capsys):
    q = make_q(impl, "packed", 8)
    q.add([2, 1])
    a = rawdump.save(q.dev, tmp_path / "a.raw")
    ch = q.dev.poll()
    q.dev.push_used(ch.id[:1], ch.wlen[:1])
    q.dev.flush()
    b = rawdump.save(q.dev, tmp_path / "b.raw")
    assert cli.main(["dump", "--diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "indices: last_avail 0 -> 3 used_idx 0 -> 2" in out
    assert "counts: inflight 0 -> 1" in out
    assert ("slot 0: len 100 -> 200, flags 0x83 -> 0x8082, flag_names NEXT|WRITE|AVAIL -> WRITE|AVAIL|USED, "
            "owner device -> driver") in out
    assert "chain gone: head 0 id 0 slots 0->1 (device, available, not polled)" in out
    assert "chain changed: head 2: device, available, not polled -> device, polled" in out
    assert cli.main(["dump", "--diff", str(a), str(b), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["indices"] == {"last_avail": [0, 3], "used_idx": [0, 2]}
    assert [r["index"] for r in d["descriptors"]] == [0, 1]  # slot 1: owner device -> driver
    assert d["descriptors"][1]["changes"] == {"owner": ["device", "driver"]}
    same = rawdump.save(q.dev, tmp_path / "c.raw")
    assert cli.main(["dump", "--diff", str(b), str(same)]) == 0
    out = capsys.readouterr().out
    assert "indices: unchanged" in out and "descriptors changed: 0" in out
