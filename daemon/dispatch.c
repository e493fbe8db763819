/*
 * dispatch.c - see dispatch.h.  The handlers here are the methods answered
 * at once: hello, health, stats, layer.register / list / drop, slot.alloc,
 * slot.info, region.register_shm / register_cuda / release, ring.attach.
 */
#include "dispatch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "defaults.h"
#include "log.h"

static void fail_with(kd_req *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail_with(kd_req *r, int code, const char *fmt, ...)
{
    kp_error e;
    va_list ap;
    va_start(ap, fmt);
    e.code = code;
    vsnprintf(e.message, sizeof(e.message), fmt, ap);
    va_end(ap);
    kd_req_fail(r, &e);
}

/* ---------------------------------------------------------------------- */
/* Immediate methods                                                      */
/* ---------------------------------------------------------------------- */

static uint32_t transports(const kd_daemon *d)
{
    uint32_t t = d->backend->info.transports;
    if (!d->cfg.transport_shm || d->session.limits.max_regions_per_client == 0)
        t &= ~KP_TRANSPORT_SHM;
    if (!d->cfg.transport_cuda_ipc || d->session.limits.max_regions_per_client == 0)
        t &= ~KP_TRANSPORT_CUDA_IPC;
    return t;
}

static void do_hello(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_hello_params p;
    kp_hello_result res;
    kp_error e;
    uint32_t version;
    if (kp_hello_params_decode(&r->msg, &d->session, &p, &e) != KP_OK ||
        kp_hello_choose_version(&p, &version, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    if (!c->hello_done)
        KD_DEBUG("conn %llu: hello from %s", (unsigned long long)c->serial,
                 p.client ? p.client : "(unnamed client)");
    /* A second hello is answered like the first and changes nothing. */
    if (!c->hello_done) {
        c->session = d->session;
        c->hello_done = true;
        kd_conn_set_max_frame(c->conn, c->session.limits.max_frame_bytes);
    }
    kd_backend_info *bi = &d->backend->info;
    memset(&res, 0, sizeof(res));
    res.version = version;
    res.server = "kdad " KD_VERSION_STRING;
    res.instance = d->instance;
    res.backend = bi->kind;
    res.has_gpu = bi->has_gpu;
    res.gpu = (kp_gpu){bi->gpu_name, bi->gpu_uuid, bi->gpu_index, bi->gpu_pci_bus_id, bi->gpu_mps};
    res.geometry = c->session.geometry;
    res.transports = transports(d);
    res.slots_persist = d->cfg.slots_persist;
    /* the semaphores last: offered when the backend writes done words */
    static const char *const features[] = {KP_FEATURE_STATS_PROMETHEUS, KP_FEATURE_STEP,
                                           KP_FEATURE_PREFILL_SEMAPHORES};
    res.features = features;
    res.nfeatures = bi->sems ? 3 : 2;
    res.limits = c->session.limits;
    res.limits.has_clients = true; /* as configured now: a reload may change them */
    res.limits.clients = kd_config_client_bounds(&d->cfg);
    res.has_memory = true;
    res.memory = kd_backend_memory(d->backend);
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_hello_result_encode(&o->w, r->id, &res, &e), &e);
}

static void do_health(kd_req *r)
{
    kd_daemon *d = r->client->d;
    kp_error e;
    if (kp_health_params_decode(&r->msg, &r->client->session, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kp_health_result res = {
        .status = d->draining ? KP_HEALTH_DRAINING : KP_HEALTH_OK,
        .uptime_us = (uv_hrtime() - d->stats.start_ns) / 1000,
        .queued = d->sched.queued,
        .running = d->backend->inflight,
    };
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_health_result_encode(&o->w, r->id, &res, &e), &e);
}

static void do_stats(kd_req *r)
{
    kd_daemon *d = r->client->d;
    kp_error e;
    uint32_t flags;
    if (kp_stats_params_decode2(&r->msg, &r->client->session, &flags, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kd_stats_gauges g;
    kd_stats_view v;
    kp_stats_result res;
    uint64_t now = uv_hrtime();
    kd_dispatch_gauges(d, &g);
    kd_stats_result(&d->stats, &g, now, &v, &res);
    uid_t uid = r->client->peer.uid;
    res.has_uid = true;
    res.uid = uid;
    res.uid_layers = kd_layers_of_uid(&d->layers, uid);
    res.uid_slots = kd_pool_uid_holds(&d->pool, uid);
    const kd_uid_use u = kd_quota_use(&d->quota, uid); /* this request's bytes among them */
    res.has_uid_held = true;
    res.uid_connections = u.connections;
    res.uid_held = (kp_held){u.inflight_bytes, u.partial_bytes, u.output_bytes, u.region_bytes};
    const kd_quota *q = &d->quota;
    res.has_clients = true;
    res.held = (kp_held){q->inflight_bytes, q->partial_bytes, q->output_bytes, q->region_bytes};
    res.held_peak = (kp_held){q->peak_inflight_bytes, q->peak_partial_bytes,
                              q->peak_output_bytes, q->peak_region_bytes};
    res.stalled = d->stats.disconnects[KD_DISC_STALLED];
    res.refused = d->stats.disconnects[KD_DISC_TOO_MANY] + d->stats.disconnects[KD_DISC_QUOTA];
    res.bounds = kd_config_client_bounds(&d->cfg);
    char *text = NULL;
    if (flags & KP_STATS_PROMETHEUS) {
        /* The same rendering as the metrics file, from the same counters. */
        if (!(text = kd_stats_prometheus(&d->stats, &g, now))) {
            fail_with(r, KP_E_NO_MEMORY, "no memory for the Prometheus text");
            return;
        }
        res.prometheus = text;
    }
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_stats_result_encode(&o->w, r->id, &res, &e), &e);
    free(text);
}

static void do_layer_register(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_layer_register_params p;
    kp_layer_register_result res;
    kp_error e;
    kd_layer_quota q = {c->session.limits.max_layers, c->session.limits.max_layers_per_uid};
    if (kp_layer_register_params_decode(&r->msg, &c->session, &p, &e) != KP_OK ||
        kd_layers_register(&d->layers, p.name, p.A_log.data, p.dt_bias.data, p.lower_bound,
                           p.scale, c->peer.uid, &q, &res.created, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    if (res.created)
        KD_INFO("layer %s: registered by uid %u", p.name, (unsigned)c->peer.uid);
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_layer_register_result_encode(&o->w, r->id, &res, &e), &e);
}

static void do_layer_list(kd_req *r)
{
    kd_daemon *d = r->client->d;
    kp_error e;
    if (kp_layer_list_params_decode(&r->msg, &r->client->session, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kp_layer_info *info = calloc(d->layers.n ? d->layers.n : 1, sizeof(*info));
    if (!info) {
        fail_with(r, KP_E_NO_MEMORY, "no memory to list the layers");
        return;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->layers.n; i++) {
        const kd_layer *l = d->layers.v[i];
        if (kd_layer_visible(l, r->client->peer.uid)) /* another uid's names are its own */
            info[n++] = (kp_layer_info){l->name, l->host.lower_bound, l->host.scale, l->source};
    }
    kp_layer_list_result res = {info, n};
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_layer_list_result_encode(&o->w, r->id, &res, &e), &e);
    free(info);
}

static void do_layer_drop(kd_req *r)
{
    kd_client *c = r->client;
    kp_layer_drop_params p;
    kp_layer_drop_result res;
    kp_error e;
    if (kp_layer_drop_params_decode(&r->msg, &c->session, &p, &e) != KP_OK ||
        kd_layers_drop(&c->d->layers, p.name, c->peer.uid, &res, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    if (res.removed)
        KD_INFO("layer %s: dropped by uid %u (%u requests still use its weights)", p.name,
                (unsigned)c->peer.uid, res.in_use);
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_layer_drop_result_encode(&o->w, r->id, &res, &e), &e);
}

static void do_slot_alloc(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_slot_alloc_params p;
    kp_error e;
    if (kp_slot_alloc_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    uint64_t *handles = malloc(p.count * sizeof(*handles));
    if (!handles) {
        fail_with(r, KP_E_NO_MEMORY, "no memory for %u handles", p.count);
        return;
    }
    if (kd_pool_alloc(&d->pool, kd_client_owner(c), c->peer.uid, &c->session.limits, p.count,
                      p.zero, handles, &e) != KP_OK) {
        free(handles);
        kd_req_fail(r, &e);
        return;
    }
    kp_slot_list res = {handles, p.count};
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_slot_alloc_result_encode(&o->w, r->id, &res, &e), &e);
    free(handles);
}

static void do_slot_info(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_slot_info_params p;
    kp_error e;
    uint64_t owner = kd_client_owner(c);
    if (kp_slot_info_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    uint32_t n = p.has_slots ? p.list.nslots : kd_pool_owned(&d->pool, owner);
    kp_slot_info *info = calloc(n ? n : 1, sizeof(*info));
    if (!info) {
        fail_with(r, KP_E_NO_MEMORY, "no memory for %u slot entries", n);
        return;
    }
    /* First collect pool indices (in .slot), then fill the entries. */
    uint32_t have = 0;
    for (uint32_t i = 0; p.has_slots && i < n; i++) {
        char field[32];
        uint32_t index;
        kp_field_name(field, sizeof(field), "slots", i, NULL);
        if (kd_pool_resolve(&d->pool, p.list.slots[i], owner, field, &index, &e) != KP_OK) {
            free(info);
            kd_req_fail(r, &e);
            return;
        }
        info[have++].slot = index;
    }
    for (uint32_t i = 0; !p.has_slots && i < d->pool.nslots && have < n; i++) {
        const kd_slot *s = kd_pool_slot(&d->pool, i);
        if (s->state != KD_SLOT_FREE && !s->retiring && s->owner == owner)
            info[have++].slot = i;
    }
    for (uint32_t i = 0; i < have; i++) {
        uint32_t index = (uint32_t)info[i].slot;
        info[i] = (kp_slot_info){kd_pool_handle(&d->pool, index),
                                 kd_pool_slot(&d->pool, index)->pos,
                                 kd_pool_status(&d->pool, index),
                                 kd_sched_slot_jobs(&d->sched, index)};
    }
    kp_slot_info_result res = {info, have, d->pool.nfree,
                               kd_pool_quota_left(&d->pool, owner, c->peer.uid,
                                                  &c->session.limits)};
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_slot_info_result_encode(&o->w, r->id, &res, &e), &e);
    free(info);
}

static kd_region_limits region_limits(const kd_client *c)
{
    const kd_config *cfg = &c->d->cfg;
    return (kd_region_limits){c->session.limits.max_regions_per_client,
                              cfg->max_region_bytes_per_connection, cfg->max_region_bytes_per_uid};
}

static void reply_region(kd_req *r, const kd_region *reg)
{
    kp_region_register_result res = {reg->id};
    kp_error e;
    kd_out *o = kd_req_frame(r);
    if (o)
        kd_req_reply(r, o, kp_region_register_result_encode(&o->w, r->id, &res, &e), &e);
}

static void do_region_register_shm(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_region_register_shm_params p;
    kp_error e;
    kd_region *reg;
    if (kp_region_register_shm_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    if (!(transports(d) & KP_TRANSPORT_SHM)) {
        fail_with(r, KP_E_NOT_SUPPORTED, "shared-memory regions are disabled in this daemon's "
                  "configuration");
        return;
    }
    if (r->fd < 0) {
        fail_with(r, KP_E_INVALID_PARAMS, "no file descriptor arrived with this frame");
        return;
    }
    int fd = r->fd;
    r->fd = -1; /* kd_region_register_shm closes it in every case */
    kd_region_limits lim = region_limits(c);
    if (kd_region_register_shm(&c->regions, d->backend, fd, p.size, &lim, &reg, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    KD_DEBUG("conn %llu: region %u: %llu bytes of shared memory", (unsigned long long)c->serial,
             reg->id, (unsigned long long)p.size);
    reply_region(r, reg);
}

static void do_region_register_cuda(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_region_register_cuda_params p;
    kp_error e;
    kd_region *reg;
    if (kp_region_register_cuda_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    if (!(transports(d) & KP_TRANSPORT_CUDA_IPC)) {
        fail_with(r, KP_E_NOT_SUPPORTED, "CUDA regions are not available: %s",
                  d->backend->ops->open_cuda ? "disabled in the configuration"
                                             : "this daemon runs the cpu backend");
        return;
    }
    if (p.handle_type == KP_CUDA_HANDLE_POSIX_FD && r->fd < 0) {
        fail_with(r, KP_E_INVALID_PARAMS, "no file descriptor arrived with this frame "
                  "(handle_type \"posix_fd\" passes the VMM allocation's fd with it)");
        return;
    }
    int fd = r->fd;
    r->fd = -1; /* kd_region_register_cuda closes it in every case */
    kd_region_limits lim = region_limits(c);
    if (kd_region_register_cuda(&c->regions, d->backend, &p, fd, &lim, &reg, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    reply_region(r, reg);
}

/* The region's memory is gone: region.release answers now. */
static void region_gone(void *arg)
{
    kd_req *r = arg;
    r->releasing = NULL;
    r->release = NULL;
    kd_req_reply_empty(r);
}

/* A region.release dropped before the memory went: nobody waits any more. */
static void forget_release(kd_req *r)
{
    if (r->releasing)
        r->releasing->gone = NULL;
    r->releasing = NULL;
}

static void do_region_release(kd_req *r)
{
    kd_client *c = r->client;
    kp_region_release_params p;
    kp_error e;
    if (kp_region_release_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kd_region *reg = kd_region_find(&c->regions, p.region);
    if (!reg) {
        kp_fail(&e, KP_E_REGION_INVALID, "region: %u is not registered on this connection",
                p.region);
        kd_req_fail(r, &e);
        return;
    }
    if (reg == c->ring_region) {
        kp_fail(&e, KP_E_REGION_INVALID, "region: %u holds this connection's frame ring, which "
                "lasts as long as the connection", p.region);
        kd_req_fail(r, &e);
        return;
    }
    r->releasing = reg;
    r->release = forget_release;
    kd_region_release(&c->regions, reg, region_gone, r);
}

static void do_ring_attach(kd_req *r)
{
    kd_client *c = r->client;
    kp_ring_attach_params p;
    kp_error e;
    if (kp_ring_attach_params_decode(&r->msg, &c->session, &p, &e) != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kd_region *reg = kd_region_find(&c->regions, p.region);
    if (!reg || reg->kind != KD_REGION_SHM) {
        fail_with(r, KP_E_REGION_INVALID, "region: %u is not a shared-memory region of this "
                  "connection", p.region);
        return;
    }
    int rc = c->inflight != 1 ? kp_fail(&e, KP_E_INVALID_PARAMS, "ring.attach must be the only "
                                        "request in flight, with nothing sent after it until "
                                        "its answer")
                              : kp_ring_check_size(p.size, reg->size, &e);
    if (rc == KP_OK && c->ring_region)
        rc = kp_fail(&e, KP_E_INVALID_PARAMS, "this connection has a frame ring already");
    if (rc == KP_OK)
        rc = kd_conn_attach_ring(c->conn, reg->host, p.size, &e);
    if (rc != KP_OK) {
        kd_req_fail(r, &e);
        return;
    }
    kd_region_ref(reg);
    c->ring_region = reg;
    KD_DEBUG("conn %llu: frames move to a ring of 2 x %llu bytes in region %u",
             (unsigned long long)c->serial, (unsigned long long)p.size, reg->id);
    kd_req_reply_empty(r);
}

/* ---------------------------------------------------------------------- */
/* Frames                                                                 */
/* ---------------------------------------------------------------------- */

static void route(kd_req *r)
{
    kd_client *c = r->client;
    kd_daemon *d = c->d;
    kp_method m = r->method;
    if (m == KP_METHOD_UNKNOWN) {
        fail_with(r, KP_E_UNKNOWN_METHOD, "method \"%s\" is not part of protocol version 1",
                  r->msg.name);
        return;
    }
    if (!c->hello_done && m != KP_METHOD_HELLO) {
        fail_with(r, KP_E_HELLO_REQUIRED, "%s: send hello first", r->msg.name);
        return;
    }
    if (d->draining && m != KP_METHOD_HELLO && m != KP_METHOD_HEALTH && m != KP_METHOD_STATS) {
        fail_with(r, KP_E_SHUTTING_DOWN, "%s: the daemon is draining for shutdown", r->msg.name);
        return;
    }
    switch (m) {
    case KP_METHOD_HELLO: do_hello(r); break;
    case KP_METHOD_HEALTH: do_health(r); break;
    case KP_METHOD_STATS: do_stats(r); break;
    case KP_METHOD_LAYER_REGISTER: do_layer_register(r); break;
    case KP_METHOD_LAYER_LIST: do_layer_list(r); break;
    case KP_METHOD_LAYER_DROP: do_layer_drop(r); break;
    case KP_METHOD_SLOT_ALLOC: do_slot_alloc(r); break;
    case KP_METHOD_SLOT_INFO: do_slot_info(r); break;
    case KP_METHOD_REGION_REGISTER_SHM: do_region_register_shm(r); break;
    case KP_METHOD_REGION_REGISTER_CUDA: do_region_register_cuda(r); break;
    case KP_METHOD_REGION_RELEASE: do_region_release(r); break;
    case KP_METHOD_RING_ATTACH: do_ring_attach(r); break;
    case KP_METHOD_PREFILL:
    case KP_METHOD_STEP:
    case KP_METHOD_SLOT_FREE:
    case KP_METHOD_SLOT_RESET:
    case KP_METHOD_SLOT_FORK:
    case KP_METHOD_SLOT_READ:
    case KP_METHOD_SLOT_WRITE:
        kd_engine_admit(&d->engine, r);
        break;
    default:
        fail_with(r, KP_E_INTERNAL, "method %s has no handler", r->msg.name);
        break;
    }
}

void kd_dispatch_frame(kd_client *c, uint8_t *body, size_t len, uint64_t arrival_ns)
{
    kp_error e;
    kd_req *r = kd_req_new(c, body, len, arrival_ns);
    if (!r) {
        kp_fail(&e, KP_E_NO_MEMORY, "no memory for a request; the connection cannot continue");
        kd_conn_close(c->conn, KD_DISC_IO_ERROR, &e);
        return;
    }
    uint64_t cap = c->hello_done ? c->session.limits.max_frame_bytes : KP_HELLO_MAX_FRAME_BYTES;
    /* Prefills, the hot path, are read in one pass; anything that reader
     * declines (other methods, errors) is decoded the general way. */
    r->prefill_read = c->hello_done && kp_prefill_request_read(&r->msg, body, len, cap,
                                                               &c->session, &r->prefill);
    int rc = r->prefill_read ? KP_OK : kp_msg_decode(&r->msg, body, len, cap, &e);
    if (rc == KP_OK && r->msg.kind != KP_MSG_REQUEST)
        rc = kp_fail(&e, KP_E_PROTOCOL, "message type %d: clients send requests only",
                     (int)r->msg.kind);
    /* The descriptor belongs to this frame whatever its params say. */
    if (rc == KP_OK && kp_msg_takes_fd(&r->msg))
        r->fd = kd_conn_take_fd(c->conn);
    if (rc == KP_OK && kd_client_id_in_flight(c, r->msg.id))
        rc = kp_fail(&e, KP_E_PROTOCOL, "id %u is already in flight on this connection",
                     r->msg.id);
    /* Without a request id to answer on (or with a duplicate one), a bad
     * frame ends the connection with a goodbye alone. */
    if (rc != KP_OK && (!r->msg.has_id || r->msg.kind != KP_MSG_REQUEST ||
                        kd_client_id_in_flight(c, r->msg.id))) {
        kd_stats_error(&c->d->stats, e.code);
        kd_req_discard(r);
        kd_conn_close(c->conn, e.code == KP_E_FRAME_TOO_LARGE ? KD_DISC_FRAME_TOO_LARGE
                                                              : KD_DISC_PROTOCOL, &e);
        return;
    }
    r->id = r->msg.id;
    r->method = r->msg.method;
    /* A decoding error takes precedence over the quota's. */
    kp_error qe;
    if (kd_req_track(r, &qe) != KP_OK && rc == KP_OK) {
        rc = qe.code;
        e = qe;
    }
    if (rc != KP_OK)
        kd_req_fail(r, &e); /* e.g. params not a map: answered on the id, then closed */
    else
        route(r);
}

void kd_dispatch_gauges(const kd_daemon *d, kd_stats_gauges *g)
{
    memset(g, 0, sizeof(*g));
    g->slots_total = d->pool.nslots;
    g->slots_used = kd_pool_used(&d->pool);
    g->slots_lost = d->pool.nlost;
    g->layers = d->layers.n;
    for (const kd_client *c = d->clients; c; c = c->next) {
        g->regions += c->regions.count;
        g->rings += c->conn && c->conn->ring_on && !c->closing;
    }
    g->queued = d->sched.queued;
    g->running = d->backend->inflight;
    g->ring_doorbells = d->net.ring_doorbells;
    g->has_memory = true;
    g->memory = kd_backend_memory(d->backend);
    const kd_quota *q = &d->quota;
    const kd_config *cfg = &d->cfg;
    g->held[KD_HELD_INFLIGHT] = (kd_stats_held){
        q->inflight_bytes, q->peak_inflight_bytes, cfg->max_inflight_bytes_per_uid,
        cfg->max_inflight_bytes_total, "clients.max_inflight_bytes_per_uid",
        "clients.max_inflight_bytes_total"};
    g->held[KD_HELD_PARTIAL] = (kd_stats_held){q->partial_bytes, q->peak_partial_bytes, 0, 0, NULL,
                                               NULL};
    g->held[KD_HELD_OUTPUT] = (kd_stats_held){
        q->output_bytes, q->peak_output_bytes, cfg->max_output_bytes_per_uid,
        cfg->max_output_bytes_total, "clients.max_output_bytes_per_uid",
        "clients.max_output_bytes_total"};
    g->held[KD_HELD_REGIONS] = (kd_stats_held){
        q->region_bytes, q->peak_region_bytes, cfg->max_region_bytes_per_uid,
        cfg->max_region_bytes_per_connection, "clients.max_region_bytes_per_uid",
        "clients.max_region_bytes_per_connection"};
}
