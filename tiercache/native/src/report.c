/* What the Python side checks its mirrors against when it binds the library
 * (tiercache.native.library): the layout of every struct it mirrors with ctypes
 * (tc_layout; tiercache.native.structs) and the value of every constant it mirrors
 * (tc_constant; tiercache.native.codes). Both list their entries by index, so the
 * binding walks them without knowing how many there are.
 */
#include <stddef.h>
#include <stdint.h>

#include "codes.h"
#include "structs.h"

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
    TC_FIELD(tc_geometry, break_rows),
    TC_STRUCT(tc_config),
    TC_FIELD(tc_config, launch), TC_FIELD(tc_config, record), TC_FIELD(tc_config, wait),
    TC_FIELD(tc_config, batch), TC_FIELD(tc_config, ctx_set), TC_FIELD(tc_config, ctx_get),
    TC_FIELD(tc_config, host_alloc), TC_FIELD(tc_config, host_free),
    TC_FIELD(tc_config, event_create), TC_FIELD(tc_config, event_destroy),
    TC_FIELD(tc_config, event_query),
    TC_FIELD(tc_config, batch_abi),
    TC_FIELD(tc_config, num_ring_slots), TC_FIELD(tc_config, ctx), TC_FIELD(tc_config, dma_stream),
    TC_FIELD(tc_config, ring_base), TC_FIELD(tc_config, ring_slot_bytes),
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

/* Every constant of codes.h that Python mirrors, by name: tc_constant(i, ...) fills entry
 * i and returns 1, or returns 0 past the last. */
typedef struct {
    const char *name;
    int64_t value;
} tc_named;

#define TC_CONSTANT(c) {#c, (int64_t)(c)}

static const tc_named tc_constants[] = {
    TC_CONSTANT(TC_QUEUED), TC_CONSTANT(TC_SPEC_GROUPS), TC_CONSTANT(TC_SPEC_GPU_COUNT),
    TC_CONSTANT(TC_SPEC_CPU_COUNT), TC_CONSTANT(TC_SPEC_GPU_RANGE),
    TC_CONSTANT(TC_SPEC_CPU_RANGE), TC_CONSTANT(TC_SPEC_REPEATED),
    TC_CONSTANT(TC_SPEC_NO_MEMORY), TC_CONSTANT(TC_NOT_FLAT), TC_CONSTANT(TC_FENCED),
    TC_CONSTANT(TC_MARK_FAILED), TC_CONSTANT(TC_SUBMIT_FAILED),
    TC_CONSTANT(TC_STATUS_PENDING), TC_CONSTANT(TC_LEDGER_WRITING),
    TC_CONSTANT(TC_LEDGER_READY), TC_CONSTANT(TC_MAX_RING_SLOTS), TC_CONSTANT(TC_MAX_PARAMS),
    TC_CONSTANT(TC_KERNEL_ARGS), TC_CONSTANT(TC_ATTRS_BYTES), TC_CONSTANT(TC_ABI_12_8),
    TC_CONSTANT(TC_NPY_C_CONTIGUOUS),
};

int tc_constant(int32_t i, const char **name, int64_t *value) {
    if (i < 0 || (size_t)i >= sizeof tc_constants / sizeof tc_constants[0])
        return 0;
    *name = tc_constants[i].name;
    *value = tc_constants[i].value;
    return 1;
}
