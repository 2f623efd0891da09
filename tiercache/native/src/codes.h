/* The values the native code and Python share: one source of truth.
 *
 * Every TC_* constant here is mirrored by exactly one Python name, and the library
 * reports them all (tc_constant, report.c): tiercache.native.codes compares the two when
 * the library is bound, so a value that drifts on either side refuses to load instead of
 * misreading an answer. The mirrors: TransferCode (tiercache.native.codes) for the
 * transfer codes, LedgerState (tiercache.region.ledger) for the ledger states, and the
 * limits and flags named beside each below.
 */
#ifndef TC_CODES_H
#define TC_CODES_H

/* What a transfer came to (tc_transfer's tc_outcome.code; the transfer paths' Outcome).
 * The TC_SPEC_* codes are validation refusals (tc_validate returns minus one): nothing
 * was queued, not even the compute stream's mark, and the planner re-checks the transfer
 * so that its SpecError says why. Past them: TC_NOT_FLAT, a caller's bug (an id array
 * not 1-d and C-contiguous: nothing queued); then transfers that keep their place in the
 * order but copy nothing (only their ordering events are queued). */
enum {
    TC_QUEUED = 0,
    TC_SPEC_GROUPS = 1,     /* not one group_sizes entry per KV-cache group */
    TC_SPEC_GPU_COUNT = 2,  /* group_sizes do not add up to the GPU ids */
    TC_SPEC_CPU_COUNT = 3,  /* the region slots are not the count the groups need */
    TC_SPEC_GPU_RANGE = 4,  /* a GPU id out of its group's range */
    TC_SPEC_CPU_RANGE = 5,  /* a region slot out of its group's range */
    TC_SPEC_REPEATED = 6,   /* a destination block twice (slots of a store, GPU ids of a load) */
    TC_SPEC_NO_MEMORY = 7,  /* no memory to validate it */
    TC_NOT_FLAT = 8,        /* an id array that is not 1-d and C-contiguous */
    TC_FENCED = 100,        /* the slot fence refused the slots (or the region) */
    TC_MARK_FAILED = 101,   /* the compute stream's mark could not be recorded */
    TC_SUBMIT_FAILED = 102, /* the backend could not take the job (set by the Python paths) */
};

/* A job's status cell: pending until its issuer has made every call of it; then 0, or
 * the first failing CUresult (or one of these, which share CUresult's numbers). Mirror:
 * tiercache.native.chunk_loop.STATUS_PENDING. */
#define TC_STATUS_PENDING (-1)
#define TC_ERROR_INVALID_VALUE 1 /* CUDA_ERROR_INVALID_VALUE: a job the layout refuses */
#define TC_ERROR_OUT_OF_MEMORY 2 /* CUDA_ERROR_OUT_OF_MEMORY: no host memory to lay it out */

/* The index ledger's slot states the fence reads (tiercache.region.ledger.LedgerState). */
#define TC_LEDGER_WRITING 1 /* a store's slots are still reserved for it */
#define TC_LEDGER_READY 2   /* a load's slots still hold its block */

/* Limits and flags (mirrors in tiercache.native.structs, .chunk_loop and
 * tiercache.device.driver). */
#define TC_MAX_RING_SLOTS 64 /* ring slots a loop may have (MAX_RING_SLOTS) */
#define TC_MAX_PARAMS 16     /* the pack kernel's parameters, at most (MAX_PARAMS) */
#define TC_KERNEL_ARGS 9     /* pairs, pair_stride, first, count, slot_base, tensors,
                                tensor_stride, groups, num_groups (KERNEL_ARGS) */
#define TC_ATTRS_BYTES 24    /* sizeof(CUmemcpyAttributes) (ATTRS_BYTES) */
#define TC_ABI_12_8 12080    /* cuMemcpyBatchAsync with failIdx (driver's ABI_12_8) */
#define TC_NPY_C_CONTIGUOUS 0x0001 /* NPY_ARRAY_C_CONTIGUOUS (C_CONTIGUOUS_FLAG) */

#endif
