/* One native call per transfer (tc_transfer): what the handler's Python path does in four
 * steps (the planner's validation, the fence, the compute stream's mark, the queueing),
 * in C on the engine's thread, under the same rules: tiercache.transfer.native_path is
 * its caller, tiercache.transfer.planned_path the same contract in Python, and
 * tiercache.transfer.fence the fence's rule (whose SlotFence.refusal says why).
 */
#include <stdlib.h>
#include <string.h>

#include "loop.h"

static int flat(const tc_ndarray *a) {
    return a->nd == 1 && (a->flags & TC_NPY_C_CONTIGUOUS);
}

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

