/* The staged chunk loop on a thread of its own: the host side of a staged transfer.
 *
 * The engine's thread hands a transfer here in one call: tc_transfer (transfer.c) takes
 * a spec's ids as they are, validates them, checks the worker's slot fence, marks the
 * compute stream and queues the job with a pair table of the queue's own (or a planner
 * that validated already, tc_validate, queues its block plan with tc_submit): per
 * KV-cache group the GPU ids, region slots and sub-pages. This thread lays it out
 * (layout.c) and enqueues it on the GPU (issue.c). It never takes the GIL and never
 * waits for the device: it only enqueues, so the engine's thread is held for none of
 * this. The exception is a small job (at most inline_pairs pairs, tc_set_inline) that
 * finds the loop idle: the caller issues it itself, which then costs it the job's few
 * driver calls instead of a thread wake-up. A job of at most zero_copy_pairs pairs
 * (tc_set_zero_copy) skips the ring: one launch of the same kernel moves its pages
 * straight between the GPU and the host rows (pinned, mapped: the kernel reaches them
 * through UVA), with no DMA and no hop between streams, the shortest path for a block
 * or two, at the cost of holding the launch's programs for the PCIe time.
 *
 * Jobs are issued strictly in submission order, one at a time (a FIFO). What keeps the
 * two issuers apart: the loop's thread leaves a job at the queue's head until it has
 * issued it (it issues with the lock released), and the caller issues inline only under
 * the lock and only while the head is empty; so the ring cursor and the DMA scratch have
 * one user at a time. Each job also carries the handler's ordering events (wait for the
 * previous transfer, record the start, record the end), so that everything a transfer
 * puts on its stream is put there by its issuer, in order. A job's status cell is
 * written last (0 or the first failing CUresult) and the issued count is then bumped:
 * the caller must not trust the job's events before it sees the job issued.
 *
 * Driver entry points arrive as function pointers (resolved by tiercache's driver
 * binding), so the loop links against nothing and can be driven by any table of
 * functions with the same signatures (the CPU tests record the calls).
 */
#include <stdlib.h>
#include <string.h>

#include "loop.h"

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
        int64_t picked = now_ns();
        int zero_copy = 0;
        int rc = ctx_rc ? ctx_rc : run_job(q, &n->job, &zero_copy);
        if (n->job.owns)
            free((void *)n->job.validated);
        int64_t issued = now_ns();
        pthread_mutex_lock(&q->mu);
        q->stamps[0] = n->submitted_ns, q->stamps[1] = picked, q->stamps[2] = issued;
        q->stamps[3] = 0; /* before the status: a caller that sees it issued reads these */
        q->stamps[4] = zero_copy;
        __atomic_store_n(n->job.status, rc, __ATOMIC_RELEASE);
        q->head = n->next;
        if (!q->head)
            q->tail = NULL;
        __atomic_store_n(&q->issued, q->issued + 1, __ATOMIC_RELEASE); /* take_table reads it */
        pthread_cond_broadcast(&q->issued_cv);
        free(n);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* A queue and its thread, or NULL (bad config or no thread). */
tc_queue *tc_open(const tc_config *cfg) {
    if (cfg->num_ring_slots < 1 || cfg->num_ring_slots > TC_MAX_RING_SLOTS
        || cfg->num_params < TC_KERNEL_ARGS || cfg->num_params > TC_MAX_PARAMS || !cfg->geometry
        || cfg->geometry->factor < 1)
        return NULL;
    tc_queue *q = calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->cfg = *cfg;
    q->inline_pairs = -1;
    q->zero_copy_pairs = -1;
    pthread_mutex_init(&q->mu, NULL);
    pthread_mutex_init(&q->tables_mu, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->issued_cv, NULL);
    if (pthread_create(&q->thread, NULL, loop, q) != 0) {
        free(q);
        return NULL;
    }
    return q;
}

/* The loop's context made current on the calling thread when none is (what torch's
 * set_device does for a fresh thread): the mark and an inline issue act on it. */
int caller_context(const tc_config *c) {
    if (!c->ctx_get || !c->ctx)
        return 0;
    void *current = NULL;
    int rc = ((ctx_get_fn)c->ctx_get)(&current);
    if (rc || current)
        return rc;
    return ((ctx_fn)c->ctx_set)(c->ctx);
}

/* Whether the calling thread may issue a job itself: the loop's context is current. */
static int caller_in_context(const tc_config *c) {
    if (!c->ctx_get)
        return c->ctx == NULL;
    void *current = NULL;
    return ((ctx_get_fn)c->ctx_get)(&current) == 0 && current != NULL
           && (c->ctx == NULL || current == c->ctx);
}

/* Queue a copy of *job (its arrays must live until it is issued; an owned validated
 * buffer is freed by its issuer); its sequence number (1, 2, ...), or 0 when refused
 * (closing, or no memory: the caller still owns everything then). A job of at most inline_pairs
 * pairs that finds the loop idle (nothing queued, nothing being issued) is issued here,
 * on the caller's thread, before this returns: a small job then pays neither the loop
 * thread's wake-up nor a second core's cold caches. Either way jobs are issued one at a
 * time, in submission order (file comment). The caller keeps the GIL through
 * the inline issue (a few enqueue-only driver calls, as torch's own launches do). */
static uint64_t submit_job(tc_queue *q, const tc_job *job) {
    int64_t submitted = now_ns();
    __atomic_store_n(job->status, TC_STATUS_PENDING, __ATOMIC_RELAXED);
    pthread_mutex_lock(&q->mu);
    if (q->stop) {
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    if (!q->head && job->num_pairs <= q->inline_pairs && caller_in_context(&q->cfg)) {
        uint64_t seq = ++q->submitted;
        int64_t picked = now_ns();
        int zero_copy = 0;
        int rc = run_job(q, job, &zero_copy);
        if (job->owns)
            free((void *)job->validated);
        __atomic_store_n(job->status, rc, __ATOMIC_RELEASE);
        q->stamps[0] = submitted, q->stamps[1] = picked, q->stamps[2] = now_ns();
        q->stamps[3] = 1, q->stamps[4] = zero_copy;
        __atomic_store_n(&q->issued, q->issued + 1, __ATOMIC_RELEASE); /* take_table reads it */
        pthread_cond_broadcast(&q->issued_cv);
        pthread_mutex_unlock(&q->mu);
        return seq;
    }
    node *n = malloc(sizeof *n);
    if (!n) {
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    n->job = *job;
    n->submitted_ns = submitted;
    n->next = NULL;
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

/* A table of the queue's for num_pairs pairs, marked taken (the caller gives it its job's
 * seq, or 0, with give_table); NULL when none can be made (no allocator, no memory, or
 * a driver error). Made current: the loop's context, for the driver calls. */
static tc_table *take_table(tc_queue *q, int64_t num_pairs) {
    const tc_config *c = &q->cfg;
    int64_t words = 4 * num_pairs;
    tc_table *t = NULL;
    if (!c->host_alloc)
        return NULL;
    pthread_mutex_lock(&q->tables_mu);
    uint64_t issued = __atomic_load_n(&q->issued, __ATOMIC_ACQUIRE);
    for (int64_t i = 0; i < q->num_tables && !t; i++) {
        tc_table *u = q->tables[i];
        if (u->words >= words && u->seq <= issued && ((event_fn)c->event_query)(u->event) == 0)
            t = u;
    }
    if (!t) {
        tc_table **grown = realloc(q->tables, (size_t)(q->num_tables + 1) * sizeof *grown);
        t = calloc(1, sizeof *t);
        int64_t size = words > TC_TABLE_MIN_WORDS ? words : TC_TABLE_MIN_WORDS;
        void *pairs = NULL, *event = NULL;
        int ok = grown && t && !caller_context(c)
                 && ((host_alloc_fn)c->host_alloc)(&pairs, (size_t)size * 8, 0) == 0;
        if (ok && ((event_create_fn)c->event_create)(&event, TC_EVENT_DISABLE_TIMING) != 0) {
            ((host_free_fn)c->host_free)(pairs);
            ok = 0;
        }
        if (grown)
            q->tables = grown;
        if (!ok) {
            free(t);
            pthread_mutex_unlock(&q->tables_mu);
            return NULL;
        }
        *t = (tc_table){pairs, size, event, 0};
        q->tables[q->num_tables++] = t;
    }
    t->seq = TC_TABLE_TAKEN;
    pthread_mutex_unlock(&q->tables_mu);
    return t;
}

static void give_table(tc_queue *q, tc_table *t, uint64_t seq) {
    pthread_mutex_lock(&q->tables_mu);
    t->seq = seq;
    pthread_mutex_unlock(&q->tables_mu);
}

/* submit_job, with one of the queue's own tables for a job that brings none (pairs
 * NULL) and lays pairs out; 0 when refused (closing, no memory, or no table). */
uint64_t tc_submit(tc_queue *q, const tc_job *job) {
    if (job->pairs || job->num_works <= 0)
        return submit_job(q, job);
    tc_table *t = take_table(q, job->num_pairs);
    if (!t)
        return 0;
    tc_job j = *job;
    j.pairs = t->pairs;
    j.table_ev = t->event;
    uint64_t seq = submit_job(q, &j);
    give_table(q, t, seq);
    return seq;
}

/* Jobs of at most this many pairs are issued by the caller when the loop is idle
 * (0: never; negative: never either, even empty jobs). */
void tc_set_inline(tc_queue *q, int64_t pairs) {
    pthread_mutex_lock(&q->mu);
    q->inline_pairs = pairs;
    pthread_mutex_unlock(&q->mu);
}

/* Jobs of at most this many pairs move zero-copy (file comment); 0 or negative: none.
 * Only for host rows that are pinned and mapped: the kernel dereferences them. */
void tc_set_zero_copy(tc_queue *q, int64_t pairs) {
    __atomic_store_n(&q->zero_copy_pairs, pairs, __ATOMIC_RELAXED);
}

/* The last issued job's times (CLOCK_MONOTONIC ns: submitted, picked up, issued),
 * whether the caller issued it (1) or the loop's thread (0), and whether it moved
 * zero-copy (1); zeros before any job. */
void tc_stamps(tc_queue *q, int64_t *out) {
    pthread_mutex_lock(&q->mu);
    memcpy(out, q->stamps, sizeof q->stamps);
    pthread_mutex_unlock(&q->mu);
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
    if (q->num_tables && !caller_context(&q->cfg)) /* the driver calls need the context */
        for (int64_t i = 0; i < q->num_tables; i++) {
            ((event_fn)q->cfg.event_destroy)(q->tables[i]->event);
            ((host_free_fn)q->cfg.host_free)(q->tables[i]->pairs);
            free(q->tables[i]);
        }
    free(q->tables);
    pthread_mutex_destroy(&q->tables_mu);
    free(q->dma.host);
    free(q->seen);
    free(q);
}
