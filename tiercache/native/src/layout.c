/* A validated job laid out for the ring: its rows in ascending host address within each
 * group, chunks of rows at their pitch, the pair table the kernels read, each row's
 * template runs as DMAs with neighbours merged, and where each chunk's pairs and DMAs
 * begin. backends/staged/block_layout.py is the specification (and the tests' oracle);
 * this is the same layout, in C, on the issuer's thread.
 */
#include <stdlib.h>
#include <string.h>

#include "loop.h"

/* One non-empty group of a job, as validated (tc_validate; the planner's GroupWork). */
typedef struct {
    int32_t group, count;
    const int64_t *gpu_ids, *slots; /* count each: per GPU page its region slot */
    const int64_t *sub_pages;       /* count: the sub-page inside the slot's row */
} tc_work;

/* Stable sort of a[0..n) by key (bottom-up merge sort through tmp[0..n)): a few
 * thousand inline comparisons for a few hundred ids, no comparator calls. */
void sort_keyed(keyed_t *a, keyed_t *tmp, int64_t n) {
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
    int64_t slot;       /* the row's region slot: the sort key */
    int64_t lo, hi;     /* the row's pairs: indices lo..hi-1 of its work */
    int64_t tpl;        /* run template */
    int32_t work;       /* index into the job's works */
} row_t;

/* rows[0..n) by slot, ties in their order (a stable sort: rows come in pair order).
 * Returns 0, or an error when out of memory. */
static int sort_rows(row_t *rows, int64_t n) {
    keyed_t *keys = malloc(2 * (size_t)n * sizeof *keys);
    row_t *copy = malloc((size_t)n * sizeof *copy);
    if (!keys || !copy) {
        free(keys), free(copy);
        return TC_ERROR_OUT_OF_MEMORY;
    }
    for (int64_t r = 0; r < n; r++)
        keys[r] = (keyed_t){rows[r].slot, r};
    sort_keyed(keys, keys + n, n);
    memcpy(copy, rows, (size_t)n * sizeof *copy);
    for (int64_t r = 0; r < n; r++)
        rows[r] = copy[keys[r].index];
    free(keys);
    free(copy);
    return 0;
}

/* Rows of work w at rows[0..], ascending slot (stable): returns how many (-1: out of
 * memory). ``whole``: every row takes its group's whole-image template (loads with
 * whole_rows). */
static int64_t work_rows(const tc_geometry *geo, const tc_work *w, int32_t index, int whole,
                         row_t *rows) {
    int64_t f = geo->factor, g = w->group, n = w->count, num_rows;
    int64_t whole_tpl = (int64_t)geo->num_groups * f * f + g;
    if (f == 1) {
        for (int64_t i = 0; i < n; i++)
            rows[i] = (row_t){w->slots[i], i, i + 1, whole ? whole_tpl : g, index};
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
            rows[r] = (row_t){w->slots[lo], lo, hi, tpl, index};
        }
    }
    for (int64_t r = 1; r < num_rows; r++)
        if (rows[r].slot < rows[r - 1].slot)
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
int lay_out(const tc_geometry *geo, const tc_job *j, int zero_copy, dma_t *x,
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
        w->slots = j->validated + P + at;
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
        int64_t host = row->slot * geo->cpu_stride[g] + geo->row_origin[g];
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
                && x->slot[d - 1] + x->bytes[d - 1] == s
                && !(u == first && geo->break_rows > 0 && row->slot % geo->break_rows == 0)) {
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
