"""`vring conform`: the virtqueue conformance checks against anyone's implementation, over vhost-user.

Two roles, each a harness that plays one side of a virtio-net queue pair and checks the other side from what
it can observe (ring memory, buffers, eventfds), with the spec (shared/spec/virtio-checklist.md IDs) as the
oracle:

* ``device``: we are the frontend (a driver); the backend under test (DPDK net_vhost, ``vring vhost``, ...)
  is driven through scripted scenarios and its device MUSTs are checked (conform/device.py);
* ``driver``: we are the backend (a device); the frontend under test (DPDK virtio_user, ``vring driver``, ...)
  meets every legal device behaviour and its driver MUSTs are checked (conform/driver.py).

Layering: this package sits above ``virtio/`` and ``vhost/`` (it reuses the vhost-user frontend of one and
the device model of the other) and ``rings/``; nothing imports it but ``vring/cmd_conform.py``.
Results are collected per checklist ID in a ``report.Report``.
"""
