"""The vhost backend emulator: a virtio-net device behind a vhost-user socket (see vhost/README.md).

``vhost.server.Server`` (the socket and the loop), ``vhost.device.NetDevice`` (what each request means),
``vhost.datapath.Datapath`` (the C burst loop of ``vhost._net``). The command is ``vring vhost``.
"""
