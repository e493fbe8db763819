/*
 * kda.h - the prefill contract between kdad and every KDA backend.
 *
 * One call runs a packed, variable-length prefill of Kimi Delta Attention
 * (docs/kda.md: the exact math) for any number of sequences.  Each
 * sequence names its own tensors (so sequences may live in one packed buffer
 * or in different buffers), its length, its layer weights and a slot of the
 * state pool.  The slot is both the initial and the final state: backends
 * update it in place.
 *
 * Backends: the float64 oracle (kda_ref.h, tests only), the CPU backend
 * (kda_cpu.h) and the fused Hopper kernel (kda_cuda.h).  The structs below
 * are plain data with no host-only members, so the CUDA backend reads the
 * same kda_seq array from device memory.
 *
 * Shapes (D = KDA_HEAD_DIM = 128, H = pool->heads, token stride H * D):
 *   q, k, v, g, out   bf16 [len][H][D]
 *   beta              bf16 [len][H]
 *   A_log             fp32 [H]
 *   dt_bias           fp32 [H][D]
 *   pool state        bf16 or fp32 [slots][H][D(v)][D(k)]  (V-major)
 */
#ifndef KDA_H
#define KDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDA_HEAD_DIM 128           /* D = K = V; the only supported size */
#define KDA_MAX_HEADS 128          /* H per pool */
#define KDA_LOWER_BOUND_MIN (-5.0f) /* gate floor range is [-5, 0) */
#define KDA_NORM_EPS 1e-6f         /* eps inside the sqrt of the q/k L2 norm */
#define KDA_ERRMSG_MAX 256

/* Status codes: 0 is success, failures are negative. */
typedef enum kda_status {
    KDA_OK = 0,
    KDA_EINVAL = -1,   /* an argument is out of its documented range */
    KDA_ENOMEM = -2,   /* host or device allocation failed */
    KDA_EDEVICE = -3,  /* the GPU reported an error; the context may be lost */
    KDA_ENOTSUP = -4,  /* the backend cannot run this (e.g. no GPU) */
} kda_status;

/* Error detail filled by every call that can fail; pass NULL to ignore. */
typedef struct kda_error {
    int code;                   /* a kda_status */
    char msg[KDA_ERRMSG_MAX];   /* one human-readable sentence */
} kda_error;

typedef enum kda_dtype {
    KDA_DTYPE_BF16 = 0,
    KDA_DTYPE_F32 = 1,
} kda_dtype;

/*
 * Per-layer weights.  For the CUDA backend the pointers are device pointers
 * and the struct itself lives in device memory (kda_seq.layer points at it).
 */
typedef struct kda_layer {
    const float *A_log;     /* [H] */
    const float *dt_bias;   /* [H][D] */
    float lower_bound;      /* gate floor: finite, in [-5, 0) */
    float scale;            /* output scale, finite (normally 1/sqrt(D)) */
} kda_layer;

/* kda_seq.flags */
#define KDA_SEQ_ZERO_STATE 0x1u   /* start from a zero state, ignoring the slot's contents */
/* Every other bit is reserved: kda_batch_check rejects it (the CUDA backend's own descriptors use
   some, kernels/cuda/params.h). */

/*
 * One sequence of a batch.  All tensors share the pool's H; tokens are
 * strided by H * D elements (H for beta).  len == 0 leaves the slot unchanged
 * (unless KDA_SEQ_ZERO_STATE, which then zeroes it) and reads no tensor.
 */
typedef struct kda_seq {
    const uint16_t *q;        /* bf16 [len][H][D] raw query (L2-normalised inside) */
    const uint16_t *k;        /* bf16 [len][H][D] raw key (L2-normalised inside) */
    const uint16_t *v;        /* bf16 [len][H][D] value */
    const uint16_t *g;        /* bf16 [len][H][D] gate pre-activation */
    const uint16_t *beta;     /* bf16 [len][H] write-strength logit */
    uint16_t *out;            /* bf16 [len][H][D] output, written */
    const kda_layer *layer;   /* layer weights (same memory space as the tensors) */
    int64_t len;              /* tokens, >= 0 */
    int64_t slot;             /* pool slot, in [0, pool->slots) and unique in the batch */
    uint32_t flags;           /* KDA_SEQ_* */
    uint32_t reserved;        /* must be 0 */
} kda_seq;

/* The state pool: [slots][H][D][D], V-major: (s,h,v,k) at ((s*H+h)*D+v)*D+k. */
typedef struct kda_pool {
    void *state;        /* host memory for the CPU backend, device memory for CUDA */
    kda_dtype dtype;
    int32_t heads;      /* H, 1..KDA_MAX_HEADS */
    int64_t slots;
} kda_pool;

/* Elements of one slot's state: H * D * D. */
static inline int64_t kda_slot_elems(int32_t heads)
{
    return (int64_t)heads * KDA_HEAD_DIM * KDA_HEAD_DIM;
}

static inline size_t kda_dtype_size(kda_dtype t)
{
    return t == KDA_DTYPE_F32 ? 4 : 2;
}

/*
 * Checks a layer's values (lower_bound in [-5, 0), finite scale, non-NULL
 * weights).  Reads only the struct, not the weight arrays.
 */
int kda_layer_check(const kda_layer *layer, kda_error *err);

/*
 * Checks a batch against a pool before anything is written: pool geometry
 * and dtype, each sequence's length, slot range, non-NULL tensors where
 * len > 0, reserved fields zero, and no slot named twice.  Does not
 * dereference tensor or layer pointers, so it works on descriptors of device
 * memory too.
 */
int kda_batch_check(const kda_pool *pool, const kda_seq *seqs, int64_t nseqs, kda_error *err);

/*
 * Fills seqs[0..n) from a packed layout: tensors of all sequences back to
 * back along T, cu_seqlens[n+1] (0 = cu[0] <= ... <= cu[n] = total_tokens)
 * and slots[n].  Rejects non-monotonic or out-of-range offsets.
 */
int kda_seqs_from_packed(kda_seq *seqs, int64_t n, int32_t heads, const int64_t *cu_seqlens,
                         int64_t total_tokens, const int64_t *slots, const uint16_t *q,
                         const uint16_t *k, const uint16_t *v, const uint16_t *g,
                         const uint16_t *beta, uint16_t *out, const kda_layer *layer,
                         kda_error *err);

/*
 * Decode steps: many sequences of a few tokens each (generation, speculative
 * drafts), in the recurrent form (KDA.md, "Per token") with no chunk
 * machinery.  Each sequence's state is read once and written once, so a step
 * costs about the state's bytes at the copy rate.
 *
 * Tensors are packed: all sequences back to back along the token axis, as
 * for kda_seqs_from_packed.  Sequence n owns tokens [start, start + len) of
 * every tensor; starts are the running sum of the lengths (checked).
 *
 * Choosing between the two forms (kda_batch_is_step): a batch whose every
 * sequence has 1..KDA_STEP_CHOICE_TOKENS tokens runs as a step; a batch with
 * any longer sequence runs as a chunked prefill, whichever form its requests
 * came in (both kernels take the other's inputs: kda_seqs_from_packed turns
 * a step's packed tensors into prefill descriptors).  Measured on the H200
 * (bench/RESULTS.md, H = 32, 256 sequences, fp32 pool, v17): the step kernel
 * takes 1.06x the state's bytes at 1 token, 1.13x at 4, 1.62x at 8 and 2.9x
 * at 16, the chunked kernel 1.65-1.98x at any length up to 16 (v15's and
 * v17's runs); at 8 tokens the step kernel is level with it or ahead (0.43
 * against 0.43 ms, 0.42 against 0.51), at 16 behind, so the step runs up to 8.
 */
#define KDA_STEP_CHOICE_TOKENS 8
#define KDA_STEP_MAX_TOKENS 16

/* One sequence of a step (16 bytes; the CUDA backend reads it from device memory). */
typedef struct kda_step_seq {
    int64_t slot;      /* pool slot, in [0, pool->slots) and unique in the step */
    int32_t start;     /* its first token in the packed tensors */
    uint16_t len;      /* tokens, 1..KDA_STEP_MAX_TOKENS */
    uint16_t flags;    /* KDA_SEQ_ZERO_STATE or 0 */
} kda_step_seq;

/*
 * One step.  The state after the step's last token replaces the slot's
 * (in place).  With `states` set, the state after every token is also
 * written there, in the pool's dtype, so a speculative draft can be rolled
 * back to any accepted prefix by copying one of them into the slot.
 */
typedef struct kda_step {
    const uint16_t *q, *k, *v, *g;   /* bf16 [tokens][H][D] */
    const uint16_t *beta;            /* bf16 [tokens][H] */
    uint16_t *out;                   /* bf16 [tokens][H][D], written */
    void *states;                    /* optional: pool dtype [tokens][H][D][D] (V-major), written */
    const kda_layer *layer;
    const kda_step_seq *seqs;        /* [nseqs] */
    int32_t nseqs;                   /* >= 0 */
    int32_t tokens;                  /* sum of the lengths */
} kda_step;

/*
 * Fills seqs[0..n) from per-sequence lengths and slots (starts as running
 * sums) and returns the total tokens in *tokens.  Rejects lengths outside
 * 1..KDA_STEP_MAX_TOKENS.
 */
int kda_step_seqs_fill(kda_step_seq *seqs, int32_t n, const int64_t *slots, const int32_t *lens,
                       int32_t *tokens, kda_error *err);

/*
 * Checks a step against a pool before anything is written: geometry, each
 * sequence's length, start (back to back), slot range and uniqueness, flags,
 * the tensors and layer non-NULL.  Reads step->seqs (host memory) but no
 * tensor or layer.
 */
int kda_step_check(const kda_pool *pool, const kda_step *step, kda_error *err);

/* 1 when a batch should run as a step: every sequence has 1..KDA_STEP_CHOICE_TOKENS tokens. */
int kda_batch_is_step(const kda_seq *seqs, int64_t nseqs);

/* Sets err (if any) and returns code; printf-style message. */
int kda_fail(kda_error *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

const char *kda_status_name(int code);

#ifdef __cplusplus
}
#endif

#endif /* KDA_H */
