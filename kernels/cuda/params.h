/*
 * params.h - the plain parameter block of the fused kernel, shared by the
 * host launcher and the device code.
 */
#ifndef KDA_CUDA_PARAMS_H
#define KDA_CUDA_PARAMS_H

#include <stdint.h>

#include "kda.h"

/* Work counters the persistent grid shares; reset by the last CTA to finish. */
typedef struct kda_sched_counters {
    uint32_t next_item;      /* next (sequence, head) work item to hand out */
    uint32_t ctas_done;      /* CTAs that have finished this launch */
} kda_sched_counters;

typedef struct kda_fwd_params {
    const kda_seq *seqs;             /* device descriptor table */
    const int32_t *nseqs;            /* device: how many of seqs to run */
    void *state;                     /* pool base */
    int32_t heads;
    int32_t state_is_bf16;           /* pool dtype: 1 bf16, 0 fp32 */
    kda_sched_counters *sched;       /* device counters */
} kda_fwd_params;

#endif /* KDA_CUDA_PARAMS_H */
