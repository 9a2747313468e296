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

struct vh_net {
    struct vq_device *rxq, *txq;         /* NULL: that queue is not served (absent or broken) */
    struct vq_chains *rxc, *txc;         /* rxc carries polled, not yet used Rx chains across bursts */
    uint32_t rx_next;                    /* first unconsumed chain in rxc */
    int32_t rx_callfd, tx_callfd;        /* -1: no call fd */
    uint32_t hdr_len, mrg_rxbuf;
    uint32_t burst, retries, per_buffer, fwd, threshold, flush_mode;
    uint64_t timer_ns;
    uint8_t *pkt_data;                   /* pkt_cap buffers of pkt_size bytes: the intermediate Tx queue */
    uint32_t *pkt_len;
    const uint8_t **pkt_src;             /* where each queued frame is: its pkt_data slot, or (direct) the
                                            driver's Tx buffer, read before that chain is completed */
    uint32_t direct;                     /* --txq-flush none: no staging copy for one-segment frames */
    uint32_t pkt_size, pkt_cap, npkts;
    uint64_t first_ns;                   /* when the oldest packet in the intermediate queue arrived */
    uint32_t *ids, *lens;                /* scratch for push_used (queue size entries) */
    uint32_t tx_unflushed;               /* Tx completions pushed, not yet published */
    uint32_t timing;                     /* measure busy_ns (two clock reads per iteration) */
    int32_t broken;                      /* bit 0: Rx queue broke, bit 1: Tx queue broke (see vq_device.error) */
    uint32_t idle_polls;                 /* --idle sleep: empty polls before kicks are enabled (0: always poll) */
    uint32_t empty;                      /* consecutive empty polls */
    uint32_t kicks_on;                   /* kicks enabled on vring 1 (the loop is about to sleep, or woke up) */
    uint32_t sleep;                      /* set by vh_run: enabled, re-checked, still empty: block on the kick */
    void (*hook)(void *, uint32_t, uint32_t, uint32_t);  /* tests: called after each enqueue attempt */
    void *hook_ctx;
    struct vh_stats st;
};
