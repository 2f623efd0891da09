/* What the library's files share inside it (nothing here is seen from Python): the
 * driver's function types, the queue, its pair tables and DMA scratch, and the functions
 * one file calls in another. The files, by concern:
 *
 *   validate.c  a transfer's ids checked by the planner's rules (tc_validate)
 *   layout.c    a validated job laid out: rows, the pair table, DMAs, chunk bounds
 *   issue.c     one job's driver calls, chunk by chunk (the pipeline)
 *   queue.c     the loop's thread, the FIFO, its pair tables (tc_open ... tc_close)
 *   transfer.c  a whole transfer in one call: validate, fence, mark, queue (tc_transfer)
 *   report.c    the layouts and constants Python checks its mirrors against
 */
#ifndef TC_LOOP_H
#define TC_LOOP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "codes.h"
#include "structs.h"

/* Functions of one file that another calls: not exported from the library. */
#define TC_INTERNAL __attribute__((visibility("hidden")))

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shared, void *stream,
                         void **params, void **extra);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*batch_13_fn)(const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes,
                           size_t count, const void *attrs, size_t *attr_idxs, size_t num_attrs,
                           void *stream);
typedef int (*batch_12_fn)(const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes,
                           size_t count, const void *attrs, size_t *attr_idxs, size_t num_attrs,
                           size_t *fail_idx, void *stream);
typedef int (*ctx_fn)(void *ctx);
typedef int (*ctx_get_fn)(void **ctx);
typedef int (*host_alloc_fn)(void **pointer, size_t bytes, unsigned flags);
typedef int (*host_free_fn)(void *pointer);
typedef int (*event_create_fn)(void **event, unsigned flags);
typedef int (*event_fn)(void *event);

#define TC_EVENT_DISABLE_TIMING 2u /* CU_EVENT_DISABLE_TIMING: the tables' events are markers */
#define TC_TABLE_MIN_WORDS 2048    /* 16 KiB: 512 pairs */
#define TC_TABLE_TAKEN UINT64_MAX

typedef struct {
    int64_t key, index;
} keyed_t;

/* The issuer's DMA scratch, reused job after job (the batch call reads its descriptors
 * during the call): host address, slot offset, bytes and staging address of each DMA. */
typedef struct {
    uint64_t *host, *slot, *bytes, *stage;
    int64_t cap;
} dma_t;

/* A pair table of the queue's own: pinned host memory the kernels read through UVA,
 * reused once the job that last used it was issued and its event (recorded after that
 * job's last launch) completed. */
typedef struct {
    int64_t *pairs;
    int64_t words; /* int64 entries: room for words / 4 pairs */
    void *event;
    uint64_t seq; /* the job that last used it; 0: none; TC_TABLE_TAKEN: being given one */
} tc_table;

typedef struct node {
    tc_job job;
    int64_t submitted_ns; /* CLOCK_MONOTONIC at tc_submit */
    struct node *next;
} node;

typedef struct tc_queue {
    tc_config cfg;
    dma_t dma; /* the issuer's: the loop's thread, or an inline caller (queue.c) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, issued_cv;
    node *head, *tail;
    uint64_t submitted, issued;
    int64_t cursor; /* the ring slot the next chunk takes (the issuer's, as dma) */
    int64_t inline_pairs; /* jobs of at most this many pairs: issued by the caller when idle */
    int64_t zero_copy_pairs; /* jobs of at most this many pairs: zero-copy (no ring, no DMA) */
    int64_t stamps[5];    /* the last job: submitted, picked up, issued (ns), 1 if inline,
                             1 if zero-copy */
    int stop;
    uint64_t *seen;       /* tc_transfer's repeat bitmap (its caller's: one thread) */
    int64_t seen_words;
    pthread_mutex_t tables_mu; /* the submitters' (the loop's thread only records events) */
    tc_table **tables;
    int64_t num_tables;
} tc_queue;

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* validate.c */
TC_INTERNAL int validate(const tc_bounds *geo, int32_t store, int32_t num_groups,
                         const int64_t *groups, const int64_t *gpu_ids, int64_t num_gpu,
                         const int64_t *cpu_ids, int64_t num_cpu, int64_t *out, uint64_t *seen);
/* layout.c */
TC_INTERNAL void sort_keyed(keyed_t *a, keyed_t *tmp, int64_t n);
TC_INTERNAL int lay_out(const tc_geometry *geo, const tc_job *j, int zero_copy, dma_t *x,
                        int64_t **pair_first, int64_t **dma_first, int64_t *num_chunks);
/* issue.c */
TC_INTERNAL int run_job(tc_queue *q, const tc_job *j, int *zero_copy_out);
/* queue.c */
TC_INTERNAL int caller_context(const tc_config *c);
uint64_t tc_submit(tc_queue *q, const tc_job *job);

#endif
