"""A control socket that answers `vring dump --ctl` with garbage. Each case: one server reply line.
Usage: python3 attack/ctl_garbage.py"""
import os, socket, subprocess, sys, threading, time
from common import ROOT
SOCK = f"/tmp/review-a-ctl-{os.getpid()}.sock"
CASES = {
    "not json": [b"hello\n"],
    "list": [b"[1,2]\n"],
    "ok no queues": [b'{"ok": true}\n'],
    "queues ints": [b'{"ok": true, "queues": [1]}\n'],
    "queues str": [b'{"ok": true, "queues": "abc"}\n'],
    "error not str": [b'{"ok": false, "error": {"a": 1}}\n'],
    "raw bad b64": [b'{"ok": true, "queues": [{"name": "q"}]}\n', b'{"ok": true, "raw": "!!!"}\n'],
    "raw not str": [b'{"ok": true, "queues": [{"name": "q"}]}\n', b'{"ok": true, "raw": 5}\n'],
    "raw garbage": [b'{"ok": true, "queues": [{"name": "q"}]}\n', b'{"ok": true, "raw": "aGVsbG8="}\n'],
    "close": [],
    "endless": None,
    "deep json": [b"[" * 100000 + b"\n"],
}
def serve(lst, replies):
    c, _ = lst.accept()
    f = c.makefile("rwb")
    try:
        if replies is None:
            f.readline()
            t = time.time()
            while time.time() - t < 6:
                c.sendall(b"x" * 65536)
        for r in replies or []:
            f.readline(); c.sendall(r)
        time.sleep(0.2)
    except OSError:
        pass
    c.close()
for name, replies in CASES.items():
    lst = socket.socket(socket.AF_UNIX); lst.bind(SOCK); lst.listen(1)
    th = threading.Thread(target=serve, args=(lst, replies), daemon=True); th.start()
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "vring.cli", "dump", "--ctl", SOCK], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    th.join(8); lst.close(); os.unlink(SOCK)
    err = p.stderr.strip().splitlines()
    flag = "ok  " if p.returncode in (1, 2) and "Traceback" not in p.stderr else "FAIL"
    print(f"{flag} {name:14s} rc={p.returncode} {round(time.time()-t,1)}s {(err[-1] if err else '')[:150]}")
