/*
 * golden.h - loads a golden-vector case (../shared/golden, format in its
 * README) into plain arrays, and the error metric the accuracy contract uses.
 * Shared by the CPU golden test, the GPU tests and the kdactl tests.
 */
#ifndef KDA_TEST_GOLDEN_H
#define KDA_TEST_GOLDEN_H

#include <stddef.h>
#include <stdint.h>

#include "kda.h"
#include "safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct golden_case {
    char name[64];
    char path[512];
    st_file *file;
    int32_t heads;
    int64_t nseqs, total_tokens;
    const int64_t *cu_seqlens;          /* [N+1] */
    const uint16_t *q, *k, *v, *g;      /* bf16 [T][H][128] */
    const uint16_t *beta;               /* bf16 [T][H] */
    float *A_log, *dt_bias;             /* copied out (the file's bytes may be unaligned) */
    float *initial_state;               /* [N][H][128][128] fp32, NULL = zeros */
    int initial_is_bf16;                /* the file stored it as BF16 */
    const float *expected_out;          /* [T][H][128] */
    const float *expected_state;        /* [N][H][128][128] */
    double lower_bound, scale;
    double fla_out_err, fla_state_err;
    double flashkda_out_err, flashkda_state_err;
} golden_case;

/* The golden folder: $KDAD_GOLDEN_DIR if set, else the one CMake compiled in. */
const char *golden_dir(void);

/* Paths of every *.safetensors in dir, sorted; returns the count or -1 (message in err). */
int golden_list(const char *dir, char ***paths, char *err, size_t errlen);
void golden_list_free(char **paths, int n);

int golden_load(const char *path, golden_case *c, char *err, size_t errlen);
void golden_free(golden_case *c);

/* rms(x - ref) / rms(ref), accumulated in float64. */
double rel_rms_f64(const double *x, const float *ref, size_t n);
double rel_rms_f32(const float *x, const float *ref, size_t n);
double rel_rms_bf16(const uint16_t *x, const float *ref, size_t n);
double rel_rms_f64_f64(const double *x, const double *ref, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* KDA_TEST_GOLDEN_H */
