"""The virtio-net driver side (frontend): guest memory and buffer pool in a size-sealed memfd, Tx/Rx bursts
over the ring engines of ``rings/`` (C hot paths in ``csrc/vnet.h``, cffi module ``virtio._net``), and the
vhost-user frontend that hands the memory and rings to a backend (DPDK net_vhost or ours).

* ``virtio.pool.BufferPool``: fixed-size buffers with headroom, packets as uint32 indices (mbuf-like chains).
* ``virtio.net``: ``NetQueues`` (memory + one Rx/Tx pair), ``TxQueue.burst`` (fast path: header in the headroom,
  one descriptor; slow path: header descriptor + chain, or indirect), Tx cleanup (normal / in-order, at least
  ``need`` descriptors), ``RxQueue.burst`` (header strip, mergeable reassembly, refill in bursts), kicks only
  when the device asks, eventfd waiting.
* ``virtio.frontend.VhostUserFrontend``: the control plane (features, protocol features, memory table, vrings,
  status, clean stop), every reply checked with a timeout.
* ``virtio.app``: the driver process behind ``vring driver`` (txonly / rxonly / macfwd).

This package never imports ``vhost/`` (DESIGN.md: the two sides meet only through ``rings/`` and the protocol).
"""
