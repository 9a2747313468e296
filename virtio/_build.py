"""cffi builder for virtio._net: the virtio-net driver's burst loops (csrc/vnet.h) over the ring primitives of
rings/csrc/virtq.h (included, not linked: every primitive is static inline)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
sys.path.insert(0, os.path.dirname(HERE))
from rings._build import package_ffi  # noqa: E402


FUNCTIONS = """
uint32_t vn_pool_alloc(struct vn_pool *p, uint32_t *out, uint32_t n);
void vn_pool_free(struct vn_pool *p, const uint32_t *idx, uint32_t n);
int vn_tx_cleanup(struct vn_txq *t, uint32_t need);
uint32_t vn_tx_burst(struct vn_txq *t, const uint32_t *idx, const uint32_t *len, uint32_t n, int more);
uint32_t vn_rx_refill(struct vn_rxq *r, uint32_t thresh);
int vn_rx_burst(struct vn_rxq *r, uint32_t *out_idx, uint32_t *out_len, uint32_t max);
int vn_rx_pending(const struct vn_rxq *r);
void vn_macswap(struct vn_pool *p, const uint32_t *idx, uint32_t n);
uint32_t vn_gen(struct vn_pool *p, uint32_t *out, uint32_t n, const uint8_t *tmpl, uint32_t len,
                uint64_t seq, uint32_t seq_off, int stamp, uint32_t ts_off);
uint32_t vn_check(const struct vn_pool *p, const uint32_t *idx, const uint32_t *len, uint32_t n,
                  const uint8_t *tmpl, uint32_t tlen, int swapped, uint32_t seq_off, uint32_t ts_off,
                  uint64_t *seqs);
int vn_fwd_burst(struct vn_rxq *r, struct vn_txq *t, uint32_t *idx, uint32_t *len, uint32_t max);
int64_t vn_fwd_loop(struct vn_rxq *r, struct vn_txq *t, uint32_t *idx, uint32_t *len, uint32_t max,
                    uint32_t spin, uint32_t bursts, int32_t *idle, uint64_t slice_ns);
int vn_tx_flush(struct vn_txq *t);
uint32_t vn_gen_tx(struct vn_txq *t, uint32_t *idx, uint32_t n, const uint8_t *tmpl, uint32_t len,
                   uint64_t seq, uint32_t seq_off, int stamp, uint32_t ts_off, uint32_t *lens);
int vn_rx_drop(struct vn_rxq *r, uint32_t *idx, uint32_t *len, uint32_t max, uint32_t spin, uint64_t slice_ns);
uint64_t vn_now_ns(void);
void vn_lat_update(struct vn_lat *l, struct vn_pool *p, const uint32_t *idx, uint32_t n);
void vn_lat_reset(struct vn_lat *l);
int64_t vn_pace_loop(struct vn_rxq *r, struct vn_txq *t, struct vn_pace *pc, uint32_t *tx_idx, uint32_t *tx_len,
                     uint32_t *rx_idx, uint32_t *rx_len, const uint8_t *tmpl, uint32_t plen, uint32_t seq_off,
                     uint32_t ts_off, uint32_t max, uint32_t rx_max, uint32_t spin, uint32_t steps);
int vq_drv_kick_prepare(struct vq_driver *q);
int vq_drv_publish(struct vq_driver *q);
"""


def build_ffi(**kw):
    """The FFI builder (``kw``: package_ffi's build options; the package build passes none)."""
    return package_ffi("virtio._net", CSRC, "vnet.h", "vnet_types.h", FUNCTIONS, **kw)


ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
