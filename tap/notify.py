"""`vring tap --notify-tap`: the tap's own eventfds between the two peers, so that every kick and call
passes through the tap, counted and timed, and goes on to the other side.

Kick (SET_VRING_KICK): the frontend writes its eventfd; the backend gets the tap's eventfd instead. The
tap reads the frontend's, counts, and writes the same count to its own. Call (SET_VRING_CALL): the backend
gets the tap's eventfd and writes it; the tap reads it, counts, and writes the count to the frontend's.
Nothing is changed on the peers' fds (no O_NONBLOCK flipped on a file description they share): the tap
reads only fds that epoll says are ready, with reads that cannot block (rings.vhost_user.eventfd_take: a
peer may read the counter first, with O_NONBLOCK cleared). The tap holds both fds of a route
until the vring's KICK/CALL is replaced or the session ends.
"""
import os
import select
import threading
import time

from rings import vhost_user as vu


class NotifyRelay:
    def __init__(self, picture, log=None):
        self.picture, self.log = picture, log
        self.lock = threading.Lock()
        self.routes = {}       # watched fd -> (kind, vring, target fd, fd the tap created)
        self.by_vring = {}     # (kind, vring) -> watched fd
        self.conn = 0
        self.ep = select.epoll()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vring-tap notify", daemon=True)
        self.thread.start()

    def interpose(self, kind, index, peer_fd, conn):
        """Take the frontend's eventfd of vring ``index`` (kind 'kick' or 'call') and return the tap's eventfd
        to send to the backend instead. The relay owns both from now on."""
        own = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        watched, target = (peer_fd, own) if kind == "kick" else (own, peer_fd)
        with self.lock:
            self.conn = conn
            self._drop(self.by_vring.pop((kind, index), None))
            self.routes[watched] = (kind, index, target, own, peer_fd)
            self.by_vring[(kind, index)] = watched
            self.ep.register(watched, select.EPOLLIN)
        return own

    def _drop(self, watched):
        route = self.routes.pop(watched, None) if watched is not None else None
        if route is None:
            return
        try:
            self.ep.unregister(watched)
        except OSError:
            pass
        for fd in (route[3], route[4]):
            try:
                os.close(fd)
            except OSError:
                pass

    def clear(self):
        """The session ended: close every route."""
        with self.lock:
            for watched in list(self.routes):
                self._drop(watched)
            self.by_vring.clear()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)
        self.clear()
        self.ep.close()

    def _run(self):
        while not self.stop.is_set():
            try:
                events = self.ep.poll(0.2)
            except (OSError, ValueError):
                return
            for fd, _ in events:
                with self.lock:
                    route = self.routes.get(fd)
                    if route is None:
                        continue
                    kind, index, target, _, _ = route
                    try:
                        count = vu.eventfd_take(fd)
                    except OSError:
                        continue
                    if not count:
                        continue
                    try:
                        os.eventfd_write(target, count)  # pass it on: same count, the peer sees no difference
                    except OSError:
                        pass
                    conn = self.conn
                when = time.time()
                self.picture.count_notify(kind, index, count, when)
                if self.log is not None:
                    self.log.write({"conn": conn, "dir": "F>B" if kind == "kick" else "B>F", "notify": kind,
                                    "vring": index, "count": count})
