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

/*
 * Flags of the descriptors the split path (split.cu) builds for the fused
 * kernel; never in a caller's table (kda_batch_check rejects them).  Such a
 * descriptor names two states: `slot` in the pool and `reserved`, a slot of
 * the fp32 scratch states (kda_fwd_params.scratch, same heads).
 */
#define KDA_SEQ_IDENTITY_STATE 0x100u  /* start from the identity and read the values as zeros */
#define KDA_SEQ_LOAD_SCRATCH 0x200u    /* the initial state is scratch slot `reserved` */
#define KDA_SEQ_STORE_SCRATCH 0x400u   /* the final state goes to scratch slot `reserved` */

typedef struct kda_fwd_params {
    const kda_seq *seqs;             /* device descriptor table */
    const int32_t *nseqs;            /* device: how many of seqs to run */
    void *state;                     /* pool base */
    float *scratch;                  /* fp32 [slots][heads][D][D] states of the split path, or null */
    int32_t heads;
    int32_t state_is_bf16;           /* pool dtype: 1 bf16, 0 fp32 */
    kda_sched_counters *sched;       /* device counters */
} kda_fwd_params;

#endif /* KDA_CUDA_PARAMS_H */
