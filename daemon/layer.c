/*
 * layer.c - see layer.h.
 */
#include "layer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "safetensors.h"

#define LAYER_ALIGN 64 /* host weights: a cache line, and what vector loads like */

void kd_layers_init(kd_layers *ls, kd_backend *backend, uint32_t heads, uint64_t seed)
{
    memset(ls, 0, sizeof(*ls));
    ls->backend = backend;
    ls->heads = heads;
    ls->seed = seed;
}

bool kd_layer_visible(const kd_layer *l, uint32_t uid)
{
    return l->source == KP_LAYER_SOURCE_CONFIG || l->uid == uid;
}

/*
 * The table's key: the namespace (a uid's, or the configuration's, apart
 * from every uid's) and the name.  FNV-1a over the name from a basis drawn at
 * start (so that which names share a bucket differs per daemon and cannot be
 * worked out offline), the namespace mixed in, then a finalizer so that the
 * low bits, which pick the bucket, depend on all of it.  Names that collide
 * anyway cost at worst a walk of one bucket, the scan of every layer that
 * this table replaced (limits.max_layers).
 */
#define CONFIG_SPACE (UINT64_C(1) << 32) /* no uid's */

static uint64_t name_hash(const kd_layers *ls, const char *name)
{
    uint64_t h = UINT64_C(14695981039346656037) ^ ls->seed;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * UINT64_C(1099511628211);
    return h;
}

static uint64_t key_hash(uint64_t name_h, uint64_t space)
{
    uint64_t h = name_h ^ (space * UINT64_C(0x9e3779b97f4a7c15));
    h ^= h >> 33;
    h *= UINT64_C(0xff51afd7ed558ccd);
    h ^= h >> 33;
    return h;
}

static uint64_t space_of(const kd_layer *l)
{
    return l->source == KP_LAYER_SOURCE_CONFIG ? CONFIG_SPACE : l->uid;
}

static kd_layer *lookup(const kd_layers *ls, const char *name, uint64_t name_h, uint64_t space)
{
    if (ls->nbuckets == 0)
        return NULL;
    uint64_t h = key_hash(name_h, space);
    for (kd_layer *l = ls->buckets[h & (ls->nbuckets - 1)]; l; l = l->next) {
        if (l->hash == h && space_of(l) == space && strcmp(l->name, name) == 0)
            return l;
    }
    return NULL;
}

/* The configuration's names are every uid's: no uid's layer shares one
 * (kd_layers_sync_config removes them, kd_layers_register finds it first). */
kd_layer *kd_layers_find(const kd_layers *ls, const char *name, uint32_t uid)
{
    uint64_t name_h = name_hash(ls, name);
    kd_layer *l = lookup(ls, name, name_h, CONFIG_SPACE);
    return l ? l : lookup(ls, name, name_h, uid);
}

static void link_layer(kd_layers *ls, kd_layer *l)
{
    kd_layer **head = &ls->buckets[l->hash & (ls->nbuckets - 1)];
    l->next = *head;
    *head = l;
}

/* Room in the table for one more layer: false without memory for a first
 * one (a table that cannot grow keeps working, with longer buckets). */
static bool reserve_bucket(kd_layers *ls)
{
    if (ls->n < ls->nbuckets)
        return true;
    uint32_t nb = ls->nbuckets ? 2 * ls->nbuckets : 64;
    kd_layer **b = calloc(nb, sizeof(*b));
    if (!b)
        return ls->nbuckets != 0;
    free(ls->buckets);
    ls->buckets = b;
    ls->nbuckets = nb;
    for (uint32_t i = 0; i < ls->n; i++)
        link_layer(ls, ls->v[i]);
    return true;
}

uint32_t kd_layers_of_uid(const kd_layers *ls, uint32_t uid)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < ls->n; i++)
        n += ls->v[i]->source == KP_LAYER_SOURCE_CLIENT && ls->v[i]->uid == uid;
    return n;
}

static void layer_free(kd_layers *ls, kd_layer *l)
{
    ls->backend->ops->layer_release(ls->backend, l->dev, l->dev_handle);
    free(l->A_log);
    free(l->dt_bias);
    free(l);
}

void kd_layer_ref(kd_layer *l)
{
    l->refs++;
}

void kd_layer_unref(kd_layers *ls, kd_layer *l)
{
    if (--l->refs == 0)
        layer_free(ls, l);
}

int kd_layers_acquire(kd_layers *ls, const char *name, uint32_t uid, kd_layer **out,
                      kp_error *err)
{
    kd_layer *l = kd_layers_find(ls, name, uid);
    if (!l)
        return kp_fail(err, KP_E_UNKNOWN_LAYER, "layer: no layer \"%s\" in the configuration "
                       "or registered by uid %u", name, (unsigned)uid);
    kd_layer_ref(l);
    *out = l;
    return KP_OK;
}

/* Removes a layer's name; its weights live on while requests use them. */
static void unregister(kd_layers *ls, uint32_t i)
{
    kd_layer *l = ls->v[i];
    kd_layer **p = &ls->buckets[l->hash & (ls->nbuckets - 1)];
    while (*p != l)
        p = &(*p)->next;
    *p = l->next;
    ls->v[i] = ls->v[--ls->n];
    ls->v[i]->index = i;
    kd_layer_unref(ls, l);
}

void kd_layers_destroy(kd_layers *ls)
{
    while (ls->n)
        unregister(ls, ls->n - 1);
    free(ls->v);
    free(ls->buckets);
    ls->v = NULL;
    ls->buckets = NULL;
    ls->cap = ls->nbuckets = 0;
}

static bool same_content(const kd_layer *l, const void *A_log, const void *dt_bias, float lb,
                         float scale, uint32_t heads)
{
    return memcmp(l->A_log, A_log, heads * sizeof(float)) == 0 &&
           memcmp(l->dt_bias, dt_bias, (size_t)heads * KDA_HEAD_DIM * sizeof(float)) == 0 &&
           memcmp(&l->host.lower_bound, &lb, sizeof(lb)) == 0 &&
           memcmp(&l->host.scale, &scale, sizeof(scale)) == 0;
}

static float *aligned_copy(const void *src, size_t n)
{
    size_t bytes = (n * sizeof(float) + LAYER_ALIGN - 1) / LAYER_ALIGN * LAYER_ALIGN;
    float *p = aligned_alloc(LAYER_ALIGN, bytes);
    if (p)
        memcpy(p, src, n * sizeof(float));
    return p;
}

/* Names a new layer (the caller checked that the name is free to it). */
static int add_layer(kd_layers *ls, const char *name, const void *A_log, const void *dt_bias,
                     float lower_bound, float scale, kp_layer_source source, uint32_t uid,
                     kp_error *err)
{
    if (ls->n == ls->cap) {
        uint32_t cap = ls->cap ? 2 * ls->cap : 16;
        kd_layer **v = realloc(ls->v, cap * sizeof(*v));
        if (!v)
            return kp_fail(err, KP_E_NO_MEMORY, "no memory for the layer table");
        ls->v = v;
        ls->cap = cap;
    }
    if (!reserve_bucket(ls))
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for the layer table");
    kd_layer *l = calloc(1, sizeof(*l));
    if (!l)
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for layer \"%s\"", name);
    snprintf(l->name, sizeof(l->name), "%s", name);
    l->source = source;
    l->uid = uid;
    l->A_log = aligned_copy(A_log, ls->heads);
    l->dt_bias = aligned_copy(dt_bias, (size_t)ls->heads * KDA_HEAD_DIM);
    l->host = (kda_layer){l->A_log, l->dt_bias, lower_bound, scale};
    l->dev = &l->host;
    if (!l->A_log || !l->dt_bias) {
        free(l->A_log);
        free(l->dt_bias);
        free(l);
        return kp_fail(err, KP_E_NO_MEMORY, "no memory for layer \"%s\"", name);
    }
    int rc = ls->backend->ops->layer_upload(ls->backend, &l->host, &l->dev, &l->dev_handle, err);
    if (rc != KP_OK) {
        free(l->A_log);
        free(l->dt_bias);
        free(l);
        return rc;
    }
    l->refs = 1;
    l->regs = 1;
    l->index = ls->n;
    l->hash = key_hash(name_hash(ls, l->name), space_of(l));
    ls->v[ls->n++] = l;
    link_layer(ls, l);
    return KP_OK;
}

int kd_layers_register(kd_layers *ls, const char *name, const void *A_log, const void *dt_bias,
                       float lower_bound, float scale, uint32_t uid, const kd_layer_quota *q,
                       bool *created, kp_error *err)
{
    kd_layer *old = kd_layers_find(ls, name, uid);
    if (old) {
        bool config = old->source == KP_LAYER_SOURCE_CONFIG;
        if (!same_content(old, A_log, dt_bias, lower_bound, scale, ls->heads)) {
            if (config)
                return kp_fail(err, KP_E_LAYER_EXISTS, "name: \"%s\" is a layer of the "
                               "daemon's configuration, with other weights", name);
            return kp_fail(err, KP_E_LAYER_EXISTS, "name: uid %u has a layer \"%s\" with "
                           "other weights (registrations: %llu); drop them all first, or use "
                           "another name", (unsigned)uid, name, (unsigned long long)old->regs);
        }
        if (!config)
            old->regs++; /* given back by a layer.drop */
        *created = false;
        return KP_OK;
    }
    if (ls->n >= q->max_layers)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "name: the daemon holds limits.max_layers %u "
                       "layers", q->max_layers);
    uint32_t mine = kd_layers_of_uid(ls, uid);
    if (mine >= q->max_layers_per_uid)
        return kp_fail(err, KP_E_QUOTA_EXCEEDED, "name: uid %u holds %u layers, "
                       "limits.max_layers_per_uid", (unsigned)uid, mine);
    int rc = add_layer(ls, name, A_log, dt_bias, lower_bound, scale, KP_LAYER_SOURCE_CLIENT, uid,
                       err);
    if (rc == KP_OK)
        *created = true;
    return rc;
}

int kd_layers_drop(kd_layers *ls, const char *name, uint32_t uid, kp_layer_drop_result *out,
                   kp_error *err)
{
    kd_layer *l = kd_layers_find(ls, name, uid);
    if (!l)
        return kp_fail(err, KP_E_UNKNOWN_LAYER, "name: uid %u has no layer \"%s\"",
                       (unsigned)uid, name);
    if (l->source == KP_LAYER_SOURCE_CONFIG)
        return kp_fail(err, KP_E_PERMISSION_DENIED, "name: layer \"%s\" comes from the "
                       "daemon's configuration", name);
    l->regs--;
    *out = (kp_layer_drop_result){.known = true, .removed = l->regs == 0,
                                  .registrations = l->regs, .in_use = l->refs - 1};
    if (out->removed)
        unregister(ls, l->index);
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* Config layers                                                          */
/* ---------------------------------------------------------------------- */

static int conf_fail(const kd_layer_conf *lc, uint32_t index, char *err, size_t errlen,
                     const char *reason)
{
    snprintf(err, errlen, "%s:%d:%d: layers[%u].file: %s", lc->file_mark.file,
             lc->file_mark.line, lc->file_mark.col, index, reason);
    return -1;
}

static float *finite_copy(const st_tensor *t, const char *what, char *reason, size_t size)
{
    size_t n = t->nbytes / sizeof(float);
    float *v = malloc(t->nbytes ? t->nbytes : 1);
    if (!v) {
        snprintf(reason, size, "no memory for %s", what);
        return NULL;
    }
    memcpy(v, t->data, t->nbytes); /* the file's data need not be aligned */
    for (size_t i = 0; i < n; i++) {
        if (!__builtin_isfinite(v[i])) {
            snprintf(reason, size, "%s[%zu] is %g: weights must be finite", what, i,
                     (double)v[i]);
            free(v);
            return NULL;
        }
    }
    return v;
}

int kd_layer_conf_load(const kd_layer_conf *lc, uint32_t index, uint32_t heads, float **A_log,
                       float **dt_bias, char *err, size_t errlen)
{
    char reason[384], st_err[ST_ERRMSG_MAX];
    st_file *f;
    if (st_open(lc->file, &f, st_err, sizeof(st_err)) != 0) {
        snprintf(reason, sizeof(reason), "%s: %s", lc->file, st_err);
        return conf_fail(lc, index, err, errlen, reason);
    }
    const int64_t a_shape[1] = {heads};
    const int64_t dt_shape[2] = {heads, KDA_HEAD_DIM};
    const st_tensor *a = st_expect(f, lc->a_log_tensor, ST_F32, 1, a_shape, st_err,
                                   sizeof(st_err));
    const st_tensor *dt = a ? st_expect(f, lc->dt_bias_tensor, ST_F32, 2, dt_shape, st_err,
                                        sizeof(st_err))
                            : NULL;
    *A_log = *dt_bias = NULL;
    if (!a || !dt) {
        snprintf(reason, sizeof(reason), "%s (heads is %u)", st_err, heads);
    } else if ((*A_log = finite_copy(a, lc->a_log_tensor, reason, sizeof(reason))) &&
               (*dt_bias = finite_copy(dt, lc->dt_bias_tensor, reason, sizeof(reason)))) {
        st_close(f);
        return 0;
    }
    free(*A_log);
    *A_log = NULL;
    st_close(f);
    return conf_fail(lc, index, err, errlen, reason);
}

int kd_layers_sync_config(kd_layers *ls, const kd_config *cfg, char *err, size_t errlen)
{
    if (cfg->nlayers > cfg->limits.max_layers) {
        snprintf(err, errlen, "layers: %u layers exceed limits.max_layers %u", cfg->nlayers,
                 cfg->limits.max_layers);
        return -1;
    }
    float **weights = calloc(2 * (size_t)cfg->nlayers + 1, sizeof(*weights));
    if (!weights) {
        snprintf(err, errlen, "no memory to load the layers");
        return -1;
    }
    int rc = 0;
    for (uint32_t i = 0; i < cfg->nlayers && rc == 0; i++)
        rc = kd_layer_conf_load(&cfg->layers[i], i, ls->heads, &weights[2 * i],
                                &weights[2 * i + 1], err, errlen);

    /* Config layers that the file no longer lists go. */
    for (uint32_t i = ls->n; rc == 0 && i-- > 0;) {
        kd_layer *l = ls->v[i];
        bool listed = false;
        for (uint32_t j = 0; j < cfg->nlayers && !listed; j++)
            listed = strcmp(cfg->layers[j].name, l->name) == 0;
        if (l->source == KP_LAYER_SOURCE_CONFIG && !listed) {
            KD_INFO("layer %s: removed from the configuration", l->name);
            unregister(ls, i);
        }
    }
    for (uint32_t j = 0; j < cfg->nlayers && rc == 0; j++) {
        const kd_layer_conf *lc = &cfg->layers[j];
        bool reloaded = false, same = false;
        /* The name is every uid's now: the old config layer, if changed, and
         * client layers of that name go. */
        for (uint32_t i = ls->n; i-- > 0;) {
            kd_layer *l = ls->v[i];
            if (strcmp(l->name, lc->name) != 0)
                continue;
            if (l->source == KP_LAYER_SOURCE_CONFIG &&
                same_content(l, weights[2 * j], weights[2 * j + 1], lc->lower_bound, lc->scale,
                             ls->heads)) {
                same = true;
                continue;
            }
            if (l->source == KP_LAYER_SOURCE_CLIENT)
                KD_WARN("layer %s: uid %u's layer is replaced by the configuration's", lc->name,
                        (unsigned)l->uid);
            reloaded |= l->source == KP_LAYER_SOURCE_CONFIG;
            unregister(ls, i);
        }
        if (same)
            continue;
        kp_error kerr;
        if (add_layer(ls, lc->name, weights[2 * j], weights[2 * j + 1], lc->lower_bound,
                      lc->scale, KP_LAYER_SOURCE_CONFIG, 0, &kerr) != KP_OK) {
            snprintf(err, errlen, "%s:%d:%d: layers[%u]: %s", lc->mark.file, lc->mark.line,
                     lc->mark.col, j, kerr.message);
            rc = -1;
            break;
        }
        KD_INFO("layer %s: %s from %s", lc->name, reloaded ? "reloaded" : "loaded", lc->file);
    }
    for (uint32_t i = 0; i < 2 * cfg->nlayers; i++)
        free(weights[i]);
    free(weights);
    return rc;
}
