/*
 * kda_ref.c - the float64 token-loop oracle (docs/kda.md, "One token").
 *
 * Deliberately the plainest possible transcription of the math: every test
 * of a fast backend is only as good as this file.
 */
#include "kda_ref.h"

#include <math.h>
#include <stdlib.h>

#include "bf16.h"

enum { D = KDA_HEAD_DIM };

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* x^ = x / sqrt(sum(x^2) + eps), upcast from bf16. */
static void l2_normalise(const uint16_t *x, double *y)
{
    double ss = 0.0;
    for (int i = 0; i < D; i++) {
        y[i] = kda_bf16_to_f32(x[i]);
        ss += y[i] * y[i];
    }
    double inv = 1.0 / sqrt(ss + (double)KDA_NORM_EPS);
    for (int i = 0; i < D; i++)
        y[i] *= inv;
}

void kda_ref_sequence(int32_t heads, const kda_layer *layer, const uint16_t *q, const uint16_t *k,
                      const uint16_t *v, const uint16_t *g, const uint16_t *beta, int64_t len,
                      double *state, double *out)
{
    const double lb = layer->lower_bound, scale = layer->scale;
    double qh[D], kh[D], a[D], sk[D], u[D];

    for (int64_t t = 0; t < len; t++) {
        for (int32_t h = 0; h < heads; h++) {
            const int64_t row = (t * heads + h) * D;
            double *S = state + (int64_t)h * D * D;     /* S[v][k], V-major */
            const double expA = exp((double)layer->A_log[h]);

            l2_normalise(q + row, qh);
            l2_normalise(k + row, kh);
            for (int j = 0; j < D; j++) {
                double gj = kda_bf16_to_f32(g[row + j]) + (double)layer->dt_bias[h * D + j];
                a[j] = exp(lb * sigmoid(expA * gj));
            }
            const double b = sigmoid(kda_bf16_to_f32(beta[t * heads + h]));

            /* S = S diag(a); sk = S k^ */
            for (int i = 0; i < D; i++) {
                double acc = 0.0;
                for (int j = 0; j < D; j++) {
                    S[i * D + j] *= a[j];
                    acc += S[i * D + j] * kh[j];
                }
                sk[i] = acc;
            }
            /* u = b (v - S k^); S += u k^T; o = scale S q^ */
            for (int i = 0; i < D; i++)
                u[i] = b * (kda_bf16_to_f32(v[row + i]) - sk[i]);
            for (int i = 0; i < D; i++) {
                double acc = 0.0;
                for (int j = 0; j < D; j++) {
                    S[i * D + j] += u[i] * kh[j];
                    acc += S[i * D + j] * qh[j];
                }
                out[row + i] = scale * acc;
            }
        }
    }
}
