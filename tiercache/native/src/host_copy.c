/* Host-to-host copies on a pool of threads: the byte path between an engine's host memory
 * (SGLang's host KV pool) and the region's rows, with no GPU on either side.
 *
 * A call hands a list of pieces (destination, source, bytes), all in memory this process
 * maps, that never overlap. The pieces are treated as one byte stream and cut into equal
 * shares, one per worker: the calling thread copies share 0 and the pool's threads the
 * others, so one page of many pieces and many pages of one piece keep every thread busy
 * alike. A copy smaller than min_share bytes per worker uses fewer workers (down to the
 * caller alone): waking a thread costs more than copying a few KiB.
 *
 * One call at a time per pool (its mutex): the caller owns the shares until every worker
 * has reported done, so the piece arrays may be freed when hc_copy returns. The Python
 * binding calls it without the GIL (ctypes.CDLL), so the engine's other threads run
 * meanwhile. hc_copy checks its arguments (count, lengths, null pointers) and returns a
 * code; it never copies part of a call it refuses.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HC_OK 0
#define HC_BAD_COUNT 1   /* n < 0 */
#define HC_NULL 2        /* a piece with bytes but a null address */
#define HC_NO_MEMORY 3   /* the prefix table could not be allocated */
#define HC_MAX_THREADS 256

typedef struct hc_pool hc_pool;

typedef struct {
    hc_pool *pool;
    int32_t index; /* 1..num_threads: share `index` of a call */
} hc_worker;

struct hc_pool {
    pthread_mutex_t call_mu; /* one call at a time */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    uint64_t epoch;   /* bumped for each call the pool's threads join */
    int32_t shares;   /* workers of the current call (the caller's share 0 included) */
    int32_t pending;  /* pool threads of the current call not yet done */
    int32_t stop;
    /* the current call */
    int64_t n;
    const uint64_t *dst, *src, *len, *prefix; /* prefix[i]: stream offset of piece i */
    uint64_t total;
    int32_t num_threads;
    pthread_t *threads;
    hc_worker *workers;
};

/* Copy stream bytes [from, to) of the current call: piece by piece from the piece holding
 * `from` (binary search over the prefix offsets). */
static void copy_range(const hc_pool *p, uint64_t from, uint64_t to) {
    if (from >= to)
        return;
    int64_t lo = 0, hi = p->n - 1;
    while (lo < hi) { /* the last piece whose prefix <= from */
        int64_t mid = (lo + hi + 1) / 2;
        if (p->prefix[mid] <= from)
            lo = mid;
        else
            hi = mid - 1;
    }
    for (int64_t i = lo; i < p->n && from < to; i++) {
        uint64_t start = p->prefix[i], end = start + p->len[i];
        if (end <= from)
            continue;
        uint64_t a = from - start, b = (to < end ? to : end) - start;
        memcpy((void *)(uintptr_t)(p->dst[i] + a), (const void *)(uintptr_t)(p->src[i] + a),
               (size_t)(b - a));
        from = start + b;
    }
}

static void share_bounds(const hc_pool *p, int32_t k, uint64_t *from, uint64_t *to) {
    /* equal shares of the stream, 64-byte aligned cuts (whole cache lines per worker) */
    uint64_t step = p->total / (uint64_t)p->shares;
    uint64_t a = (step * (uint64_t)k) & ~(uint64_t)63;
    uint64_t b = k + 1 == p->shares ? p->total : (step * (uint64_t)(k + 1)) & ~(uint64_t)63;
    *from = a;
    *to = b;
}

static void *worker_main(void *arg) {
    hc_worker *w = (hc_worker *)arg;
    hc_pool *p = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->epoch == seen)
            pthread_cond_wait(&p->start, &p->mu);
        if (p->stop)
            break;
        seen = p->epoch;
        if (w->index >= p->shares)
            continue; /* not needed for this call */
        pthread_mutex_unlock(&p->mu);
        uint64_t from, to;
        share_bounds(p, w->index, &from, &to);
        copy_range(p, from, to);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A pool of num_threads threads besides the caller (0: the caller copies alone). NULL when
 * the threads or memory could not be had. */
hc_pool *hc_open(int32_t num_threads) {
    if (num_threads < 0 || num_threads > HC_MAX_THREADS)
        return NULL;
    hc_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    pthread_mutex_init(&p->call_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc((size_t)(num_threads ? num_threads : 1), sizeof(pthread_t));
    p->workers = calloc((size_t)(num_threads ? num_threads : 1), sizeof(hc_worker));
    if (!p->threads || !p->workers) {
        free(p->threads);
        free(p->workers);
        free(p);
        return NULL;
    }
    for (int32_t t = 0; t < num_threads; t++) {
        p->workers[t].pool = p;
        p->workers[t].index = t + 1;
        if (pthread_create(&p->threads[t], NULL, worker_main, &p->workers[t]) != 0) {
            pthread_mutex_lock(&p->mu);
            p->stop = 1;
            pthread_cond_broadcast(&p->start);
            pthread_mutex_unlock(&p->mu);
            for (int32_t j = 0; j < t; j++)
                pthread_join(p->threads[j], NULL);
            free(p->threads);
            free(p->workers);
            free(p);
            return NULL;
        }
        p->num_threads = t + 1;
    }
    return p;
}

int32_t hc_num_threads(const hc_pool *p) { return p->num_threads; }

/* Copy n pieces: dst[i] <- src[i], len[i] bytes. min_share: the fewest bytes worth a
 * worker of its own. Returns HC_OK or the refusal's code (nothing copied then). */
int hc_copy(hc_pool *p, int64_t n, const uint64_t *dst, const uint64_t *src,
            const uint64_t *len, uint64_t min_share) {
    if (n < 0)
        return HC_BAD_COUNT;
    if (n == 0)
        return HC_OK;
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (len[i] && (!dst[i] || !src[i]))
            return HC_NULL;
        total += len[i];
    }
    if (total == 0)
        return HC_OK;
    uint64_t *prefix = malloc((size_t)n * sizeof(uint64_t));
    if (!prefix)
        return HC_NO_MEMORY;
    uint64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        prefix[i] = at;
        at += len[i];
    }
    if (min_share == 0)
        min_share = 1;
    pthread_mutex_lock(&p->call_mu);
    uint64_t want = total / min_share;
    int32_t shares = want > (uint64_t)p->num_threads ? p->num_threads + 1 : (int32_t)want;
    if (shares < 1)
        shares = 1;
    pthread_mutex_lock(&p->mu);
    p->n = n;
    p->dst = dst;
    p->src = src;
    p->len = len;
    p->prefix = prefix;
    p->total = total;
    p->shares = shares;
    p->pending = shares - 1;
    if (shares > 1) {
        p->epoch++;
        pthread_cond_broadcast(&p->start);
    }
    pthread_mutex_unlock(&p->mu);
    uint64_t from, to;
    share_bounds(p, 0, &from, &to);
    copy_range(p, from, to);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    p->prefix = NULL;
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->call_mu);
    free(prefix);
    return HC_OK;
}

void hc_close(hc_pool *p) {
    if (!p)
        return;
    pthread_mutex_lock(&p->call_mu); /* a call in progress finishes first */
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    for (int32_t t = 0; t < p->num_threads; t++)
        pthread_join(p->threads[t], NULL);
    pthread_mutex_unlock(&p->call_mu);
    pthread_mutex_destroy(&p->call_mu);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p->workers);
    free(p);
}
