/* One job's driver calls: per chunk one pack / unpack launch, one cuMemcpyBatchAsync and
 * four event calls, in the order backends/staged/backend.py's docstring gives (the CPU
 * tests hold the calls to that order: tests/support/loop_fakes.contract). Called by the
 * job's issuer, one at a time (queue.c): the loop's thread, or a caller issuing a small
 * job inline.
 */
#include <stdlib.h>
#include <string.h>

#include "loop.h"

static int launch(const tc_config *c, const tc_job *j, int64_t first, int64_t count,
                  uint64_t slot_base) {
    if (count <= 0)
        return 0;
    uint64_t values[TC_MAX_PARAMS] = {0};
    void *params[TC_MAX_PARAMS];
    values[0] = (uint64_t)(uintptr_t)j->pairs;
    values[1] = (uint64_t)j->num_pairs;
    values[2] = (uint64_t)first;
    values[3] = (uint64_t)count;
    values[4] = slot_base;
    memcpy(&values[5], c->static_args, sizeof c->static_args);
    for (int i = 0; i < c->num_params; i++)
        params[i] = &values[i]; /* little-endian: a 4-byte parameter reads the low half */
    unsigned gx = (unsigned)count;
    if (c->max_grid_x && gx > c->max_grid_x)
        gx = c->max_grid_x;
    int s = j->store ? 1 : 0;
    return ((launch_fn)c->launch)(c->function[s], gx, c->grid_y, 1, c->block_x, 1, 1,
                                  c->shared[s], j->stream, params, NULL);
}

static int batch(const tc_config *c, const uint64_t *dst, const uint64_t *src,
                 const uint64_t *size, size_t count, int store, void *stream) {
    if (count == 0)
        return 0;
    size_t attr_idx = 0, fail_idx = 0;
    const void *attrs = c->attrs[store ? 1 : 0];
    if (c->batch_abi == TC_ABI_12_8)
        return ((batch_12_fn)c->batch)(dst, src, size, count, attrs, &attr_idx, 1, &fail_idx,
                                       stream);
    return ((batch_13_fn)c->batch)(dst, src, size, count, attrs, &attr_idx, 1, stream);
}

/* One job; returns 0 or the first failing CUresult, and sets *zero_copy_out to whether it
 * moved zero-copy. After a failure the remaining chunks are skipped, but the joins and the
 * job's end event are still recorded (later transfers, the pair table's reuse and the
 * handler's completion order on them). */
int run_job(tc_queue *q, const tc_job *j, int *zero_copy_out) {
    const tc_config *c = &q->cfg;
    record_fn record = (record_fn)c->record;
    wait_fn wait = (wait_fn)c->wait;
    void *S = j->stream, *D = c->dma_stream;
    const dma_t *x = &q->dma;
    int err = 0, rc;
    int64_t *pair_first = NULL, *dma_first = NULL, num_chunks = 0;
#define CALL(x)                                                                            \
    do {                                                                                   \
        if (!err && (rc = (x)) != 0)                                                       \
            err = rc;                                                                      \
    } while (0)
#define ALWAYS(x)                                                                          \
    do {                                                                                   \
        if ((rc = (x)) != 0 && !err)                                                       \
            err = rc;                                                                      \
    } while (0)
    if (j->after)
        CALL(wait(S, j->after, 0));
    if (j->prev_end)
        CALL(wait(S, j->prev_end, 0));
    if (j->start_ev)
        CALL(record(j->start_ev, S));
    int zero_copy = j->num_works > 0
                    && j->num_pairs <= __atomic_load_n(&q->zero_copy_pairs, __ATOMIC_RELAXED);
    *zero_copy_out = zero_copy;
    if (j->num_works > 0 && !err)
        err = lay_out(c->geometry, j, zero_copy, &q->dma, &pair_first, &dma_first, &num_chunks);
    if (zero_copy && num_chunks > 0 && !err) { /* no ring: the kernel reaches the host rows */
        CALL(launch(c, j, 0, j->num_pairs, 0));
        if (j->table_ev)
            ALWAYS(record(j->table_ev, S));
    }
    /* One chunk has nothing to overlap: all of it on the transfer's stream, no hops to
     * the DMA stream and back (the slot's free event still orders it with the ring). */
    int hop = num_chunks > 1;
    void *X = hop ? D : S; /* where the DMAs go */
    if (!zero_copy && num_chunks > 0 && !err) {
        if (hop) {
            CALL(record(c->begin_ev, S));
            CALL(wait(D, c->begin_ev, 0));
        }
        for (int64_t k = 0; k < num_chunks && !err; k++) {
            int s = (int)((q->cursor + k) % c->num_ring_slots);
            uint64_t base = c->ring_base + (uint64_t)s * c->ring_slot_bytes;
            int64_t lo = dma_first[k], hi = dma_first[k + 1];
            for (int64_t i = lo; i < hi; i++)
                x->stage[i] = base + x->slot[i];
            int64_t first = pair_first[k], count = pair_first[k + 1] - first;
            if (j->store) {
                CALL(wait(S, c->free_ev[s], 0));
                CALL(launch(c, j, first, count, base));
                if (hop) {
                    CALL(record(c->ready_ev[s], S));
                    CALL(wait(D, c->ready_ev[s], 0));
                }
                CALL(batch(c, x->host + lo, x->stage + lo, x->bytes + lo,
                           (size_t)(hi - lo), 1, X));
                CALL(record(c->free_ev[s], X));
            } else {
                CALL(wait(X, c->free_ev[s], 0));
                CALL(batch(c, x->stage + lo, x->host + lo, x->bytes + lo,
                           (size_t)(hi - lo), 0, X));
                if (hop) {
                    CALL(record(c->ready_ev[s], D));
                    CALL(wait(S, c->ready_ev[s], 0));
                }
                CALL(launch(c, j, first, count, base));
                CALL(record(c->free_ev[s], S));
            }
        }
        q->cursor = (q->cursor + num_chunks) % c->num_ring_slots;
        /* Even after a failure: the table's event must follow the launches that did go
         * out (the buffer is reused once it completes), and the end must follow the DMAs
         * that did (the handler reports the transfer finished at its end). */
        if (j->table_ev)
            ALWAYS(record(j->table_ev, S));
        if (hop) {
            ALWAYS(record(c->done_ev, D));
            ALWAYS(wait(S, c->done_ev, 0));
        }
    }
    free(pair_first);
    free(dma_first);
    if (j->end_ev) {
        rc = record(j->end_ev, S);
        if (!err)
            err = rc;
    }
#undef CALL
#undef ALWAYS
    return err;
}

