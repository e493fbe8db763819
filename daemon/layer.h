/*
 * layer.h - the layer registry: named KDA layer weights (A_log, dt_bias,
 * lower_bound, scale) that prefill requests refer to by name.
 *
 * Layers come from the configuration (loaded from safetensors files at
 * start and on SIGHUP) or from clients (layer.register).  Each holds an
 * aligned host copy of its weights and the backend's copy (device memory on
 * cuda).  A layer is reference-counted: dropping or replacing it removes the
 * name at once, and the weights are released when the last request that
 * admitted it finishes.
 */
#ifndef KDAD_LAYER_H
#define KDAD_LAYER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "config.h"
#include "kda.h"
#include "kdaproto.h"

typedef struct kd_layer {
    char name[KP_NAME_MAX + 1];
    kp_layer_source source;
    uint32_t uid;            /* who registered it (client layers) */
    float *A_log;            /* [H], 64-byte aligned host copy */
    float *dt_bias;          /* [H][128] */
    kda_layer host;          /* points at the host copies */
    const kda_layer *dev;    /* what the backend's kernel reads (kd_batch_seq.layer) */
    void *dev_handle;
    uint32_t refs;           /* 1 while registered, +1 per admitted request */
} kd_layer;

typedef struct kd_layers {
    kd_layer **v;            /* registered layers */
    uint32_t n, cap;
    kd_backend *backend;
    uint32_t heads;
} kd_layers;

void kd_layers_init(kd_layers *ls, kd_backend *backend, uint32_t heads);
/* Unregisters everything; layers still referenced by requests are released
 * when those finish. */
void kd_layers_destroy(kd_layers *ls);

kd_layer *kd_layers_find(const kd_layers *ls, const char *name);

/*
 * Registers a layer (weights copied; A_log [H] and dt_bias [H][128] f32,
 * any alignment).  An existing layer of that name with bit-identical content
 * gives *created = false; different content gives KP_E_LAYER_EXISTS.
 * max_layers: KP_E_QUOTA_EXCEEDED beyond it.
 */
int kd_layers_register(kd_layers *ls, const char *name, const void *A_log, const void *dt_bias,
                       float lower_bound, float scale, kp_layer_source source, uint32_t uid,
                       uint32_t max_layers, bool *created, kp_error *err);

/* layer.drop for a client of `uid`: KP_E_UNKNOWN_LAYER, KP_E_PERMISSION_DENIED
 * for config layers and layers of another uid. */
int kd_layers_drop(kd_layers *ls, const char *name, uint32_t uid, kp_error *err);

void kd_layer_ref(kd_layer *l);
void kd_layer_unref(kd_layers *ls, kd_layer *l);

/*
 * Reads a config layer's weights (entry `index` of `layers`) from its
 * safetensors file and checks them
 * (f32, A_log [heads], dt_bias [heads, 128], all finite).  On success
 * *A_log and *dt_bias are malloc'd copies; on failure err reads
 * "FILE:LINE:COL: layers[i].file: reason".
 */
int kd_layer_conf_load(const kd_layer_conf *lc, uint32_t index, uint32_t heads, float **A_log,
                       float **dt_bias, char *err, size_t errlen);

/*
 * Makes the config-sourced layers match cfg: loads every file first (a bad
 * file changes nothing), then removes config layers no longer listed, and
 * adds new layers and replaces changed ones (an upload failure stops there).
 * A client layer of the same name is replaced (with a warning): the config
 * wins.
 */
int kd_layers_sync_config(kd_layers *ls, const kd_config *cfg, char *err, size_t errlen);

#endif /* KDAD_LAYER_H */
