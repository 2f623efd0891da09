/* The staged chunk loop on a thread of its own: the host side of a staged transfer.
 *
 * The engine's thread hands a transfer here in one call: tc_transfer takes a spec's ids
 * as they are, validates them (the planner's rules), checks the worker's slot fence,
 * marks the compute stream and queues the job with a pair table of the queue's own (or
 * a planner that validated already, tc_validate, queues its block plan with tc_submit):
 * per KV-cache group the GPU ids, region slots and sub-pages. This thread lays it out
 * (backends/staged/block_layout.py is the specification: rows in ascending host address
 * within a group, chunks of rows at their pitch, the pair table the kernels read, each
 * row's template runs as DMAs, neighbours merged) and enqueues it on the GPU: per chunk
 * one pack/unpack launch, one cuMemcpyBatchAsync and four event calls
 * (backends/staged/backend.py has the order). It never takes the GIL and never waits
 * for the device: it only enqueues, so the engine's thread is held for none of this.
 * The exception is a small job (at most inline_pairs pairs, tc_set_inline) that finds
 * the loop idle: the caller issues it itself, which then costs it the job's few driver
 * calls instead of a thread wake-up. A job of at most zero_copy_pairs pairs
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
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

#define TC_EVENT_DISABLE_TIMING 2u
#define TC_TABLE_MIN_WORDS 2048 /* 16 KiB: 512 pairs */

#define TC_MAX_SLOTS 64
#define TC_MAX_PARAMS 16
#define TC_KERNEL_ARGS 9 /* pairs, pair_stride, first, count, slot_base, tensors,
                            tensor_stride, groups, num_groups */
#define TC_ABI_12_8 12080

/* What tc_validate checks ids against: the planner's geometry (block_size_factor and,
 * per KV-cache group, how many GPU blocks and region slots there are), owned by the
 * caller. */
typedef struct {
    int32_t factor, num_groups;
    const int64_t *num_gpu_blocks, *num_slots; /* per group: the ids' bounds */
} tc_bounds;

/* The static tables of a BlockLayout (backends/staged/block_layout.py), owned by the
 * caller. */
typedef struct {
    int32_t factor, num_groups, whole_rows; /* whole_rows: loads take whole images */
    int32_t max_runs;                       /* the most runs a row's template has */
    uint64_t chunk_bytes;
    const int64_t *cpu_stride, *row_origin, *pitch; /* per group */
    const int64_t *tpl_first, *tpl_count;           /* per template */
    const int64_t *run_offset, *run_bytes;          /* per run */
} tc_geometry;

/* One non-empty group of a transfer, validated (tc_validate; the planner's GroupWork). */
typedef struct {
    int32_t group, count;
    const int64_t *gpu_ids, *cpu_rows; /* count each: per GPU page its CPU block */
    const int64_t *sub_pages;          /* count: the sub-page inside the CPU block */
} tc_work;

typedef struct {
    void *launch, *record, *wait, *batch, *ctx_set; /* driver entry points */
    void *ctx_get; /* cuCtxGetCurrent: the caller may issue a job itself only in ctx */
    /* cuMemHostAlloc, cuMemFreeHost, cuEventCreate, cuEventDestroy, cuEventQuery: the
     * queue's own pair tables (NULL: every job brings its table) */
    void *host_alloc, *host_free, *event_create, *event_destroy, *event_query;
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
    const tc_geometry *geometry;
} tc_config;

typedef struct {
    void *stream;                 /* the transfer's stream */
    void *after, *prev_end;       /* waited for first, in this order (NULL: none) */
    void *start_ev, *end_ev;      /* recorded on stream around the transfer (NULL: none) */
    void *table_ev;               /* recorded on stream after the last launch (NULL: none) */
    int32_t store, num_works;
    int32_t owns;                 /* validated is the job's own (tc_transfer): freed once issued */
    /* The block plan's buffer (tc_validate's output): (3, num_pairs) GPU ids, CPU rows,
     * sub-pages, then (num_works, 2) group and count of each work, back to back. */
    const int64_t *validated;
    int64_t *pairs;               /* out: the (4, num_pairs) table the kernels read */
    int64_t num_pairs;            /* the works' counts summed */
    volatile int32_t *status;     /* written last: 0, or the first failing CUresult */
} tc_job;

typedef struct node {
    tc_job job;
    int64_t submitted_ns; /* CLOCK_MONOTONIC at tc_submit */
    struct node *next;
} node;

/* The loop's DMA scratch, reused job after job (the batch call reads its descriptors
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

#define TC_TABLE_TAKEN UINT64_MAX

typedef struct {
    tc_config cfg;
    dma_t dma; /* the issuer's: the loop's thread, or an inline caller (file comment) */
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

#define TC_ERROR_INVALID_VALUE 1
#define TC_ERROR_OUT_OF_MEMORY 2

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

/* ------------------------------------------------------------------ layout */

typedef struct {
    int64_t key, index;
} keyed_t;

/* Stable sort of a[0..n) by key (bottom-up merge sort through tmp[0..n)): a few
 * thousand inline comparisons for a few hundred ids, no comparator calls. */
static void sort_keyed(keyed_t *a, keyed_t *tmp, int64_t n) {
    int64_t i = 1;
    while (i < n && a[i - 1].key <= a[i].key)
        i++;
    if (i >= n)
        return; /* already ascending */
    keyed_t *src = a, *dst = tmp;
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t x = lo, y = mid, o = lo;
            while (x < mid && y < hi)
                dst[o++] = src[y].key < src[x].key ? src[y++] : src[x++];
            while (x < mid)
                dst[o++] = src[x++];
            while (y < hi)
                dst[o++] = src[y++];
        }
        keyed_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof *a);
}

typedef struct {
    int64_t cpu_row;    /* sort key */
    int64_t lo, hi;     /* the row's pairs: indices lo..hi-1 of its work */
    int64_t tpl;        /* run template */
    int32_t work;       /* index into the job's works */
} row_t;

/* rows[0..n) by CPU row, ties in their order (a stable sort: rows come in pair order).
 * Returns 0, or an error when out of memory. */
static int sort_rows(row_t *rows, int64_t n) {
    keyed_t *keys = malloc(2 * (size_t)n * sizeof *keys);
    row_t *copy = malloc((size_t)n * sizeof *copy);
    if (!keys || !copy) {
        free(keys), free(copy);
        return TC_ERROR_OUT_OF_MEMORY;
    }
    for (int64_t r = 0; r < n; r++)
        keys[r] = (keyed_t){rows[r].cpu_row, r};
    sort_keyed(keys, keys + n, n);
    memcpy(copy, rows, (size_t)n * sizeof *copy);
    for (int64_t r = 0; r < n; r++)
        rows[r] = copy[keys[r].index];
    free(keys);
    free(copy);
    return 0;
}

/* Rows of work w at rows[0..], ascending CPU row (stable): returns how many (-1: out of
 * memory). ``whole``: every row takes its group's whole-image template (loads with
 * whole_rows). */
static int64_t work_rows(const tc_geometry *geo, const tc_work *w, int32_t index, int whole,
                         row_t *rows) {
    int64_t f = geo->factor, g = w->group, n = w->count, num_rows;
    int64_t whole_tpl = (int64_t)geo->num_groups * f * f + g;
    if (f == 1) {
        for (int64_t i = 0; i < n; i++)
            rows[i] = (row_t){w->cpu_rows[i], i, i + 1, whole ? whole_tpl : g, index};
        num_rows = n;
    } else {
        int64_t skip = w->sub_pages[0], last = w->sub_pages[n - 1];
        num_rows = (skip + n - 1) / f + 1;
        for (int64_t r = 0; r < num_rows; r++) {
            int64_t lo = r * f - skip, hi = (r + 1) * f - skip;
            lo = lo < 0 ? 0 : lo;
            hi = hi > n ? n : hi;
            int64_t tpl = (g * f) * f + f - 1; /* sub-pages 0..F-1 */
            if (whole)
                tpl = whole_tpl;
            else if (!(skip == 0 && last == f - 1)) {
                if (r == num_rows - 1)
                    tpl = (g * f) * f + last;
                if (r == 0)
                    tpl = (g * f + skip) * f + (num_rows == 1 ? last : f - 1);
            }
            rows[r] = (row_t){w->cpu_rows[lo], lo, hi, tpl, index};
        }
    }
    for (int64_t r = 1; r < num_rows; r++)
        if (rows[r].cpu_row < rows[r - 1].cpu_row)
            return sort_rows(rows, num_rows) ? -1 : num_rows;
    return num_rows;
}

/* Room for n DMAs in the scratch (grown, never shrunk). Returns 0 or an error. */
static int dma_reserve(dma_t *x, int64_t n) {
    if (n <= x->cap)
        return 0;
    int64_t cap = n > 2 * x->cap ? n : 2 * x->cap;
    uint64_t *m = malloc(4 * (size_t)cap * sizeof *m);
    if (!m)
        return TC_ERROR_OUT_OF_MEMORY;
    free(x->host);
    x->host = m, x->slot = m + cap, x->bytes = m + 2 * cap, x->stage = m + 3 * cap;
    x->cap = cap;
    return 0;
}

/* Lay the job out: pairs into j->pairs, DMAs into *x, chunk boundaries into
 * *pair_first / *dma_first (malloc'd, num_chunks + 1 each). Returns 0 or an error.
 * zero_copy: one chunk and no DMAs; each pair's row offset is its row image's host
 * address (the kernel, given slot base 0, then moves pages between the GPU and the
 * host rows themselves: a row's slot image has the host image's offsets). */
static int lay_out(const tc_geometry *geo, const tc_job *j, int zero_copy, dma_t *x,
                   int64_t **pair_first, int64_t **dma_first, int64_t *num_chunks) {
    int64_t f = geo->factor, total = 0, P = j->num_pairs, at = 0;
    const int64_t *work_meta = j->validated + 3 * P;
    *pair_first = *dma_first = NULL;
    *num_chunks = 0;
    /* rows <= pairs + 1 per work (a partial first row), DMAs <= runs per row */
    int64_t max_dmas = (P + j->num_works) * (geo->max_runs > 0 ? geo->max_runs : 1);
    if (dma_reserve(x, max_dmas))
        return TC_ERROR_OUT_OF_MEMORY;
    tc_work *works = malloc((size_t)j->num_works * sizeof *works);
    if (!works)
        return TC_ERROR_OUT_OF_MEMORY;
    for (int32_t i = 0; i < j->num_works; i++) {
        tc_work *w = &works[i];
        w->group = (int32_t)work_meta[2 * i];
        w->count = (int32_t)work_meta[2 * i + 1];
        if (w->count <= 0 || w->group < 0 || w->group >= geo->num_groups || at + w->count > P) {
            free(works);
            return TC_ERROR_INVALID_VALUE;
        }
        w->gpu_ids = j->validated + at;
        w->cpu_rows = j->validated + P + at;
        w->sub_pages = j->validated + 2 * P + at;
        at += w->count;
        total += f == 1 ? w->count : (w->sub_pages[0] + w->count - 1) / f + 1;
    }
    row_t *rows = malloc((size_t)(total ? total : 1) * sizeof *rows);
    int64_t *pf = malloc((size_t)(total + 1) * sizeof *pf);
    int64_t *df = malloc((size_t)(total + 1) * sizeof *df);
    if (!rows || !pf || !df) {
        free(rows), free(pf), free(df), free(works);
        return TC_ERROR_OUT_OF_MEMORY;
    }
    at = 0;
    for (int32_t i = 0; i < j->num_works; i++) {
        int64_t made = work_rows(geo, &works[i], i, geo->whole_rows && !j->store, rows + at);
        if (made < 0) {
            free(rows), free(pf), free(df), free(works);
            return TC_ERROR_OUT_OF_MEMORY;
        }
        at += made;
    }
    int64_t k = -1, offset = 0, p = 0, d = 0;
    int err = 0;
    for (int64_t r = 0; r < total && !err; r++) {
        const row_t *row = &rows[r];
        const tc_work *w = &works[row->work];
        int64_t g = w->group, pitch = geo->pitch[g];
        if (k < 0
            || (!zero_copy && offset > 0 && (uint64_t)(offset + pitch) > geo->chunk_bytes)) {
            k++;
            pf[k] = p;
            df[k] = d;
            offset = 0;
        }
        int64_t host = row->cpu_row * geo->cpu_stride[g] + geo->row_origin[g];
        int64_t slot = zero_copy ? host : offset;
        offset += pitch;
        for (int64_t q = row->lo; q < row->hi; q++, p++) {
            if (p >= P) {
                err = TC_ERROR_INVALID_VALUE;
                break;
            }
            j->pairs[p] = w->gpu_ids[q];
            j->pairs[P + p] = slot;
            j->pairs[2 * P + p] = w->sub_pages[q];
            j->pairs[3 * P + p] = g;
        }
        int64_t first = geo->tpl_first[row->tpl];
        int64_t runs = zero_copy ? 0 : geo->tpl_count[row->tpl];
        for (int64_t u = first; u < first + runs && !err; u++) {
            uint64_t h = (uint64_t)(host + geo->run_offset[u]);
            uint64_t s = (uint64_t)(slot + geo->run_offset[u]), n = (uint64_t)geo->run_bytes[u];
            if (d > df[k] && x->host[d - 1] + x->bytes[d - 1] == h
                && x->slot[d - 1] + x->bytes[d - 1] == s) {
                x->bytes[d - 1] += n; /* continues its neighbour on both sides */
                continue;
            }
            if (d >= max_dmas) {
                err = TC_ERROR_INVALID_VALUE;
                break;
            }
            x->host[d] = h;
            x->slot[d] = s;
            x->bytes[d] = n;
            d++;
        }
    }
    free(rows);
    free(works);
    if (!err && p != P)
        err = TC_ERROR_INVALID_VALUE;
    if (err) {
        free(pf), free(df);
        return err;
    }
    *num_chunks = k + 1;
    pf[k + 1] = p;
    df[k + 1] = d;
    *pair_first = pf;
    *dma_first = df;
    return 0;
}

/* ------------------------------------------------------------------ validation */

/* What tc_validate refuses (the planner's SpecError cases, planning/planner.py). */
enum {
    TC_SPEC_GROUPS = 1,    /* not one group_sizes entry per KV-cache group */
    TC_SPEC_GPU_COUNT,     /* group_sizes do not add up to the GPU ids */
    TC_SPEC_CPU_COUNT,     /* the CPU ids are not the count the groups need */
    TC_SPEC_GPU_RANGE,     /* a GPU id out of its group's range */
    TC_SPEC_CPU_RANGE,     /* a CPU id out of its group's range */
    TC_SPEC_REPEATED,      /* a destination block twice (CPU ids of a store, GPU of a load) */
    TC_SPEC_NO_MEMORY,
};

/* Whether two of ids[0..n) are equal, by sorting them into keys (tmp: scratch of n). */
static int has_repeat_of(keyed_t *keys, keyed_t *tmp, const int64_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        keys[i] = (keyed_t){ids[i], i};
    sort_keyed(keys, tmp, n);
    for (int64_t i = 1; i < n; i++)
        if (keys[i].key == keys[i - 1].key)
            return 1;
    return 0;
}

/* Sets bit id of seen for each of ids[0..n) and says whether one was set already; then
 * clears what it set (seen is all zeros again). The repeat check without a sort. */
static int bits_repeat(uint64_t *seen, const int64_t *ids, int64_t n) {
    int repeat = 0;
    int64_t i = 0;
    for (; i < n; i++) {
        uint64_t bit = (uint64_t)1 << (ids[i] & 63);
        uint64_t *word = &seen[ids[i] >> 6];
        if (*word & bit) {
            repeat = 1;
            break;
        }
        *word |= bit;
    }
    for (int64_t k = 0; k < i; k++)
        seen[ids[k] >> 6] &= ~((uint64_t)1 << (ids[k] & 63));
    return repeat;
}

/* tc_validate's rules (below); with seen (a zeroed bitmap of at least every group's
 * largest bound, in bits) repeats are found without sorting, and factor-1 pairs stay in
 * the given order (the loop's layout sorts rows itself): the caller's thread pays no
 * sort. */
static int validate(const tc_bounds *geo, int32_t store, int32_t num_groups,
                    const int64_t *groups, const int64_t *gpu_ids, int64_t num_gpu,
                    const int64_t *cpu_ids, int64_t num_cpu, int64_t *out, uint64_t *seen) {
    int64_t f = geo->factor, sum = 0, need = 0;
    const int64_t *group_sizes = groups, *block_indices = groups + num_groups;
    int64_t *meta = out + 3 * num_gpu;
    if (num_groups != geo->num_groups)
        return -TC_SPEC_GROUPS;
    for (int32_t g = 0; g < num_groups; g++) {
        int64_t n = group_sizes[g], skip = block_indices[g] % f;
        sum += n;
        need += n ? (n + skip + f - 1) / f : 0;
    }
    if (sum != num_gpu)
        return -TC_SPEC_GPU_COUNT;
    if (need != num_cpu)
        return -TC_SPEC_CPU_COUNT;
    keyed_t *keys = NULL, *tmp = NULL;
    if (!seen) {
        keys = malloc(2 * (size_t)(num_gpu ? num_gpu : 1) * sizeof *keys);
        if (!keys)
            return -TC_SPEC_NO_MEMORY;
        tmp = keys + (num_gpu ? num_gpu : 1);
    }
    int64_t gat = 0, cat = 0, works = 0;
    int rc = 0;
    for (int32_t g = 0; g < num_groups && !rc; g++) {
        int64_t n = group_sizes[g], skip = block_indices[g] % f;
        if (!n)
            continue;
        int64_t count = (n + skip + f - 1) / f;
        const int64_t *gids = gpu_ids + gat, *cids = cpu_ids + cat;
        for (int64_t i = 0; i < n && !rc; i++)
            if (gids[i] < 0 || gids[i] >= geo->num_gpu_blocks[g])
                rc = TC_SPEC_GPU_RANGE;
        for (int64_t i = 0; i < count && !rc; i++)
            if (cids[i] < 0 || cids[i] >= geo->num_slots[g])
                rc = TC_SPEC_CPU_RANGE;
        if (rc)
            break;
        int64_t *o_gpu = out + gat, *o_row = out + num_gpu + gat, *o_sub = out + 2 * num_gpu + gat;
        if (seen) { /* any order; repeats of the destination side from the bitmap */
            for (int64_t i = 0; i < n; i++) {
                o_gpu[i] = gids[i];
                o_row[i] = cids[(skip + i) / f];
                o_sub[i] = (skip + i) % f;
            }
            if (bits_repeat(seen, store ? cids : gids, store ? count : n))
                rc = TC_SPEC_REPEATED;
        } else if (f == 1) { /* pairs in ascending CPU row, stable */
            int ascending = 1;
            for (int64_t i = 1; i < n && ascending; i++)
                ascending = cids[i] > cids[i - 1];
            for (int64_t i = 0; i < n; i++)
                keys[i] = (keyed_t){cids[i], i};
            if (!ascending)
                sort_keyed(keys, tmp, n);
            for (int64_t i = 0; i < n; i++) {
                o_gpu[i] = gids[keys[i].index];
                o_row[i] = keys[i].key;
                o_sub[i] = 0;
            }
            if (store) { /* the destination: the CPU rows, just sorted */
                for (int64_t i = 1; i < n && !rc; i++)
                    if (o_row[i] == o_row[i - 1])
                        rc = TC_SPEC_REPEATED;
            } else if (has_repeat_of(keys, tmp, gids, n)) {
                rc = TC_SPEC_REPEATED;
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                o_gpu[i] = gids[i];
                o_row[i] = cids[(skip + i) / f];
                o_sub[i] = (skip + i) % f;
            }
            if (has_repeat_of(keys, tmp, store ? cids : gids, store ? count : n))
                rc = TC_SPEC_REPEATED;
        }
        meta[2 * works] = g;
        meta[2 * works + 1] = n;
        works++;
        gat += n;
        cat += count;
    }
    free(keys);
    return rc ? -rc : (int)works;
}

/* Validate one transfer as the planner does and write its works into out: first
 * (3, num_gpu) (GPU ids, CPU rows, sub-pages; with factor 1 the pairs in ascending CPU
 * row, stable), then (G, 2) (group, count of each non-empty group, in group order).
 * groups is (2, num_groups): group_sizes, then block_indices. Returns the number of
 * works, or minus a TC_SPEC_* code (out is then meaningless). */
int tc_validate(const tc_bounds *geo, int32_t store, int32_t num_groups,
                const int64_t *groups, const int64_t *gpu_ids, int64_t num_gpu,
                const int64_t *cpu_ids, int64_t num_cpu, int64_t *out) {
    return validate(geo, store, num_groups, groups, gpu_ids, num_gpu, cpu_ids, num_cpu, out,
                    NULL);
}

/* ------------------------------------------------------------------ issue */

/* One job; returns 0 or the first failing CUresult, and sets *zero_copy_out to whether it
 * moved zero-copy. After a failure the remaining chunks are skipped, but the joins and the
 * job's end event are still recorded (later transfers, the pair table's reuse and the
 * handler's completion order on them). */
static int run_job(tc_queue *q, const tc_job *j, int *zero_copy_out) {
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
            int s = (int)((q->cursor + k) % c->num_slots);
            uint64_t base = c->ring_base + (uint64_t)s * c->slot_bytes;
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
        q->cursor = (q->cursor + num_chunks) % c->num_slots;
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

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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
    if (cfg->num_slots < 1 || cfg->num_slots > TC_MAX_SLOTS || cfg->num_params < TC_KERNEL_ARGS
        || cfg->num_params > TC_MAX_PARAMS || !cfg->geometry || cfg->geometry->factor < 1)
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
static int caller_context(const tc_config *c) {
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
    __atomic_store_n(job->status, -1, __ATOMIC_RELAXED);
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

/* ------------------------------------------------------------------ one call per transfer */

/* What tc_transfer checks a transfer against besides the planner's bounds: the bytes one
 * pair of each group moves, and the worker's slot fence (tiercache/transfer/fence.py):
 * the index ledger's records in this worker's mapping (NULL: no fence), their count and
 * size, where a record keeps its generation (u64) and state (u32), and the identity of
 * the region mapped. Owned by the caller. */
typedef struct {
    const tc_bounds *bounds;
    const int64_t *pair_bytes;
    const uint8_t *ledger;
    int64_t ledger_slots, record_bytes, gen_offset, state_offset;
    uint64_t region_id;
} tc_caller;

/* A numpy array as C reads it: the head of numpy's PyArrayObject_fields
 * (ndarraytypes.h), which every extension compiled against any numpy relies on
 * (PyArray_DATA, PyArray_NDIM, PyArray_DIMS and PyArray_FLAGS are inline field reads).
 * The caller passes an array by its object's address (CPython's id()), which spares it
 * reading three addresses through the array interface (1-2 us each); Python checks this
 * layout against numpy once (tiercache.native.structs.ndarray_mismatches). */
typedef struct {
    intptr_t ob_refcnt;
    void *ob_type;
    char *data;
    int32_t nd;
    const intptr_t *dimensions, *strides;
    void *base, *descr;
    int32_t flags;
} tc_ndarray;

#define TC_NPY_C_CONTIGUOUS 0x0001
#define TC_NOT_FLAT 8 /* a tc_transfer array that is not 1-d and C-contiguous */

static int flat(const tc_ndarray *a) {
    return a->nd == 1 && (a->flags & TC_NPY_C_CONTIGUOUS);
}

#define TC_LEDGER_WRITING 1u /* LedgerState: a store's slots are still reserved for it */
#define TC_LEDGER_READY 2u   /* a load's slots still hold its block */
#define TC_FENCED 100        /* tc_transfer's codes past the TC_SPEC_* ones */
#define TC_MARK_FAILED 101

/* What tc_transfer did: code 0 (queued), a TC_SPEC_* refusal (nothing queued), TC_FENCED
 * or TC_MARK_FAILED (only the job's ordering events queued; cu: the CUresult of the
 * mark); the bytes the transfer moves (0 when refused by the spec); its sequence number
 * (0: nothing queued); when each step ended (for probes: four vDSO clock reads a call). */
typedef struct {
    int32_t code, cu;
    int64_t num_bytes;
    uint64_t seq;
    int64_t spans_ns[4]; /* since the call began: validated, fenced, marked, queued */
} tc_outcome;

/* SlotFence.refusal's rule: a fenced spec (region_id != 0) must name the region mapped,
 * and each slot must still have the generation it was handed out with, in the state the
 * direction needs. No ledger: the caller has no fence. */
static int fence_refuses(const tc_caller *c, int store, const int64_t *slots, int64_t n,
                         const uint64_t *gens, uint64_t region_id) {
    if (!c->ledger || region_id == 0)
        return 0;
    if (region_id != c->region_id)
        return 1;
    if (!gens)
        return 0;
    uint32_t want = store ? TC_LEDGER_WRITING : TC_LEDGER_READY;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= c->ledger_slots)
            return 1;
        const uint8_t *record = c->ledger + slots[i] * c->record_bytes;
        uint64_t gen = __atomic_load_n((const uint64_t *)(record + c->gen_offset),
                                       __ATOMIC_ACQUIRE);
        uint32_t state = __atomic_load_n((const uint32_t *)(record + c->state_offset),
                                         __ATOMIC_ACQUIRE);
        if (gen != gens[i] || state != want)
            return 1;
    }
    return 0;
}

/* q->seen grown to a bit for every id below the largest bound of geo (zeroed). */
static int repeat_bitmap(tc_queue *q, const tc_bounds *geo) {
    int64_t top = 1;
    for (int32_t g = 0; g < geo->num_groups; g++) {
        top = geo->num_slots[g] > top ? geo->num_slots[g] : top;
        top = geo->num_gpu_blocks[g] > top ? geo->num_gpu_blocks[g] : top;
    }
    int64_t words = (top + 63) / 64;
    if (words <= q->seen_words)
        return 0;
    uint64_t *seen = calloc((size_t)words, sizeof *seen);
    if (!seen)
        return TC_ERROR_OUT_OF_MEMORY;
    free(q->seen);
    q->seen = seen;
    q->seen_words = words;
    return 0;
}


/* A transfer from the engine's thread in one call, what the handler otherwise does in
 * four steps of Python: validate its ids (tc_validate's rules, repeats found with the
 * queue's bitmap instead of a sort, into a buffer the job owns and its issuer frees: the
 * loop's layout orders the rows), check the slot fence, record the compute stream's
 * mark (job->after, on compute) and queue the job with one of the queue's pair tables
 * (tc_submit: inline when small and the loop is idle). job gives the transfer's stream,
 * events, status cell and direction; its validated, num_works, num_pairs, owns, pairs
 * and table_ev are this call's. groups is (2, num_groups): group_sizes, then
 * block_indices; gpu and cpu are the specs' block ids (int64), gens (NULL: unfenced;
 * uint64, one per slot) and region_id the CPU spec's fence. Arrays that are not 1-d and
 * C-contiguous are refused (TC_NOT_FLAT, nothing queued), and so is a spec the
 * validation refuses; a fenced-off transfer, or one whose mark failed, queues its
 * ordering events only (later transfers wait on its end). Returns 0, or -1 when the
 * queue refused the job (closing, or no memory for it or its table; nothing is queued).
 * Growing the table pool (a cuMemHostAlloc, rare) is the one slow step it may take. */
int tc_transfer(tc_queue *q, const tc_caller *c, const tc_job *job, void *compute,
                int32_t num_groups, const int64_t *groups, const tc_ndarray *gpu,
                const tc_ndarray *cpu, const tc_ndarray *gens, uint64_t region_id,
                tc_outcome *out) {
    int64_t began = now_ns();
    memset(out, 0, sizeof *out);
    if (!flat(gpu) || !flat(cpu) || (gens && !flat(gens))) {
        out->code = TC_NOT_FLAT;
        return 0;
    }
    const int64_t *gpu_ids = (const int64_t *)gpu->data, *cpu_ids = (const int64_t *)cpu->data;
    int64_t num_gpu = gpu->dimensions[0], num_cpu = cpu->dimensions[0];
    const uint64_t *slot_gens = gens ? (const uint64_t *)gens->data : NULL;
    if (num_groups < 0) {
        out->code = TC_SPEC_GROUPS;
        return 0;
    }
    int64_t words = 3 * num_gpu + 2 * (int64_t)num_groups;
    int64_t *buf = malloc((size_t)(words ? words : 1) * sizeof *buf);
    if (!buf) {
        out->code = TC_SPEC_NO_MEMORY;
        return 0;
    }
    int works = repeat_bitmap(q, c->bounds) ? -TC_SPEC_NO_MEMORY
        : validate(c->bounds, job->store, num_groups, groups, gpu_ids, num_gpu, cpu_ids,
                   num_cpu, buf, q->seen);
    if (works < 0) {
        free(buf);
        out->code = -works;
        return 0;
    }
    for (int32_t g = 0; g < num_groups; g++)
        out->num_bytes += groups[g] * c->pair_bytes[g];
    out->spans_ns[0] = now_ns() - began;
    tc_job j = *job;
    int fenced = (gens && gens->dimensions[0] != num_cpu)
                 || fence_refuses(c, j.store, cpu_ids, num_cpu, slot_gens, region_id);
    out->spans_ns[1] = now_ns() - began;
    if (fenced) {
        out->code = TC_FENCED;
    } else if (j.after) {
        int rc = caller_context(&q->cfg);
        if (!rc)
            rc = ((record_fn)q->cfg.record)(j.after, compute);
        if (rc) {
            out->code = TC_MARK_FAILED;
            out->cu = rc;
        }
    }
    out->spans_ns[2] = now_ns() - began;
    j.owns = 1;
    j.validated = buf;
    if (out->code) { /* the ordering only: nothing of the compute stream to wait for */
        j.after = NULL;
        j.num_works = 0;
        j.num_pairs = 0;
    } else {
        j.num_works = works;
        j.num_pairs = num_gpu;
    }
    out->seq = tc_submit(q, &j);
    out->spans_ns[3] = now_ns() - began;
    if (!out->seq) {
        free(buf);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ layout check */

/* Every struct the Python side mirrors with ctypes (tiercache/native/structs.py), field by
 * field: tc_layout(i, ...) fills entry i and returns 1, or returns 0 past the last. A
 * struct's own entry has the field name "" and its sizeof as size. */
typedef struct {
    const char *strct, *field;
    int64_t offset, size;
} tc_field;

#define TC_STRUCT(s) {#s, "", 0, (int64_t)sizeof(s)}
#define TC_FIELD(s, f) {#s, #f, (int64_t)offsetof(s, f), (int64_t)sizeof(((s *)0)->f)}

static const tc_field tc_fields[] = {
    TC_STRUCT(tc_bounds),
    TC_FIELD(tc_bounds, factor), TC_FIELD(tc_bounds, num_groups),
    TC_FIELD(tc_bounds, num_gpu_blocks), TC_FIELD(tc_bounds, num_slots),
    TC_STRUCT(tc_geometry),
    TC_FIELD(tc_geometry, factor), TC_FIELD(tc_geometry, num_groups),
    TC_FIELD(tc_geometry, whole_rows), TC_FIELD(tc_geometry, max_runs),
    TC_FIELD(tc_geometry, chunk_bytes), TC_FIELD(tc_geometry, cpu_stride),
    TC_FIELD(tc_geometry, row_origin), TC_FIELD(tc_geometry, pitch),
    TC_FIELD(tc_geometry, tpl_first), TC_FIELD(tc_geometry, tpl_count),
    TC_FIELD(tc_geometry, run_offset), TC_FIELD(tc_geometry, run_bytes),
    TC_STRUCT(tc_config),
    TC_FIELD(tc_config, launch), TC_FIELD(tc_config, record), TC_FIELD(tc_config, wait),
    TC_FIELD(tc_config, batch), TC_FIELD(tc_config, ctx_set), TC_FIELD(tc_config, ctx_get),
    TC_FIELD(tc_config, host_alloc), TC_FIELD(tc_config, host_free),
    TC_FIELD(tc_config, event_create), TC_FIELD(tc_config, event_destroy),
    TC_FIELD(tc_config, event_query),
    TC_FIELD(tc_config, batch_abi),
    TC_FIELD(tc_config, num_slots), TC_FIELD(tc_config, ctx), TC_FIELD(tc_config, dma_stream),
    TC_FIELD(tc_config, ring_base), TC_FIELD(tc_config, slot_bytes),
    TC_FIELD(tc_config, free_ev), TC_FIELD(tc_config, ready_ev), TC_FIELD(tc_config, begin_ev),
    TC_FIELD(tc_config, done_ev), TC_FIELD(tc_config, function), TC_FIELD(tc_config, block_x),
    TC_FIELD(tc_config, shared), TC_FIELD(tc_config, grid_y), TC_FIELD(tc_config, max_grid_x),
    TC_FIELD(tc_config, num_params), TC_FIELD(tc_config, static_args),
    TC_FIELD(tc_config, attrs), TC_FIELD(tc_config, geometry),
    TC_STRUCT(tc_job),
    TC_FIELD(tc_job, stream), TC_FIELD(tc_job, after), TC_FIELD(tc_job, prev_end),
    TC_FIELD(tc_job, start_ev), TC_FIELD(tc_job, end_ev), TC_FIELD(tc_job, table_ev),
    TC_FIELD(tc_job, store), TC_FIELD(tc_job, num_works), TC_FIELD(tc_job, owns),
    TC_FIELD(tc_job, validated),
    TC_FIELD(tc_job, pairs), TC_FIELD(tc_job, num_pairs), TC_FIELD(tc_job, status),
    TC_STRUCT(tc_caller),
    TC_FIELD(tc_caller, bounds), TC_FIELD(tc_caller, pair_bytes), TC_FIELD(tc_caller, ledger),
    TC_FIELD(tc_caller, ledger_slots), TC_FIELD(tc_caller, record_bytes),
    TC_FIELD(tc_caller, gen_offset), TC_FIELD(tc_caller, state_offset),
    TC_FIELD(tc_caller, region_id),
    TC_STRUCT(tc_ndarray),
    TC_FIELD(tc_ndarray, ob_refcnt), TC_FIELD(tc_ndarray, ob_type), TC_FIELD(tc_ndarray, data),
    TC_FIELD(tc_ndarray, nd), TC_FIELD(tc_ndarray, dimensions), TC_FIELD(tc_ndarray, strides),
    TC_FIELD(tc_ndarray, base), TC_FIELD(tc_ndarray, descr), TC_FIELD(tc_ndarray, flags),
    TC_STRUCT(tc_outcome),
    TC_FIELD(tc_outcome, code), TC_FIELD(tc_outcome, cu), TC_FIELD(tc_outcome, num_bytes),
    TC_FIELD(tc_outcome, seq), TC_FIELD(tc_outcome, spans_ns),
};

int tc_layout(int32_t i, const char **strct, const char **field, int64_t *offset,
              int64_t *size) {
    if (i < 0 || (size_t)i >= sizeof tc_fields / sizeof tc_fields[0])
        return 0;
    *strct = tc_fields[i].strct;
    *field = tc_fields[i].field;
    *offset = tc_fields[i].offset;
    *size = tc_fields[i].size;
    return 1;
}
