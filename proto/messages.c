/*
 * messages.c - encoders and decoders of the session and registry methods:
 * hello, health, stats, layer.register / list / drop, region.register_shm /
 * register_cuda / release, ring.attach.  (slot.* live in slots.c, prefill in
 * prefill.c, the ring's shared memory layout in ring.c.)
 *
 * Each method has four functions: params encode (client), params decode
 * (daemon, strict, checked against the session), result encode (daemon),
 * result decode (client, lenient about unknown fields).  The field names in
 * the static `*_fields` lists are the wire names of PROTOCOL.md.
 */
#include <stdio.h>
#include <string.h>

#include "codec.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "tensor bytes are little-endian on the wire and used in place");

static const char *const backend_names[] = {"cpu", "cuda", NULL};
static const char *const dtype_names[] = {"bf16", "f32", NULL};

/* ---------------------------------------------------------------------- */
/* hello                                                                  */
/* ---------------------------------------------------------------------- */

static const char *const hello_fields[] = {"versions", "client", NULL};

int kp_hello_params_encode(kp_writer *w, uint32_t id, const kp_hello_params *p, kp_error *err)
{
    if (p->nversions == 0 || p->nversions > KP_MAX_VERSIONS)
        return kp_fail(err, KP_E_INVALID_PARAMS, "versions: %u entries, expected 1..%d",
                       p->nversions, KP_MAX_VERSIONS);
    enc_request(w, id, KP_METHOD_HELLO, p->client ? 2 : 1);
    enc_key(w, "versions");
    enc_array(w, p->nversions);
    for (uint32_t i = 0; i < p->nversions; i++)
        enc_u64(w, p->versions[i]);
    if (p->client)
        enc_kv_str(w, "client", p->client);
    return enc_finish(w, err);
}

int kp_hello_params_decode(kp_msg *msg, const kp_session *s, kp_hello_params *p, kp_error *err)
{
    dec_fields f;
    const msgpack_object *v;
    bool has_client;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, hello_fields, err);
    if (rc || (rc = dec_array(&f, "versions", KP_MAX_VERSIONS, false, &v, &p->nversions, NULL,
                              err)))
        return rc;
    for (uint32_t i = 0; i < p->nversions; i++) {
        if (v[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER || v[i].via.u64 == 0 ||
            v[i].via.u64 > UINT32_MAX)
            return kp_fail(err, KP_E_INVALID_PARAMS,
                           "versions[%u]: expected a version number in [1, 2^32)", i);
        p->versions[i] = (uint32_t)v[i].via.u64;
    }
    rc = dec_str(&f, "client", 0, KP_TEXT_MAX, &p->client, &has_client, err);
    if (rc == KP_OK && !has_client)
        p->client = NULL;
    return rc;
}

int kp_hello_choose_version(const kp_hello_params *p, uint32_t *version, kp_error *err)
{
    char offered[KP_MAX_VERSIONS * 12] = "";
    for (uint32_t i = 0; i < p->nversions; i++) {
        if (p->versions[i] == KP_PROTOCOL_VERSION) {
            *version = KP_PROTOCOL_VERSION;
            return KP_OK;
        }
        size_t used = strlen(offered);
        snprintf(offered + used, sizeof(offered) - used, "%s%u", i ? ", " : "", p->versions[i]);
    }
    return kp_fail(err, KP_E_UNSUPPORTED_VERSION,
                   "versions: the client speaks [%s]; this daemon speaks [%d]", offered,
                   KP_PROTOCOL_VERSION);
}

static const char *const limits_fields[] = {
    "max_frame_bytes", "max_inline_bytes", "max_batch_tokens", "max_batch_seqs",
    "max_seqs_per_request", "max_slots_per_client", "max_regions_per_client",
    "max_inflight_requests", "max_inflight_bytes", "max_layers", "max_layers_per_uid",
    "max_slots_per_uid", "clients", NULL};

static const char *const client_bounds_fields[] = {
    "max_connections", "max_connections_per_uid", "max_inflight_bytes_per_uid",
    "max_inflight_bytes_total", "output_hard_limit", "output_soft_limit", "output_soft_seconds",
    "max_output_bytes_per_uid", "max_output_bytes_total", "max_region_bytes_per_connection",
    "max_region_bytes_per_uid", "frame_stall_seconds", "output_stall_seconds", NULL};

/* The clients.* bounds, under key (hello's limits.clients, stats' clients.bounds). */
static void encode_client_bounds(kp_writer *w, const char *key, const kp_client_bounds *b)
{
    enc_str(w, key);
    enc_map(w, 13);
    enc_kv_u64(w, "max_connections", b->max_connections);
    enc_kv_u64(w, "max_connections_per_uid", b->max_connections_per_uid);
    enc_kv_u64(w, "max_inflight_bytes_per_uid", b->max_inflight_bytes_per_uid);
    enc_kv_u64(w, "max_inflight_bytes_total", b->max_inflight_bytes_total);
    enc_kv_u64(w, "output_hard_limit", b->output_hard_limit);
    enc_kv_u64(w, "output_soft_limit", b->output_soft_limit);
    enc_kv_u64(w, "output_soft_seconds", b->output_soft_seconds);
    enc_kv_u64(w, "max_output_bytes_per_uid", b->max_output_bytes_per_uid);
    enc_kv_u64(w, "max_output_bytes_total", b->max_output_bytes_total);
    enc_kv_u64(w, "max_region_bytes_per_connection", b->max_region_bytes_per_connection);
    enc_kv_u64(w, "max_region_bytes_per_uid", b->max_region_bytes_per_uid);
    enc_kv_u64(w, "frame_stall_seconds", b->frame_stall_seconds);
    enc_kv_u64(w, "output_stall_seconds", b->output_stall_seconds);
}

/* Each field optional (0: not sent), so that a daemon may add or drop one. */
static int decode_client_bounds(kp_msg *msg, const msgpack_object *o, const char *path,
                                kp_client_bounds *b, kp_error *err)
{
    dec_fields f;
    bool here;
    memset(b, 0, sizeof(*b));
    int rc = dec_open(&f, msg, o, path, client_bounds_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc ||
        (rc = dec_u32(&f, "max_connections", 0, UINT32_MAX, &b->max_connections, &here, err)) ||
        (rc = dec_u32(&f, "max_connections_per_uid", 0, UINT32_MAX,
                      &b->max_connections_per_uid, &here, err)) ||
        (rc = dec_u64(&f, "max_inflight_bytes_per_uid", 0, UINT64_MAX,
                      &b->max_inflight_bytes_per_uid, &here, err)) ||
        (rc = dec_u64(&f, "max_inflight_bytes_total", 0, UINT64_MAX,
                      &b->max_inflight_bytes_total, &here, err)) ||
        (rc = dec_u64(&f, "output_hard_limit", 0, UINT64_MAX, &b->output_hard_limit, &here,
                      err)) ||
        (rc = dec_u64(&f, "output_soft_limit", 0, UINT64_MAX, &b->output_soft_limit, &here,
                      err)) ||
        (rc = dec_u32(&f, "output_soft_seconds", 0, UINT32_MAX, &b->output_soft_seconds, &here,
                      err)) ||
        (rc = dec_u64(&f, "max_output_bytes_per_uid", 0, UINT64_MAX,
                      &b->max_output_bytes_per_uid, &here, err)) ||
        (rc = dec_u64(&f, "max_output_bytes_total", 0, UINT64_MAX,
                      &b->max_output_bytes_total, &here, err)) ||
        (rc = dec_u64(&f, "max_region_bytes_per_connection", 0, UINT64_MAX,
                      &b->max_region_bytes_per_connection, &here, err)) ||
        (rc = dec_u64(&f, "max_region_bytes_per_uid", 0, UINT64_MAX,
                      &b->max_region_bytes_per_uid, &here, err)) ||
        (rc = dec_u32(&f, "frame_stall_seconds", 0, UINT32_MAX, &b->frame_stall_seconds, &here,
                      err)) ||
        (rc = dec_u32(&f, "output_stall_seconds", 0, UINT32_MAX, &b->output_stall_seconds,
                      &here, err)))
        return rc;
    return KP_OK;
}

static void encode_limits(kp_writer *w, const kp_limits *l)
{
    enc_key(w, "limits");
    enc_map(w, 12 + l->has_clients);
    enc_kv_u64(w, "max_frame_bytes", l->max_frame_bytes);
    enc_kv_u64(w, "max_inline_bytes", l->max_inline_bytes);
    enc_kv_u64(w, "max_batch_tokens", l->max_batch_tokens);
    enc_kv_u64(w, "max_batch_seqs", l->max_batch_seqs);
    enc_kv_u64(w, "max_seqs_per_request", l->max_seqs_per_request);
    enc_kv_u64(w, "max_slots_per_client", l->max_slots_per_client);
    enc_kv_u64(w, "max_regions_per_client", l->max_regions_per_client);
    enc_kv_u64(w, "max_inflight_requests", l->max_inflight_requests);
    enc_kv_u64(w, "max_inflight_bytes", l->max_inflight_bytes);
    enc_kv_u64(w, "max_layers", l->max_layers);
    enc_kv_u64(w, "max_layers_per_uid", l->max_layers_per_uid);
    enc_kv_u64(w, "max_slots_per_uid", l->max_slots_per_uid);
    if (l->has_clients)
        encode_client_bounds(w, "clients", &l->clients);
}

static int decode_limits(kp_msg *msg, const msgpack_object *o, kp_limits *l, kp_error *err)
{
    dec_fields f;
    int rc = dec_open(&f, msg, o, "limits", limits_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u64(&f, "max_frame_bytes", 0, UINT64_MAX, &l->max_frame_bytes, NULL, err)) ||
        (rc = dec_u64(&f, "max_inline_bytes", 0, UINT64_MAX, &l->max_inline_bytes, NULL, err)) ||
        (rc = dec_u32(&f, "max_batch_tokens", 0, UINT32_MAX, &l->max_batch_tokens, NULL, err)) ||
        (rc = dec_u32(&f, "max_batch_seqs", 0, UINT32_MAX, &l->max_batch_seqs, NULL, err)) ||
        (rc = dec_u32(&f, "max_seqs_per_request", 0, UINT32_MAX, &l->max_seqs_per_request, NULL,
                      err)) ||
        (rc = dec_u32(&f, "max_slots_per_client", 0, UINT32_MAX, &l->max_slots_per_client, NULL,
                      err)) ||
        (rc = dec_u32(&f, "max_regions_per_client", 0, UINT32_MAX, &l->max_regions_per_client,
                      NULL, err)) ||
        (rc = dec_u32(&f, "max_inflight_requests", 0, UINT32_MAX, &l->max_inflight_requests,
                      NULL, err)) ||
        (rc = dec_u64(&f, "max_inflight_bytes", 0, UINT64_MAX, &l->max_inflight_bytes, NULL,
                      err)) ||
        (rc = dec_u32(&f, "max_layers", 0, UINT32_MAX, &l->max_layers, NULL, err)))
        return rc;
    /* Per-uid bounds: optional (daemons before them omit them: 0). */
    bool here;
    l->max_layers_per_uid = l->max_slots_per_uid = 0;
    if ((rc = dec_u32(&f, "max_layers_per_uid", 0, UINT32_MAX, &l->max_layers_per_uid, &here,
                      err)) ||
        (rc = dec_u32(&f, "max_slots_per_uid", 0, UINT32_MAX, &l->max_slots_per_uid, &here,
                      err)))
        return rc;
    const msgpack_object *clients;
    if ((rc = dec_map(&f, "clients", &clients, &l->has_clients, err)) ||
        (l->has_clients &&
         (rc = decode_client_bounds(msg, clients, "limits.clients", &l->clients, err))))
        return rc;
    kp_error why;
    if (kp_limits_check(l, &why))
        return kp_fail(err, KP_E_PROTOCOL, "limits.%s", why.message);
    return KP_OK;
}

static const char *const hello_result_fields[] = {
    "version", "server", "instance", "backend", "gpu", "heads", "head_dim", "slots",
    "state_dtype", "transports", "slots_persist", "features", "limits", "memory", NULL};
static const char *const memory_fields[] = {"pool", "staging", "scratch", "kernel", "lanes",
                                            "layers", "total", NULL};

static void encode_memory(kp_writer *w, const kp_memory *m)
{
    enc_key(w, "memory");
    enc_map(w, 7);
    enc_kv_u64(w, "pool", m->pool);
    enc_kv_u64(w, "staging", m->staging);
    enc_kv_u64(w, "scratch", m->scratch);
    enc_kv_u64(w, "kernel", m->kernel);
    enc_kv_u64(w, "lanes", m->lanes);
    enc_kv_u64(w, "layers", m->layers);
    enc_kv_u64(w, "total", m->total);
}

static int decode_memory(kp_msg *msg, const msgpack_object *o, kp_memory *m, kp_error *err)
{
    dec_fields f;
    int rc = dec_open(&f, msg, o, "memory", memory_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u64(&f, "pool", 0, UINT64_MAX, &m->pool, NULL, err)) ||
        (rc = dec_u64(&f, "staging", 0, UINT64_MAX, &m->staging, NULL, err)) ||
        (rc = dec_u64(&f, "scratch", 0, UINT64_MAX, &m->scratch, NULL, err)) ||
        (rc = dec_u64(&f, "kernel", 0, UINT64_MAX, &m->kernel, NULL, err)) ||
        (rc = dec_u64(&f, "lanes", 0, UINT64_MAX, &m->lanes, NULL, err)) ||
        (rc = dec_u64(&f, "layers", 0, UINT64_MAX, &m->layers, NULL, err)) ||
        (rc = dec_u64(&f, "total", 0, UINT64_MAX, &m->total, NULL, err)))
        return rc;
    return KP_OK;
}
static const char *const gpu_fields[] = {"name", "uuid", "index", "pci_bus_id", "mps", NULL};
static const char *const transport_names[] = {"inline", "shm", "cuda_ipc", NULL};

int kp_hello_result_encode(kp_writer *w, uint32_t id, const kp_hello_result *r, kp_error *err)
{
    int rc;
    if ((rc = enc_need_str(r->server, "server", err)))
        return rc;
    if (r->has_gpu && ((rc = enc_need_str(r->gpu.name, "gpu.name", err)) ||
                       (rc = enc_need_str(r->gpu.uuid, "gpu.uuid", err))))
        return rc;
    enc_result(w, id, 13 + r->has_memory);
    enc_kv_u64(w, "version", r->version);
    enc_kv_str(w, "server", r->server);
    enc_kv_u64(w, "instance", r->instance);
    enc_kv_str(w, "backend", backend_names[r->backend == KP_BACKEND_CUDA]);
    if (r->has_gpu) {
        const bool pci = r->gpu.pci_bus_id && r->gpu.pci_bus_id[0];
        enc_key(w, "gpu");
        enc_map(w, pci ? 5 : 4);
        enc_kv_str(w, "name", r->gpu.name);
        enc_kv_str(w, "uuid", r->gpu.uuid);
        enc_kv_u64(w, "index", r->gpu.index);
        if (pci)
            enc_kv_str(w, "pci_bus_id", r->gpu.pci_bus_id);
        enc_kv_bool(w, "mps", r->gpu.mps);
    } else {
        enc_kv_nil(w, "gpu");
    }
    enc_kv_u64(w, "heads", r->geometry.heads);
    enc_kv_u64(w, "head_dim", KP_HEAD_DIM);
    enc_kv_u64(w, "slots", r->geometry.slots);
    enc_kv_str(w, "state_dtype", kp_dtype_name(r->geometry.state_dtype));
    uint32_t ntransports = 0;
    for (int i = 0; transport_names[i]; i++)
        ntransports += (r->transports >> i) & 1;
    enc_key(w, "transports");
    enc_array(w, ntransports);
    for (int i = 0; transport_names[i]; i++) {
        if ((r->transports >> i) & 1)
            enc_str(w, transport_names[i]);
    }
    enc_kv_bool(w, "slots_persist", r->slots_persist);
    enc_key(w, "features");
    enc_array(w, r->nfeatures);
    for (uint32_t i = 0; i < r->nfeatures; i++)
        enc_str(w, r->features[i]);
    encode_limits(w, &r->limits);
    if (r->has_memory)
        encode_memory(w, &r->memory);
    return enc_finish(w, err);
}

static int decode_gpu(kp_msg *msg, const msgpack_object *o, kp_gpu *gpu, kp_error *err)
{
    dec_fields f;
    bool pci, mps; /* optional: older daemons send three or four fields */
    int rc = dec_open(&f, msg, o, "gpu", gpu_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_str(&f, "name", 0, KP_TEXT_MAX, &gpu->name, NULL, err)) ||
        (rc = dec_str(&f, "uuid", 0, KP_TEXT_MAX, &gpu->uuid, NULL, err)) ||
        (rc = dec_u32(&f, "index", 0, UINT32_MAX, &gpu->index, NULL, err)) ||
        (rc = dec_str(&f, "pci_bus_id", 0, KP_TEXT_MAX, &gpu->pci_bus_id, &pci, err)) ||
        (rc = dec_bool(&f, "mps", &gpu->mps, &mps, err)))
        return rc;
    return KP_OK;
}

/* An array of str; known ones set bits of *mask (unknown ones are ignored:
 * a newer daemon may offer transports this client does not know). */
static int decode_transports(const dec_fields *f, uint32_t *mask, kp_error *err)
{
    const msgpack_object *arr;
    uint32_t n;
    int rc = dec_array(f, "transports", 32, true, &arr, &n, NULL, err);
    if (rc)
        return rc;
    *mask = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (arr[i].type != MSGPACK_OBJECT_STR)
            return kp_fail(err, KP_E_PROTOCOL, "transports[%u]: expected a str", i);
        for (int t = 0; transport_names[t]; t++) {
            if (strlen(transport_names[t]) == arr[i].via.str.size &&
                memcmp(transport_names[t], arr[i].via.str.ptr, arr[i].via.str.size) == 0)
                *mask |= 1u << t;
        }
    }
    return KP_OK;
}

static int decode_features(const dec_fields *f, kp_hello_result *r, kp_error *err)
{
    const msgpack_object *arr;
    uint32_t n;
    int rc = dec_array(f, "features", 64, true, &arr, &n, NULL, err);
    if (rc)
        return rc;
    const char **features = dec_alloc(f->msg, n, sizeof(*features), err);
    if (!features)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        char path[DEC_PATH_MAX];
        snprintf(path, sizeof(path), "features[%u]", i);
        if ((rc = dec_copy_str(f->msg, &arr[i], path, KP_NAME_MAX, KP_E_PROTOCOL, &features[i],
                               err)))
            return rc;
    }
    r->features = features;
    r->nfeatures = n;
    return KP_OK;
}

int kp_hello_result_decode(kp_msg *msg, kp_hello_result *r, kp_error *err)
{
    dec_fields f;
    const msgpack_object *gpu = NULL, *limits, *memory;
    int backend, dtype;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, hello_result_fields, err);
    if (rc || (rc = dec_u32(&f, "version", 1, UINT32_MAX, &r->version, NULL, err)) ||
        (rc = dec_str(&f, "server", 0, KP_TEXT_MAX, &r->server, NULL, err)) ||
        (rc = dec_u64(&f, "instance", 0, UINT64_MAX, &r->instance, NULL, err)) ||
        (rc = dec_enum(&f, "backend", backend_names, &backend, NULL, err)) ||
        (rc = dec_map(&f, "gpu", &gpu, &r->has_gpu, err)) ||
        (rc = dec_u32(&f, "heads", 1, KP_MAX_HEADS, &r->geometry.heads, NULL, err)) ||
        (rc = dec_u32(&f, "head_dim", KP_HEAD_DIM, KP_HEAD_DIM, &r->geometry.head_dim, NULL,
                      err)) ||
        (rc = dec_u32(&f, "slots", 1, UINT32_MAX, &r->geometry.slots, NULL, err)) ||
        (rc = dec_enum(&f, "state_dtype", dtype_names, &dtype, NULL, err)) ||
        (rc = decode_transports(&f, &r->transports, err)) ||
        (rc = dec_bool(&f, "slots_persist", &r->slots_persist, NULL, err)) ||
        (rc = decode_features(&f, r, err)) ||
        (rc = dec_map(&f, "limits", &limits, NULL, err)) ||
        (rc = dec_map(&f, "memory", &memory, &r->has_memory, err)) ||
        (r->has_memory && (rc = decode_memory(msg, memory, &r->memory, err))))
        return rc;
    r->backend = (kp_backend)backend;
    r->geometry.state_dtype = (kp_dtype)dtype;
    if (r->has_gpu && (rc = decode_gpu(msg, gpu, &r->gpu, err)))
        return rc;
    return decode_limits(msg, limits, &r->limits, err);
}

/* ---------------------------------------------------------------------- */
/* Methods without params: health, stats, layer.list                      */
/* ---------------------------------------------------------------------- */

static const char *const no_fields[] = {NULL};

static int encode_no_params(kp_writer *w, uint32_t id, kp_method m, kp_error *err)
{
    enc_request(w, id, m, 0);
    return enc_finish(w, err);
}

static int decode_no_params(kp_msg *msg, kp_error *err)
{
    dec_fields f;
    return dec_params(&f, msg, no_fields, err);
}

int kp_health_params_encode(kp_writer *w, uint32_t id, kp_error *err)
{
    return encode_no_params(w, id, KP_METHOD_HEALTH, err);
}

int kp_health_params_decode(kp_msg *msg, const kp_session *s, kp_error *err)
{
    return decode_no_params(msg, err);
}

static const char *const stats_params_fields[] = {"format", NULL};
static const char *const stats_format_names[] = {"map", "prometheus", NULL};

int kp_stats_params_encode(kp_writer *w, uint32_t id, kp_error *err)
{
    return kp_stats_params_encode2(w, id, 0, err);
}

int kp_stats_params_encode2(kp_writer *w, uint32_t id, uint32_t flags, kp_error *err)
{
    if (flags & ~KP_STATS_PROMETHEUS)
        return kp_fail(err, KP_E_INVALID_PARAMS, "flags: 0x%x has unknown bits", flags);
    if (!(flags & KP_STATS_PROMETHEUS))
        return encode_no_params(w, id, KP_METHOD_STATS, err);
    enc_request(w, id, KP_METHOD_STATS, 1);
    enc_kv_str(w, "format", stats_format_names[1]);
    return enc_finish(w, err);
}

int kp_stats_params_decode(kp_msg *msg, const kp_session *s, kp_error *err)
{
    uint32_t flags;
    return kp_stats_params_decode2(msg, s, &flags, err);
}

int kp_stats_params_decode2(kp_msg *msg, const kp_session *s, uint32_t *flags, kp_error *err)
{
    dec_fields f;
    int format = 0;
    bool has_format;
    int rc = dec_params(&f, msg, stats_params_fields, err);
    if (rc || (rc = dec_enum(&f, "format", stats_format_names, &format, &has_format, err)))
        return rc;
    *flags = format == 1 ? KP_STATS_PROMETHEUS : 0;
    return KP_OK;
}

int kp_layer_list_params_encode(kp_writer *w, uint32_t id, kp_error *err)
{
    return encode_no_params(w, id, KP_METHOD_LAYER_LIST, err);
}

int kp_layer_list_params_decode(kp_msg *msg, const kp_session *s, kp_error *err)
{
    return decode_no_params(msg, err);
}

/* ---------------------------------------------------------------------- */
/* health result                                                          */
/* ---------------------------------------------------------------------- */

static const char *const health_status_names[] = {"ok", "draining", NULL};
static const char *const health_result_fields[] = {"status", "uptime_us", "queued", "running",
                                                   NULL};

int kp_health_result_encode(kp_writer *w, uint32_t id, const kp_health_result *r, kp_error *err)
{
    enc_result(w, id, 4);
    enc_kv_str(w, "status", health_status_names[r->status == KP_HEALTH_DRAINING]);
    enc_kv_u64(w, "uptime_us", r->uptime_us);
    enc_kv_u64(w, "queued", r->queued);
    enc_kv_u64(w, "running", r->running);
    return enc_finish(w, err);
}

int kp_health_result_decode(kp_msg *msg, kp_health_result *r, kp_error *err)
{
    dec_fields f;
    int status;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, health_result_fields, err);
    if (rc || (rc = dec_enum(&f, "status", health_status_names, &status, NULL, err)) ||
        (rc = dec_u64(&f, "uptime_us", 0, UINT64_MAX, &r->uptime_us, NULL, err)) ||
        (rc = dec_u32(&f, "queued", 0, UINT32_MAX, &r->queued, NULL, err)) ||
        (rc = dec_u32(&f, "running", 0, UINT32_MAX, &r->running, NULL, err)))
        return rc;
    r->status = (kp_health_status)status;
    return KP_OK;
}

/* ---------------------------------------------------------------------- */
/* stats result                                                           */
/* ---------------------------------------------------------------------- */

static const char *const stats_fields[] = {
    "uptime_us", "connections", "connections_total", "requests", "batches", "batches_held",
    "batches_gathered", "seqs", "tokens", "latency_us", "pool", "layers", "regions", "rings",
    "ring_doorbells", "errors", "disconnects", "transport_bytes", "prometheus", "batch_us", "uid",
    "clients", "memory", NULL};
static const char *const uid_fields[] = {"uid", "layers", "slots", "connections", "held", NULL};
static const char *const held_fields[] = {"inflight_bytes", "partial_bytes", "output_bytes",
                                          "region_bytes", NULL};
static const char *const clients_fields[] = {"held", "peak", "stalled", "refused", "bounds",
                                             NULL};
static const char *const batch_fields[] = {"count", "window", "phases", NULL};
static const char *const phase_fields[] = {"p50", "p90", "p99", "sum", NULL};
static const char *const latency_fields[] = {"count", "p50", "p90", "p99", "max", "bounds",
                                             "counts", NULL};
static const char *const pool_fields[] = {"slots", "used", "lost", NULL};
static const char *const in_out_fields[] = {"in", "out", NULL};

static void encode_counters(kp_writer *w, const char *key, const kp_counter *c, uint32_t n)
{
    enc_str(w, key);
    enc_map(w, n);
    for (uint32_t i = 0; i < n; i++) {
        enc_str(w, c[i].name);
        enc_u64(w, c[i].value);
    }
}

static void encode_u64_array(kp_writer *w, const char *key, const uint64_t *v, uint32_t n)
{
    enc_str(w, key);
    enc_array(w, n);
    for (uint32_t i = 0; i < n; i++)
        enc_u64(w, v[i]);
}

static void encode_held(kp_writer *w, const char *key, const kp_held *h)
{
    enc_str(w, key);
    enc_map(w, 4);
    enc_kv_u64(w, "inflight_bytes", h->inflight_bytes);
    enc_kv_u64(w, "partial_bytes", h->partial_bytes);
    enc_kv_u64(w, "output_bytes", h->output_bytes);
    enc_kv_u64(w, "region_bytes", h->region_bytes);
}

static int decode_held(kp_msg *msg, const msgpack_object *o, const char *path, kp_held *h,
                       kp_error *err)
{
    dec_fields f;
    int rc = dec_open(&f, msg, o, path, held_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u64(&f, "inflight_bytes", 0, UINT64_MAX, &h->inflight_bytes, NULL, err)) ||
        (rc = dec_u64(&f, "partial_bytes", 0, UINT64_MAX, &h->partial_bytes, NULL, err)) ||
        (rc = dec_u64(&f, "output_bytes", 0, UINT64_MAX, &h->output_bytes, NULL, err)) ||
        (rc = dec_u64(&f, "region_bytes", 0, UINT64_MAX, &h->region_bytes, NULL, err)))
        return rc;
    return KP_OK;
}

int kp_stats_result_encode(kp_writer *w, uint32_t id, const kp_stats_result *r, kp_error *err)
{
    if (r->latency_nbounds > KP_HIST_MAX_BUCKETS)
        return kp_fail(err, KP_E_INVALID_PARAMS, "latency_us.bounds: %u bounds, at most %d",
                       r->latency_nbounds, KP_HIST_MAX_BUCKETS);
    for (uint32_t i = 0; i < r->nerrors; i++) {
        int rc = enc_need_str(r->errors[i].name, "errors[].name", err);
        if (rc)
            return rc;
    }
    for (uint32_t i = 0; i < r->ndisconnects; i++) {
        int rc = enc_need_str(r->disconnects[i].name, "disconnects[].name", err);
        if (rc)
            return rc;
    }
    if (r->has_batch_phases && r->nphases > KP_STATS_MAX_PHASES)
        return kp_fail(err, KP_E_INVALID_PARAMS, "batch_us.phases: %u phases, at most %d",
                       r->nphases, KP_STATS_MAX_PHASES);
    for (uint32_t i = 0; r->has_batch_phases && i < r->nphases; i++) {
        int rc = enc_need_str(r->phases[i].name, "batch_us.phases[].name", err);
        if (rc)
            return rc;
    }
    enc_result(w, id,
               18 + (r->prometheus != NULL) + r->has_batch_phases + r->has_uid + r->has_clients +
                   r->has_memory);
    enc_kv_u64(w, "uptime_us", r->uptime_us);
    enc_kv_u64(w, "connections", r->connections);
    enc_kv_u64(w, "connections_total", r->connections_total);
    enc_kv_u64(w, "requests", r->requests);
    enc_kv_u64(w, "batches", r->batches);
    enc_kv_u64(w, "batches_held", r->batches_held);
    enc_kv_u64(w, "batches_gathered", r->batches_gathered);
    enc_kv_u64(w, "seqs", r->seqs);
    enc_kv_u64(w, "tokens", r->tokens);

    enc_key(w, "latency_us");
    enc_map(w, 7);
    enc_kv_u64(w, "count", r->latency_count);
    enc_kv_u64(w, "p50", r->latency_p50_us);
    enc_kv_u64(w, "p90", r->latency_p90_us);
    enc_kv_u64(w, "p99", r->latency_p99_us);
    enc_kv_u64(w, "max", r->latency_max_us);
    encode_u64_array(w, "bounds", r->latency_bounds_us, r->latency_nbounds);
    encode_u64_array(w, "counts", r->latency_counts, r->latency_nbounds + 1);

    enc_key(w, "pool");
    enc_map(w, 3);
    enc_kv_u64(w, "slots", r->slots_total);
    enc_kv_u64(w, "used", r->slots_used);
    enc_kv_u64(w, "lost", r->slots_lost);

    enc_kv_u64(w, "layers", r->layers);
    if (r->has_uid) {
        enc_key(w, "uid");
        enc_map(w, 3 + 2 * r->has_uid_held);
        enc_kv_u64(w, "uid", r->uid);
        enc_kv_u64(w, "layers", r->uid_layers);
        enc_kv_u64(w, "slots", r->uid_slots);
        if (r->has_uid_held) {
            enc_kv_u64(w, "connections", r->uid_connections);
            encode_held(w, "held", &r->uid_held);
        }
    }
    if (r->has_clients) {
        enc_key(w, "clients");
        enc_map(w, 5);
        encode_held(w, "held", &r->held);
        encode_held(w, "peak", &r->held_peak);
        enc_kv_u64(w, "stalled", r->stalled);
        enc_kv_u64(w, "refused", r->refused);
        encode_client_bounds(w, "bounds", &r->bounds);
    }
    enc_kv_u64(w, "regions", r->regions);
    enc_kv_u64(w, "rings", r->rings);
    enc_kv_u64(w, "ring_doorbells", r->ring_doorbells);
    encode_counters(w, "errors", r->errors, r->nerrors);
    encode_counters(w, "disconnects", r->disconnects, r->ndisconnects);

    enc_key(w, "transport_bytes");
    enc_map(w, KP_TRANSPORT_ID_COUNT);
    for (int t = 0; t < KP_TRANSPORT_ID_COUNT; t++) {
        enc_str(w, transport_names[t]);
        enc_map(w, 2);
        enc_kv_u64(w, "in", r->bytes_in[t]);
        enc_kv_u64(w, "out", r->bytes_out[t]);
    }
    if (r->prometheus)
        enc_kv_str(w, "prometheus", r->prometheus);
    if (r->has_batch_phases) {
        enc_key(w, "batch_us");
        enc_map(w, 3);
        enc_kv_u64(w, "count", r->batch_count);
        enc_kv_u64(w, "window", r->batch_window);
        enc_key(w, "phases");
        enc_map(w, r->nphases);
        for (uint32_t i = 0; i < r->nphases; i++) {
            const kp_phase *p = &r->phases[i];
            enc_str(w, p->name);
            enc_map(w, 4);
            enc_kv_u64(w, "p50", p->p50_us);
            enc_kv_u64(w, "p90", p->p90_us);
            enc_kv_u64(w, "p99", p->p99_us);
            enc_kv_u64(w, "sum", p->sum_us);
        }
    }
    if (r->has_memory)
        encode_memory(w, &r->memory);
    return enc_finish(w, err);
}

/* An array of exactly n u64 (n from the bounds), copied into the zone. */
static int decode_u64_array(const dec_fields *f, const char *name, uint32_t min_n,
                            uint32_t max_n, const uint64_t **out, uint32_t *n, kp_error *err)
{
    const msgpack_object *arr;
    int rc = dec_array(f, name, max_n, min_n == 0, &arr, n, NULL, err);
    if (rc)
        return rc;
    if (*n < min_n)
        return kp_fail(err, KP_E_PROTOCOL, "latency_us.%s: %u entries, expected %u", name, *n,
                       min_n);
    uint64_t *v = dec_alloc(f->msg, *n, sizeof(*v), err);
    if (!v)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < *n; i++) {
        if (arr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return kp_fail(err, KP_E_PROTOCOL, "latency_us.%s[%u]: expected an unsigned "
                           "integer", name, i);
        v[i] = arr[i].via.u64;
    }
    *out = v;
    return KP_OK;
}

static int decode_latency(kp_msg *msg, const msgpack_object *o, kp_stats_result *r,
                          kp_error *err)
{
    dec_fields f;
    uint32_t ncounts;
    int rc = dec_open(&f, msg, o, "latency_us", latency_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u64(&f, "count", 0, UINT64_MAX, &r->latency_count, NULL, err)) ||
        (rc = dec_u64(&f, "p50", 0, UINT64_MAX, &r->latency_p50_us, NULL, err)) ||
        (rc = dec_u64(&f, "p90", 0, UINT64_MAX, &r->latency_p90_us, NULL, err)) ||
        (rc = dec_u64(&f, "p99", 0, UINT64_MAX, &r->latency_p99_us, NULL, err)) ||
        (rc = dec_u64(&f, "max", 0, UINT64_MAX, &r->latency_max_us, NULL, err)) ||
        (rc = decode_u64_array(&f, "bounds", 0, KP_HIST_MAX_BUCKETS, &r->latency_bounds_us,
                               &r->latency_nbounds, err)))
        return rc;
    for (uint32_t i = 1; i < r->latency_nbounds; i++) {
        if (r->latency_bounds_us[i] <= r->latency_bounds_us[i - 1])
            return kp_fail(err, KP_E_PROTOCOL, "latency_us.bounds: not strictly increasing "
                           "at [%u]", i);
    }
    rc = decode_u64_array(&f, "counts", r->latency_nbounds + 1, r->latency_nbounds + 1,
                          &r->latency_counts, &ncounts, err);
    return rc;
}

static int decode_pool(kp_msg *msg, const msgpack_object *o, kp_stats_result *r, kp_error *err)
{
    dec_fields f;
    int rc = dec_open(&f, msg, o, "pool", pool_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u32(&f, "slots", 0, UINT32_MAX, &r->slots_total, NULL, err)) ||
        (rc = dec_u32(&f, "used", 0, UINT32_MAX, &r->slots_used, NULL, err)) ||
        (rc = dec_u32(&f, "lost", 0, UINT32_MAX, &r->slots_lost, NULL, err)))
        return rc;
    return KP_OK;
}

/* A map of name -> u64 into a zone array of kp_counter. */
static int decode_counters(kp_msg *msg, const msgpack_object *o, const char *what,
                           const kp_counter **out, uint32_t *n, kp_error *err)
{
    uint32_t size = o->via.map.size;
    kp_counter *c = dec_alloc(msg, size, sizeof(*c), err);
    if (!c)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < size; i++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[i];
        int rc = dec_copy_str(msg, &kv->key, what, KP_NAME_MAX, KP_E_PROTOCOL, &c[i].name, err);
        if (rc)
            return rc;
        if (kv->val.type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return kp_fail(err, KP_E_PROTOCOL, "%s.%s: expected an unsigned integer", what,
                           c[i].name);
        c[i].value = kv->val.via.u64;
    }
    *out = c;
    *n = size;
    return KP_OK;
}

static int decode_transport_bytes(kp_msg *msg, const msgpack_object *o, kp_stats_result *r,
                                  kp_error *err)
{
    dec_fields f;
    int rc = dec_open(&f, msg, o, "transport_bytes", transport_names, DEC_LENIENT,
                      KP_E_PROTOCOL, err);
    if (rc)
        return rc;
    for (int t = 0; t < KP_TRANSPORT_ID_COUNT; t++) {
        const msgpack_object *io;
        dec_fields iof;
        char path[DEC_PATH_MAX];
        snprintf(path, sizeof(path), "transport_bytes.%s", transport_names[t]);
        if ((rc = dec_map(&f, transport_names[t], &io, NULL, err)) ||
            (rc = dec_open(&iof, msg, io, path, in_out_fields, DEC_LENIENT, KP_E_PROTOCOL,
                           err)) ||
            (rc = dec_u64(&iof, "in", 0, UINT64_MAX, &r->bytes_in[t], NULL, err)) ||
            (rc = dec_u64(&iof, "out", 0, UINT64_MAX, &r->bytes_out[t], NULL, err)))
            return rc;
    }
    return KP_OK;
}

static int decode_uid(kp_msg *msg, const msgpack_object *o, kp_stats_result *r, kp_error *err)
{
    dec_fields f;
    const msgpack_object *held;
    bool has_held, present;
    int rc = dec_open(&f, msg, o, "uid", uid_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u32(&f, "uid", 0, UINT32_MAX, &r->uid, NULL, err)) ||
        (rc = dec_u32(&f, "layers", 0, UINT32_MAX, &r->uid_layers, NULL, err)) ||
        (rc = dec_u32(&f, "slots", 0, UINT32_MAX, &r->uid_slots, NULL, err)) ||
        /* connections and held: optional, together (daemons before them send neither) */
        (rc = dec_u32(&f, "connections", 0, UINT32_MAX, &r->uid_connections, &present, err)) ||
        (rc = dec_map(&f, "held", &held, &has_held, err)) ||
        (has_held && (rc = decode_held(msg, held, "uid.held", &r->uid_held, err))))
        return rc;
    r->has_uid = true;
    r->has_uid_held = has_held;
    return KP_OK;
}

static int decode_clients(kp_msg *msg, const msgpack_object *o, kp_stats_result *r,
                          kp_error *err)
{
    dec_fields f;
    const msgpack_object *held, *peak, *bounds;
    int rc = dec_open(&f, msg, o, "clients", clients_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_map(&f, "held", &held, NULL, err)) ||
        (rc = dec_map(&f, "peak", &peak, NULL, err)) ||
        (rc = dec_map(&f, "bounds", &bounds, NULL, err)) ||
        (rc = dec_u64(&f, "stalled", 0, UINT64_MAX, &r->stalled, NULL, err)) ||
        (rc = dec_u64(&f, "refused", 0, UINT64_MAX, &r->refused, NULL, err)) ||
        (rc = decode_held(msg, held, "clients.held", &r->held, err)) ||
        (rc = decode_held(msg, peak, "clients.peak", &r->held_peak, err)) ||
        (rc = decode_client_bounds(msg, bounds, "clients.bounds", &r->bounds, err)))
        return rc;
    r->has_clients = true;
    return KP_OK;
}

static int decode_batch(kp_msg *msg, const msgpack_object *o, kp_stats_result *r,
                        kp_error *err)
{
    dec_fields f;
    const msgpack_object *phases;
    int rc = dec_open(&f, msg, o, "batch_us", batch_fields, DEC_LENIENT, KP_E_PROTOCOL, err);
    if (rc || (rc = dec_u64(&f, "count", 0, UINT64_MAX, &r->batch_count, NULL, err)) ||
        (rc = dec_u32(&f, "window", 0, UINT32_MAX, &r->batch_window, NULL, err)) ||
        (rc = dec_map(&f, "phases", &phases, NULL, err)))
        return rc;
    uint32_t n = phases->via.map.size;
    if (n > KP_STATS_MAX_PHASES)
        return kp_fail(err, KP_E_PROTOCOL, "batch_us.phases: %u phases, at most %d", n,
                       KP_STATS_MAX_PHASES);
    kp_phase *p = dec_alloc(msg, n ? n : 1, sizeof(*p), err);
    if (!p)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object_kv *kv = &phases->via.map.ptr[i];
        char path[DEC_PATH_MAX];
        dec_fields pf;
        if ((rc = dec_copy_str(msg, &kv->key, "batch_us.phases", KP_NAME_MAX, KP_E_PROTOCOL,
                               &p[i].name, err)))
            return rc;
        snprintf(path, sizeof(path), "batch_us.phases.%s", p[i].name);
        if ((rc = dec_open(&pf, msg, &kv->val, path, phase_fields, DEC_LENIENT, KP_E_PROTOCOL,
                           err)) ||
            (rc = dec_u64(&pf, "p50", 0, UINT64_MAX, &p[i].p50_us, NULL, err)) ||
            (rc = dec_u64(&pf, "p90", 0, UINT64_MAX, &p[i].p90_us, NULL, err)) ||
            (rc = dec_u64(&pf, "p99", 0, UINT64_MAX, &p[i].p99_us, NULL, err)) ||
            (rc = dec_u64(&pf, "sum", 0, UINT64_MAX, &p[i].sum_us, NULL, err)))
            return rc;
    }
    r->phases = p;
    r->nphases = n;
    r->has_batch_phases = true;
    return KP_OK;
}

int kp_stats_result_decode(kp_msg *msg, kp_stats_result *r, kp_error *err)
{
    dec_fields f;
    const msgpack_object *latency, *pool, *errors, *disconnects, *bytes, *batch, *uid, *clients,
        *memory;
    bool has_prometheus, has_batch, has_uid, has_clients, present;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, stats_fields, err);
    if (rc || (rc = dec_u64(&f, "uptime_us", 0, UINT64_MAX, &r->uptime_us, NULL, err)) ||
        (rc = dec_u32(&f, "connections", 0, UINT32_MAX, &r->connections, NULL, err)) ||
        (rc = dec_u64(&f, "connections_total", 0, UINT64_MAX, &r->connections_total, NULL,
                      err)) ||
        (rc = dec_u64(&f, "requests", 0, UINT64_MAX, &r->requests, NULL, err)) ||
        (rc = dec_u64(&f, "batches", 0, UINT64_MAX, &r->batches, NULL, err)) ||
        (rc = dec_u64(&f, "batches_held", 0, UINT64_MAX, &r->batches_held, &present, err)) ||
        (rc = dec_u64(&f, "batches_gathered", 0, UINT64_MAX, &r->batches_gathered, &present,
                      err)) ||
        (rc = dec_u64(&f, "seqs", 0, UINT64_MAX, &r->seqs, NULL, err)) ||
        (rc = dec_u64(&f, "tokens", 0, UINT64_MAX, &r->tokens, NULL, err)) ||
        (rc = dec_u32(&f, "layers", 0, UINT32_MAX, &r->layers, NULL, err)) ||
        (rc = dec_u32(&f, "regions", 0, UINT32_MAX, &r->regions, NULL, err)) ||
        (rc = dec_u32(&f, "rings", 0, UINT32_MAX, &r->rings, &present, err)) ||
        (rc = dec_u64(&f, "ring_doorbells", 0, UINT64_MAX, &r->ring_doorbells, &present,
                      err)) ||
        (rc = dec_map(&f, "latency_us", &latency, NULL, err)) ||
        (rc = dec_map(&f, "pool", &pool, NULL, err)) ||
        (rc = dec_map(&f, "errors", &errors, NULL, err)) ||
        (rc = dec_map(&f, "disconnects", &disconnects, NULL, err)) ||
        (rc = dec_map(&f, "transport_bytes", &bytes, NULL, err)) ||
        (rc = decode_latency(msg, latency, r, err)) || (rc = decode_pool(msg, pool, r, err)) ||
        (rc = decode_counters(msg, errors, "errors", &r->errors, &r->nerrors, err)) ||
        (rc = decode_counters(msg, disconnects, "disconnects", &r->disconnects,
                              &r->ndisconnects, err)) ||
        (rc = dec_str(&f, "prometheus", 0, UINT32_MAX, &r->prometheus, &has_prometheus, err)) ||
        (rc = dec_map(&f, "batch_us", &batch, &has_batch, err)) ||
        (has_batch && (rc = decode_batch(msg, batch, r, err))) ||
        (rc = dec_map(&f, "uid", &uid, &has_uid, err)) ||
        (has_uid && (rc = decode_uid(msg, uid, r, err))) ||
        (rc = dec_map(&f, "clients", &clients, &has_clients, err)) ||
        (has_clients && (rc = decode_clients(msg, clients, r, err))) ||
        (rc = dec_map(&f, "memory", &memory, &r->has_memory, err)) ||
        (r->has_memory && (rc = decode_memory(msg, memory, &r->memory, err))))
        return rc;
    return decode_transport_bytes(msg, bytes, r, err);
}

/* ---------------------------------------------------------------------- */
/* layer.register, layer.list, layer.drop                                 */
/* ---------------------------------------------------------------------- */

static const char *const layer_register_fields[] = {"name", "A_log", "dt_bias", "lower_bound",
                                                    "scale", NULL};
static const char *const layer_name_fields[] = {"name", NULL};

/* Layer names appear in logs, metrics and config files: keep them plain. */
static int check_layer_name(const char *name, kp_error *err)
{
    for (const char *c = name; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              strchr("._:/-", *c)))
            return kp_fail(err, KP_E_INVALID_PARAMS, "name: byte 0x%02x is not allowed; use "
                           "[A-Za-z0-9._:/-]", (unsigned char)*c);
    }
    return KP_OK;
}

/* Every f32 of an inline weight must be finite: a NaN weight would poison
 * every state that ever passes through the layer. */
static int check_finite_f32(const kp_ref *ref, const char *field, kp_error *err)
{
    const uint8_t *bytes = ref->data;
    for (uint64_t i = 0; i < ref->nbytes / 4; i++) {
        float v;
        memcpy(&v, bytes + 4 * i, sizeof(v)); /* unaligned inside the frame */
        if (!__builtin_isfinite(v))
            return kp_fail(err, KP_E_INVALID_PARAMS, "%s[%llu]: %g is not finite", field,
                           (unsigned long long)i, (double)v);
    }
    return KP_OK;
}

int kp_layer_register_params_encode(kp_writer *w, uint32_t id, const kp_layer_register_params *p,
                                    kp_error *err)
{
    int rc = enc_need_str(p->name, "name", err);
    if (rc)
        return rc;
    if (p->A_log.kind != KP_REF_INLINE || p->dt_bias.kind != KP_REF_INLINE)
        return kp_fail(err, KP_E_INVALID_PARAMS, "A_log, dt_bias: layer weights travel inline");
    enc_request(w, id, KP_METHOD_LAYER_REGISTER, 5);
    enc_kv_str(w, "name", p->name);
    enc_kv_ref(w, "A_log", &p->A_log);
    enc_kv_ref(w, "dt_bias", &p->dt_bias);
    enc_kv_float(w, "lower_bound", p->lower_bound);
    enc_kv_float(w, "scale", p->scale);
    return enc_finish(w, err);
}

int kp_layer_register_params_decode(kp_msg *msg, const kp_session *s, kp_layer_register_params *p,
                                    kp_error *err)
{
    dec_fields f;
    uint32_t heads = s->geometry.heads;
    memset(p, 0, sizeof(*p));
    p->scale = KP_DEFAULT_SCALE;
    bool has_scale;
    int rc = dec_params(&f, msg, layer_register_fields, err);
    if (rc || (rc = dec_str(&f, "name", 1, KP_NAME_MAX, &p->name, NULL, err)) ||
        (rc = check_layer_name(p->name, err)) ||
        (rc = dec_ref(&f, "A_log", (uint64_t)heads * 4, true, false, &p->A_log, NULL, err,
                      "%u heads x 4 bytes f32", heads)) ||
        (rc = dec_ref(&f, "dt_bias", (uint64_t)heads * KP_HEAD_DIM * 4, true, false,
                      &p->dt_bias, NULL, err, "%u heads x %d x 4 bytes f32", heads,
                      KP_HEAD_DIM)) ||
        (rc = check_finite_f32(&p->A_log, "A_log", err)) ||
        (rc = check_finite_f32(&p->dt_bias, "dt_bias", err)) ||
        (rc = dec_float(&f, "lower_bound", &p->lower_bound, NULL, err)) ||
        (rc = dec_float(&f, "scale", &p->scale, &has_scale, err)))
        return rc;
    if (!(p->lower_bound >= -5.0f && p->lower_bound < 0.0f))
        return kp_fail(err, KP_E_INVALID_PARAMS, "lower_bound: %g is outside [-5, 0)",
                       (double)p->lower_bound);
    return KP_OK;
}

int kp_layer_register_result_encode(kp_writer *w, uint32_t id, const kp_layer_register_result *r,
                                    kp_error *err)
{
    enc_result(w, id, 1);
    enc_kv_bool(w, "created", r->created);
    return enc_finish(w, err);
}

int kp_layer_register_result_decode(kp_msg *msg, kp_layer_register_result *r, kp_error *err)
{
    static const char *const names[] = {"created", NULL};
    dec_fields f;
    int rc = dec_result(&f, msg, names, err);
    if (rc)
        return rc;
    return dec_bool(&f, "created", &r->created, NULL, err);
}

static const char *const layer_info_fields[] = {"name", "lower_bound", "scale", "source", NULL};
static const char *const layer_source_names[] = {"config", "client", NULL};

int kp_layer_list_result_encode(kp_writer *w, uint32_t id, const kp_layer_list_result *r,
                                kp_error *err)
{
    for (uint32_t i = 0; i < r->nlayers; i++) {
        int rc = enc_need_str(r->layers[i].name, "layers[].name", err);
        if (rc)
            return rc;
    }
    enc_result(w, id, 1);
    enc_key(w, "layers");
    enc_array(w, r->nlayers);
    for (uint32_t i = 0; i < r->nlayers; i++) {
        const kp_layer_info *l = &r->layers[i];
        enc_map(w, 4);
        enc_kv_str(w, "name", l->name);
        enc_kv_float(w, "lower_bound", l->lower_bound);
        enc_kv_float(w, "scale", l->scale);
        enc_kv_str(w, "source", layer_source_names[l->source == KP_LAYER_SOURCE_CLIENT]);
    }
    return enc_finish(w, err);
}

int kp_layer_list_result_decode(kp_msg *msg, kp_layer_list_result *r, kp_error *err)
{
    static const char *const names[] = {"layers", NULL};
    dec_fields f;
    const msgpack_object *arr;
    uint32_t n;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, names, err);
    if (rc || (rc = dec_array(&f, "layers", UINT32_MAX, true, &arr, &n, NULL, err)))
        return rc;
    kp_layer_info *layers = dec_alloc(msg, n, sizeof(*layers), err);
    if (!layers)
        return err ? err->code : KP_E_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        char path[DEC_PATH_MAX];
        dec_fields lf;
        int source;
        snprintf(path, sizeof(path), "layers[%u]", i);
        if ((rc = dec_open(&lf, msg, &arr[i], path, layer_info_fields, DEC_LENIENT,
                           KP_E_PROTOCOL, err)) ||
            (rc = dec_str(&lf, "name", 1, KP_NAME_MAX, &layers[i].name, NULL, err)) ||
            (rc = dec_float(&lf, "lower_bound", &layers[i].lower_bound, NULL, err)) ||
            (rc = dec_float(&lf, "scale", &layers[i].scale, NULL, err)) ||
            (rc = dec_enum(&lf, "source", layer_source_names, &source, NULL, err)))
            return rc;
        layers[i].source = (kp_layer_source)source;
    }
    r->layers = layers;
    r->nlayers = n;
    return KP_OK;
}

int kp_layer_drop_params_encode(kp_writer *w, uint32_t id, const kp_layer_drop_params *p,
                                kp_error *err)
{
    int rc = enc_need_str(p->name, "name", err);
    if (rc)
        return rc;
    enc_request(w, id, KP_METHOD_LAYER_DROP, 1);
    enc_kv_str(w, "name", p->name);
    return enc_finish(w, err);
}

int kp_layer_drop_params_decode(kp_msg *msg, const kp_session *s, kp_layer_drop_params *p,
                                kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, layer_name_fields, err);
    if (rc || (rc = dec_str(&f, "name", 1, KP_NAME_MAX, &p->name, NULL, err)))
        return rc;
    return check_layer_name(p->name, err);
}

int kp_layer_drop_result_encode(kp_writer *w, uint32_t id, const kp_layer_drop_result *r,
                                kp_error *err)
{
    enc_result(w, id, 3);
    enc_kv_bool(w, "removed", r->removed);
    enc_kv_u64(w, "registrations", r->registrations);
    enc_kv_u64(w, "in_use", r->in_use);
    return enc_finish(w, err);
}

int kp_layer_drop_result_decode(kp_msg *msg, kp_layer_drop_result *r, kp_error *err)
{
    static const char *const names[] = {"removed", "registrations", "in_use", NULL};
    dec_fields f;
    memset(r, 0, sizeof(*r));
    int rc = dec_result(&f, msg, names, err);
    if (rc || (rc = dec_bool(&f, "removed", &r->removed, &r->known, err)) || !r->known)
        return rc;
    if ((rc = dec_u64(&f, "registrations", 0, UINT64_MAX, &r->registrations, NULL, err)))
        return rc;
    return dec_u32(&f, "in_use", 0, UINT32_MAX, &r->in_use, NULL, err);
}

/* ---------------------------------------------------------------------- */
/* region.register_shm, region.register_cuda, region.release              */
/* ---------------------------------------------------------------------- */

static const char *const shm_fields[] = {"size", NULL};
static const char *const cuda_fields[] = {"size", "device", "handle_type", "handle", NULL};
static const char *const handle_type_names[] = {"ipc", "posix_fd", NULL};
static const char *const region_fields[] = {"region", NULL};

int kp_region_register_shm_params_encode(kp_writer *w, uint32_t id,
                                         const kp_region_register_shm_params *p, kp_error *err)
{
    enc_request(w, id, KP_METHOD_REGION_REGISTER_SHM, 1);
    enc_kv_u64(w, "size", p->size);
    return enc_finish(w, err);
}

int kp_region_register_shm_params_decode(kp_msg *msg, const kp_session *s,
                                         kp_region_register_shm_params *p, kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, shm_fields, err);
    if (rc)
        return rc;
    return dec_u64(&f, "size", 1, UINT64_MAX, &p->size, NULL, err);
}

int kp_region_register_cuda_params_encode(kp_writer *w, uint32_t id,
                                          const kp_region_register_cuda_params *p, kp_error *err)
{
    bool ipc = p->handle_type == KP_CUDA_HANDLE_IPC;
    int rc = enc_need_str(p->device, "device", err);
    if (rc)
        return rc;
    if (ipc != (p->handle != NULL))
        return kp_fail(err, KP_E_INVALID_PARAMS, "handle: required with handle_type \"ipc\", "
                       "absent with \"posix_fd\"");
    enc_request(w, id, KP_METHOD_REGION_REGISTER_CUDA, ipc ? 4 : 3);
    enc_kv_u64(w, "size", p->size);
    enc_kv_str(w, "device", p->device);
    enc_kv_str(w, "handle_type", handle_type_names[p->handle_type == KP_CUDA_HANDLE_POSIX_FD]);
    if (ipc) {
        enc_key(w, "handle");
        enc_bin(w, p->handle, KP_CUDA_IPC_HANDLE_BYTES);
    }
    return enc_finish(w, err);
}

int kp_region_register_cuda_params_decode(kp_msg *msg, const kp_session *s,
                                          kp_region_register_cuda_params *p, kp_error *err)
{
    dec_fields f;
    int type = KP_CUDA_HANDLE_IPC;
    bool has_type, has_handle;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, cuda_fields, err);
    if (rc || (rc = dec_u64(&f, "size", 1, UINT64_MAX, &p->size, NULL, err)) ||
        (rc = dec_str(&f, "device", 1, KP_TEXT_MAX, &p->device, NULL, err)) ||
        (rc = dec_enum(&f, "handle_type", handle_type_names, &type, &has_type, err)) ||
        (rc = dec_bin(&f, "handle", KP_CUDA_IPC_HANDLE_BYTES, &p->handle, &has_handle, err,
                      "sizeof(cudaIpcMemHandle_t)")))
        return rc;
    p->handle_type = (kp_cuda_handle_type)type;
    if (p->handle_type == KP_CUDA_HANDLE_IPC && !has_handle)
        return kp_fail(err, KP_E_INVALID_PARAMS, "handle: required with handle_type \"ipc\"");
    if (p->handle_type == KP_CUDA_HANDLE_POSIX_FD && has_handle)
        return kp_fail(err, KP_E_INVALID_PARAMS, "handle: not used with handle_type "
                       "\"posix_fd\" (the fd rides with the frame)");
    if (!has_handle)
        p->handle = NULL;
    return KP_OK;
}

int kp_region_register_result_encode(kp_writer *w, uint32_t id,
                                     const kp_region_register_result *r, kp_error *err)
{
    enc_result(w, id, 1);
    enc_kv_u64(w, "region", r->region);
    return enc_finish(w, err);
}

int kp_region_register_result_decode(kp_msg *msg, kp_region_register_result *r, kp_error *err)
{
    dec_fields f;
    int rc = dec_result(&f, msg, region_fields, err);
    if (rc)
        return rc;
    return dec_u32(&f, "region", 1, UINT32_MAX, &r->region, NULL, err);
}

int kp_region_release_params_encode(kp_writer *w, uint32_t id, const kp_region_release_params *p,
                                    kp_error *err)
{
    enc_request(w, id, KP_METHOD_REGION_RELEASE, 1);
    enc_kv_u64(w, "region", p->region);
    return enc_finish(w, err);
}

int kp_region_release_params_decode(kp_msg *msg, const kp_session *s,
                                    kp_region_release_params *p, kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, region_fields, err);
    if (rc)
        return rc;
    return dec_u32(&f, "region", 1, UINT32_MAX, &p->region, NULL, err);
}

/* ---------------------------------------------------------------------- */
/* ring.attach                                                            */
/* ---------------------------------------------------------------------- */

static const char *const ring_fields[] = {"region", "size", NULL};

int kp_ring_attach_params_encode(kp_writer *w, uint32_t id, const kp_ring_attach_params *p,
                                 kp_error *err)
{
    enc_request(w, id, KP_METHOD_RING_ATTACH, 2);
    enc_kv_u64(w, "region", p->region);
    enc_kv_u64(w, "size", p->size);
    return enc_finish(w, err);
}

int kp_ring_attach_params_decode(kp_msg *msg, const kp_session *s, kp_ring_attach_params *p,
                                 kp_error *err)
{
    dec_fields f;
    memset(p, 0, sizeof(*p));
    int rc = dec_params(&f, msg, ring_fields, err);
    if (rc || (rc = dec_u32(&f, "region", 1, UINT32_MAX, &p->region, NULL, err)) ||
        (rc = dec_u64(&f, "size", KP_RING_MIN_SIZE, KP_RING_MAX_SIZE, &p->size, NULL, err)))
        return rc;
    return kp_ring_check_size(p->size, UINT64_MAX, err);
}
