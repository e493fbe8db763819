/*
 * prefill_io.h - kdactl's tensor files: layer weights, the golden-vector
 * input format (docs/kda.md, "Golden vectors": q, k, v, g, beta, A_log,
 * dt_bias, cu_seqlens, optional initial_state, metadata lower_bound and
 * scale), synthetic inputs drawn like the golden ones, and the output file
 * (out BF16 [T, H, 128], final_state F32 [N, H, 128, 128], cu_seqlens).
 * No daemon involved: tests/test_kdactl_io.c covers this file on its own.
 */
#ifndef KDACTL_PREFILL_IO_H
#define KDACTL_PREFILL_IO_H

#include <stddef.h>
#include <stdint.h>

#include "kdaclient.h"
#include "safetensors.h"

#define KDACTL_DEFAULT_LOWER_BOUND (-5.0f)

typedef struct layer_weights {
    int32_t heads;
    float *A_log;      /* [H], owned */
    float *dt_bias;    /* [H][128], owned */
    float lower_bound; /* metadata "lower_bound", else -5 */
    float scale;       /* metadata "scale", else 1/sqrt(128) */
} layer_weights;

/* Reads A_log F32 [H] and dt_bias F32 [H, 128] and the metadata of f. */
int layer_weights_read(const st_file *f, layer_weights *w, char *err, size_t errlen);
/* A_log, dt_bias ~ U(0, 1) from seed; lower_bound -5, the default scale. */
int layer_weights_random(layer_weights *w, int32_t heads, uint64_t seed);
void layer_weights_free(layer_weights *w);
/* "kdactl.<16 hex digits>": a name that only identical weights and
 * constants share, so registering it again is harmless (created: false). */
void layer_weights_name(const layer_weights *w, char *buf, size_t size);

typedef struct prefill_input {
    int32_t heads;
    uint32_t nseqs;
    uint32_t total_tokens;
    int64_t *cu_seqlens;            /* [N+1], owned */
    const uint16_t *q, *k, *v, *g;  /* bf16 [T][H][128] */
    const uint16_t *beta;           /* bf16 [T][H] */
    layer_weights weights;
    const void *initial_state;      /* [N][H][128][128] in initial_dtype, or NULL: zeros */
    kdac_dtype initial_dtype;
    st_file *file;                  /* the input file (owns the tensors), or NULL */
    void *owned;                    /* synthetic tensors, or NULL */
} prefill_input;

/* Reads a golden-format file; every tensor's dtype and shape is checked. */
int prefill_input_read(prefill_input *in, const char *path, char *err, size_t errlen);
/*
 * Synthetic inputs drawn as the golden ones are (q, k, v, g, beta ~ N(0,1)
 * in bf16, A_log and dt_bias ~ U(0,1), lower_bound -5, default scale), no
 * initial state, `tokens` split into `nseqs` near-equal sequences; the same
 * seed gives the same bytes.
 */
int prefill_input_random(prefill_input *in, uint32_t tokens, int32_t heads, uint32_t nseqs,
                         uint64_t seed, char *err, size_t errlen);
void prefill_input_free(prefill_input *in);

/* What `prefill --check` finds: rms(x - ref) / rms(ref) of the output and the final state
 * against the input file's expected tensors, and the contract's bounds for them,
 * max(0.005, fla's error) when the file records fla's error (docs/kda.md). */
typedef struct prefill_check {
    double out_err, state_err;
    double out_bound, state_bound;
    bool ok;
} prefill_check;

/* Compares out (bf16 [T][H][128]) and final_state (f32 [N][H][128][128]) with the file's
 * expected_out and expected_final_state; -1 (and err) when the input has none. */
int prefill_input_check(const prefill_input *in, const uint16_t *out, const float *final_state,
                        prefill_check *res, char *err, size_t errlen);

/* Tokens of sequence i. */
static inline uint32_t prefill_input_len(const prefill_input *in, uint32_t i)
{
    return (uint32_t)(in->cu_seqlens[i + 1] - in->cu_seqlens[i]);
}

/* Writes out (bf16 [T][H][128]), final_state (f32 [N][H][128][128]) and
 * cu_seqlens, with the metadata pairs meta[0..2*nmeta). */
int prefill_output_write(const char *path, const prefill_input *in, const uint16_t *out,
                         const float *final_state, const char *const *meta, size_t nmeta,
                         char *err, size_t errlen);

/* A splitmix64 stream: the same numbers on every machine for a seed. */
uint64_t rng_next(uint64_t *state);
double rng_uniform(uint64_t *state); /* [0, 1) */
/* Fills n bf16 values ~ N(0,1) from the stream seeded with seed. */
void random_bf16(uint16_t *x, size_t n, uint64_t seed);

#endif /* KDACTL_PREFILL_IO_H */
