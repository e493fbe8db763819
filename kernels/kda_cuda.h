/*
 * kda_cuda.h - the fused Hopper (sm_90a) backend of the prefill contract.
 *
 * One launch runs a whole batch: a persistent grid walks the (sequence, head)
 * work items of a descriptor table that lives in device memory, so a launch
 * captured in a CUDA Graph stays valid while the batch's lengths, pointers and
 * slots change (up to the max_seqs it was captured with).  Launching
 * allocates nothing and never synchronises the host.
 *
 * Everything the kernel reads is device memory: the kda_seq table, the
 * tensors it points to, the kda_layer structs and their weights, the pool.
 *
 * Range: the kernel scales raw (not yet normalised) q and k by decay factors
 * of up to e^80 before rounding them to bf16 (docs/kernel.md, Accuracy), so
 * q and k elements must stay below ~6e3 in magnitude; beyond that the
 * results overflow where the CPU backend's would not.
 */
#ifndef KDA_CUDA_H
#define KDA_CUDA_H

#include "kda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kda_cuda kda_cuda;

/*
 * Binds a backend to a device: checks for sm_90 and enough shared memory,
 * raises the kernel's shared-memory limit and allocates the scheduler's
 * counters and the split path's scratch (kda_cuda_set_split), its outputs
 * scratch at KDA_CUDA_SPLIT_SCRATCH_DEFAULT bytes.  Returns KDA_ENOTSUP when
 * no usable GPU is present.
 */
int kda_cuda_create(int device, kda_cuda **out, kda_error *err);
/* The same with an outputs scratch of split_scratch_bytes (rounded down to whole bf16 values;
   0: none, every cut segment is recomputed). */
int kda_cuda_create_with_scratch(int device, uint64_t split_scratch_bytes, kda_cuda **out,
                                 kda_error *err);
void kda_cuda_destroy(kda_cuda *cuda);

/* The split path's outputs scratch kda_cuda_create allocates: 2^27 bf16 values, 256 MiB. */
#define KDA_CUDA_SPLIT_SCRATCH_DEFAULT ((uint64_t)256 << 20)

/* Device memory the instance holds, in bytes: all of it, and of that the split path's outputs
   scratch (the rest: the scheduler counters, the split path's states and descriptors). */
uint64_t kda_cuda_device_bytes(const kda_cuda *cuda);
uint64_t kda_cuda_split_scratch_bytes(const kda_cuda *cuda);

/* Device name and SM count, for logs and hello. */
const char *kda_cuda_device_name(const kda_cuda *cuda);
int kda_cuda_sm_count(const kda_cuda *cuda);

/*
 * Host-side check of a batch before its descriptors are uploaded:
 * kda_batch_check plus the kernel's alignment rule (q, k, v, g, out 16-byte
 * aligned).  Does not dereference device pointers.
 */
int kda_cuda_batch_check(const kda_pool *pool, const kda_seq *seqs, int64_t nseqs, kda_error *err);

/*
 * Enqueues one batch on `stream` (a cudaStream_t; NULL = the default stream).
 * seqs_dev: device array of at least max_seqs descriptors, of which the
 * first *nseqs_dev are run; both are read when the kernel runs, not now.
 * Sorting the descriptors longest first balances the work.  The batch must
 * already satisfy kda_cuda_batch_check.  Returns after enqueueing; errors of
 * the launch itself are reported, errors during the run surface on the
 * stream.  One batch at a time per kda_cuda (the scheduler counters are
 * shared): launches on one stream are fine.
 */
int kda_cuda_prefill(kda_cuda *cuda, const kda_pool *pool, const kda_seq *seqs_dev,
                     const int32_t *nseqs_dev, int32_t max_seqs, void *stream, kda_error *err);

/*
 * How chains map to CTAs.  AUTO (the default): when max_seqs x heads chains
 * fit the clusters the GPU runs at once, each chain runs on a cluster of two
 * CTAs that share its chunk preparation (paired chains: about twice as fast
 * per chain); otherwise one CTA per chain.  OFF and ALWAYS force one way
 * (tests); ALWAYS with more chains than clusters gives each cluster several.
 */
typedef enum kda_cuda_pairing {
    KDA_CUDA_PAIRING_AUTO = 0,
    KDA_CUDA_PAIRING_OFF,
    KDA_CUDA_PAIRING_ALWAYS,
} kda_cuda_pairing;
void kda_cuda_set_pairing(kda_cuda *cuda, kda_cuda_pairing pairing);
/* The clusters of paired chains the device runs at once (AUTO pairs up to this many chains). */
int kda_cuda_paired_clusters(const kda_cuda *cuda);

/*
 * Decode steps (kda.h, kda_step) on the GPU: one CTA per (sequence, head)
 * holds its state in registers for the sequence's tokens, so each state byte
 * is read once and written once (kernels/cuda/kda_decode_sm90.cu).
 *
 * kda_cuda_step_check: host-side check of a step whose descriptors are still
 * in host memory: kda_step_check plus the kernel's rule that q, k, v, g, out
 * and states are 16-byte aligned.
 *
 * kda_cuda_step: enqueues one step on `stream`.  step_dev is a kda_step in
 * device memory whose seqs, tensors and layer are device memory too; it is
 * read when the kernel runs, so a launch captured in a CUDA Graph replays
 * with new steps of at most max_seqs sequences (step_dev->nseqs <= max_seqs).
 * The step must already satisfy kda_cuda_step_check.  Allocates nothing,
 * never synchronises the host, shares no state with kda_cuda_prefill (the
 * two may be enqueued on different streams at once when their slots differ).
 */
int kda_cuda_step_check(const kda_pool *pool, const kda_step *step, kda_error *err);
int kda_cuda_step(kda_cuda *cuda, const kda_pool *pool, const kda_step *step_dev, int32_t max_seqs,
                  void *stream, kda_error *err);

/*
 * Long chains cut into segments that run at once (docs/kernel.md, "Splitting
 * a chain").  AUTO (the default): when at least three segments per sequence
 * fit the SMs (2 x max_seqs x heads x 3 <= SMs, e.g. H = 8 with one sequence),
 * each sequence is cut into up to SMs / (2 x max_seqs x heads) segments (at
 * most 16) of at least 2048 tokens, chosen on the device from its length
 * (shorter sequences run whole); the launch is then five kernels instead of
 * one (plan, pass 1, scan, correction, pass 3).  Each segment's outputs are
 * corrected from its initial state when the batch's tokens fit a scratch
 * allocated by kda_cuda_create (by default 256 MiB: 2^27 values, e.g. H = 8 x
 * 131072 tokens); past it the segments are recomputed from their initial states.
 * The choice of the path depends only on max_seqs, heads and the GPU, so a
 * captured graph stays valid for any batch of its bucket.  OFF never cuts;
 * ALWAYS cuts whenever two segments fit, down to 64 tokens a segment (tests).
 */
typedef enum kda_cuda_split {
    KDA_CUDA_SPLIT_AUTO = 0,
    KDA_CUDA_SPLIT_OFF,
    KDA_CUDA_SPLIT_ALWAYS,
} kda_cuda_split;
void kda_cuda_set_split(kda_cuda *cuda, kda_cuda_split split);
/* Caps the correction's scratch at elems bf16 values (tests: segments past it are recomputed); a negative
   elems, or more than was allocated, restores the whole scratch. */
void kda_cuda_set_split_outputs(kda_cuda *cuda, int64_t elems);

/*
 * Enqueues on `stream` a one-thread kernel that, when it runs, reads a
 * destination address from *dst (device memory) and, unless it is NULL,
 * stores the 8-byte word *src (device memory) there (device memory, or mapped
 * host memory), one aligned 64-bit store after a system-wide fence.  Both are
 * read when the kernel runs, so a launch captured in a CUDA Graph stores a
 * semaphore word chosen per replay, with a value that may still change until
 * then (kdad's done words of launches it may call off).  All 8-byte aligned.
 */
int kda_cuda_store_word(uint64_t *const *dst, const uint64_t *src, void *stream, kda_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KDA_CUDA_H */
