"""Shared memory, spec-exact ring layouts, the ring engines (C and reference), snapshots and the vhost-user
wire format. The lowest layer: it imports nothing from virtio/, vhost/ or vring/."""
