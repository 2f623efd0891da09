/* The structs the Python side passes to the library, mirrored field by field by ctypes
 * classes in tiercache/native/structs.py. The library reports sizeof and offsetof of
 * every field (tc_layout, report.c) and the binding compares them with the mirrors: a
 * field that drifts on either side refuses to load, never reads the wrong bytes.
 */
#ifndef TC_STRUCTS_H
#define TC_STRUCTS_H

#include <stdint.h>

#include "codes.h"

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
    int64_t break_rows; /* no DMA runs into a row whose slot is a multiple (0: none):
                         * a registration boundary of the region */
} tc_geometry;

/* One loop's constant part: its driver entry points, ring, events and kernels. */
typedef struct {
    void *launch, *record, *wait, *batch, *ctx_set; /* driver entry points */
    void *ctx_get; /* cuCtxGetCurrent: the caller may issue a job itself only in ctx */
    /* cuMemHostAlloc, cuMemFreeHost, cuEventCreate, cuEventDestroy, cuEventQuery: the
     * queue's own pair tables (NULL: every job brings its table) */
    void *host_alloc, *host_free, *event_create, *event_destroy, *event_query;
    int32_t batch_abi;                              /* 12080 (with failIdx) or 13000 */
    int32_t num_ring_slots;
    void *ctx;        /* made current on the loop's thread (NULL: leave as is) */
    void *dma_stream; /* the backend's DMA stream */
    uint64_t ring_base, ring_slot_bytes;
    void *free_ev[TC_MAX_RING_SLOTS], *ready_ev[TC_MAX_RING_SLOTS];
    void *begin_ev, *done_ev; /* DMA stream after the transfer's stream, and back */
    void *function[2];        /* [0] unpack (loads), [1] pack (stores) */
    uint32_t block_x, shared[2];
    uint32_t grid_y, max_grid_x; /* max_grid_x 0: one program per pair */
    int32_t num_params;          /* the kernel's parameters; past the first 9 all zero */
    uint64_t static_args[4];     /* tensors, tensor_stride, groups, num_groups */
    uint8_t attrs[2][TC_ATTRS_BYTES]; /* CUmemcpyAttributes of loads [0] and stores [1] */
    const tc_geometry *geometry;
} tc_config;

/* One transfer (tc_submit copies the struct; its arrays must live until it is issued). */
typedef struct {
    void *stream;                 /* the transfer's stream */
    void *after, *prev_end;       /* waited for first, in this order (NULL: none) */
    void *start_ev, *end_ev;      /* recorded on stream around the transfer (NULL: none) */
    void *table_ev;               /* recorded on stream after the last launch (NULL: none) */
    int32_t store, num_works;
    int32_t owns;                 /* validated is the job's own (tc_transfer): freed once issued */
    /* The block plan's buffer (tc_validate's output): (3, num_pairs) GPU ids, region
     * slots, sub-pages, then (num_works, 2) group and count of each work, back to back. */
    const int64_t *validated;
    int64_t *pairs;               /* out: the (4, num_pairs) table the kernels read */
    int64_t num_pairs;            /* the works' counts summed */
    volatile int32_t *status;     /* written last: 0, or the first failing CUresult */
} tc_job;

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

/* What tc_transfer did: code TC_QUEUED, a TC_SPEC_* refusal (nothing queued), TC_FENCED
 * or TC_MARK_FAILED (only the job's ordering events queued; cu: the CUresult of the
 * mark); the bytes the transfer moves (0 when refused by the spec); its sequence number
 * (0: nothing queued); when each step ended (for probes: four vDSO clock reads a call). */
typedef struct {
    int32_t code, cu;
    int64_t num_bytes;
    uint64_t seq;
    int64_t spans_ns[4]; /* since the call began: validated, fenced, marked, queued */
} tc_outcome;

#endif
