/* The backend's burst state: one struct per running device (a queue pair: vring 0 = the driver's Rx,
 * vring 1 = the driver's Tx). Declarations only (also fed to cffi's cdef): no macros, no includes.
 * Requires virtq_types.h first. */

struct vh_stats {
    /* dequeue side: the driver's Tx queue (vring 1) */
    uint64_t tx_packets, tx_bytes;       /* packets copied out (bytes without the virtio-net header) */
    uint64_t tx_runt;                    /* chains of <= hdr_len readable bytes: given back, not forwarded */
    uint64_t tx_oversize;                /* packets larger than a backend buffer: given back, dropped */
    uint64_t tx_bursts, tx_calls;        /* non-empty dequeue bursts; call eventfd writes */
    /* enqueue side: the driver's Rx queue (vring 0) */
    uint64_t rx_packets, rx_bytes;       /* packets delivered (bytes without the header) */
    uint64_t rx_buffers;                 /* Rx buffers used (> rx_packets with MRG_RXBUF) */
    uint64_t rx_dropped;                 /* no Rx buffer left after the retries (or Rx queue broken) */
    uint64_t rx_too_big;                 /* packet larger than the offered buffer (no MRG_RXBUF): dropped */
    uint64_t rx_runt_bufs;               /* MRG_RXBUF buffers shorter than the header: used with len 0 */
    uint64_t rx_retries;                 /* enqueue attempts after the first (each after progress) */
    uint64_t rx_attempts, rx_calls;      /* enqueue attempts; call eventfd writes */
    /* intermediate Tx queue */
    uint64_t flush_threshold, flush_rx_batch, flush_timer, flush_idle;
    uint64_t fwd_dropped;                /* rxonly: packets freed */
    uint64_t iterations;
    uint64_t busy_iterations, busy_ns;  /* iterations that moved packets, and the time they took */
    /* notifications (--idle sleep) */
    uint64_t sleeps;                     /* times the loop gave up polling and asked to block on the kick */
    uint64_t tx_kicks;                   /* kicks received on vring 1 (eventfd counts, added by the server) */
};

/* Inflight I/O tracking (vhost-user VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD): the layouts of one queue's region
 * in the shared inflight area, as QEMU's vhost-user spec ("Inflight I/O tracking") and DPDK's rte_vhost.h
 * define them. The frontend keeps the area across backend restarts; the successor reads it at start. */
struct vhi_desc_split {          /* DescStateSplit, 16 bytes, indexed by head descriptor */
    uint8_t inflight;
    uint8_t padding[5];
    uint16_t next;               /* the list of the last batch of used heads */
    uint64_t counter;            /* the order in which heads were taken */
};

struct vhi_region_split {        /* QueueRegionSplit: 16-byte header, then desc[queue size] */
    uint64_t features;
    uint16_t version;
    uint16_t desc_num;
    uint16_t last_batch_head;
    uint16_t used_idx;           /* used->idx once the last batch's inflight flags are cleared */
    struct vhi_desc_split desc[];
};

struct vhi_desc_packed {         /* DescStatePacked, 32 bytes: an entry of a free list of queue-size entries */
    uint8_t inflight;            /* head entries only */
    uint8_t padding;
    uint16_t next;               /* the next free entry / the next entry of this chain */
    uint16_t last;               /* head: the chain's last entry */
    uint16_t num;                /* head: the chain's descriptors */
    uint64_t counter;            /* head: the order in which chains were taken */
    uint16_t id;                 /* a copy of the ring descriptor */
    uint16_t flags;
    uint32_t len;
    uint64_t addr;
};

struct vhi_region_packed {       /* QueueRegionPacked: 29-byte header (desc[] at 32) */
    uint64_t features;
    uint16_t version;
    uint16_t desc_num;
    uint16_t free_head;
    uint16_t old_free_head;
    uint16_t used_idx;
    uint16_t old_used_idx;
    uint8_t used_wrap_counter;
    uint8_t old_used_wrap_counter;
    uint8_t padding[7];
    struct vhi_desc_packed desc[];
};

/* The backend's private side of one queue's tracking. The C engine reads the shared region never: what it
 * needs (free list, chain lengths, positions) has private copies, so a frontend that scribbles over the area
 * cannot steer the data path; the successor validates the area before it trusts it. */
struct vh_inflight {
    void *region;                /* struct vhi_region_split / vhi_region_packed */
    uint16_t size;
    uint8_t packed, stopped;     /* stopped: a hostile driver put more descriptors in flight than the ring holds */
    uint16_t last_batch_head;    /* split */
    uint16_t free_head;          /* packed: head of the free entry list */
    uint16_t used_idx;           /* packed: the device's used position and wrap counter */
    uint16_t used_wrap;
    uint64_t counter;            /* the next chain's counter */
    uint16_t *entry_of_id;       /* packed: the head entry of each buffer id in flight */
    uint16_t *e_next, *e_last, *e_num;   /* packed: private copies of desc[].next/last/num */
    uint16_t *resubmit;          /* heads (split) / head entries (packed) to take again, in taken order */
    uint32_t nresubmit, resubmit_pos;
    struct vring_packed_desc *scratch;   /* packed: one chain's descriptors, re-parsed as a ring */
    uint64_t taken, completed, resubmitted;
    uint32_t die_at;             /* tests: _exit(9) at the die_at-th store point below from now (0: off) */
};

struct vh_net {
    struct vq_device *rxq, *txq;         /* NULL: that queue is not served (absent or broken) */
    struct vq_chains *rxc, *txc;         /* rxc carries polled, not yet used Rx chains across bursts */
    uint32_t rx_next;                    /* first unconsumed chain in rxc */
    int32_t rx_callfd, tx_callfd;        /* -1: no call fd */
    uint32_t hdr_len, mrg_rxbuf;
    uint32_t burst, retries, per_buffer, fwd, threshold, flush_mode;
    uint64_t timer_ns;
    uint8_t *pkt_data;                   /* the intermediate Tx queue: pkt_cap slots of pkt_size bytes */
    uint8_t *pkt_long;                   /* its frames longer than a slot: long_size bytes, long_fill in use */
    uint64_t long_size, long_fill;
    uint32_t *pkt_len;
    const uint8_t **pkt_src;             /* where each queued frame is: its pkt_data slot, its place in pkt_long,
                                            or (direct) the driver's Tx buffer, read before that chain is completed */
    uint32_t direct;                     /* --txq-flush none: no staging copy for one-segment frames */
    uint32_t capture;                    /* --pcap: rxonly frames queued too (read by Python, then discarded) */
    uint32_t pkt_size;                   /* a slot (odd 64-byte lines: no cache-set aliasing between slots) */
    uint32_t pkt_max;                    /* the longest frame taken; longer ones are dropped (tx_oversize) */
    uint32_t pkt_cap, npkts;
    uint64_t first_ns;                   /* when the oldest packet in the intermediate queue arrived */
    uint32_t *ids, *lens;                /* scratch for push_used (queue size entries) */
    uint32_t tx_unflushed;               /* Tx completions pushed, not yet published */
    uint32_t timing;                     /* measure busy_ns (two clock reads per iteration) */
    int32_t broken;                      /* bit 0: Rx queue broke, bit 1: Tx queue broke (see vq_device.error) */
    uint32_t guest_fault;                /* set by a guarded entry point: the frontend's memory vanished (SIGBUS)
                                            under it; nothing in this struct's queues may be touched again */
    uint32_t idle_polls;                 /* --idle sleep: empty polls before kicks are enabled (0: always poll) */
    uint32_t empty;                      /* consecutive empty polls */
    uint32_t kicks_on;                   /* kicks enabled on vring 1 (the loop is about to sleep, or woke up) */
    uint32_t sleep;                      /* set by vh_run: enabled, re-checked, still empty: block on the kick */
    void (*hook)(void *, uint32_t, uint32_t, uint32_t);  /* tests: called after each enqueue attempt */
    void *hook_ctx;
    struct vh_inflight *rx_inf, *tx_inf;  /* inflight tracking of each queue (INFLIGHT_SHMFD), or NULL */
    uint32_t crash_after;                /* fault injection: _exit after this many enqueues that delivered */
    struct vh_stats st;
};

