/* The staged chunk loop on a thread of its own: the host side of a staged transfer.
 *
 * The engine's thread lays a transfer out (numpy, O(blocks)) and hands it here in one
 * call (tc_submit); this thread enqueues it on the GPU: per chunk one pack/unpack launch,
 * one cuMemcpyBatchAsync and four event calls (backends/staged.py's module docstring has
 * the order). It never takes the GIL and never waits for the device: it only enqueues, so
 * a transfer's calls are issued within microseconds of each other, the first DMA is not
 * delayed by the later chunks' calls, and the engine's thread is held for none of them.
 *
 * Jobs are issued strictly in submission order (a FIFO, one thread). Each job also
 * carries the handler's ordering events (wait for the previous transfer, record the
 * start, record the end), so that everything a transfer puts on its stream is put there
 * by this thread, in order. A job's status cell is written last (0 or the first failing
 * CUresult) and the issued count is then bumped: the caller must not trust the job's
 * events before it sees the job issued.
 *
 * Driver entry points arrive as function pointers (resolved by tiercache's driver
 * binding), so the loop links against nothing and can be driven by any table of
 * functions with the same signatures (the CPU tests record the calls).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define TC_MAX_SLOTS 64
#define TC_MAX_PARAMS 16
#define TC_KERNEL_ARGS 9 /* pairs, pair_stride, first, count, slot_base, tensors,
                            tensor_stride, groups, num_groups */
#define TC_ABI_12_8 12080

typedef struct {
    void *launch, *record, *wait, *batch, *ctx_set; /* driver entry points */
    int32_t batch_abi;                              /* 12080 (with failIdx) or 13000 */
    int32_t num_slots;
    void *ctx;        /* made current on the loop's thread (NULL: leave as is) */
    void *dma_stream; /* the backend's DMA stream */
    uint64_t ring_base, slot_bytes;
    void *free_ev[TC_MAX_SLOTS], *ready_ev[TC_MAX_SLOTS];
    void *begin_ev, *done_ev; /* DMA stream after the transfer's stream, and back */
    void *function[2];        /* [0] unpack (loads), [1] pack (stores) */
    uint32_t block_x, shared[2];
    uint32_t grid_y, max_grid_x; /* max_grid_x 0: one program per pair */
    int32_t num_params;          /* the kernel's parameters; past the first 9 all zero */
    uint64_t static_args[4];     /* tensors, tensor_stride, groups, num_groups */
    uint8_t attrs[2][24];        /* CUmemcpyAttributes of loads [0] and stores [1] */
} tc_config;

typedef struct {
    void *stream;                 /* the transfer's stream */
    void *prev_end;               /* wait for it first (NULL: none) */
    void *start_ev, *end_ev;      /* recorded on stream around the transfer (NULL: none) */
    void *table_ev;               /* recorded on stream after the last launch (NULL: none) */
    int32_t store, num_chunks, cursor, num_pairs;
    uint64_t pairs;               /* the pair table, as the kernel reads it */
    const int64_t *pair_first;    /* num_chunks + 1 */
    const uint64_t *dma_host, *dma_slot, *dma_bytes; /* dma_first[num_chunks] each */
    const int64_t *dma_first;     /* num_chunks + 1 */
    uint64_t *stage;              /* dma_first[num_chunks]: filled with the DMAs' slot ends */
    volatile int32_t *status;     /* written last: 0, or the first failing CUresult */
} tc_job;

typedef struct node {
    tc_job job;
    struct node *next;
} node;

typedef struct {
    tc_config cfg;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, issued_cv;
    node *head, *tail;
    uint64_t submitted, issued;
    int stop;
} tc_queue;

static int launch(const tc_config *c, const tc_job *j, int64_t first, int64_t count,
                  uint64_t slot_base) {
    if (count <= 0)
        return 0;
    uint64_t values[TC_MAX_PARAMS] = {0};
    void *params[TC_MAX_PARAMS];
    values[0] = j->pairs;
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

/* One job; returns 0 or the first failing CUresult. After a failure the remaining chunks
 * are skipped, but the job's end event is still recorded (later transfers order on it). */
static int run_job(const tc_config *c, const tc_job *j) {
    record_fn record = (record_fn)c->record;
    wait_fn wait = (wait_fn)c->wait;
    void *S = j->stream, *D = c->dma_stream;
    int err = 0, rc;
#define CALL(x)                                                                            \
    do {                                                                                   \
        if (!err && (rc = (x)) != 0)                                                       \
            err = rc;                                                                      \
    } while (0)
    if (j->prev_end)
        CALL(wait(S, j->prev_end, 0));
    if (j->start_ev)
        CALL(record(j->start_ev, S));
    if (j->num_chunks > 0) {
        CALL(record(c->begin_ev, S));
        CALL(wait(D, c->begin_ev, 0));
        for (int32_t k = 0; k < j->num_chunks && !err; k++) {
            int s = (j->cursor + k) % c->num_slots;
            uint64_t base = c->ring_base + (uint64_t)s * c->slot_bytes;
            int64_t lo = j->dma_first[k], hi = j->dma_first[k + 1];
            for (int64_t i = lo; i < hi; i++)
                j->stage[i] = base + j->dma_slot[i];
            int64_t first = j->pair_first[k], count = j->pair_first[k + 1] - first;
            if (j->store) {
                CALL(wait(S, c->free_ev[s], 0));
                CALL(launch(c, j, first, count, base));
                CALL(record(c->ready_ev[s], S));
                CALL(wait(D, c->ready_ev[s], 0));
                CALL(batch(c, j->dma_host + lo, j->stage + lo, j->dma_bytes + lo,
                           (size_t)(hi - lo), 1, D));
                CALL(record(c->free_ev[s], D));
            } else {
                CALL(wait(D, c->free_ev[s], 0));
                CALL(batch(c, j->stage + lo, j->dma_host + lo, j->dma_bytes + lo,
                           (size_t)(hi - lo), 0, D));
                CALL(record(c->ready_ev[s], D));
                CALL(wait(S, c->ready_ev[s], 0));
                CALL(launch(c, j, first, count, base));
                CALL(record(c->free_ev[s], S));
            }
        }
        if (j->table_ev)
            CALL(record(j->table_ev, S));
        CALL(record(c->done_ev, D));
        CALL(wait(S, c->done_ev, 0));
    }
    if (j->end_ev) {
        rc = record(j->end_ev, S);
        if (!err)
            err = rc;
    }
#undef CALL
    return err;
}

static void *loop(void *arg) {
    tc_queue *q = arg;
    int ctx_rc = q->cfg.ctx ? ((ctx_fn)q->cfg.ctx_set)(q->cfg.ctx) : 0;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->stop)
            pthread_cond_wait(&q->work, &q->mu);
        if (!q->head)
            break; /* stop, and nothing left */
        node *n = q->head;
        pthread_mutex_unlock(&q->mu);
        int rc = ctx_rc ? ctx_rc : run_job(&q->cfg, &n->job);
        __atomic_store_n(n->job.status, rc, __ATOMIC_RELEASE);
        pthread_mutex_lock(&q->mu);
        q->head = n->next;
        if (!q->head)
            q->tail = NULL;
        q->issued++;
        pthread_cond_broadcast(&q->issued_cv);
        free(n);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* A queue and its thread, or NULL (bad config or no thread). */
tc_queue *tc_open(const tc_config *cfg) {
    if (cfg->num_slots < 1 || cfg->num_slots > TC_MAX_SLOTS || cfg->num_params < TC_KERNEL_ARGS
        || cfg->num_params > TC_MAX_PARAMS)
        return NULL;
    tc_queue *q = calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->cfg = *cfg;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->issued_cv, NULL);
    if (pthread_create(&q->thread, NULL, loop, q) != 0) {
        free(q);
        return NULL;
    }
    return q;
}

/* Queue a copy of *job (its arrays must live until it is issued); its sequence number
 * (1, 2, ...), or 0 when refused (closing, or no memory). */
uint64_t tc_submit(tc_queue *q, const tc_job *job) {
    node *n = malloc(sizeof *n);
    if (!n)
        return 0;
    n->job = *job;
    n->next = NULL;
    __atomic_store_n(job->status, -1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&q->mu);
    if (q->stop) {
        pthread_mutex_unlock(&q->mu);
        free(n);
        return 0;
    }
    if (q->tail)
        q->tail->next = n;
    else
        q->head = n;
    q->tail = n;
    uint64_t seq = ++q->submitted;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    return seq;
}

/* Block until the jobs up to seq were issued (seq 0: all submitted so far). */
void tc_wait(tc_queue *q, uint64_t seq) {
    pthread_mutex_lock(&q->mu);
    if (seq == 0)
        seq = q->submitted;
    while (q->issued < seq)
        pthread_cond_wait(&q->issued_cv, &q->mu);
    pthread_mutex_unlock(&q->mu);
}

uint64_t tc_issued(tc_queue *q) {
    pthread_mutex_lock(&q->mu);
    uint64_t n = q->issued;
    pthread_mutex_unlock(&q->mu);
    return n;
}

/* Issue what is queued, stop the thread, free the queue. */
void tc_close(tc_queue *q) {
    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->issued_cv);
    pthread_mutex_destroy(&q->mu);
    free(q);
}
