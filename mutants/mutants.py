"""Named mutants of spec rules, each applied to both implementations at once: the C engine (rings/csrc/virtq.h,
or rings/virtq.py where the rule lives in its Python half) and the reference model (rings/reference.py, or
rings/layout.py which it uses); the C engine's one-descriptor fast paths, which only C has, get mutants of their
own. An edit is (file, exact snippet, replacement); the snippet must occur exactly once, or run.py stops: a
mutant must never turn silently into a no-op when the files change.

``ids``: the checklist IDs of the rule broken; a mutant counts as killed only if a test whose name carries one
of them fails.
"""
from typing import NamedTuple

H = "rings/csrc/virtq.h"
PY = "rings/virtq.py"
REF = "rings/reference.py"
LAYOUT = "rings/layout.py"


class Mutant(NamedTuple):
    name: str
    ids: tuple
    what: str
    edits: tuple   # (file, snippet, replacement)


MUTANTS = [
    # ---- split driver ----------------------------------------------------------------------------
    Mutant("split_d_02_writable_segments_first", ("SPLIT-D-02",),
           "the driver lays writable segments out before the readable ones",
           ((H, "(j >= nread ? VIRTQ_DESC_F_WRITE : 0));\n            VQ_STORE(d->next, last ? 0 : nxt);",
             "(j < nseg - nread ? VIRTQ_DESC_F_WRITE : 0));\n            VQ_STORE(d->next, last ? 0 : nxt);"),
            (REF, "_pack(_DESC, self.desc, 16 * idxs[j], addr, length, _chain_flags(j, last, write),",
             "_pack(_DESC, self.desc, 16 * idxs[j], addr, length,\n"
             "                      _chain_flags(j, last, j < len(segs) - sum(not s[2] for s in segs)),"))),
    Mutant("split_d_04_2_32_bytes_accepted", ("SPLIT-D-04",),
           "a buffer of 2^32 bytes or more is put in the ring",
           ((PY, "if (np.bincount(per_buf[part], lens[part], len(nseg)) > 0xFFFFFFFF).any():", "if False:"),
            (REF, "            if rlen > U32_MAX or wlen > U32_MAX:\n                raise ConfigError(f\"a buffer of",
             "            if False:\n                raise ConfigError(f\"a buffer of"))),
    Mutant("split_d_05_chain_longer_than_queue", ("SPLIT-D-05", "PACKED-D-09"),
           "a direct chain longer than the queue is not refused",
           ((PY, "        if (direct > self.size).any():", "        if False:"),
            (REF, "        if nseg > self.size:", "        if False:"))),
    Mutant("split_d_06_indirect_without_feature", ("SPLIT-D-06",),
           "indirect tables are used whenever an area is given, negotiated or not",
           ((PY, "if indirect is not None and has(features, VIRTIO_F_INDIRECT_DESC):", "if indirect is not None:"),
            (REF, "if indirect is not None and has(self.features, VIRTIO_F_INDIRECT_DESC):",
             "if indirect is not None:"))),
    Mutant("split_d_15_used_len_ignored", ("SPLIT-D-15",),
           "the driver reports the buffer's writable size instead of the used len",
           ((H, "tokens[n] = q->id_token[id]; lens[n] = len; n++;\n            vq_drv_free_split(q, id);",
             "tokens[n] = q->id_token[id]; lens[n] = q->id_wlen[id]; n++;\n            vq_drv_free_split(q, id);"),
            (H, "tokens[n] = q->id_token[id]; lens[n] = len; n++;\n            vq_drv_free_append(q, id, id);",
             "tokens[n] = q->id_token[id]; lens[n] = q->id_wlen[id]; n++;\n"
             "            vq_drv_free_append(q, id, id);"),
            (REF, "lens.append(length if k == len(batch) - 1 else self.id_wlen[id])",
             "lens.append(self.id_wlen[id])"))),
    Mutant("evt_10_used_flags_not_initialised", ("EVT-10",),
           "the driver leaves used.flags as it found the memory",
           ((PY, "c.used.flags = 0  # EVT-10", "pass  # EVT-10"),
            (REF, "self._put16(self.used, 0, 0)  # EVT-10", "pass  # EVT-10"))),
    Mutant("inorder_04_next_not_wrapped", ("INORDER-04",),
           "IN_ORDER: the last descriptor of the table chains to QS instead of 0",
           ((H, "VQ_STORE(d->next, last ? 0 : nxt);",
             "VQ_STORE(d->next, last ? 0 : (q->in_order ? (uint16_t)(i + 1) : nxt));"),
            (REF, "                      idxs[j + 1] if j < last else 0)",
             "                      (idxs[j] + 1 if self.in_order else idxs[j + 1]) if j < last else 0)"))),
    Mutant("inorder_05_table_not_sequential", ("INORDER-05",),
           "indirect table entries chain to the last entry instead of the next one",
           ((H, "VQ_STORE(t[j].next, last ? 0 : (uint16_t)(j + 1));",
             "VQ_STORE(t[j].next, last ? 0 : (uint16_t)(nseg - 1));"),
            (REF, "                                                          j + 1 if j < last else 0))",
             "                                                          last if j < last else 0))"))),
    # ---- memory order, driver --------------------------------------------------------------------
    Mutant("mem_02_avail_idx_before_ring_entry", ("MEM-02", "SPLIT-D-18"),
           "avail.idx is published before the ring entry of the head it covers",
           ((H, "    VQ_STORE(q->avail->ring[q->next_avail & (size - 1)], head);",
             "    VQ_RELEASE(q->avail->idx, (uint16_t)(q->next_avail + 1));\n"
             "    VQ_STORE(q->avail->ring[q->next_avail & (size - 1)], head);"),
            (REF, "        self._put16(self.avail, 4 + 2 * (self.next_avail % self.size), head)",
             "        self._release16(self.avail, 2, (self.next_avail + 1) & 0xFFFF)\n"
             "        self._put16(self.avail, 4 + 2 * (self.next_avail % self.size), head)"))),
    Mutant("mem_02_avail_idx_relaxed_store", ("MEM-02",),
           "avail.idx is published with a relaxed store (no release barrier)",
           ((H, "        VQ_RELEASE(q->avail->idx, q->next_avail);", "        VQ_SET(q->avail->idx, q->next_avail);"),
            (REF, "self._release16(self.avail, 2, self.next_avail)  # SPLIT-D-12",
             "self._put16(self.avail, 2, self.next_avail)  # SPLIT-D-12"))),
    Mutant("evt_25_no_fence_before_reading_device_event", ("EVT-25", "MEM-03", "MEM-05"),
           "the driver reads the device's suppression fields without a fence after publishing",
           ((H, "    VQ_FENCE();   /* MEM-03 / EVT-25: publish before reading the device's suppression fields */\n", ""),
            (REF, "        _fence()  # EVT-25, MEM-03: the suppression is read after the publishing store\n", ""))),
    Mutant("packed_d_12_head_available_first", ("PACKED-D-12", "MEM-06"),
           "a packed list's head flags are stored with its body, before the rest of the list",
           ((H, "        if (j == 0)\n            head_flags = flags;\n        else\n            VQ_SET(d->flags, flags);",
             "        if (j == 0)\n            head_flags = flags;\n        VQ_SET(d->flags, flags);"),
            (REF, "            if head is None:\n                head = (slot, flags)\n            else:\n"
                  "                self._put16(self.desc, 16 * slot + 14, flags)",
             "            if head is None:\n                head = (slot, flags)\n"
             "            self._put16(self.desc, 16 * slot + 14, flags)"))),
    Mutant("packed_d_22_flags_before_id", ("PACKED-D-22", "MEM-04"),
           "a packed descriptor's id is stored after its flags",
           ((H, "        VQ_STORE(d->id, id);\n        if (j == 0)", "        if (j == 0)"),
            (H, "            VQ_SET(d->flags, flags);\n        if (++q->next_avail == size) {",
             "            VQ_SET(d->flags, flags);\n        VQ_STORE(d->id, id);\n        if (++q->next_avail == size) {"),
            (REF, "            _pack(_DESC_BODY, self.desc, 16 * slot, addr, length, id)\n            if head is None:",
             "            if head is None:"),
            (REF, "                self._put16(self.desc, 16 * slot + 14, flags)\n            self.next_avail += 1",
             "                self._put16(self.desc, 16 * slot + 14, flags)\n"
             "            _pack(_DESC_BODY, self.desc, 16 * slot, addr, length, id)\n            self.next_avail += 1"))),
    Mutant("packed_d_11_partial_list", ("PACKED-D-11",),
           "a packed list is started with too few free descriptors for all of it",
           ((H, "    if (needed > q->num_free)\n        return 1;\n    uint16_t id = q->in_order ? q->next_avail : "
                 "q->free_head, head",
             "    if (q->num_free == 0)\n        return 1;\n    uint16_t id = q->in_order ? q->next_avail : "
             "q->free_head, head"),
            (REF, "            if needed > self.num_free:  # all or nothing", "            if self.num_free == 0:  #"))),
    Mutant("packed_d_04_descriptors_reused_early", ("PACKED-D-04", "PACKED-D-05"),
           "reclaim gives back one descriptor too many, so the driver rewrites one the device owns",
           ((H, "            q->num_free += q->id_ndesc[id];\n            q->inflight--;\n"
                 "            vq_drv_advance_used_packed",
             "            q->num_free += q->id_ndesc[id] + 1;\n            q->inflight--;\n"
             "            vq_drv_advance_used_packed"),
            (REF, "            self.num_free += self.id_ndesc[id]\n",
             "            self.num_free += self.id_ndesc[id] + (self.packed and not self.in_order)\n"))),
    Mutant("packed_d_24_used_check_ignores_wrap", ("PACKED-D-24",),
           "the driver takes a slot as used when AVAIL == USED, whatever its wrap counter",
           ((H, "        if (!!(flags & VIRTQ_DESC_F_AVAIL) != w || !!(flags & VIRTQ_DESC_F_USED) != w)",
             "        if (!!(flags & VIRTQ_DESC_F_AVAIL) != !!(flags & VIRTQ_DESC_F_USED))"),
            (REF, "            if bool(flags & VIRTQ_DESC_F_AVAIL) != w or bool(flags & VIRTQ_DESC_F_USED) != w:",
             "            if bool(flags & VIRTQ_DESC_F_AVAIL) != bool(flags & VIRTQ_DESC_F_USED):"))),
    # the C engine's one-descriptor fast paths keep their own copy of these rules (C only: the reference
    # has no fast path; these must be killed by the C instance of the aimed tests)
    Mutant("packed_d_24_fast_path_ignores_wrap", ("PACKED-D-24",),
           "the driver's one-descriptor reclaim takes a slot as used when AVAIL == USED, whatever its wrap",
           ((H, "        if ((flags & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED)) != vq_used_bits(w))\n            break;",
             "        if (!!(flags & VIRTQ_DESC_F_AVAIL) != !!(flags & VIRTQ_DESC_F_USED))\n            break;"),)),
    Mutant("packed_d_12_fast_path_head_available_first", ("PACKED-D-12", "MEM-06"),
           "the driver's one-descriptor add stores the batch's first head flags at once, not at publish",
           ((H, "        if (pending++ == 0) {\n            q->pending_head = slot;\n            q->pending_flags = flags;\n"
                "        } else {\n            VQ_SET(d->flags, flags);\n        }",
             "        if (pending++ == 0) {\n            q->pending_head = slot;\n            q->pending_flags = flags;\n"
             "        }\n        VQ_SET(d->flags, flags);"),)),
    # ---- notifications, driver -------------------------------------------------------------------
    Mutant("evt_02_avail_flags_set_with_event_idx", ("EVT-02",),
           "with EVENT_IDX the driver still sets avail.flags to suppress calls",
           ((H, "        VQ_SET(q->avail->flags, 0);", "        VQ_SET(q->avail->flags, on ? 0 : VIRTQ_AVAIL_F_NO_INTERRUPT);"),
            (REF, "            self._put16(self.avail, 0, 0)\n            self._put16(self.avail, self._used_event_off(),",
             "            self._put16(self.avail, 0, 0 if on else VIRTQ_AVAIL_F_NO_INTERRUPT)\n"
             "            self._put16(self.avail, self._used_event_off(),"))),
    Mutant("evt_11_avail_event_used_without_event_idx", ("EVT-11",),
           "without EVENT_IDX the driver decides kicks by avail_event",
           ((H, "    } else if (q->event_idx) {   /* EVT-13/14 */", "    } else if (1) {   /* EVT-13/14 */"),
            (REF, "        elif self.event_idx:  # EVT-13/14", "        elif True:  # EVT-13/14"))),
    Mutant("evt_12_no_kick_when_flags_0", ("EVT-12",),
           "without EVENT_IDX the driver never kicks, even when used.flags is 0",
           ((H, "        need = !(VQ_ONCE(q->used->flags) & VIRTQ_USED_F_NO_NOTIFY);", "        need = 0;"),
            (REF, "            kick = not self._get16(self.used, 0) & VIRTQ_USED_F_NO_NOTIFY", "            kick = False"))),
    Mutant("evt_13_flags_bit_honoured_with_event_idx", ("EVT-13",),
           "with EVENT_IDX the driver skips the kick when used.flags bit 0 is set",
           ((H, "    } else if (q->event_idx) {   /* EVT-13/14 */",
             "    } else if (q->event_idx && !(VQ_ONCE(q->used->flags) & VIRTQ_USED_F_NO_NOTIFY)) {   /* EVT-13/14 */"),
            (REF, "        elif self.event_idx:  # EVT-13/14",
             "        elif self.event_idx and not self._get16(self.used, 0) & VIRTQ_USED_F_NO_NOTIFY:  # EVT-13/14"))),
    Mutant("evt_07_evt_14_need_event_off_by_one", ("EVT-07", "EVT-14"),
           "vring_need_event without the -1: notifies one index late",
           ((H, "    return (uint16_t)(new_idx - event_idx - 1) < (uint16_t)(new_idx - old_idx);",
             "    return (uint16_t)(new_idx - event_idx) < (uint16_t)(new_idx - old_idx);"),
            (LAYOUT, "    return ((new_idx - event_idx - 1) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)",
             "    return ((new_idx - event_idx) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)"))),
    # ---- split device ----------------------------------------------------------------------------
    Mutant("split_v_04_device_writes_descriptor", ("SPLIT-V-04",),
           "the device clears the len of each descriptor it has read",
           ((H, "            d.next = VQ_ONCE(q->desc[i].next);\n",
             "            d.next = VQ_ONCE(q->desc[i].next);\n            VQ_STORE(q->desc[i].len, 0);\n"),
            (H, "            uint32_t len = VQ_ONCE(desc[head].len);\n",   # the one-descriptor fast path
             "            uint32_t len = VQ_ONCE(desc[head].len);\n"
             "            VQ_STORE(((struct vring_desc *)desc)[head].len, 0);\n"),
            (REF, "            addr, length, flags, nxt = _DESC.unpack_from(table, 16 * i)  # copied out, then checked\n",
             "            addr, length, flags, nxt = _DESC.unpack_from(table, 16 * i)  # copied out, then checked\n"
             "            _pack(_DESC, table, 16 * i, addr, 0, flags, nxt)\n"))),
    Mutant("split_v_05_write_on_indirect_refused", ("SPLIT-V-05",),
           "the device refuses INDIRECT|WRITE instead of ignoring WRITE",
           ((H, "            if (d.flags & VIRTQ_DESC_F_NEXT)\n                return vq_dev_fail(q, VQ_ERR_INDIRECT_WITH_NEXT, head, i);",
             "            if (d.flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE))\n"
             "                return vq_dev_fail(q, VQ_ERR_INDIRECT_WITH_NEXT, head, i);"),
            (REF, "                if flags & VIRTQ_DESC_F_NEXT:  # SPLIT-D-08",
             "                if flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE):  # SPLIT-D-08"))),
    Mutant("split_v_06_chain_then_indirect_refused", ("SPLIT-V-06",),
           "the device refuses an indirect descriptor at the end of a chain (the packed rule, applied to split)",
           ((H, "            if (in_indirect)\n                return vq_dev_fail(q, VQ_ERR_NESTED_INDIRECT, head, i);",
             "            if (in_indirect || ring_descs > 1)\n                return vq_dev_fail(q, VQ_ERR_NESTED_INDIRECT, head, i);"),
            (REF, "                if in_table:  # SPLIT-D-07", "                if in_table or ndesc > 1:  # SPLIT-D-07"))),
    Mutant("split_v_08_used_idx_before_elements", ("SPLIT-V-08", "MEM-07"),
           "used.idx is published before the used elements are written",
           ((H, "    vq_shadow_load(&v, q);\n    for (uint32_t i = 0; i < v.count;) {\n"
                 "        uint32_t j = vq_dev_batch_end(&v, i);\n        struct vring_used_elem",
             "    vq_shadow_load(&v, q);\n    VQ_RELEASE(q->used->idx, (uint16_t)(v.used_idx + v.count));\n"
             "    for (uint32_t i = 0; i < v.count;) {\n"
             "        uint32_t j = vq_dev_batch_end(&v, i);\n        struct vring_used_elem"),
            (REF, "            for batch in self._batches():\n                id, length = batch[-1]  # INORDER-06",
             "            self._release16(self.used, 2, (self.used_idx + len(self.shadow)) & 0xFFFF)\n"
             "            for batch in self._batches():\n                id, length = batch[-1]  # INORDER-06"))),
    # ---- notifications, device -------------------------------------------------------------------
    Mutant("evt_04_used_event_without_event_idx", ("EVT-04",),
           "without EVENT_IDX the device decides calls by used_event",
           ((H, "    } else if (q->event_idx) {   /* EVT-06/07 */", "    } else if (1) {   /* EVT-06/07 */"),
            (REF, "        elif self.event_idx:  # EVT-06/07", "        elif True:  # EVT-06/07"))),
    Mutant("evt_05_no_call_when_flags_0", ("EVT-05",),
           "without EVENT_IDX the device never calls, even when avail.flags is 0",
           ((H, "        need = !(VQ_ONCE(q->avail->flags) & VIRTQ_AVAIL_F_NO_INTERRUPT);", "        need = 0;"),
            (REF, "            call = not self._get16(self.avail, 0) & VIRTQ_AVAIL_F_NO_INTERRUPT", "            call = False"))),
    Mutant("evt_06_flags_bit_honoured_with_event_idx", ("EVT-06",),
           "with EVENT_IDX the device skips the call when avail.flags bit 0 is set",
           ((H, "    } else if (q->event_idx) {   /* EVT-06/07 */",
             "    } else if (q->event_idx && !(VQ_ONCE(q->avail->flags) & VIRTQ_AVAIL_F_NO_INTERRUPT)) {   /* EVT-06/07 */"),
            (REF, "        elif self.event_idx:  # EVT-06/07",
             "        elif self.event_idx and not self._get16(self.avail, 0) & VIRTQ_AVAIL_F_NO_INTERRUPT:  # EVT-06/07"))),
    Mutant("evt_16_used_flags_set_with_event_idx", ("EVT-16",),
           "with EVENT_IDX the device still sets used.flags to suppress kicks",
           ((H, "        VQ_SET(q->used->flags, 0);", "        VQ_SET(q->used->flags, on ? 0 : VIRTQ_USED_F_NO_NOTIFY);"),
            (REF, "            self._put16(self.used, 0, 0)\n            self._put16(self.used, self._avail_event_off(),",
             "            self._put16(self.used, 0, 0 if on else VIRTQ_USED_F_NO_NOTIFY)\n"
             "            self._put16(self.used, self._avail_event_off(),"))),
    Mutant("mem_10_no_fence_before_reading_driver_event", ("MEM-10",),
           "the device reads the driver's suppression fields without a fence after publishing",
           ((H, "    VQ_FENCE();   /* MEM-10: publish used before reading the driver's suppression fields */\n", ""),
            (REF, "        _fence()  # MEM-10: the suppression is read after the publishing store\n", ""))),
    # ---- packed device ---------------------------------------------------------------------------
    Mutant("packed_v_04_avail_check_ignores_wrap", ("PACKED-V-04",),
           "the device takes a slot as available when AVAIL != USED, whatever its wrap counter",
           ((H, "        if (!!(flags & VIRTQ_DESC_F_AVAIL) != w || !!(flags & VIRTQ_DESC_F_USED) == w)",
             "        if (!!(flags & VIRTQ_DESC_F_AVAIL) == !!(flags & VIRTQ_DESC_F_USED))"),
            (REF, "        if bool(flags & VIRTQ_DESC_F_AVAIL) != wrap or bool(flags & VIRTQ_DESC_F_USED) == wrap:",
             "        if bool(flags & VIRTQ_DESC_F_AVAIL) == bool(flags & VIRTQ_DESC_F_USED):"))),
    Mutant("packed_v_04_fast_path_ignores_wrap", ("PACKED-V-04",),
           "the device's one-descriptor poll takes a slot as available when AVAIL != USED, whatever its wrap",
           ((H, "            if ((flags & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED | VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT))\n"
                "                    != vq_avail_bits(w)) {",
             "            if (!!(flags & VIRTQ_DESC_F_AVAIL) == !!(flags & VIRTQ_DESC_F_USED)\n"
             "                    || (flags & (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_INDIRECT))) {"),)),
    Mutant("packed_v_05_used_flags_before_body", ("PACKED-V-05", "MEM-07"),
           "a used descriptor's id and len are stored after its flags",
           ((H, "        VQ_STORE(d->id, (uint16_t)v.id[j]);   /* INORDER-11/13: last id, at the batch's "
                 "first slot */\n        VQ_STORE(d->len, v.len[j]);\n", ""),
            (H, "        else\n            VQ_SET(d->flags, flags);   /* after its body, before the first's */\n"
                "        /* adv <= inflight_slots",
             "        else\n            VQ_SET(d->flags, flags);   /* after its body, before the first's */\n"
             "        VQ_STORE(d->id, (uint16_t)v.id[j]);\n        VQ_STORE(d->len, v.len[j]);\n"
             "        /* adv <= inflight_slots"),
            (H, "            VQ_STORE(d->id, (uint16_t)id);\n            VQ_STORE(d->len, len);\n"   # one per buffer
                "            v.id_inflight[id] = 0;\n            if (i == 0)\n                first_flags = flags;\n"
                "            else\n                VQ_SET(d->flags, flags);   /* after its body, before the first's */\n",
             "            v.id_inflight[id] = 0;\n            if (i == 0)\n                first_flags = flags;\n"
             "            else\n                VQ_SET(d->flags, flags);\n"
             "            VQ_STORE(d->id, (uint16_t)id);\n            VQ_STORE(d->len, len);\n"),
            (REF, "                _pack(_LEN_ID, self.desc, 16 * self.used_idx + 8, length, id)\n", ""),
            (REF, "                    self._put16(self.desc, 16 * self.used_idx + 14, flags)\n",
             "                    self._put16(self.desc, 16 * self.used_idx + 14, flags)\n"
             "                _pack(_LEN_ID, self.desc, 16 * self.used_idx + 8, length, id)\n"))),
    Mutant("packed_v_16_first_used_flags_early", ("PACKED-V-16", "PACKED-V-05"),
           "the first used descriptor's flags are stored in turn (and again at the end), not last",
           ((H, "        if (i == 0)\n            first_flags = flags;\n        else\n            VQ_SET(d->flags, flags);",
             "        if (i == 0)\n            first_flags = flags;\n        VQ_SET(d->flags, flags);"),
            (H, "            if (i == 0)\n                first_flags = flags;\n            else\n"   # one per buffer
                "                VQ_SET(d->flags, flags);",
             "            if (i == 0)\n                first_flags = flags;\n            VQ_SET(d->flags, flags);"),
            (REF, "                else:  # PACKED-V-05: body, then flags\n"
                  "                    self._put16(self.desc, 16 * self.used_idx + 14, flags)",
             "                self._put16(self.desc, 16 * self.used_idx + 14, flags)"))),
    Mutant("packed_v_10_id_from_first_descriptor", ("PACKED-V-10",),
           "the device returns the buffer id of a list's first descriptor",
           ((H, "        id = d.id;\n", "        if (ndesc == 1)\n            id = d.id;\n"),
            (REF, "            addr, length, id, flags = _DESC.unpack_from(self.desc, 16 * slot)  # copied out, then checked\n",
             "            addr, length, id_, flags = _DESC.unpack_from(self.desc, 16 * slot)\n"
             "            id = id_ if ndesc == 1 else id\n"))),
    # ---- IN_ORDER device -------------------------------------------------------------------------
    Mutant("inorder_02_order_check_removed", ("INORDER-02",),
           "IN_ORDER: push_used accepts completions out of avail order",
           ((H, "            if (fifo_count == 0 || fifo[fifo_head] != id) {\n"
                 "                rc = VQ_USAGE_OUT_OF_ORDER;\n                break;\n            }\n", ""),
            (REF, "            if self.in_order and self.fifo[k] != id:  # INORDER-02",
             "            if False:  # INORDER-02"))),
    Mutant("inorder_10_partial_buffer_skipped", ("INORDER-10", "SPLIT-V-09"),
           "IN_ORDER batching skips over a buffer that was not written completely",
           ((H, "    while (i + 1 < v->count && v->len[i] == v->id_wlen[v->id[i]])",
             "    while (i + 1 < v->count)"),
            (REF, "            if length != self.id_wlen[id]:", "            if False:"))),
]

# ---- C engine only: rules whose reference-model form no test could tell apart (acquire loads, fences), or that
# only the C engine implements twice
MUTANTS += [
    Mutant("split_v_13_avail_idx_jump_unchecked", ("SPLIT-V-13", "SPLIT-V-14"),
           "the device accepts avail.idx more than a ring ahead",
           ((H, "    if ((uint16_t)(avail_idx - q->last_avail) > size)   /* SPLIT-V-13 */",
             "    if (0)   /* SPLIT-V-13 */"),)),
    Mutant("split_v_14_indirect_with_next_accepted", ("SPLIT-V-14", "SPLIT-D-08"),
           "the split device follows INDIRECT|NEXT instead of refusing it",
           ((H, "            if (d.flags & VIRTQ_DESC_F_NEXT)\n                return vq_dev_fail(q, VQ_ERR_INDIRECT_WITH_NEXT, head, i);\n", ""),)),
    Mutant("packed_d_03_list_tail_keeps_head_wrap", ("PACKED-D-03", "PACKED-D-14", "PACKED-D-02"),
           "a packed list straddling the ring end marks its tail with the head's (old) wrap counter",
           ((H, "    uint16_t id = q->in_order ? q->next_avail : q->free_head, head = q->next_avail, head_flags = 0;",
             "    uint16_t id = q->in_order ? q->next_avail : q->free_head, head = q->next_avail, head_flags = 0, hw = q->avail_wrap;"),
            (H, "        uint16_t flags = vq_avail_bits(q->avail_wrap);\n        if (needed == 1 && nseg > 1) {",
             "        uint16_t flags = vq_avail_bits(hw);\n        if (needed == 1 && nseg > 1) {"))),
    Mutant("evt_23_packed_need_event_ignores_wrap", ("EVT-23", "EVT-07", "EVT-14"),
           "packed DESC-mode event: the wrap bit of off_wrap is ignored",
           ((H, "    if ((off_wrap >> 15) != wrap_at_new)\n        off -= size;\n", ""),)),
    Mutant("evt_16_avail_event_one_late", ("EVT-16", "MEM-10", "EVT-14"),
           "device re-enabling kicks with EVENT_IDX asks for a kick one buffer too late",
           ((H, "(uint16_t)(on ? q->last_avail : q->last_avail + 0x7fff)", "(uint16_t)(on ? q->last_avail + 1 : q->last_avail + 0x7fff)"),)),
    Mutant("evt_02_used_event_one_late", ("EVT-02", "EVT-07", "EVT-09"),
           "driver re-enabling calls with EVENT_IDX asks for a call one buffer too late",
           ((H, "(uint16_t)(on ? q->last_used : q->last_used + 0x7fff)", "(uint16_t)(on ? q->last_used + 1 : q->last_used + 0x7fff)"),)),
    Mutant("split_v_08_used_idx_relaxed", ("SPLIT-V-08", "MEM-07"),
           "the device publishes used.idx with a relaxed store",
           ((H, "    VQ_RELEASE(q->used->idx, q->used_idx);   /* SPLIT-V-08: entries before idx */",
             "    VQ_SET(q->used->idx, q->used_idx);"),)),
    Mutant("packed_v_05_first_used_flags_relaxed", ("PACKED-V-05", "MEM-07", "PACKED-V-16"),
           "the device publishes the first used flags with a relaxed store",
           ((H, "        vq_shadow_store(&v, q);\n        VQ_RELEASE(ring[first].flags, first_flags);   /* PACKED-V-16: the first one last */\n        return;",
             "        vq_shadow_store(&v, q);\n        VQ_SET(ring[first].flags, first_flags);\n        return;"),
            (H, "    vq_shadow_store(&v, q);\n    VQ_RELEASE(ring[first].flags, first_flags);   /* PACKED-V-16: the first one last */\n}",
             "    vq_shadow_store(&v, q);\n    VQ_SET(ring[first].flags, first_flags);\n}"))),
    Mutant("packed_d_22_publish_relaxed", ("PACKED-D-22", "MEM-04"),
           "the driver publishes a packed batch's head flags with a relaxed store",
           ((H, "VQ_RELEASE(q->pdesc[q->pending_head].flags, q->pending_flags);",
             "VQ_SET(q->pdesc[q->pending_head].flags, q->pending_flags);"),)),
    Mutant("split_v_13_avail_idx_relaxed_load", ("SPLIT-V-13", "MEM-08", "MEM-11"),
           "the device reads avail.idx with a relaxed load (ring slots may be read before idx)",
           ((H, "uint16_t size = q->size, avail_idx = VQ_ACQUIRE(q->avail->idx);",
             "uint16_t size = q->size, avail_idx = VQ_ONCE(q->avail->idx);"),)),
    Mutant("packed_d_24_used_flags_relaxed_load", ("PACKED-D-24", "MEM-08"),
           "the driver reads used flags with a relaxed load before reading id/len",
           ((H, "        uint16_t flags = VQ_ACQUIRE(d->flags);\n        /* PACKED-D-24: used iff AVAIL == USED == used wrap counter */\n        if ((flags &",
             "        uint16_t flags = VQ_ONCE(d->flags);\n        /* PACKED-D-24: used iff AVAIL == USED == used wrap counter */\n        if ((flags &"),
            (H, "        uint16_t flags = VQ_ACQUIRE(d->flags);\n        uint16_t w = q->used_wrap;",
             "        uint16_t flags = VQ_ONCE(d->flags);\n        uint16_t w = q->used_wrap;"))),
    Mutant("evt_09_no_fence_after_enable_calls", ("EVT-09", "MEM-09", "EVT-26"),
           "the driver re-enables calls without a fence before re-checking the ring",
           ((H, "    VQ_FENCE();   /* EVT-09/MEM-09: callers re-check the ring after enabling */\n", ""),)),
    Mutant("mem_10_fence_before_avail_event_store", ("MEM-10",),
           "the device re-enables kicks with the fence before, not after, the avail_event/flags store",
           ((H, "static inline void vq_dev_enable_kicks(struct vq_device *q, int on)\n{\n",
             "static inline void vq_dev_enable_kicks(struct vq_device *q, int on)\n{\n    VQ_FENCE();\n"),
            (H, "    VQ_FENCE();   /* MEM-10: callers re-check the ring after enabling */\n", ""))),
    Mutant("inorder_08_entry_at_last_slot", ("INORDER-08", "INORDER-02"),
           "IN_ORDER split batch: the used entry goes to the batch's last slot instead of its first",
           ((H, "struct vring_used_elem *e = &ring[v.used_idx & (v.size - 1)];   /* INORDER-08 */",
             "struct vring_used_elem *e = &ring[(uint16_t)(v.used_idx + j - i) & (v.size - 1)];"),)),
    Mutant("evt_23_packed_kick_counts_buffers", ("EVT-23", "EVT-14"),
           "packed driver counts buffers, not descriptors, for the DESC-mode kick decision",
           ((H, "    q->kick_added += needed;\n    return 0;", "    q->kick_added++;\n    return 0;"),)),
    Mutant("split_d_17_used_len_unchecked", ("SPLIT-D-17", "SPLIT-D-15"),
           "the driver accepts a used len larger than the buffer's writable size",
           ((H, "    if (len > q->id_wlen[id])\n        return vq_drv_fail(q, VQ_ERR_USED_LEN_TOO_LARGE, id, len);\n", ""),
            (H, "if (id >= size || !id_inflight[id] || id_ndesc[id] != 1 || len > id_wlen[id] || (in_order && id != oldest))",
             "if (id >= size || !id_inflight[id] || id_ndesc[id] != 1 || (in_order && id != oldest))"),
            (H, "        if (len > id_wlen[id])\n            break;\n", ""))),
    Mutant("packed_v_12_no_write_flag_in_used", ("PACKED-V-12",),
           "the device never sets WRITE in used descriptors, even when it wrote data",
           ((H, "uint16_t flags = vq_used_bits(wrap) | (len ? VIRTQ_DESC_F_WRITE : 0);", "uint16_t flags = vq_used_bits(wrap);"),
            (H, "uint16_t flags = vq_used_bits(v.used_wrap) | (v.len[j] ? VIRTQ_DESC_F_WRITE : 0);",
             "uint16_t flags = vq_used_bits(v.used_wrap);"))),
    Mutant("inorder_10_skipped_len_zero", ("INORDER-10",),
           "IN_ORDER split driver reports skipped buffers of a batch with len 0 instead of fully written",
           ((H, "            lens[n] = h == id ? len : q->id_wlen[h];   /* INORDER-10 */\n            n++;\n            q->oldest",
             "            lens[n] = h == id ? len : 0;\n            n++;\n            q->oldest"),)),
    Mutant("inorder_15_batch_without_in_order", ("INORDER-15",),
           "the device batches used entries when IN_ORDER was not negotiated",
           ((H, "v->batch = q->in_order && q->batch;", "v->batch = q->batch;"),)),
]
