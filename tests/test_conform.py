"""`vring conform`: the conformance harnesses against our own peers both ways, against deliberately wrong peers
(the checks can fail, with evidence), and the command line (exit codes, one-line errors, JSON).

* ``conform device`` against ``vring vhost`` (a thread of this process) for split/packed x in-order/not x
  MRG_RXBUF x EVENT_IDX: every exercised row passes.
* ``conform driver`` against ``vring driver --mode macfwd``: every exercised row passes, the kick rows
  (EVT-12 / EVT-24: kicks arrive on the eventfd while notifications are enabled) included.
* Wrong peers (tests/conform_peers.py): a backend that uses buffers out of order under IN_ORDER or completes
  one twice, a looping backend that writes num_buffers one too high, puts an IN_ORDER batch entry at the
  batch's last used slot or gives Tx buffers their readable length as used len (each blamed on its own row
  only), one that writes Rx descriptors, the avail ring or 8 bytes past a used ring (SPLIT-V-04, SPLIT-L-08,
  SPLIT-L-02), a driver that offers an in-flight head again or changes a published descriptor (split and packed).
* Packed looping backends that stall the harness by a fault (used flags without AVAIL, the used position moved
  by 1 per list or past a buffer never used): the stall still names the row (exit 1); used ids taken from the
  head descriptor, where the harness planted garbage that is never an id in flight (PACKED-V-10).
* A correct packed driver whose Tx slots are given back by other buffers' used entries (completions out of
  order, the ring full) and refilled while the buffers published there are still held: no false PACKED-D-04.
"""
import json
import os
import subprocess
import sys

import pytest

from conform import frames
from tests.conform_peers import FaultyDevice, FaultyDriver, LoopDevice
from tests.procs import collect
from vhost.datapath import Options
from vhost.testing import ThreadedServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def conform(*args, timeout=120):
    """Run `vring conform ... --json`; returns (exit status, report or None, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "vring.cli", "conform", *args, "--json"], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    try:
        rep = json.loads(p.stdout) if p.stdout.strip() else None
    except json.JSONDecodeError:
        rep = None
    return p.returncode, rep, p.stderr


def rows(rep):
    return {r["id"]: r for r in rep["results"]}


def failed(rep):
    return {r["id"]: r["evidence"] for r in rep["results"] if r["status"] == "fail"}


def start_conform_driver(sock, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "vring.cli", "conform", "driver", "--socket", sock, "--json",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def start_vring_driver(sock, *args, out=subprocess.PIPE):
    """`vring driver --mode macfwd --drain 0` on ``sock``; ``out``: where its stdout and stderr go."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--mode", "macfwd",
                             "--drain", "0", *args], stdout=out, stderr=out, env=env, cwd=ROOT)


def wait_socket(path, proc, timeout=10):
    import stat
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return
        except FileNotFoundError:
            pass
        assert proc is None or proc.poll() is None, proc.stderr.read() if proc else ""
        time.sleep(0.02)
    raise AssertionError(f"no socket {path}")


def finish(proc, timeout=60):
    rc, out, err = collect(proc, timeout)
    return rc, (json.loads(out) if out.strip() else None), err


# --------------------------------------------------------------------------------------------- ours, both ways

DEVICE_CASES = [
    pytest.param(["--split", "--in-order"], id="split-inorder"),
    pytest.param(["--packed", "--in-order", "--mrg-rxbuf"], id="packed-inorder-mrg"),
    pytest.param(["--split", "--no-in-order", "--mrg-rxbuf", "--event-idx"], id="split-eventidx-mrg"),
    pytest.param(["--packed", "--no-in-order", "--event-idx"], id="packed-eventidx"),
]


@pytest.mark.parametrize("args", DEVICE_CASES)
def test_conform_device_against_vring_vhost(tmp_path, args):
    """Every device row the configuration exercises passes; the Tx queue writes batch entries (in-order)."""
    sock = str(tmp_path / "vh.sock")
    with ThreadedServer(sock, Options(fwd="macswap", in_order_batch=True)):
        rc, rep, err = conform("device", "--socket", sock, "--ring-size", "32", *args)
    assert rep is not None, err
    assert rc == 0 and not failed(rep) and rep["error"] is None, (failed(rep), rep["error"], err)
    r = rows(rep)
    packed = "--packed" in args
    for rid in (["PACKED-V-02", "PACKED-V-03", "PACKED-V-11", "PACKED-V-12", "MEM-07", "EVT-22"] if packed else
                ["SPLIT-V-02", "SPLIT-V-04", "SPLIT-V-09", "SPLIT-V-11", "SPLIT-V-12", "SPLIT-V-13", "SPLIT-V-15"]):
        assert r[rid]["status"] == "pass", r[rid]
    for rid in ("GEN-01", "EVT-17", "NET-17", "NET-21", "NET-33"):
        assert r[rid]["status"] == "pass", r[rid]
    if "--in-order" in args:
        assert r["INORDER-02"]["status"] == "pass"
        assert r["INORDER-13" if packed else "INORDER-08"]["status"] == "pass"   # batch entries were checked
    if "--mrg-rxbuf" in args:
        assert r["NET-29"]["status"] == r["NET-30"]["status"] == r["NET-31"]["status"] == "pass"
    else:
        assert r["NET-28"]["status"] == "pass"
    if "--event-idx" in args:
        assert r["EVT-23" if packed else "EVT-07"]["status"] == "pass"
    assert "0 not back" in rep["context"]["traffic"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_driver_against_vring_driver(tmp_path, packed):
    """`vring driver --mode macfwd` meets every device behaviour; frames come back once and intact, and it kicks
    while kicks are asked for."""
    sock = str(tmp_path / "drv.sock")
    harness = start_conform_driver(sock, "--seconds", "4")
    wait_socket(sock, harness)
    drv = start_vring_driver(sock, "--seconds", "30", "--packed" if packed else "--split")
    rc, rep, err = finish(harness)
    drv.communicate(timeout=30)
    assert rep is not None, err
    kick_row = "EVT-24" if packed else "EVT-12"
    assert not failed(rep) and rep["error"] is None, (failed(rep), rep["error"])
    r = rows(rep)
    for rid in (["PACKED-D-03", "PACKED-D-04", "PACKED-D-14", "INORDER-11", "EVT-22"] if packed else
                ["SPLIT-D-13", "SPLIT-D-14", "SPLIT-L-08", "INORDER-03", "INORDER-06", "INORDER-09", "INORDER-10"]):
        assert r[rid]["status"] == "pass", r[rid]
    for rid in ("NET-06", "NET-25", "NET-32", "MEM-11", "SPLIT-D-15", "EVT-03", "FEAT-02", "NOTIF-08"):
        assert r[rid]["status"] == "pass", r[rid]
    assert r[kick_row]["status"] == "pass", r[kick_row]
    assert " 0 lost" in rep["context"]["traffic"]
    assert [p["name"] for p in rep["scenarios"]] == ["per-buffer", "kicks", "batches", "ring-full", "late",
                                                     "spurious-calls"]
    assert all(p["buffers"] > 0 for p in rep["scenarios"]), rep["scenarios"]


# --------------------------------------------------------------------------------------------- wrong peers

@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_inorder_02_catches_out_of_order_use(tmp_path, packed):
    """A backend that negotiates IN_ORDER but writes used entries last buffer first: the harness reads the
    first entry as a batch and finds the skipped slot written, naming a buffer of the batch."""
    sock = str(tmp_path / "bad.sock")
    dev = FaultyDevice(sock, "reorder")
    wait_socket(sock, None)
    rc, rep, err = conform("device", "--socket", sock, "--ring-size", "32", "--in-order",
                           "--packed" if packed else "--split", "--scenarios", "batches", "--rx-wait", "0.2")
    assert dev.join() and dev.error is None, dev.error
    assert rc == 1, (rc, err)
    f = failed(rep)
    assert "INORDER-02" in f, f
    assert ("PACKED-V-09" if packed else "INORDER-08") in f, f
    assert any("was used after buffer" in e or "inside an in-order batch" in e for e in f["INORDER-02"]), f


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_conform_device_inorder_02_catches_out_of_order_use_published_one_entry_at_a_time(tmp_path, seed):
    """Found by attack43: split, IN_ORDER, used entries last buffer first, each published on its own. The harness
    read the first entry (a buffer beyond what used idx covers in avail order) as a short batch and stopped:
    INORDER-07, or INORDER-02, depending on timing. The entry after it now tells which: INORDER-02, every run.
    When the harness looks only after both entries are out (a loaded machine: CI beside a benchmark), used idx
    covers the two and the state in memory is a batch of two whose skipped slot names its older buffer: INORDER-02
    then comes with INORDER-08, worded from that slot; either wording names the order."""
    sock = str(tmp_path / "bad.sock")
    dev = FaultyDevice(sock, "reorder-apart")
    wait_socket(sock, None)
    rc, rep, err = conform("device", "--socket", sock, "--ring-size", "32", "--in-order", "--split",
                           "--scenarios", "batches", "--rx-wait", "0.2", "--seed", str(seed))
    assert dev.join() and dev.error is None, dev.error
    assert rc == 1, (rc, err)
    f = failed(rep)
    assert "INORDER-02" in f and "INORDER-07" not in f, f
    first = f["INORDER-02"][0]
    assert "buffers used out of order" in first or "which was made available after it" in first, f


def test_conform_driver_that_leaves_early_is_no_pass(tmp_path):
    """Found by attack43: a driver that closed the connection half a second into a 4 s run got exit 0 (only a
    note said so), though the phases after it never ran. It is an early end (exit 2, PeerGone), and the rows
    it left unexercised say why."""
    sock = str(tmp_path / "drv.sock")
    harness = start_conform_driver(sock, "--seconds", "4")
    wait_socket(sock, harness)
    drv = start_vring_driver(sock, "--seconds", "0.5", out=subprocess.DEVNULL)
    rc, rep, err = finish(harness)
    drv.wait(30)
    assert rc == 2 and rep["error"].startswith("PeerGone: the driver closed the connection"), (rc, rep, err)
    r = rows(rep)
    assert r["INORDER-06"]["status"] == "not exercised" and "the run ended early" in r["INORDER-06"]["note"], r


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_split_v_15_catches_double_completion(tmp_path, packed):
    """A backend that writes a second used entry for a buffer it already used."""
    sock = str(tmp_path / "bad.sock")
    dev = FaultyDevice(sock, "double")
    wait_socket(sock, None)
    rc, rep, err = conform("device", "--socket", sock, "--ring-size", "32", "--packed" if packed else "--split",
                           "--scenarios", "batches", "--rx-wait", "0.2")
    assert dev.join() and dev.error is None, dev.error
    assert rc == 1, (rc, err)
    f = failed(rep)
    if packed:   # nothing was in flight any more: the extra used descriptor sits in a slot not made available
        assert "PACKED-V-04" in f and "a used descriptor" in f["PACKED-V-04"][0], f
    else:
        assert "SPLIT-V-15" in f and "not a head in flight" in f["SPLIT-V-15"][0], f
        assert rep["error"] and "used id not in flight" in rep["error"]


def run_loop_device(tmp_path, fault, *args, packed=False):
    """`vring conform device` (ring 32) against a LoopDevice with ``fault`` that fails the run: (report, failed)."""
    sock = str(tmp_path / "loop.sock")
    dev = LoopDevice(sock, fault, packed=packed)
    rc, rep, err = conform("device", "--socket", sock, "--ring-size", "32", "--packed" if packed else "--split",
                           "--rx-wait", "0.3", *args)
    assert dev.join() and dev.error is None, dev.error
    assert dev.faults > 0, "the fault never struck"
    assert rc == 1 and rep is not None, (rc, err)
    return rep, failed(rep)


def conform_loop_device(tmp_path, fault, *args):
    """Split, in-order: the run goes to its end and every frame comes back: (report, failed)."""
    rep, f = run_loop_device(tmp_path, fault, "--in-order", *args)
    assert rep["error"] is None and "0 not back" in rep["context"]["traffic"], (rep["error"], rep["context"])
    return rep, f


def test_conform_device_net_29_catches_num_buffers_one_too_high(tmp_path):
    """Merged packets with num_buffers one above the buffers the frame fills: NET-29 fails with the frame's
    length and the used entries; the packets are still taken apart by what the frame needs (no NET-30/31,
    length or duplicate-frame cascade)."""
    rep, f = conform_loop_device(tmp_path, "num-buffers+1", "--mrg-rxbuf", "--scenarios", "batches,mergeable")
    assert set(f) == {"NET-29"}, f
    assert "spans" in f["NET-29"][0] and "belong to the next packet" in f["NET-29"][0], f
    r = rows(rep)
    assert r["NET-30"]["passes"] and r["NET-31"]["passes"], (r["NET-30"], r["NET-31"])


def test_conform_device_net_29_catches_num_buffers_one_too_low(tmp_path):
    """The mirror: num_buffers one below the buffers the frame fills. NET-29 alone fails, naming the span; the
    buffer it leaves out is not taken for the next packet (no length row, NET-30/31 or data cascade)."""
    rep, f = conform_loop_device(tmp_path, "num-buffers-1", "--mrg-rxbuf", "--scenarios", "batches,mergeable")
    assert set(f) == {"NET-29"}, f
    assert "spans" in f["NET-29"][0], f


def test_conform_device_inorder_08_catches_batch_entry_at_last_slot(tmp_path):
    """An IN_ORDER Tx batch's entry written at the batch's last used slot (used idx moved by the batch): the
    first slot still holds the harness's canary; INORDER-08 names both slots, and the run goes on."""
    rep, f = conform_loop_device(tmp_path, "batch-last", "--scenarios", "batches")
    assert set(f) == {"INORDER-08"}, f
    assert "still holds the canary" in f["INORDER-08"][0] and "the batch's last slot" in f["INORDER-08"][0], f
    assert rows(rep)["INORDER-07"]["status"] == "pass"


def test_conform_device_net_21_split_v_11_catch_tx_used_len(tmp_path):
    """Tx buffers completed with their readable length as used len: SPLIT-V-11 and NET-21 (whose checklist text
    says the Tx used len is 0) both fail; nothing else does."""
    rep, f = conform_loop_device(tmp_path, "tx-len", "--scenarios", "batches")
    assert set(f) == {"SPLIT-V-11", "NET-21"}, f
    assert "used len" in f["NET-21"][0] and "readable bytes" in f["NET-21"][0], f


def test_conform_device_split_v_09_catches_rx_packet_never_written(tmp_path):
    """Rx buffers used with len header + frame, but only the header written (the frame never is): the packet
    bytes are still the harness's canary. SPLIT-V-09 fails; before, the packets counted as foreign frames, the
    Rx rows as not exercised, and the run passed."""
    rep, f = conform_loop_device(tmp_path, "hdr-only", "--scenarios", "batches")
    assert set(f) == {"SPLIT-V-09"}, f
    assert "still hold the canary" in f["SPLIT-V-09"][0], f


def test_conform_device_split_v_09_catches_rx_frame_with_damaged_stamp(tmp_path):
    """Every frame delivered with one byte of the harness's stamp changed, the rest intact: SPLIT-V-09 fails with
    the changed stamp. Before, such frames counted as foreign (not ours), the harness concluded that the backend
    does not bring frames back (the Rx rows not exercised), and the run passed (exit 0)."""
    rep, f = conform_loop_device(tmp_path, "stamp", "--scenarios", "batches")
    assert set(f) == {"SPLIT-V-09"}, f
    assert "whose stamp was changed to" in f["SPLIT-V-09"][0], f
    assert " 0 foreign" in rep["context"]["traffic"], rep["context"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_evt_05_evt_24_catch_notification_before_the_used_index(tmp_path, packed):
    """Flags 0 / ENABLE: the device sent the Tx notification, then 20 ms later published the used entries, and
    nothing after. A driver woken by that call finds nothing new and sleeps. EVT-05 (packed: EVT-24) fails with
    where the last call was read; before, any call in the round counted and the run passed (exit 0)."""
    rep, f = run_loop_device(tmp_path, "call-early", "--in-order", "--scenarios", "batches", packed=packed)
    rid = "EVT-24" if packed else "EVT-05"
    assert set(f) == {rid}, f
    assert "came before the used " + ("descriptors" if packed else "index") + " it announces" in f[rid][0], f


def test_conform_device_evt_05_catches_notifications_on_the_other_queues_eventfd(tmp_path):
    """Each queue's used buffer notifications written to the other queue's call eventfd: every round where both
    queues ask for them passed (exit 0). The notify-off scenario now has rounds where only one queue asks: the
    one that asks gets nothing (EVT-05 fails), the other gets calls while suppressed (a SHOULD NOT: warned)."""
    rep, f = conform_loop_device(tmp_path, "call-swap", "--scenarios", "batches,notify-off")
    assert set(f) == {"EVT-05"}, f
    assert any("sent on the wrong eventfd?" in e for e in f["EVT-05"]), f


def test_conform_device_evt_07_catches_notification_only_at_the_first_index(tmp_path):
    """EVENT_IDX done naively: a notification only when a publication's first used index is used_event, so a
    batch that crosses used_event further in goes unannounced. The harness placed used_event only at the next
    index, where the naive rule agrees with vring_need_event, and the run passed; it now also places it inside and
    past the round, and EVT-07 fails with the crossing."""
    rep, f = conform_loop_device(tmp_path, "evt-first", "--event-idx", "--scenarios", "batches")
    assert set(f) == {"EVT-07"}, f
    assert "crossing used_event" in f["EVT-07"][0], f


def test_conform_device_evt_23_catches_notification_only_at_the_first_used_slot(tmp_path):
    """Packed EVENT_IDX done naively: DESC mode notifies only when a publication's first used slot is the event
    slot. The harness put the event slot only at the next used slot, where that agrees with the spec, and the run
    passed; it now also places it inside and past the round, and EVT-23 fails over the slots crossed."""
    rep, f = run_loop_device(tmp_path, "evt-first", "--in-order", "--event-idx", "--scenarios", "batches",
                             packed=True)
    assert set(f) == {"EVT-23"}, f
    assert "over the event slot" in f["EVT-23"][0], f


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_gen_01_catches_rx_buffers_used_before_driver_ok(tmp_path, packed):
    """A backend running its rings before DRIVER_OK loops the early Tx frames into Rx buffers (unannounced) and
    uses the Tx buffers only after DRIVER_OK: GEN-01 fails. On packed rings only the Tx heads were compared, and
    the run passed."""
    rep, f = run_loop_device(tmp_path, "gen01", "--in-order", "--scenarios", "start", packed=packed)
    assert set(f) == {"GEN-01"}, f
    assert ("rx slot" if packed else "(rx)") in f["GEN-01"][0], f


def test_conform_device_split_v_04_catches_rx_descriptor_write(tmp_path):
    """Each used Rx buffer's descriptor gets the bytes written as its len: SPLIT-V-04 fails with the entry and its
    len. Before, publishing the Rx refill (inside the wait, after every Rx completion) re-copied the whole
    descriptor table into the harness's copy, the device's write was taken as the harness's own and the run
    passed; now the copies take only what the harness writes, and are compared before it writes again."""
    rep, f = conform_loop_device(tmp_path, "rx-desc-write", "--scenarios", "batches")
    assert set(f) == {"SPLIT-V-04"}, f
    assert all(e.startswith("rx: the device wrote descriptor table entry") for e in f["SPLIT-V-04"]), f
    assert "len 1536 -> " in f["SPLIT-V-04"][0], f


def test_conform_device_split_l_08_catches_rx_avail_ring_write(tmp_path):
    """The avail slots the device read last overwritten with 0xFFFF as Rx buffers are used: SPLIT-L-08 fails with
    the slot and the values (before, absorbed into the harness's copy of the avail ring as SPLIT-V-04 above)."""
    rep, f = conform_loop_device(tmp_path, "rx-avail-write", "--scenarios", "batches")
    assert set(f) == {"SPLIT-L-08"}, f
    assert f["SPLIT-L-08"][0].startswith("rx: the device wrote the avail ring (driver area): ring[") and \
        "-> 0xffff" in f["SPLIT-L-08"][0], f


def test_conform_device_split_l_02_catches_write_past_used_ring(tmp_path):
    """8 bytes written just past the end of the Tx used ring (6 + 8*QS bytes), memory given to no one: the gaps
    around the ring areas hold a canary, and SPLIT-L-02 fails naming the bytes and the area they follow.
    Before, only the ring areas were compared and the run passed."""
    rep, f = conform_loop_device(tmp_path, "scribble", "--scenarios", "batches")
    assert set(f) == {"SPLIT-L-02"}, f
    assert "-> deadbeefdeadbeef), just past the end of vring 1's used ring" in f["SPLIT-L-02"][0], f
    assert len(f["SPLIT-L-02"]) == 1, f   # the same bytes written again: reported once


def test_conform_device_packed_v_02_catches_used_flags_without_avail(tmp_path):
    """Packed Tx used descriptors marked USED=1 AVAIL=0 on a lap with wrap counter 1: nothing the harness can
    consume, the run stalls. Before it ends, PACKED-V-02 fails with the slots and their flags (exit 1, the stall
    reported too); before, the run ended as a stall only (exit 2), PACKED-V-02 passing from the Rx side."""
    rep, f = run_loop_device(tmp_path, "no-avail", "--in-order", "--stall", "1", "--scenarios", "start",
                             packed=True)
    assert set(f) == {"PACKED-V-02"}, f
    assert "slot 0 (the device's, wrap 1) flags 0x80 -> 0x8000 (AVAIL=0 USED=1; id 0 len 0)" in f["PACKED-V-02"][0], f
    assert rep["error"].startswith("Stalled:"), rep["error"]


@pytest.mark.parametrize("in_order", [True, False], ids=["inorder", "no-inorder"])
def test_conform_device_packed_v_09_catches_used_position_advanced_by_one_per_list(tmp_path, in_order):
    """Packed Tx: the used position moved by 1 per buffer, whatever the length of its list (the naive skip). The
    used descriptors land in slots the harness counts as skipped inside a used list; it waits for the next one
    at the slot after the list and stalls. Before it ends, PACKED-V-09 fails with those slots (with IN_ORDER,
    INORDER-13 too: written inside a batch); before, the stall ended the run unexplained (exit 2), or (without
    IN_ORDER) blamed on INORDER-15 with PACKED-V-09 not exercised. That guess is left out when the slots name
    the fault."""
    rep, f = run_loop_device(tmp_path, "adv1", "--in-order" if in_order else "--no-in-order", "--stall", "1",
                             "--scenarios", "start,chains", packed=True)
    assert set(f) == ({"PACKED-V-09", "INORDER-13", "INORDER-02"} if in_order else {"PACKED-V-09"}), f
    assert "(a slot skipped inside a used list) changed: a used descriptor" in f["PACKED-V-09"][0], f
    assert rep["error"].startswith("Stalled:"), rep["error"]


def test_conform_device_inorder_13_catches_used_position_moved_past_unused_buffer(tmp_path):
    """Packed, IN_ORDER: a batch's one used descriptor names its second-to-last buffer (the position moved by the
    whole batch): the last buffer is never used and the run stalls. Before it ends, one more Tx buffer is
    published; its used descriptor lands past the oldest buffer's first slot, still the driver's: INORDER-13
    fails with both slots. Before, the run ended as a stall only (exit 2)."""
    rep, f = run_loop_device(tmp_path, "short-id", "--in-order", "--stall", "1", "--scenarios", "start",
                             packed=True)
    assert set(f) == {"INORDER-13"}, f
    assert ("slot 4 holds a used descriptor (id 4 len 0, flags 0x8080), but slot 3, the next used position (where "
            "buffer 3, the oldest in flight, starts)") in f["INORDER-13"][0], f
    assert rep["error"].startswith("Stalled:") and "4 frames sent" in rep["context"]["traffic"], rep


def test_conform_device_packed_v_10_catches_id_from_head_descriptor(tmp_path):
    """Packed Tx used ids read from the list's first descriptor, where the harness plants garbage ids. The
    garbage is never an id in flight, so the used id is always one not in flight: PACKED-V-10 and PACKED-V-11
    fail. Before, the garbage could be the id of another buffer in flight (seed 34 here): that buffer counted as
    used, the run stalled on the one really used, blamed on INORDER-15, PACKED-V-10 passing."""
    rep, f = run_loop_device(tmp_path, "head-id", "--no-in-order", "--seed", "34", "--stall", "1",
                             "--scenarios", "start,batches,chains", packed=True)
    assert set(f) == {"PACKED-V-10", "PACKED-V-11"}, f
    assert "is a garbage id the harness wrote in a non-last descriptor" in f["PACKED-V-10"][0], f
    assert "used id not in flight" in rep["error"], rep["error"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_split_v_09_mem_07_catch_rx_frame_with_changed_run_id(tmp_path, packed):
    """Every frame delivered with one bit of its stamp's run id flipped, the rest intact: the data row (SPLIT-V-09,
    packed MEM-07) fails with the stamp as changed and as sent (the stamp's check value tells it from an intact
    stamp of an earlier run, which stays foreign), and the frames count as back. Before, they counted as an
    earlier run's, the harness concluded that the backend does not bring frames back (Rx rows not exercised) and
    the run passed."""
    other_run = frames.make_frame(100, 7, 1)
    flipped = bytearray(other_run)
    flipped[frames.STAMP_OFF + 4] ^= 1
    assert frames.stamp_of(other_run, 6) is None and frames.read_stamp(other_run) == (7, 1)   # foreign
    assert frames.read_stamp(bytes(flipped)) is None   # damaged
    rep, f = run_loop_device(tmp_path, "stamp-run", "--in-order", "--mrg-rxbuf", "--scenarios", "batches",
                             packed=packed)
    rid = "MEM-07" if packed else "SPLIT-V-09"
    assert set(f) == {rid}, f
    assert "whose stamp was changed to" in f[rid][0] and "was sent with" in f[rid][0], f
    assert " 0 foreign" in rep["context"]["traffic"] and "0 not back" in rep["context"]["traffic"], rep["context"]
    assert not any("did not bring frames back" in n for n in rep["notes"]), rep["notes"]


@pytest.mark.parametrize("fault,rid,size", [("hdr20", "NET-02", 20), ("hdr10", "NET-03", 10)])
@pytest.mark.parametrize("packed,mrg", [(False, False), (False, True), (True, True)],
                         ids=["split", "split-mrg", "packed-mrg"])
def test_conform_device_net_02_net_03_catch_rx_header_of_another_size(tmp_path, fault, rid, size, packed, mrg):
    """Frames delivered after a 20-byte header (the HASH_REPORT layout) or the legacy 10-byte one, neither what
    the negotiated features give (12): the row of that header size fails with the offset the frame's stamp was
    found at, nothing else (num_buffers is not read from a header that has none). Before, the frames counted as
    foreign, the Rx rows as not exercised, and the run passed."""
    rep, f = run_loop_device(tmp_path, fault, "--in-order", "--scenarios", "batches,mergeable",
                             *(["--mrg-rxbuf"] * mrg), packed=packed)
    assert rep["error"] is None and "0 not back" in rep["context"]["traffic"], (rep["error"], rep["context"])
    assert set(f) == {rid}, f
    assert f"the device wrote a {size}-byte virtio-net header" in f[rid][0] and "the frame after it: intact" in \
        f[rid][0], f
    assert " 0 foreign" in rep["context"]["traffic"], rep["context"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("mrg", [False, True], ids=["one-buffer", "mrg"])
def test_conform_device_inorder_10_catches_skipped_rx_buffer_never_written(tmp_path, packed, mrg):
    """IN_ORDER Rx batches that skip a buffer the device never wrote (the batch entry names the next one, which
    holds the frame): INORDER-10 fails naming the skipped buffer and the entry; the canary in it is not parsed as
    a packet (no header, num_buffers or data rows fail), and no note says the device wrote no batch entry."""
    rep, f = run_loop_device(tmp_path, "rx-skip", "--in-order", "--scenarios", "batches", *(["--mrg-rxbuf"] * mrg),
                             packed=packed)
    assert rep["error"] is None and "0 not back" in rep["context"]["traffic"], (rep["error"], rep["context"])
    assert set(f) == {"INORDER-10"}, f
    assert "was skipped by the in-order batch entry for buffer" in f["INORDER-10"][0], f
    assert "the device wrote none of them" in f["INORDER-10"][0], f


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_split_v_11_packed_v_12_blame_a_batch_entry_len_not_the_skipped_buffers(tmp_path, packed):
    """Found by attack43: IN_ORDER Rx batches of merged packets whose skipped buffers were written whole and
    right, and whose batch entry's len is one byte too long, failed INORDER-10 ("skipped by an in-order batch")
    every time, and the used-len row only by chance. Bytes that all match the frame put the blame on the len."""
    rep, f = run_loop_device(tmp_path, "rx-batch-len+1", "--in-order", "--mrg-rxbuf", "--scenarios", "mergeable",
                             packed=packed)
    row = "PACKED-V-12" if packed else "SPLIT-V-11"
    assert row in f and "INORDER-10" not in f, f
    assert rows(rep)["INORDER-10"]["status"] == "pass", rows(rep)["INORDER-10"]


@pytest.mark.parametrize("fault", ["rx-batch-len-1", "rx-len-1"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_split_v_11_packed_v_12_blame_a_batch_entry_len_one_short_and_nothing_else(tmp_path, packed,
                                                                                                  fault):
    """The same batches with the batch entry's len one byte short of what was written: the frame's buffers
    seemed not to hold all of it, so the next packet's buffers were counted in, and NET-29/30/31/33-35, INORDER-10
    and SPLIT-V-13/PACKED-V-18 failed too (eight rows for one wrong len). A buffer that begins the next packet
    ends the frame's span: only the used-len row fails. The same for every packet's last len one short, packets
    of one buffer included (attack51: the span's second buffer was never looked at)."""
    rep, f = run_loop_device(tmp_path, fault, "--in-order", "--mrg-rxbuf", "--scenarios", "mergeable",
                             packed=packed)
    row = "PACKED-V-12" if packed else "SPLIT-V-11"
    assert set(f) == {row}, f
    assert rows(rep)["NET-29"]["status"] == "pass" and rows(rep)["INORDER-10"]["status"] == "pass", f


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_device_net_03_alone_when_a_short_len_meets_a_header_of_another_size(tmp_path, packed):
    """Found by attack50: the next packet's start was looked for after a header of the negotiated size, not the
    size the device writes; with a 10-byte header and a merged packet's last len one byte short, the next
    packet's buffers were counted in again: NET-30/31/33-35 (frame bytes read as a header), PACKED-V-16/18."""
    rep, f = run_loop_device(tmp_path, "hdr10-len-1", "--in-order", "--mrg-rxbuf", "--scenarios", "mergeable",
                             packed=packed)
    assert "NET-03" in f and not set(f) - {"NET-03", "PACKED-V-12" if packed else "SPLIT-V-11"}, f


def test_conform_device_inorder_10_catches_a_skipped_buffer_holding_a_short_frame(tmp_path):
    """Found by attack44, a regression of the len blame above: a skipped buffer (one used entry for two frames'
    buffers, no MRG_RXBUF) holding a frame shorter than the buffer is what INORDER-10 forbids; its canary tail
    past the frame made "only the length is wrong" true, and INORDER-10 passed. A skipped buffer's length is
    assumed, not given: only the last buffer's len can be blamed."""
    rep, f = run_loop_device(tmp_path, "rx-pair-short", "--in-order", "--no-mrg-rxbuf", "--scenarios", "batches")
    assert "INORDER-10" in f and rows(rep)["INORDER-10"]["status"] == "fail", f
    assert "SPLIT-V-11" not in f, f


def test_conform_device_split_v_08_catches_used_len_set_after_used_idx(tmp_path):
    """Used entries published with their ids, used idx moved, the lens written 20 ms later: SPLIT-V-08 fails on
    both queues naming the slot, the canary the len still held and the len it became; the buffers are judged by
    that len (before, SPLIT-V-11 and NET-21 failed on the harness's own canary as if it were the device's len)."""
    rep, f = conform_loop_device(tmp_path, "len-late", "--scenarios", "batches", "--rx-wait", "2")   # 20 ms a frame
    assert set(f) == {"SPLIT-V-08"}, f
    ev = f["SPLIT-V-08"]
    assert any(e.startswith("tx:") for e in ev) and any(e.startswith("rx:") for e in ev), ev
    assert "with len 0xc0decafe, the canary the harness wrote there" in ev[0] and "it became" in ev[0], ev


def test_conform_driver_split_d_13_catches_reoffered_head(tmp_path):
    """A driver that puts a head still in flight into the avail ring again: the device refuses the ring."""
    sock = str(tmp_path / "drv.sock")
    harness = start_conform_driver(sock, "--seconds", "5", "--phases", "per-buffer")
    wait_socket(sock, harness)
    drv = FaultyDriver(sock, "reoffer")
    rc, rep, err = finish(harness)
    assert drv.join() and drv.error is None, drv.error
    assert drv.faults == 1
    assert rc == 1 and rep is not None, err
    f = failed(rep)
    assert "SPLIT-D-13" in f and "BufferIdInUse" in f["SPLIT-D-13"][0], f
    assert "broke the ring" in rep["error"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_driver_split_d_14_packed_d_04_catch_descriptor_changed_after_publication(tmp_path, packed):
    """A driver that changes a descriptor's length ~3 ms after publishing it; the device holds its completions
    5-30 ms (phase late) and reads the chain again before completing it."""
    sock = str(tmp_path / "drv.sock")
    harness = start_conform_driver(sock, "--seconds", "3", "--phases", "late")
    wait_socket(sock, harness)
    drv = FaultyDriver(sock, "late-write", packed=packed)
    rc, rep, err = finish(harness)
    assert drv.join() and drv.error is None, drv.error
    assert rc == 1 and rep is not None, err
    f = failed(rep)
    ids = ("PACKED-D-04", "MEM-04") if packed else ("SPLIT-D-14", "MEM-02")
    assert all(rid in f for rid in ids), f
    assert "descriptor bytes changed between the publication and the completion" in f[ids[0]][0]


def test_conform_driver_packed_d_04_mem_04_slots_given_back_by_other_used_entries(tmp_path):
    """No false PACKED-D-04 / MEM-04: packed, no IN_ORDER, Tx chains of 2 descriptors (header chained), the ring
    full and Tx buffers completed in random order by a device that lets the driver refill each used entry's slots
    before the next one. A used entry at slot P for a 2-descriptor buffer gives back P and P+1; the driver may
    write a new descriptor at P+1 while it is a slot of a buffer the device still holds (DPDK virtio_user did
    under load), so that slot is not the held buffer's any more when it is completed."""
    sock = str(tmp_path / "drv.sock")
    dev = FaultyDevice(sock, "patient", phases=("ring-full",), seconds=3)
    wait_socket(sock, None)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    drv = subprocess.Popen([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--mode", "txonly",
                            "--seconds", "30", "--drain", "0", "--packed", "--no-in-order", "--no-indirect",
                            "--tx-hdr", "chain", "--ring-size", "64"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert dev.join(60) and dev.error is None, dev.error
    finally:
        collect(drv, 30)
    rep = dev.harness.report.as_dict()
    assert not failed(rep) and rep["error"] is None, (failed(rep), rep["error"])
    r = rows(rep)
    assert r["PACKED-D-04"]["status"] == r["MEM-04"]["status"] == "pass", r["PACKED-D-04"]
    assert dev.harness.overlaps > 0   # the case arose: slots of held buffers were given back


# --------------------------------------------------------------------------------------------- command line

def test_conform_usage_and_connection_errors_exit_2_with_one_line(tmp_path):
    # a run that ended on a connection error still prints its --json document, with the error in it
    rc, rep, err = conform("device", "--socket", str(tmp_path / "nobody.sock"))
    assert rc == 2 and rep["exit_code"] == 2 and rep["error"].startswith("PeerGone:"), rep
    assert rep["role"] == "device" and not failed(rep)
    assert err.strip().count("\n") == 0 and err.startswith("vring conform: PeerGone:"), err
    p = subprocess.run([sys.executable, "-m", "vring.cli", "conform", "device", "--socket",
                        str(tmp_path / "nobody.sock")], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith("vring conform: PeerGone:"), p
    rc, rep, err = conform("device", "--socket", str(tmp_path / "x.sock"), "--ring-size", "3")
    assert rc == 2 and err.startswith("vring conform: ConfigError:") and "power of 2" in err, err
    rc, rep, err = conform("device", "--socket", str(tmp_path / "x.sock"), "--scenarios", "nope")
    assert rc == 2 and "unknown scenario" in err, err
    rc, rep, err = conform("driver", "--socket", str(tmp_path / "y.sock"), "--seconds", "0")
    assert rc == 2 and err.startswith("vring conform: ConfigError:"), err
    assert rep is None   # usage errors: no run, no document
    rc, rep, err = conform("driver", "--socket", str(tmp_path / "z.sock"), "--wait", "0.3")
    assert rc == 2 and err.startswith("vring conform: ProtocolTimeout:") and "nobody connected" in err, err
    assert rep["role"] == "driver" and rep["error"].startswith("ProtocolTimeout:") and rep["exit_code"] == 2
    assert not os.path.exists(tmp_path / "z.sock")


def test_report_table_json_and_exit_codes():
    from conform.report import Report
    r = Report("device", ["SPLIT-V-15", "NET-28", "EVT-05"])
    r.ok("SPLIT-V-15", 3)
    r.warn("EVT-05", "2 notifications while suppressed")
    assert r.exit_code() == 0 and r.status("NET-28") == "not exercised" and r.status("EVT-05") == "warn"
    for _ in range(7):
        r.fail("NET-28", "num_buffers 0x0fc6")
    assert r.exit_code() == 1
    t = r.table()
    assert "NET-28" in t and "FAIL: num_buffers 0x0fc6" in t and "(7 failed observations in all)" in t
    d = json.loads(r.to_json())
    assert d["counts"] == {"pass": 1, "fail": 1, "warn": 1, "not exercised": 0} and d["exit_code"] == 1
    assert [x["evidence"] for x in d["results"] if x["id"] == "NET-28"] == [["num_buffers 0x0fc6"]]
    with pytest.raises(ValueError):
        Report("device", ["NOT-AN-ID"])
