"""Hostile ring contents against a running `vring vhost`: random descriptors/avail/flags, racing rewrites.
Usage: python3 attack/vhost_ring_garbage.py [rounds]"""
import os, sys, time, signal, random
from common import *
from vhost.testing import ScriptedFrontend, frame, GPA_BASE, RING_AREA

SOCK = f"/tmp/review-a-ring-{os.getpid()}.sock"
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
p = start_vhost(SOCK)
bad = 0
try:
    for r in range(rounds):
        rnd = random.Random(r)
        packed = bool(r & 1)
        fe = ScriptedFrontend(SOCK, packed=packed, in_order=bool(r & 2), queue_size=rnd.choice([8, 256]) if not packed else rnd.choice([7, 256]))
        try:
            fe.connect(); fe.negotiate(); fe.start()
            fe.post_rx(4); fe.send([frame(i) for i in range(4)])
            for k in range(30):
                q = rnd.choice([0, 1])
                lay = fe.layouts[q]
                # scribble either on the descriptor area, the driver area or a few bytes in the middle
                area = rnd.choice([(lay.desc, 16 * fe.size), (lay.driver, 4 + 2 * fe.size), (GPA_BASE + q * RING_AREA, RING_AREA)])
                n = rnd.randrange(1, 64)
                off = rnd.randrange(0, area[1] - n) if area[1] > n else 0
                fe.mem.write(area[0] + off, rnd.randbytes(n))
                if rnd.random() < 0.3:
                    # plausible-looking descriptor pointing near the region end (straddling)
                    d = lay.desc + 16 * rnd.randrange(fe.size)
                    fe.mem.write(d, (GPA_BASE + (4 << 20) - 8).to_bytes(8, "little") + (64).to_bytes(4, "little") + rnd.choice([0, 1, 4, 2]).to_bytes(2, "little") + rnd.randrange(65536).to_bytes(2, "little"))
                time.sleep(0.002)
            time.sleep(0.2)
            fe.stop()
        except Exception as e:
            pass
        finally:
            fe.close()
        time.sleep(0.2)
        if not alive(p):
            print("round", r, "backend died rc", p.returncode); bad += 1; break
    ok = False
    if alive(p):
        with ScriptedFrontend(SOCK) as fe:
            fe.connect(); fe.negotiate(); fe.start(); fe.post_rx(8); fe.send([frame(i) for i in range(4)]); time.sleep(0.3)
            ok = len(fe.receive()) == 4
    print("rounds", rounds, "alive", alive(p), "clean frontend after:", ok, "fds", nfds(p.pid) if alive(p) else None)
finally:
    if alive(p):
        p.send_signal(signal.SIGINT); p.wait(10)
    err = stderr_of(p)
    print("exit", p.returncode, "traceback:", "Traceback" in err, "broken-queue lines:", err.count("broken"))
    i = err.find("Traceback")
    if i >= 0: print(err[i:i+3000])
