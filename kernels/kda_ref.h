/*
 * kda_ref.h - the float64 token-loop oracle, straight from docs/kda.md.
 *
 * Slow and exact: every test compares backends against it.
 */
#ifndef KDA_REF_H
#define KDA_REF_H

#include "kda.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Runs one sequence of `len` tokens for all `heads` heads.  Tensors are as in
 * kda.h (bf16, token stride heads * D).  state: float64 [heads][D][D] V-major,
 * the initial state in, the final state out.  out: float64 [len][heads][D].
 */
void kda_ref_sequence(int32_t heads, const kda_layer *layer, const uint16_t *q, const uint16_t *k,
                      const uint16_t *v, const uint16_t *g, const uint16_t *beta, int64_t len,
                      double *state, double *out);

#ifdef __cplusplus
}
#endif

#endif /* KDA_REF_H */
