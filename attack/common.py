"""Shared bits of the attack scripts: start `vring vhost`, connect raw, check health."""
import os, socket, struct, subprocess, sys, time, tempfile, signal
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rings import vhost_user as vu
R = vu.VhostUserRequest

def start_vhost(sock, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    err = tempfile.TemporaryFile()
    p = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--json",
                          "--handshake-timeout", "2", *args], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    p.errfile = err
    return p

def stderr_of(p):
    p.errfile.seek(0)
    return p.errfile.read().decode(errors="replace")

def nfds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))

def raw(sock):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    s.settimeout(5)
    return s

def send(s, req, payload=b"", fds=(), flags=1, size=None):
    hdr = struct.pack("<III", req, flags, len(payload) if size is None else size)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    s.sendmsg([hdr + payload], anc)

def recv(s, timeout=3):
    s.settimeout(timeout)
    try:
        data, anc, _, _ = s.recvmsg(12 + 4096, 1024)
    except (TimeoutError, socket.timeout):
        return "timeout"
    except ConnectionResetError:
        return "reset"
    if not data:
        return "eof"
    fds = []
    for lvl, t, d in anc:
        fds += list(struct.unpack(f"{len(d)//4}i", d[:len(d)//4*4]))
    for fd in fds:
        os.close(fd)
    req, flags, size = struct.unpack_from("<III", data)
    return (req, flags, data[12:12 + size], len(fds))

def alive(p):
    return p.poll() is None
