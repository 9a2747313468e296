"""`vring tap`: a transparent vhost-user proxy between any frontend and any backend, and what it can see
from there: the message log, live dumps of both peers' rings, and a packet capture.

Layers: built on ``rings/`` only (the wire format, the memory table, snapshots and diagnoses); it imports
neither ``virtio/`` nor ``vhost/``.

* ``tap.picture``: what the tap learned from the messages it relayed (features, memory regions mapped
  read-only, vrings), kept current across reconnects and GET_VRING_BASE; read-only views of each vring
  for ``rings.ctl`` (``vring dump --ctl``).
* ``tap.proxy``: the relay: every message with its fds passed on unchanged, both ways.
* ``tap.notify``: ``--notify-tap``: the tap's own eventfds between the peers, to count and time kicks
  and calls (and pass them on).
* ``tap.msglog``: ``--log`` JSON lines and ``--decode``.
* ``tap.capture``: ``--pcap``: frames read from the rings as the used entries appear.
"""
