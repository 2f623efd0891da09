/* A transfer's ids checked by the planner's rules (planning/planner.py, which re-checks a
 * refusal so that its SpecError says why) and written as a block plan: per non-empty
 * KV-cache group its (GPU id, region slot, sub-page) pairs. Two callers: tc_validate
 * (the planner's accelerator: block plans validated in C) and tc_transfer (a whole
 * transfer in one call, which finds repeats with the queue's bitmap instead of a sort).
 */
#include <stdlib.h>

#include "loop.h"


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
int validate(const tc_bounds *geo, int32_t store, int32_t num_groups,
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
        } else if (f == 1) { /* pairs in ascending slot, stable */
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
            if (store) { /* the destination: the slots, just sorted */
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
 * (3, num_gpu) (GPU ids, region slots, sub-pages; with factor 1 the pairs in ascending
 * slot, stable), then (G, 2) (group, count of each non-empty group, in group order).
 * groups is (2, num_groups): group_sizes, then block_indices. Returns the number of
 * works, or minus a TC_SPEC_* code (out is then meaningless). */
int tc_validate(const tc_bounds *geo, int32_t store, int32_t num_groups,
                const int64_t *groups, const int64_t *gpu_ids, int64_t num_gpu,
                const int64_t *cpu_ids, int64_t num_cpu, int64_t *out) {
    return validate(geo, store, num_groups, groups, gpu_ids, num_gpu, cpu_ids, num_cpu, out,
                    NULL);
}

