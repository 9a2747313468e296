"""Hostile frontend shrinks the shared-memory file after SET_MEM_TABLE: does `vring vhost` die of SIGBUS?
Also: a blocking pipe as call fd (does the backend block in write()?)."""
import os, sys, time, signal
from common import *
from vhost.testing import ScriptedFrontend, frame

SOCK = f"/tmp/review-a-sigbus-{os.getpid()}.sock"
mode = sys.argv[1] if len(sys.argv) > 1 else "shrink"
p = start_vhost(SOCK, *(sys.argv[2:]))
try:
    fe = ScriptedFrontend(SOCK)
    fe.connect(); fe.negotiate()
    if mode == "pipe-call":
        r, w = os.pipe()      # blocking write end as the call fd, never read; filled up first
        os.set_blocking(w, False)
        try:
            while True: os.write(w, bytes(4096))
        except BlockingIOError: pass
        os.set_blocking(w, True)
        for i in range(2):
            fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [w])
    fe.start()
    fe.post_rx(200)
    if mode == "shrink":
        fe.send([frame(i) for i in range(8)])
        time.sleep(0.3)
        os.ftruncate(fe.shm.fileno(), 0)     # the backend's mapping now faults on every page
        time.sleep(1.0)
        print("backend alive after shrink:", alive(p), "rc", p.poll())
    else:
        fe.rxq.enable_calls(True); fe.txq.enable_calls(True)
        t0 = time.time()
        sent = 0
        while time.time() - t0 < 8:
            if len(fe.pkt_free) > 8:
                fe.post_rx(2); sent += fe.send([frame(i) for i in range(2)])
            time.sleep(0.01)
            fe.reclaim_tx(); fe.receive()
            fe.rxq.enable_calls(True)
        print("frames sent", sent)
        # now is the backend responsive on its control socket?
        t = time.time()
        try:
            with ScriptedFrontend(SOCK, timeout=3) as fe2:
                fe2.connect(); fe2.call(R.GET_FEATURES)
            print("second frontend answered (busy notice or features) in", round(time.time() - t, 2))
        except Exception as e:
            print("second frontend:", type(e).__name__, e, round(time.time() - t, 2))
        try:
            print("GET_FEATURES on first conn:", fe.call(R.GET_FEATURES))
        except Exception as e:
            print("first conn control:", type(e).__name__, e)
finally:
    if alive(p):
        p.send_signal(signal.SIGINT)
        try:
            p.wait(5)
        except Exception:
            print("backend did not stop on SIGINT: HUNG"); p.kill(); p.wait()
    print("exit", p.returncode)
    err = stderr_of(p)
    print(err[-1500:])
    try: os.unlink(SOCK)
    except OSError: pass
