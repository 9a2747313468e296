"""A hostile vhost-user backend for `vring driver`. Modes:
  shrink     : on SET_MEM_TABLE, ftruncate the driver's memory fd to 0 and ACK (driver then faults: SIGBUS?)
  inflight-garbage : GET_INFLIGHT_FD answered with a pipe fd / bogus sizes
  wrong-reply : answer GET_FEATURES with a reply to another request
Usage: python3 attack/evil_backend.py MODE SOCK   (serves one connection, then exits)"""
import os, sys, time
from common import *
from vhost.server import Server
from vhost import device as D

mode, sock = sys.argv[1], sys.argv[2]
if mode == "shrink":
    def evil_mem(self, msg, regions):
        for fd in msg.take_fds():
            os.ftruncate(fd, 0); os.close(fd)
    D.NetDevice._set_mem_table = evil_mem
    D.NetDevice.ready = lambda self: False
elif mode == "inflight-garbage":
    def evil_inflight(self, msg, inf):
        r, w = os.pipe(); os.close(w)
        return D.Reply(vu.Inflight(inf.mmap_size or 4096, 0, inf.num_queues, inf.queue_size).pack(), [r])
    D.NetDevice._get_inflight_fd = evil_inflight
elif mode == "wrong-reply":
    orig = D.NetDevice._get_features
    D.NetDevice._get_features = lambda self, msg, v: (setattr(msg, "request", vu.VhostUserRequest.GET_STATUS), orig(self, msg, v))[1]
srv = Server(sock, handshake_timeout=10)
srv.serve(max_connections=1)
