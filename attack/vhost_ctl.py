"""Hostile frontend vs `vring vhost`: control-plane attacks, one connection each.
Usage: python3 attack/vhost_ctl.py   (prints one line per scenario; FAIL lines are findings)"""
import os, socket, struct, time, mmap, tempfile, sys
from common import *
from vhost.testing import ScriptedFrontend, GPA_BASE, UADDR_BASE, MMAP_OFFSET, REGION_SIZE

SOCK = f"/tmp/review-a-vhost-{os.getpid()}.sock"
NEED = vu.NEED_REPLY | 1

def memfd(size):
    fd = os.memfd_create("atk")
    os.ftruncate(fd, size)
    return fd

def handshake(s, packed=False):
    send(s, R.GET_FEATURES); recv(s)
    send(s, R.GET_PROTOCOL_FEATURES); recv(s)
    send(s, R.SET_PROTOCOL_FEATURES, vu.pack_u64((1 << 3) | (1 << 12)))
    f = (1 << 32) | (1 << 30) | ((1 << 34) if packed else 0)
    send(s, R.SET_FEATURES, vu.pack_u64(f))

def region(gpa=0x1000, size=0x10000, uaddr=0x10000000, off=0):
    return vu.MemRegion(gpa, size, uaddr, off)

scen = {}
def sc(f):
    scen[f.__name__] = f
    return f

@sc
def garbage(s):
    s.sendall(os.urandom(64)); return recv(s)
@sc
def huge_size(s):
    send(s, R.GET_FEATURES, size=0xFFFFFFFF); return recv(s)
@sc
def too_many_fds(s):
    fds = [os.eventfd(0) for _ in range(12)]
    send(s, R.SET_OWNER, fds=fds); r = recv(s)
    [os.close(x) for x in fds]; return r
@sc
def unknown_need_reply(s):
    send(s, 99, b"x" * 8, flags=NEED); return recv(s)
@sc
def reply_flag(s):
    send(s, R.GET_FEATURES, flags=5); return recv(s)
@sc
def memtable_eventfd(s):
    handshake(s); fd = os.eventfd(0)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region()]), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def memtable_pipe(s):
    handshake(s); r, w = os.pipe()
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region()]), [r], flags=NEED); os.close(r); os.close(w); return recv(s)
@sc
def memtable_dir(s):
    handshake(s); fd = os.open("/tmp", os.O_RDONLY)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region(size=0x10)]), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def memtable_rdonly(s):
    handshake(s); p = tempfile.mktemp(); open(p, "wb").write(bytes(0x20000)); fd = os.open(p, os.O_RDONLY); os.unlink(p)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region()]), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def memtable_devzero(s):
    handshake(s); fd = os.open("/dev/zero", os.O_RDWR)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region()]), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def memtable_overlap(s):
    handshake(s); a, b = memfd(0x20000), memfd(0x20000)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region(), region(gpa=0x2000, uaddr=0x20000000)]), [a, b], flags=NEED)
    os.close(a); os.close(b); return recv(s)
@sc
def memtable_fd_count_mismatch(s):
    handshake(s); a = memfd(0x20000)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region(), region(gpa=0x100000, uaddr=0x20000000)]), [a], flags=NEED)
    os.close(a); return recv(s)
@sc
def memtable_huge_offset(s):
    handshake(s); a = memfd(0x20000)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region(off=(1 << 64) - 0x10000)]), [a], flags=NEED)
    os.close(a); return recv(s)
@sc
def memtable_huge_sparse(s):
    handshake(s); a = memfd(1 << 46)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region(size=1 << 46)]), [a], flags=NEED)
    os.close(a); return recv(s)
@sc
def addr_outside(s):
    handshake(s); a = memfd(0x20000)
    send(s, R.SET_MEM_TABLE, vu.pack_mem_table([region()]), [a], flags=NEED); recv(s); os.close(a)
    send(s, R.SET_VRING_NUM, vu.VringState(0, 256).pack(), flags=NEED); recv(s)
    send(s, R.SET_VRING_ADDR, vu.VringAddr(0, 0, 0x10000000 + 0xF000, 0x10000000, 0x10000000).pack(), flags=NEED)
    return recv(s)
@sc
def num_then_switch_format(s):
    handshake(s, packed=True)
    send(s, R.SET_VRING_NUM, vu.VringState(0, 300).pack(), flags=NEED); a = recv(s)
    send(s, R.SET_FEATURES, vu.pack_u64((1 << 32) | (1 << 30)), flags=NEED); b = recv(s)
    send(s, R.SET_VRING_BASE, vu.VringState(0, 0xFFFF).pack(), flags=NEED); c = recv(s)
    return (a, b, c)
@sc
def vring_index_255(s):
    handshake(s)
    send(s, R.SET_VRING_NUM, vu.VringState(255, 256).pack(), flags=NEED); return recv(s)
@sc
def kick_nofd_with_fd(s):
    handshake(s); fd = os.eventfd(0)
    send(s, R.SET_VRING_KICK, vu.pack_u64(0x100), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def inflight_get_huge(s):
    handshake(s)
    send(s, R.GET_INFLIGHT_FD, vu.Inflight(0, 0, 256, 32768).pack()); return recv(s, 20)
@sc
def inflight_get_zero(s):
    handshake(s)
    send(s, R.GET_INFLIGHT_FD, vu.Inflight(0, 0, 0, 0).pack()); return recv(s)
@sc
def inflight_set_rdonly(s):
    handshake(s); p = tempfile.mktemp(); open(p, "wb").write(bytes(0x20000)); fd = os.open(p, os.O_RDONLY); os.unlink(p)
    send(s, R.SET_INFLIGHT_FD, vu.Inflight(0x10000, 0, 2, 256).pack(), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def inflight_set_eventfd(s):
    handshake(s); fd = os.eventfd(0)
    send(s, R.SET_INFLIGHT_FD, vu.Inflight(0x10000, 0, 2, 256).pack(), [fd], flags=NEED); os.close(fd); return recv(s)
@sc
def inflight_set_huge(s):
    handshake(s); fd = memfd(0x10000)
    send(s, R.SET_INFLIGHT_FD, vu.Inflight((1 << 64) - 1, (1 << 64) - 1, 0xFFFF, 0xFFFF).pack(), [fd], flags=NEED)
    os.close(fd); return recv(s)
@sc
def config_oversize(s):
    handshake(s)
    send(s, R.GET_CONFIG, struct.pack("<III", 0, 300, 0) + bytes(300), flags=NEED); return recv(s)
@sc
def status_without_features(s):
    send(s, R.GET_FEATURES); recv(s)
    send(s, R.SET_STATUS, vu.pack_u64(0xF), flags=NEED); return recv(s)
@sc
def half_message_then_close(s):
    s.sendall(struct.pack("<III", R.SET_FEATURES, 1, 8) + b"\x01"); time.sleep(0.2); return "closed"
@sc
def silent(s):
    time.sleep(3); return recv(s, 1)
@sc
def get_vring_base_repeat(s):
    handshake(s)
    out = []
    for i in range(3):
        send(s, R.GET_VRING_BASE, vu.VringState(1, 0).pack()); out.append(recv(s))
    return out

def main():
    only = sys.argv[1:]
    p = start_vhost(SOCK)
    time.sleep(0.5)
    base = nfds(p.pid)
    bad = 0
    try:
        for name, f in scen.items():
            if only and name not in only:
                continue
            s = raw(SOCK)
            try:
                res = f(s)
            except Exception as e:
                res = f"client exception {type(e).__name__}: {e}"
            s.close()
            time.sleep(0.3)
            ok = alive(p)
            fdn = nfds(p.pid) if ok else -1
            # a fresh, honest frontend must still be served
            good = False
            if ok:
                try:
                    with ScriptedFrontend(SOCK) as fe:
                        fe.connect(); fe.negotiate(); fe.start(); fe.stop(); good = True
                except Exception as e:
                    good = f"{type(e).__name__}: {e}"
                time.sleep(0.3)
                fdn = nfds(p.pid) if alive(p) else -1
            flag = "ok  " if ok and good is True and fdn == base else "FAIL"
            if flag == "FAIL": bad += 1
            print(f"{flag} {name:28s} alive={ok} fds={fdn}/{base} next_frontend={good} reply={str(res)[:110]}")
    finally:
        p.send_signal(signal.SIGINT); p.wait(10)
        err = stderr_of(p)
        print("traceback in stderr:", "Traceback" in err, " exit:", p.returncode)
        if "Traceback" in err:
            print(err[err.index("Traceback"):][:3000])
    return bad

if __name__ == "__main__":
    sys.exit(1 if main() else 0)
