"""What inflight tracking costs the backend's data path, in instructions per packet (callgrind; repeatable on a
busy machine, unlike timings).

One process: driver halves (rings.virtq.DriverQueue) and the backend's C loop (vhost.datapath.Datapath, the
same object `vring vhost` runs) over one region; the driver sends bursts of 64-byte frames and keeps the Rx
ring full, the backend forwards them (macswap) with and without a ``QueueTracking`` on both queues. Only the
backend's C call is counted (callgrind toggled on ``_cffi_f_vh_run``).

    python3 benchmarks/inflight_cost.py            # runs itself under valgrind for the 4 paths x on/off
    python3 benchmarks/inflight_cost.py --child split normal on   # one measurement (what valgrind runs)
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

GPA, SIZE, PKT, HDR, BURST, ROUNDS = 0x1000_0000, 256, 2048, 12, 32, 2000


def child(fmt, order, tracking):
    from rings.layout import VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, QueueLayout, bit
    from rings.shm import MemoryTable, ShmRegion
    from rings.virtq import DeviceQueue, DriverQueue
    from vhost.datapath import Datapath, Options
    packed = fmt == "packed"
    features = bit(VIRTIO_F_VERSION_1) | (bit(VIRTIO_F_RING_PACKED) if packed else 0) \
        | (bit(VIRTIO_F_IN_ORDER) if order == "in-order" else 0)
    region = ShmRegion.create(0x20000 + 4 * SIZE * PKT, prefix="vring-cost")
    try:
        mem = MemoryTable([(GPA, region.size, region.buf)])
        lays = [QueueLayout.contiguous(fmt, SIZE, GPA + i * 0x10000) for i in range(2)]
        drv = [DriverQueue(mem, lay, features) for lay in lays]
        dev = [DeviceQueue(mem, lay, features) for lay in lays]
        trk = (None, None)
        area = None
        if tracking == "on":
            from vhost.inflight import InflightArea, QueueTracking, create_area
            fd, size = create_area(2, SIZE, packed)
            area = InflightArea(fd, size, 0, 2, SIZE, packed)
            trk = tuple(QueueTracking(area, i, SIZE) for i in range(2))
            for t, q in zip(trk, dev):
                t.start(q, mem)
        kw = {"tracking": trk} if tracking == "on" else {}   # off: the call as before tracking existed
        dp = Datapath(dev[0], dev[1], features, Options(), **kw)
        buf = lambda s: GPA + 0x20000 + s * PKT   # noqa: E731
        rx_slots, tx_slots = np.arange(SIZE), np.arange(SIZE, 2 * SIZE)
        frame = bytes(HDR) + bytes.fromhex("aaaaaaaaaaaa" "bbbbbbbbbbbb") + bytes(64 - 12)
        for s in tx_slots:
            mem.write(buf(int(s)), frame)
        drv[0].add_simple(np.array([buf(int(s)) for s in rx_slots], np.uint64), np.full(SIZE, PKT, np.uint32),
                          rx_slots.astype(np.uint64), writable=True)
        drv[0].publish()
        free_tx = list(tx_slots)
        packets = 0
        for _ in range(ROUNDS):
            n = min(BURST, len(free_tx))
            slots = [free_tx.pop() for _ in range(n)]
            drv[1].add_simple(np.array([buf(int(s)) for s in slots], np.uint64), np.full(n, HDR + 64, np.uint32),
                              np.array(slots, np.uint64))
            drv[1].publish()
            dp.run(budget_us=1000, max_iters=1)    # one iteration: dequeue, enqueue, complete
            tok, _ = drv[1].reclaim()
            free_tx.extend(int(t) for t in tok)
            tok, _ = drv[0].reclaim()
            packets += len(tok)
            drv[0].add_simple(np.array([buf(int(t)) for t in tok], np.uint64), np.full(len(tok), PKT, np.uint32),
                              tok.copy(), writable=True)
            drv[0].publish()
        assert dp.stats()["rx_packets"] == packets == ROUNDS * BURST, dp.stats()
        print(f"PACKETS {packets}")
        dp = None
        if area is not None:
            trk = None
            area.close()
    finally:
        region.close()


def main():
    rows = []
    for fmt in ("split", "packed"):
        for order in ("normal", "in-order"):
            ir = {}
            for tracking in ("off", "on"):
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "cg.out")
                    r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                        "--collect-atstart=no", "--toggle-collect=_cffi_f_vh_run",
                                        sys.executable, __file__, "--child", fmt, order, tracking],
                                       capture_output=True, text=True)
                    m = re.search(r"PACKETS (\d+)", r.stdout)
                    tot = re.search(r"Collected : (\d+)", r.stderr)
                    if not (m and tot):
                        sys.exit(f"callgrind run failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                    ir[tracking] = int(tot.group(1)) / int(m.group(1))
            rows.append((fmt, order, ir["off"], ir["on"]))
            print(f"{fmt:6s} {order:8s} instructions/packet: tracking off {ir['off']:7.1f}, on {ir['on']:7.1f} "
                  f"(+{ir['on'] - ir['off']:.1f}, +{100 * (ir['on'] / ir['off'] - 1):.1f}%)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
