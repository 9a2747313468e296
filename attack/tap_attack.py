"""Hostile frontend through `vring tap --pcap --ctl` to a real `vring vhost`.
Modes: shrink (frontend ftruncates its memory after the rings run), zero (memory fd of size 0 announced as 4 MiB),
fdleak (many sessions with garbage, then compare tap fd count). Usage: python3 attack/tap_attack.py MODE"""
import os, sys, time, signal, subprocess, tempfile
from common import *
from vhost.testing import ScriptedFrontend, frame, MMAP_OFFSET, REGION_SIZE

mode = sys.argv[1]
pid = os.getpid()
B, A, CTL = f"/tmp/ra-tapB-{pid}.sock", f"/tmp/ra-tapA-{pid}.sock", f"/tmp/ra-tapC-{pid}.sock"
PCAP = f"/tmp/ra-tap-{pid}.pcap"
env = dict(os.environ, PYTHONPATH=ROOT)
be = start_vhost(B)
terr = tempfile.TemporaryFile()
tap = subprocess.Popen([sys.executable, "-m", "vring.cli", "tap", "--listen", A, "--connect", B, "--ctl", CTL,
                        "--pcap", PCAP], stdout=subprocess.DEVNULL, stderr=terr, env=env, cwd=ROOT)
for _ in range(100):
    if os.path.exists(A) and os.path.exists(CTL): break
    time.sleep(0.05)
time.sleep(0.3)
base = nfds(tap.pid)
def dump():
    return subprocess.run([sys.executable, "-m", "vring.cli", "dump", "--ctl", CTL], capture_output=True, text=True, env=env, timeout=30)
try:
    if mode == "shrink":
        fe = ScriptedFrontend(A); fe.connect(); fe.negotiate(); fe.start(); fe.post_rx(16); fe.send([frame(i) for i in range(4)])
        time.sleep(0.5)
        os.ftruncate(fe.shm.fileno(), 0)
        time.sleep(1)
        d = dump()
        print("dump rc", d.returncode, d.stderr.strip()[-200:])
    elif mode == "zero":
        fe = ScriptedFrontend(A); fe.connect(); fe.negotiate()
        z = os.memfd_create("zero")    # st_size 0: the tap skips its size check
        try:
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [z], need_reply=True)
        except Exception as e:
            print("SET_MEM_TABLE:", type(e).__name__, e)
        for i in range(2):
            fe.call(R.SET_VRING_NUM, vu.VringState(i, 256).pack())
            fe.call(R.SET_VRING_ADDR, fe.vring_addr(i).pack())
        time.sleep(0.5)
        d = dump()
        print("dump rc", d.returncode, d.stderr.strip()[-300:])
    elif mode == "fdleak":
        for k in range(15):
            fe = ScriptedFrontend(A); fe.connect(); fe.negotiate(); fe.start(); fe.post_rx(4)
            fe.send([frame(i) for i in range(2)])
            # garbage: a message with 3 fds that the backend NACKs; then vanish mid-message
            e1, e2, e3 = os.eventfd(0), os.eventfd(0), os.eventfd(0)
            send(fe.conn.sock, R.SET_VRING_ERR, vu.pack_u64(0), [e1, e2, e3])
            [os.close(x) for x in (e1, e2, e3)]
            fe.conn.sock.sendall(b"\x05\x00\x00\x00\x01\x00\x00\x00\x28\x00\x00\x00abc")
            fe.close()
            time.sleep(0.3)
        time.sleep(1.5)
    print("tap alive", alive(tap), "rc", tap.poll(), "fds", nfds(tap.pid) if alive(tap) else None, "/", base,
          "backend alive", alive(be))
finally:
    for p in (tap, be):
        if alive(p):
            p.send_signal(signal.SIGINT)
            try: p.wait(10)
            except subprocess.TimeoutExpired: print("HUNG on SIGINT", p.pid); p.kill(); p.wait()
    terr.seek(0); e = terr.read().decode(errors="replace")
    print("tap exit", tap.returncode, "traceback", "Traceback" in e); print(e[-800:])
    for f in (A, B, CTL, PCAP):
        if os.path.exists(f): print("left behind:", f); os.unlink(f)
