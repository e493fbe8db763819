/*
 * layer.h - the layer registry: named KDA layer weights (A_log, dt_bias,
 * lower_bound, scale) that prefill requests refer to by name.
 *
 * Layers come from the configuration (loaded from safetensors files at
 * start and on SIGHUP) or from clients (layer.register).  Each holds an
 * aligned host copy of its weights and the backend's copy (device memory on
 * cuda).
 *
 * Names: a configuration layer's name is the daemon's, seen by every client.
 * A client layer belongs to the uid that registered it: each uid has its own
 * namespace (on top of the configuration's names), so a name resolves to the
 * configuration's layer or to the caller's uid's own, never to another uid's.
 * Layers belong to the uid rather than to the connection because serving
 * stacks register them once (or from every worker process, identically) and
 * use them from many connections that come and go.
 *
 * Two counts keep a layer alive.  Registrations: every successful
 * layer.register of a uid's name (creating it, or the same weights again)
 * takes one, every layer.drop of that uid gives one back, and the name goes
 * with the last.  References: the name holds one, and every admitted
 * request one more, so weights a request uses are released only when the
 * last such request finishes, even after the name is gone or replaced.
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
    uint32_t uid;            /* the owner (client layers) */
    uint64_t regs;           /* registrations (client layers); the name goes at 0 */
    float *A_log;            /* [H], 64-byte aligned host copy */
    float *dt_bias;          /* [H][128] */
    kda_layer host;          /* points at the host copies */
    const kda_layer *dev;    /* what the backend's kernel reads (kd_batch_seq.layer) */
    void *dev_handle;
    uint32_t refs;           /* 1 while registered, +1 per admitted request */
    /* while named: */
    uint32_t index;          /* its place in kd_layers.v */
    uint64_t hash;           /* of its name and namespace (layer.c) */
    struct kd_layer *next;   /* the next in its bucket of kd_layers.buckets */
} kd_layer;

typedef struct kd_layers {
    kd_layer **v;            /* named layers: the configuration's and every uid's, unordered */
    uint32_t n, cap;
    /* the same layers by namespace (the configuration's, or a uid's) and name: a
     * request's name is resolved in one or two probes however many there are */
    kd_layer **buckets;
    uint32_t nbuckets;       /* 0 or a power of two, at least n */
    kd_backend *backend;
    uint32_t heads;
    uint64_t seed;           /* the name hash's basis, random per start */
} kd_layers;

void kd_layers_init(kd_layers *ls, kd_backend *backend, uint32_t heads, uint64_t seed);
/* Unregisters everything; layers still referenced by requests are released
 * when those finish. */
void kd_layers_destroy(kd_layers *ls);

/* What a client of uid sees under name: the configuration's layer, or uid's own. */
kd_layer *kd_layers_find(const kd_layers *ls, const char *name, uint32_t uid);
/* Whether a client of uid sees l (layer.list). */
bool kd_layer_visible(const kd_layer *l, uint32_t uid);
/* Client layers uid holds names of. */
uint32_t kd_layers_of_uid(const kd_layers *ls, uint32_t uid);

/* For a request of a client of uid: the layer it names, referenced (the
 * request gives the reference back with kd_layer_unref), or
 * KP_E_UNKNOWN_LAYER. */
int kd_layers_acquire(kd_layers *ls, const char *name, uint32_t uid, kd_layer **out,
                      kp_error *err);

/* What a client may register: the daemon-wide and the per-uid bound. */
typedef struct kd_layer_quota {
    uint32_t max_layers;         /* named layers in the daemon (limits.max_layers) */
    uint32_t max_layers_per_uid; /* client layers per uid (limits.max_layers_per_uid) */
} kd_layer_quota;

/*
 * layer.register by a client of uid (weights copied; A_log [H] and dt_bias
 * [H][128] f32, any alignment).  A layer of that name with bit-identical
 * content (the configuration's, or uid's own) gives *created = false, and
 * takes another registration of uid's own; different content gives
 * KP_E_LAYER_EXISTS and changes nothing.  KP_E_QUOTA_EXCEEDED names the
 * bound a new layer would pass.
 */
int kd_layers_register(kd_layers *ls, const char *name, const void *A_log, const void *dt_bias,
                       float lower_bound, float scale, uint32_t uid, const kd_layer_quota *q,
                       bool *created, kp_error *err);

/* layer.drop by a client of uid: gives back one registration of uid's layer
 * (the name goes with the last); *out says what is left (its answer).
 * KP_E_PERMISSION_DENIED for the configuration's layers, KP_E_UNKNOWN_LAYER
 * when uid has no layer of that name (another uid's does not count). */
int kd_layers_drop(kd_layers *ls, const char *name, uint32_t uid, kp_layer_drop_result *out,
                   kp_error *err);

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
 * Client layers of the same name (of any uid) are removed (with a warning):
 * the configuration wins, and its names are every uid's.
 */
int kd_layers_sync_config(kd_layers *ls, const kd_config *cfg, char *err, size_t errlen);

#endif /* KDAD_LAYER_H */
