/*
 * client.c - the connection's life: the socket path, connect, the hello
 * handshake (version and geometry), close, and the library's version.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client_int.h"

_Static_assert(KDAC_PATH_MAX == sizeof(((struct sockaddr_un *)0)->sun_path), "sun_path size");

#define KDAC_STR2(x) #x
#define KDAC_STR(x) KDAC_STR2(x)
#define KDAC_VERSION_STRING \
    KDAC_STR(KDAC_VERSION_MAJOR) "." KDAC_STR(KDAC_VERSION_MINOR) "." KDAC_STR(KDAC_VERSION_PATCH)

unsigned kdac_version(void)
{
    return KDAC_VERSION_HEX;
}

const char *kdac_version_string(void)
{
    return KDAC_VERSION_STRING;
}

void kdac_options_init(kdac_options *opts)
{
    memset(opts, 0, sizeof(*opts));
}

/* $XDG_RUNTIME_DIR/NAME if that exists (a user instance), else SYSTEM_DIR/NAME. */
static int socket_in_runtime_dir(const char *name, char *buf, size_t size)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    int n = -1;
    if (xdg && *xdg) {
        n = snprintf(buf, size, "%s/%s", xdg, name);
        if (n >= 0 && (size_t)n < size && stat(buf, &st) != 0)
            n = -1; /* no user instance: the system service */
    }
    if (n < 0)
        n = snprintf(buf, size, "%s/%s", KDAC_SYSTEM_SOCKET_DIR, name);
    return n < 0 || (size_t)n >= size ? KDAC_E_INVALID_ARGUMENT : KDAC_OK;
}

int kdac_socket_for_gpu(const char *gpu, char *buf, size_t size)
{
    if (!gpu || !*gpu || strlen(gpu) > 64 ||
        strspn(gpu, "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-") !=
            strlen(gpu))
        return KDAC_E_INVALID_ARGUMENT;
    char name[80];
    snprintf(name, sizeof(name), "kdad-%s.sock", gpu);
    return socket_in_runtime_dir(name, buf, size);
}

int kdac_socket_default(char *buf, size_t size)
{
    const char *env = getenv("KDAD_SOCKET");
    if (env && *env) {
        int n = snprintf(buf, size, "%s", env);
        return n < 0 || (size_t)n >= size ? KDAC_E_INVALID_ARGUMENT : KDAC_OK;
    }
    const char *gpu = getenv("KDAD_GPU");
    if (gpu && *gpu)
        return kdac_socket_for_gpu(gpu, buf, size);
    return socket_in_runtime_dir(KDAC_USER_SOCKET_NAME, buf, size);
}

const kdac_server_info *kdac_client_info(const kdac_client *c)
{
    return &c->info;
}

const char *kdac_client_path(const kdac_client *c)
{
    return c->path;
}

/* Connects the blocking way (a Unix socket connects at once or fails), then
 * makes the socket non-blocking for the event loop. */
static int client_connect(kdac_client *c, kdac_error *err)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, c->path, strlen(c->path) + 1);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        return kdac_fail(err, KDAC_E_SYSTEM, "socket: %s", strerror(errno));
    int rc;
    do {
        rc = connect(c->fd, (struct sockaddr *)&addr, sizeof(addr));
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) {
        int e = errno;
        if (e == ENOENT)
            return kdac_fail(err, KDAC_E_NOT_RUNNING, "daemon not running: no socket at %s "
                             "(start kdad, or point KDAD_SOCKET / --socket at its socket)",
                             c->path);
        if (e == ECONNREFUSED)
            return kdac_fail(err, KDAC_E_NOT_RUNNING, "daemon not running: nothing listens on "
                             "%s (a stale socket file?)", c->path);
        return kdac_fail(err, KDAC_E_CONNECT, "cannot connect to %s: %s", c->path, strerror(e));
    }
    int flags = fcntl(c->fd, F_GETFL);
    if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return kdac_fail(err, KDAC_E_SYSTEM, "fcntl(O_NONBLOCK): %s", strerror(errno));
    return KDAC_OK;
}

static void copy_text(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src ? src : "");
}

void kdac_bounds_from_wire(kdac_bounds *out, const kp_client_bounds *b)
{
    *out = (kdac_bounds){
        .max_connections = b->max_connections,
        .max_connections_per_uid = b->max_connections_per_uid,
        .max_inflight_bytes_per_uid = b->max_inflight_bytes_per_uid,
        .max_inflight_bytes_total = b->max_inflight_bytes_total,
        .output_hard_limit = b->output_hard_limit,
        .output_soft_limit = b->output_soft_limit,
        .max_output_bytes_per_uid = b->max_output_bytes_per_uid,
        .max_output_bytes_total = b->max_output_bytes_total,
        .max_region_bytes_per_connection = b->max_region_bytes_per_connection,
        .max_region_bytes_per_uid = b->max_region_bytes_per_uid,
        .output_soft_seconds = b->output_soft_seconds,
        .frame_stall_seconds = b->frame_stall_seconds,
        .output_stall_seconds = b->output_stall_seconds,
    };
}

kdac_memory kdac_memory_from_wire(const kp_memory *m)
{
    return (kdac_memory){m->pool,  m->staging, m->scratch, m->kernel,
                         m->lanes, m->layers,  m->total};
}

/* hello's result: the session for the codec and the public info. */
static int hello_decode(kdac_client *c, pending *p, kp_msg *msg, kdac_result *res, kp_error *err)
{
    kp_hello_result r;
    int rc = kp_hello_result_decode(msg, &r, err);
    if (rc)
        return rc;
    if (r.version != KP_PROTOCOL_VERSION)
        return kp_fail(err, KP_E_PROTOCOL, "the daemon chose protocol version %u, which this "
                       "client did not offer (it speaks %d)", r.version, KP_PROTOCOL_VERSION);
    kdac_server_info *i = &c->info;
    memset(i, 0, sizeof(*i));
    i->version = r.version;
    copy_text(i->server, sizeof(i->server), r.server);
    i->instance = r.instance;
    copy_text(i->backend, sizeof(i->backend), r.backend == KP_BACKEND_CUDA ? "cuda" : "cpu");
    i->has_gpu = r.has_gpu;
    if (r.has_gpu) {
        copy_text(i->gpu_name, sizeof(i->gpu_name), r.gpu.name);
        copy_text(i->gpu_uuid, sizeof(i->gpu_uuid), r.gpu.uuid);
        i->gpu_index = r.gpu.index;
        copy_text(i->gpu_pci_bus_id, sizeof(i->gpu_pci_bus_id), r.gpu.pci_bus_id);
        i->gpu_mps = r.gpu.mps;
    }
    i->heads = r.geometry.heads;
    i->slots = r.geometry.slots;
    i->state_dtype = (kdac_dtype)r.geometry.state_dtype;
    i->transports = r.transports;
    i->slots_persist = r.slots_persist;
    i->nfeatures = r.nfeatures < KDAC_MAX_FEATURES ? r.nfeatures : KDAC_MAX_FEATURES;
    for (uint32_t f = 0; f < i->nfeatures; f++)
        copy_text(i->features[f], sizeof(i->features[f]), r.features[f]);
    const kp_limits *l = &r.limits;
    i->limits = (kdac_limits){l->max_frame_bytes,      l->max_inline_bytes,
                              l->max_batch_tokens,     l->max_batch_seqs,
                              l->max_seqs_per_request, l->max_slots_per_client,
                              l->max_regions_per_client, l->max_inflight_requests,
                              l->max_inflight_bytes,   l->max_layers};
    i->has_bounds = l->has_clients;
    kdac_bounds_from_wire(&i->bounds, &l->clients);
    i->bounds.max_layers_per_uid = l->max_layers_per_uid;
    i->bounds.max_slots_per_uid = l->max_slots_per_uid;
    i->has_memory = r.has_memory;
    i->memory = kdac_memory_from_wire(&r.memory);
    kp_session_from_hello(&c->session, &r);
    return KP_OK;
}

static int client_hello(kdac_client *c, const char *name, kdac_error *err)
{
    sync_call s;
    memset(&s, 0, sizeof(s));
    pending *p = pending_new(c, KP_METHOD_HELLO, sync_cb, &s, hello_decode);
    if (!p)
        return kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate the hello request");
    kp_hello_params hp = {{KP_PROTOCOL_VERSION}, 1, name};
    kp_error e;
    p->id = client_next_id(c);
    if (kp_hello_params_encode(p->w, p->id, &hp, &e) != KP_OK) {
        pending_free(c, p);
        return kdac_from_kp(err, &e);
    }
    client_submit(c, p);
    int rc = sync_wait(c, &s, err);
    if (rc == KDAC_E_PROTOCOL || rc == KDAC_E_FRAME_TOO_LARGE) {
        /* Whatever answers there, it is not a kdad of our protocol. */
        char why[KDAC_ERRMSG_MAX];
        snprintf(why, sizeof(why), "%s", err ? err->message : "");
        return kdac_fail(err, KDAC_E_PROTOCOL, "%s does not speak the kdad protocol "
                         "(version %d): %s", c->path, KP_PROTOCOL_VERSION, why);
    }
    if (rc)
        return rc;
    /* Frames after the response may be as large as the daemon's cap. */
    kp_reader_set_max_frame(&c->rd, c->session.limits.max_frame_bytes);
    c->hello_done = true;
    return KDAC_OK;
}

int kdac_client_open(kdac_client **out, const kdac_options *opts, kdac_error *err)
{
    kdac_options defaults;
    if (!out)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!opts) {
        kdac_options_init(&defaults);
        opts = &defaults;
    }
    if (opts->timeout_ms < 0)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "timeout_ms: %d is negative",
                         opts->timeout_ms);
    if (opts->client_name && strlen(opts->client_name) > KDAC_TEXT_MAX)
        return kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "client_name: longer than %d bytes",
                         KDAC_TEXT_MAX);
    kdac_client *c = calloc(1, sizeof(*c));
    if (!c)
        return kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate a client");
    c->fd = -1;
    c->ring_shm.fd = -1;
    c->timeout_ms = opts->timeout_ms;
    kp_reader_init(&c->rd, KP_HELLO_MAX_FRAME_BYTES);
    int rc;
    if (opts->socket_path) {
        if (strlen(opts->socket_path) >= sizeof(c->path)) {
            rc = kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "socket path longer than %zu bytes",
                           sizeof(c->path) - 1);
            goto fail;
        }
        snprintf(c->path, sizeof(c->path), "%s", opts->socket_path);
    } else if (kdac_socket_default(c->path, sizeof(c->path)) != KDAC_OK) {
        rc = kdac_fail(err, KDAC_E_INVALID_ARGUMENT, "no socket path from KDAD_SOCKET, "
                       "KDAD_GPU (a GPU ordinal or UUID) or XDG_RUNTIME_DIR: too long (over %zu "
                       "bytes) or not a GPU name", sizeof(c->path) - 1);
        goto fail;
    }
    c->stage = malloc(CLIENT_STAGE_BYTES);
    if (!c->stage) {
        rc = kdac_fail(err, KDAC_E_NO_MEMORY, "cannot allocate the receive buffer");
        goto fail;
    }
    if ((rc = client_connect(c, err)) ||
        (rc = client_hello(c, opts->client_name ? opts->client_name
                                                : "libkdaclient/" KDAC_VERSION_STRING, err)))
        goto fail;
    *out = c;
    return KDAC_OK;
fail:
    kdac_client_close(c);
    return rc;
}

int kdac_client_close(kdac_client *c)
{
    if (!c)
        return KDAC_OK;
    if (c->cb_depth > 0)
        return KDAC_E_INVALID_ARGUMENT;
    kdac_error e;
    kdac_fail(&e, KDAC_E_CANCELED, "canceled: the client was closed before the answer came");
    c->failed = true; /* nothing is written or read any more */
    client_complete_all(c, &e);
    if (c->fd >= 0)
        close(c->fd);
    kdac_shm_close(&c->ring_shm);
    kp_reader_close(&c->rd);
    if (c->spare_writer)
        kp_writer_close(c->spare_writer);
    free(c->spare_writer);
    free(c->stage);
    free(c->scratch);
    free(c);
    return KDAC_OK;
}
