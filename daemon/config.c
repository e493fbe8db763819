/*
 * config.c - the YAML configuration (config.h).
 *
 * One table (`schema`) lists every key with its type, range and place in
 * kd_config; the YAML walk, the command-line overrides and the error
 * messages all go through it, so a key is added in one line.  libyaml loads
 * the whole document (node marks give line and column); the walk refuses
 * unknown and duplicate keys and anything of the wrong type.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <unistd.h>

#include <yaml.h>

/* ---------------------------------------------------------------------- */
/* Schema                                                                 */
/* ---------------------------------------------------------------------- */

typedef enum key_type {
    K_STR,      /* char * */
    K_DEVICE,   /* char *: a CUDA ordinal in [min, max], or a GPU UUID or a prefix of one */
    K_U32,      /* uint32_t in [min, max] */
    K_SIZE,     /* uint64_t bytes in [min, max]; accepts KiB/MiB/GiB suffixes */
    K_BOOL,     /* bool */
    K_MODE,     /* uint32_t permission bits, octal */
    K_ENUM,     /* int-sized enum: index into choices */
    K_UID_LIST, /* uint32_t * + uint32_t count: uids, as numbers or user names */
    K_GID_LIST, /* uint32_t * + uint32_t count: gids, as numbers or group names */
    K_BUCKETS,  /* uint32_t[KD_MAX_GRAPH_BUCKETS] + count */
    K_LAYERS,   /* kd_layer_conf * + count */
} key_type;

typedef struct key_spec {
    const char *path;   /* dotted path from the root */
    key_type type;
    size_t offset;      /* of the value in kd_config */
    size_t count_off;   /* lists: of the uint32_t count */
    uint64_t min, max;  /* numbers */
    const char *const *choices; /* K_ENUM, NULL-terminated; index = value */
} key_spec;

static const char *const backend_choices[] = {"auto", "cpu", "cuda", NULL};
static const char *const completion_choices[] = {"poll", "block", NULL};
static const char *const dtype_choices[] = {"bf16", "f32", NULL}; /* = kp_dtype */
static const char *const level_choices[] = {"", "", "", "error", "warning", "notice", "info",
                                            "debug", NULL}; /* index = kd_log_level */

#define OFF(f) offsetof(kd_config, f)
#define LIM(f) (offsetof(kd_config, limits) + offsetof(kp_limits, f))
#define U32(p, f, lo, hi) {p, K_U32, OFF(f), 0, lo, hi, NULL}
#define SIZE(p, off, lo, hi) {p, K_SIZE, off, 0, lo, hi, NULL}

static const key_spec schema[] = {
    {"socket.path", K_STR, OFF(socket_path), 0, 0, 0, NULL},
    {"socket.mode", K_MODE, OFF(socket_mode), 0, 0, 0777, NULL},
    {"socket.group", K_STR, OFF(socket_group), 0, 0, 0, NULL},
    {"access.allowed_uids", K_UID_LIST, OFF(allowed_uids), OFF(nallowed_uids), 0, UINT32_MAX - 1,
     NULL},
    {"access.allowed_gids", K_GID_LIST, OFF(allowed_gids), OFF(nallowed_gids), 0, UINT32_MAX - 1,
     NULL},
    {"backend", K_ENUM, OFF(backend), 0, 0, 0, backend_choices},
    {"device", K_DEVICE, OFF(device), 0, 0, 1023, NULL},
    {"cuda_completion", K_ENUM, OFF(cuda_completion), 0, 0, 0, completion_choices},
    SIZE("cuda_split_scratch", OFF(cuda_split_scratch), 0, 1ull << 36),
    U32("cpu_threads", cpu_threads, 0, 1024),
    U32("heads", heads, 1, KP_MAX_HEADS),
    U32("slots", slots, 1, KD_MAX_SLOTS),
    {"state_dtype", K_ENUM, OFF(state_dtype), 0, 0, 0, dtype_choices},
    {"slots_persist", K_BOOL, OFF(slots_persist), 0, 0, 0, NULL},
    SIZE("limits.max_frame_bytes", LIM(max_frame_bytes), KP_HELLO_MAX_FRAME_BYTES,
         KP_MAX_FRAME_BYTES_CEILING),
    SIZE("limits.max_inline_bytes", LIM(max_inline_bytes), 1, KP_MAX_FRAME_BYTES_CEILING),
    {"limits.max_batch_tokens", K_U32, LIM(max_batch_tokens), 0, 1, INT32_MAX, NULL},
    {"limits.max_batch_seqs", K_U32, LIM(max_batch_seqs), 0, 1, 1u << 16, NULL},
    {"limits.max_seqs_per_request", K_U32, LIM(max_seqs_per_request), 0, 1,
     KP_MAX_SEQS_PER_REQUEST_CEILING, NULL},
    {"limits.max_slots_per_client", K_U32, LIM(max_slots_per_client), 0, 1,
     KP_MAX_SLOTS_PER_CLIENT_CEILING, NULL},
    {"limits.max_regions_per_client", K_U32, LIM(max_regions_per_client), 0, 0, 1u << 16, NULL},
    {"limits.max_inflight_requests", K_U32, LIM(max_inflight_requests), 0, 1, 1u << 16, NULL},
    SIZE("limits.max_inflight_bytes", LIM(max_inflight_bytes), KP_HELLO_MAX_FRAME_BYTES,
         1ull << 40),
    {"limits.max_layers", K_U32, LIM(max_layers), 0, 0, 1u << 16, NULL},
    {"limits.max_layers_per_uid", K_U32, LIM(max_layers_per_uid), 0, 0, 1u << 16, NULL},
    {"limits.max_slots_per_uid", K_U32, LIM(max_slots_per_uid), 0, 0, KD_MAX_SLOTS, NULL},
    {"batching.graph_buckets", K_BUCKETS, OFF(graph_buckets), OFF(ngraph_buckets), 1, 1u << 16,
     NULL},
    U32("batching.max_queued_requests", max_queued_requests, 1, 1u << 20),
    U32("batching.spin_us", spin_us, 0, 100000),
    {"batching.hold_while_busy", K_BOOL, OFF(hold_while_busy), 0, 0, 0, NULL},
    U32("batching.hold_fill_percent", hold_fill_percent, 1, 100),
    U32("batching.hold_max_us", hold_max_us, 1, 1000000),
    U32("batching.gather_us", gather_us, 0, 100000),
    U32("batching.gather_wave_percent", gather_wave_percent, 1, 100),
    U32("batching.ready_spin_us", ready_spin_us, 0, 1000000),
    U32("batching.ready_timeout_ms", ready_timeout_ms, 1, 3600000),
    {"batching.ready_on_device", K_BOOL, OFF(ready_on_device), 0, 0, 0, NULL},
    U32("clients.max_connections", max_connections, 1, 1u << 20),
    U32("clients.max_connections_per_uid", max_connections_per_uid, 1, 1u << 20),
    SIZE("clients.max_inflight_bytes_per_uid", OFF(max_inflight_bytes_per_uid),
         KP_HELLO_MAX_FRAME_BYTES, 1ull << 44),
    SIZE("clients.max_inflight_bytes_total", OFF(max_inflight_bytes_total), 0, 1ull << 46),
    SIZE("clients.output_hard_limit", OFF(output_hard_limit), KP_HELLO_MAX_FRAME_BYTES, 1ull << 40),
    SIZE("clients.output_soft_limit", OFF(output_soft_limit), KP_HELLO_MAX_FRAME_BYTES, 1ull << 40),
    U32("clients.output_soft_seconds", output_soft_seconds, 1, 86400),
    SIZE("clients.max_output_bytes_per_uid", OFF(max_output_bytes_per_uid), 0, 1ull << 46),
    SIZE("clients.max_output_bytes_total", OFF(max_output_bytes_total), 0, 1ull << 46),
    SIZE("clients.max_region_bytes_per_connection", OFF(max_region_bytes_per_connection), 0,
         1ull << 50),
    SIZE("clients.max_region_bytes_per_uid", OFF(max_region_bytes_per_uid), 0, 1ull << 50),
    U32("clients.frame_stall_seconds", frame_stall_seconds, 1, 86400),
    U32("clients.output_stall_seconds", output_stall_seconds, 1, 86400),
    {"transports.shm", K_BOOL, OFF(transport_shm), 0, 0, 0, NULL},
    {"transports.cuda_ipc", K_BOOL, OFF(transport_cuda_ipc), 0, 0, 0, NULL},
    {"layers", K_LAYERS, OFF(layers), OFF(nlayers), 0, 0, NULL},
    {"log.level", K_ENUM, OFF(log_level), 0, 0, 0, level_choices},
    {"metrics.prometheus_file", K_STR, OFF(prometheus_file), 0, 0, 0, NULL},
    U32("metrics.interval_ms", metrics_interval_ms, 100, 86400000),
    U32("drain_timeout_ms", drain_timeout_ms, 0, 86400000),
};
#define NKEYS (sizeof(schema) / sizeof(schema[0]))

#undef OFF
#undef LIM
#undef U32
#undef SIZE

/* ---------------------------------------------------------------------- */
/* Errors                                                                 */
/* ---------------------------------------------------------------------- */

typedef struct cerr {
    char *buf;
    size_t len;
} cerr;

/* "FILE:LINE:COL: path: reason", or "NAME: reason" for overrides. */
static int fail_at(cerr *e, kd_conf_mark m, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail_at(cerr *e, kd_conf_mark m, const char *path, const char *fmt, ...)
{
    char reason[KD_CONFIG_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof(reason), fmt, ap);
    va_end(ap);
    if (m.line > 0)
        snprintf(e->buf, e->len, "%s:%d:%d: %s%s%s", m.file, m.line, m.col, path ? path : "",
                 path ? ": " : "", reason);
    else
        snprintf(e->buf, e->len, "%s: %s", m.file, reason);
    return -1;
}

static kd_conf_mark node_mark(const char *file, const yaml_node_t *n)
{
    return (kd_conf_mark){file, (int)n->start_mark.line + 1, (int)n->start_mark.column + 1};
}

/* ---------------------------------------------------------------------- */
/* Scalars                                                                */
/* ---------------------------------------------------------------------- */

static uint64_t *u64_at(kd_config *c, const key_spec *k) { return (uint64_t *)((char *)c + k->offset); }
static uint32_t *u32_at(kd_config *c, const key_spec *k) { return (uint32_t *)((char *)c + k->offset); }
static uint32_t *count_at(kd_config *c, const key_spec *k) { return (uint32_t *)((char *)c + k->count_off); }

/* A non-negative integer, optionally with a binary size suffix. */
static int parse_uint(const char *s, bool sizes, uint64_t *out)
{
    static const struct { const char *suffix; unsigned shift; } units[] = {
        {"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}, {"K", 10}, {"M", 20}, {"G", 30},
    };
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return -1;
    if (*end && sizes) {
        for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
            if (strcmp(end, units[i].suffix) == 0) {
                if (v > (UINT64_MAX >> units[i].shift))
                    return -1;
                *out = (uint64_t)v << units[i].shift;
                return 0;
            }
        }
    }
    if (*end)
        return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out)
{
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || !isfinite((float)v))
        return -1;
    *out = (float)v;
    return 0;
}

static int set_string(char **slot, const char *s)
{
    char *copy = strdup(s);
    if (!copy)
        return -1;
    free(*slot);
    *slot = copy;
    return 0;
}

/* A device: decimal digits up to max, or "GPU-" and 1..32 hex digits in the
 * dashed groups of a UUID (as nvidia-smi -L prints them; any case). */
static bool device_ok(const char *s, uint64_t max)
{
    uint64_t v;
    if (s[0] >= '0' && s[0] <= '9')
        return parse_uint(s, false, &v) == 0 && v <= max;
    if (strncmp(s, "GPU-", 4) != 0)
        return false;
    size_t hex = 0, len = strlen(s + 4);
    for (const char *p = s + 4; *p; p++) {
        if (isxdigit((unsigned char)*p))
            hex++;
        else if (*p != '-' || p == s + 4)
            return false;
    }
    return hex >= 1 && hex <= 32 && len <= 36;
}

/* Sets a scalar key from its text.  m and path label errors. */
static int set_scalar(kd_config *c, const key_spec *k, const char *s, kd_conf_mark m, cerr *e)
{
    uint64_t v;
    switch (k->type) {
    case K_STR:
        if (set_string((char **)((char *)c + k->offset), s))
            return fail_at(e, m, k->path, "out of memory");
        return 0;
    case K_DEVICE:
        if (!device_ok(s, k->max))
            return fail_at(e, m, k->path, "\"%s\" is neither a CUDA ordinal in [0, %llu] nor a "
                           "GPU UUID (GPU-xxxxxxxx-xxxx-..., or a unique prefix of one)", s,
                           (unsigned long long)k->max);
        if (set_string((char **)((char *)c + k->offset), s))
            return fail_at(e, m, k->path, "out of memory");
        return 0;
    case K_U32:
    case K_SIZE:
        if (parse_uint(s, k->type == K_SIZE, &v))
            return fail_at(e, m, k->path, "\"%s\" is not a %s", s,
                           k->type == K_SIZE ? "size (bytes, or a number with KiB, MiB or GiB)"
                                             : "non-negative integer");
        if (v < k->min || v > k->max)
            return fail_at(e, m, k->path, "%s is outside [%llu, %llu]", s,
                           (unsigned long long)k->min, (unsigned long long)k->max);
        if (k->type == K_U32)
            *u32_at(c, k) = (uint32_t)v;
        else
            *u64_at(c, k) = v;
        return 0;
    case K_BOOL:
        if (strcmp(s, "true") && strcmp(s, "false"))
            return fail_at(e, m, k->path, "\"%s\" is not true or false", s);
        *(bool *)((char *)c + k->offset) = strcmp(s, "true") == 0;
        return 0;
    case K_MODE: {
        errno = 0;
        char *end;
        const char *digits = strncmp(s, "0o", 2) == 0 ? s + 2 : s;
        unsigned long mode = strtoul(digits, &end, 8);
        if (errno || end == digits || *end || mode > k->max)
            return fail_at(e, m, k->path, "\"%s\" is not an octal permission mode like 0660", s);
        *u32_at(c, k) = (uint32_t)mode;
        return 0;
    }
    case K_ENUM:
        if (k->choices == dtype_choices) {   /* the usual spellings of the two dtypes */
            if (!strcasecmp(s, "fp32") || !strcasecmp(s, "float32") || !strcasecmp(s, "F32"))
                s = "f32";
            else if (!strcasecmp(s, "bfloat16") || !strcasecmp(s, "BF16"))
                s = "bf16";
        }
        for (int i = 0; k->choices[i]; i++) {
            if (k->choices[i][0] && strcmp(s, k->choices[i]) == 0) {
                *(int *)((char *)c + k->offset) = i;
                return 0;
            }
        }
        {
            char list[128] = "";
            for (int i = 0; k->choices[i]; i++) {
                if (k->choices[i][0])
                    snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s",
                             list[0] ? ", " : "", k->choices[i]);
            }
            return fail_at(e, m, k->path, "\"%s\" is not one of: %s", s, list);
        }
    default:
        return fail_at(e, m, k->path, "expected a list");
    }
}

/* ---------------------------------------------------------------------- */
/* The YAML walk                                                          */
/* ---------------------------------------------------------------------- */

typedef struct walk {
    kd_config *cfg;
    yaml_document_t *doc;
    const char *file;    /* name used in marks (owned by cfg->files) */
    const char *dir;     /* directory of the file, for relative layer paths; NULL: cwd */
    cerr *e;
} walk;

static const char *scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

static int expect(walk *w, const yaml_node_t *n, yaml_node_type_t type, const char *path)
{
    static const char *const names[] = {"nothing", "a scalar", "a list", "a mapping"};
    if (n->type == type)
        return 0;
    return fail_at(w->e, node_mark(w->file, n), path, "expected %s, got %s", names[type],
                   names[n->type]);
}

static const key_spec *find_key(const char *path)
{
    for (size_t i = 0; i < NKEYS; i++) {
        if (strcmp(schema[i].path, path) == 0)
            return &schema[i];
    }
    return NULL;
}

static bool is_section(const char *path)
{
    size_t n = strlen(path);
    for (size_t i = 0; i < NKEYS; i++) {
        if (strncmp(schema[i].path, path, n) == 0 && schema[i].path[n] == '.')
            return true;
    }
    return false;
}

/* A user or group name (K_UID_LIST, K_GID_LIST) as the system resolves it now. */
static int lookup_id(key_type type, const char *name, uint32_t *id)
{
    char buf[4096];
    if (type == K_UID_LIST) {
        struct passwd pw, *found = NULL;
        if (getpwnam_r(name, &pw, buf, sizeof(buf), &found) != 0 || !found)
            return -1;
        *id = (uint32_t)found->pw_uid;
        return 0;
    }
    struct group gr, *found = NULL;
    if (getgrnam_r(name, &gr, buf, sizeof(buf), &found) != 0 || !found)
        return -1;
    *id = (uint32_t)found->gr_gid;
    return 0;
}

static int u32_list(walk *w, const key_spec *k, const yaml_node_t *n, uint32_t *vals,
                    uint32_t cap, uint32_t *count)
{
    uint32_t have = 0;
    for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top;
         it++) {
        yaml_node_t *item = yaml_document_get_node(w->doc, *it);
        uint64_t v;
        if (expect(w, item, YAML_SCALAR_NODE, k->path))
            return -1;
        if (have == cap)
            return fail_at(w->e, node_mark(w->file, item), k->path, "more than %u entries",
                           cap);
        bool names = k->type == K_UID_LIST || k->type == K_GID_LIST;
        if (names && (*scalar(item) < '0' || *scalar(item) > '9')) {
            uint32_t id;
            if (lookup_id(k->type, scalar(item), &id))
                return fail_at(w->e, node_mark(w->file, item), k->path, "no %s \"%s\" on this "
                               "system", k->type == K_UID_LIST ? "user" : "group", scalar(item));
            vals[have++] = id;
            continue;
        }
        if (parse_uint(scalar(item), false, &v) || v < k->min || v > k->max)
            return fail_at(w->e, node_mark(w->file, item), k->path,
                           "\"%s\" is not an integer in [%llu, %llu]", scalar(item),
                           (unsigned long long)k->min, (unsigned long long)k->max);
        vals[have++] = (uint32_t)v;
    }
    *count = have;
    return 0;
}

static int set_list(walk *w, const key_spec *k, const yaml_node_t *n)
{
    if (expect(w, n, YAML_SEQUENCE_NODE, k->path))
        return -1;
    uint32_t len = (uint32_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (k->type == K_BUCKETS)
        return u32_list(w, k, n, u32_at(w->cfg, k), KD_MAX_GRAPH_BUCKETS, count_at(w->cfg, k));
    uint32_t *vals = calloc(len ? len : 1, sizeof(*vals));
    if (!vals)
        return fail_at(w->e, node_mark(w->file, n), k->path, "out of memory");
    uint32_t count;
    if (u32_list(w, k, n, vals, len, &count)) {
        free(vals);
        return -1;
    }
    uint32_t **slot = (uint32_t **)((char *)w->cfg + k->offset);
    free(*slot);
    *slot = vals;
    *count_at(w->cfg, k) = count;
    return 0;
}

static void layer_conf_clear(kd_layer_conf *l)
{
    free(l->name);
    free(l->file);
    free(l->a_log_tensor);
    free(l->dt_bias_tensor);
    memset(l, 0, sizeof(*l));
}

static bool layer_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > KP_NAME_MAX)
        return false;
    for (; *s; s++) {
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              strchr("._:/-", *s)))
            return false;
    }
    return true;
}

/* A relative layer file is taken relative to the config file's folder. */
static int layer_path(walk *w, const char *s, char **out)
{
    if (s[0] == '/' || !w->dir)
        return set_string(out, s);
    size_t n = strlen(w->dir) + strlen(s) + 2;
    char *p = malloc(n);
    if (!p)
        return -1;
    snprintf(p, n, "%s/%s", w->dir, s);
    free(*out);
    *out = p;
    return 0;
}

static int parse_layer(walk *w, const yaml_node_t *n, uint32_t index, kd_layer_conf *l)
{
    static const char *const fields[] = {"name", "file", "A_log", "dt_bias", "lower_bound",
                                         "scale", NULL};
    char path[64];
    snprintf(path, sizeof(path), "layers[%u]", index);
    if (expect(w, n, YAML_MAPPING_NODE, path))
        return -1;
    l->mark = node_mark(w->file, n);
    l->scale = KP_DEFAULT_SCALE;
    bool seen[6] = {false};
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *kn = yaml_document_get_node(w->doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(w->doc, p->value);
        if (expect(w, kn, YAML_SCALAR_NODE, path))
            return -1;
        int f = 0;
        while (fields[f] && strcmp(fields[f], scalar(kn)) != 0)
            f++;
        kd_conf_mark km = node_mark(w->file, kn), vm = node_mark(w->file, vn);
        if (!fields[f])
            return fail_at(w->e, km, path, "unknown key \"%s\" (known: name, file, A_log, "
                           "dt_bias, lower_bound, scale)", scalar(kn));
        if (seen[f])
            return fail_at(w->e, km, path, "key \"%s\" given twice", fields[f]);
        seen[f] = true;
        char fpath[96];
        snprintf(fpath, sizeof(fpath), "%s.%s", path, fields[f]);
        if (expect(w, vn, YAML_SCALAR_NODE, fpath))
            return -1;
        const char *s = scalar(vn);
        int rc = 0;
        switch (f) {
        case 0:
            if (!layer_name_ok(s))
                return fail_at(w->e, vm, fpath, "\"%s\" must be 1..%d bytes of [A-Za-z0-9._:/-]",
                               s, KP_NAME_MAX);
            rc = set_string(&l->name, s);
            break;
        case 1:
            if (!s[0])
                return fail_at(w->e, vm, fpath, "must name a safetensors file");
            l->file_mark = vm;
            rc = layer_path(w, s, &l->file);
            break;
        case 2: rc = set_string(&l->a_log_tensor, s); break;
        case 3: rc = set_string(&l->dt_bias_tensor, s); break;
        case 4:
            if (parse_float(s, &l->lower_bound) || !(l->lower_bound >= -5.0f &&
                                                      l->lower_bound < 0.0f))
                return fail_at(w->e, vm, fpath, "\"%s\" is not a number in [-5, 0)", s);
            break;
        case 5:
            if (parse_float(s, &l->scale))
                return fail_at(w->e, vm, fpath, "\"%s\" is not a finite number", s);
            break;
        }
        if (rc)
            return fail_at(w->e, vm, fpath, "out of memory");
    }
    const char *missing = !seen[0] ? "name" : !seen[1] ? "file" : !seen[4] ? "lower_bound" : NULL;
    if (missing)
        return fail_at(w->e, l->mark, path, "missing key \"%s\"", missing);
    if ((!l->a_log_tensor && set_string(&l->a_log_tensor, "A_log")) ||
        (!l->dt_bias_tensor && set_string(&l->dt_bias_tensor, "dt_bias")))
        return fail_at(w->e, l->mark, path, "out of memory");
    return 0;
}

static void layers_free(kd_layer_conf *layers, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        layer_conf_clear(&layers[i]);
    free(layers);
}

static int set_layers(walk *w, const key_spec *k, const yaml_node_t *n)
{
    if (expect(w, n, YAML_SEQUENCE_NODE, k->path))
        return -1;
    uint32_t len = (uint32_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    kd_layer_conf *layers = calloc(len ? len : 1, sizeof(*layers));
    if (!layers)
        return fail_at(w->e, node_mark(w->file, n), k->path, "out of memory");
    for (uint32_t i = 0; i < len; i++) {
        yaml_node_t *item = yaml_document_get_node(w->doc, n->data.sequence.items.start[i]);
        if (parse_layer(w, item, i, &layers[i])) {
            layers_free(layers, len);
            return -1;
        }
        for (uint32_t j = 0; j < i; j++) {
            if (strcmp(layers[j].name, layers[i].name) == 0) {
                fail_at(w->e, layers[i].mark, "layers", "layer \"%s\" is defined twice (first "
                        "at line %d)", layers[i].name, layers[j].mark.line);
                layers_free(layers, len);
                return -1;
            }
        }
    }
    layers_free(w->cfg->layers, w->cfg->nlayers);
    w->cfg->layers = layers;
    w->cfg->nlayers = len;
    return 0;
}

static int walk_mapping(walk *w, const yaml_node_t *n, const char *prefix)
{
    if (expect(w, n, YAML_MAPPING_NODE, prefix[0] ? prefix : "the document"))
        return -1;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *kn = yaml_document_get_node(w->doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(w->doc, p->value);
        if (expect(w, kn, YAML_SCALAR_NODE, prefix[0] ? prefix : NULL))
            return -1;
        for (yaml_node_pair_t *q = n->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = yaml_document_get_node(w->doc, q->key);
            if (prev->type == YAML_SCALAR_NODE && strcmp(scalar(prev), scalar(kn)) == 0)
                return fail_at(w->e, node_mark(w->file, kn), prefix[0] ? prefix : NULL,
                               "key \"%s\" given twice (first at line %zu)", scalar(kn),
                               prev->start_mark.line + 1);
        }
        char path[128];
        snprintf(path, sizeof(path), "%s%s%s", prefix, prefix[0] ? "." : "", scalar(kn));
        const key_spec *k = find_key(path);
        int rc;
        if (!k && is_section(path)) {
            rc = walk_mapping(w, vn, path);
        } else if (!k) {
            rc = fail_at(w->e, node_mark(w->file, kn), NULL, "unknown key \"%s\"", path);
        } else if (k->type == K_UID_LIST || k->type == K_GID_LIST || k->type == K_BUCKETS) {
            rc = set_list(w, k, vn);
        } else if (k->type == K_LAYERS) {
            rc = set_layers(w, k, vn);
        } else {
            rc = expect(w, vn, YAML_SCALAR_NODE, path);
            if (!rc)
                rc = set_scalar(w->cfg, k, scalar(vn), node_mark(w->file, vn), w->e);
        }
        if (rc)
            return -1;
        if (k)
            w->cfg->marks[k - schema] = node_mark(w->file, vn);
    }
    return 0;
}

/* Keeps `name` alive as long as the config (marks point at it). */
static const char *own_name(kd_config *c, const char *name)
{
    char **files = realloc(c->files, (c->nfiles + 1) * sizeof(*files));
    if (!files)
        return NULL;
    c->files = files;
    char *copy = strdup(name);
    if (!copy)
        return NULL;
    c->files[c->nfiles++] = copy;
    return copy;
}

/*
 * Collections nest at most this deep.  kdad's schema needs 3 levels; libyaml
 * spends time quadratic in the depth of flow collections ("[[[[...": every
 * token walks all open levels), so 100,000 levels would take minutes.  The
 * walk over parser events below stops at the first level too deep, before
 * the document is loaded.
 */
#define MAX_DEPTH 64

/* 0, or -1 with "FILE:LINE:COLUMN: ..." at the first collection nested
 * deeper than MAX_DEPTH.  Syntax errors are left to the loader. */
static int check_depth(const char *file, const char *text, size_t len, cerr *e)
{
    yaml_parser_t parser;
    yaml_event_t ev;
    if (!yaml_parser_initialize(&parser))
        return fail_at(e, (kd_conf_mark){file, 0, 0}, NULL, "out of memory");
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    int depth = 0, rc = 0;
    bool end = false;
    while (!end && rc == 0 && yaml_parser_parse(&parser, &ev)) {
        switch (ev.type) {
        case YAML_SEQUENCE_START_EVENT:
        case YAML_MAPPING_START_EVENT:
            if (++depth > MAX_DEPTH)
                rc = fail_at(e, (kd_conf_mark){file, (int)ev.start_mark.line + 1,
                                               (int)ev.start_mark.column + 1},
                             NULL, "collections nested deeper than %d levels", MAX_DEPTH);
            break;
        case YAML_SEQUENCE_END_EVENT:
        case YAML_MAPPING_END_EVENT: depth--; break;
        case YAML_STREAM_END_EVENT: end = true; break;
        default: break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&parser);
    return rc;
}

/* Parses one YAML text on top of what cfg holds. */
static int apply_yaml(kd_config *c, const char *name, const char *dir, const char *text,
                      size_t len, cerr *e)
{
    const char *file = own_name(c, name);
    if (!file)
        return fail_at(e, (kd_conf_mark){name, 0, 0}, NULL, "out of memory");
    if (check_depth(file, text, len, e) != 0)
        return -1;
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser))
        return fail_at(e, (kd_conf_mark){name, 0, 0}, NULL, "out of memory");
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        kd_conf_mark m = {file, (int)parser.problem_mark.line + 1,
                          (int)parser.problem_mark.column + 1};
        fail_at(e, m, NULL, "YAML syntax: %s%s%s", parser.problem ? parser.problem : "error",
                parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        return -1;
    }
    int rc = 0;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    /* An empty document (only comments) changes nothing. */
    if (root && !(root->type == YAML_SCALAR_NODE && root->data.scalar.length == 0)) {
        walk w = {c, &doc, file, dir, e};
        rc = walk_mapping(&w, root, "");
    }
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    return rc;
}

/* ---------------------------------------------------------------------- */
/* Whole-config checks                                                    */
/* ---------------------------------------------------------------------- */

static kd_conf_mark mark_of(const kd_config *c, const char *path)
{
    const key_spec *k = find_key(path);
    return k ? c->marks[k - schema] : (kd_conf_mark){"config", 0, 0};
}

static int check(kd_config *c, cerr *e)
{
    kp_error kerr;
    if (kp_limits_check(&c->limits, &kerr) != KP_OK) {
        /* kp_limits_check names the field first: "max_inline_bytes: ..." */
        char path[96] = "limits.";
        size_t n = strcspn(kerr.message, ":");
        snprintf(path + 7, sizeof(path) - 7, "%.*s", (int)n, kerr.message);
        const char *reason = kerr.message[n] ? kerr.message + n + 2 : kerr.message;
        return fail_at(e, mark_of(c, path), path, "%s", reason);
    }
    /* Per-uid bounds: 0 sizes them from the daemon-wide ones; above those they mean nothing. */
    kp_limits *l = &c->limits;
    if (l->max_layers_per_uid > l->max_layers)
        return fail_at(e, mark_of(c, "limits.max_layers_per_uid"), "limits.max_layers_per_uid",
                       "%u is above limits.max_layers %u", l->max_layers_per_uid, l->max_layers);
    if (l->max_slots_per_uid > c->slots)
        return fail_at(e, mark_of(c, "limits.max_slots_per_uid"), "limits.max_slots_per_uid",
                       "%u is above the pool's %u slots", l->max_slots_per_uid, c->slots);
    if (l->max_layers_per_uid == 0)
        l->max_layers_per_uid = (l->max_layers + 1) / 2;
    if (l->max_slots_per_uid == 0)
        l->max_slots_per_uid = c->slots;
    if (c->output_hard_limit < c->limits.max_frame_bytes + KP_FRAME_HEADER_BYTES)
        return fail_at(e, mark_of(c, "clients.output_hard_limit"), "clients.output_hard_limit",
                       "%llu is below limits.max_frame_bytes + 4: one response could never be "
                       "sent", (unsigned long long)c->output_hard_limit);
    /* 0 in the file: a share of the machine's memory (of the address space
     * kdad may map, for regions) */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    const uint64_t ram = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page
                                               : KD_FALLBACK_MEMORY_BYTES;
    uint64_t mappable = ram;
    struct rlimit as;
    if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
        (uint64_t)as.rlim_cur < mappable)
        mappable = (uint64_t)as.rlim_cur;
    if (c->max_inflight_bytes_total == 0)
        c->max_inflight_bytes_total = ram / 2;
    if (c->max_output_bytes_per_uid == 0)
        c->max_output_bytes_per_uid = ram / 8;
    if (c->max_output_bytes_total == 0)
        c->max_output_bytes_total = ram / 4;
    if (c->max_region_bytes_per_connection == 0)
        c->max_region_bytes_per_connection = mappable / 4;
    if (c->max_region_bytes_per_uid == 0)
        c->max_region_bytes_per_uid = mappable / 2;
    /* the quotas on unanswered bytes must admit one frame of the largest size */
    const struct { const char *key; uint64_t value; } quotas[] = {
        {"clients.max_inflight_bytes_per_uid", c->max_inflight_bytes_per_uid},
        {"clients.max_inflight_bytes_total", c->max_inflight_bytes_total},
    };
    for (size_t i = 0; i < sizeof(quotas) / sizeof(quotas[0]); i++) {
        if (quotas[i].value < c->limits.max_frame_bytes)
            return fail_at(e, mark_of(c, quotas[i].key), quotas[i].key, "%llu is below "
                           "limits.max_frame_bytes %llu: a frame of the largest size could never "
                           "be admitted", (unsigned long long)quotas[i].value,
                           (unsigned long long)c->limits.max_frame_bytes);
    }
    if (c->output_soft_limit > c->output_hard_limit)
        return fail_at(e, mark_of(c, "clients.output_soft_limit"), "clients.output_soft_limit",
                       "%llu is above clients.output_hard_limit %llu",
                       (unsigned long long)c->output_soft_limit,
                       (unsigned long long)c->output_hard_limit);
    for (uint32_t i = 1; i < c->ngraph_buckets; i++) {
        if (c->graph_buckets[i] <= c->graph_buckets[i - 1])
            return fail_at(e, mark_of(c, "batching.graph_buckets"), "batching.graph_buckets",
                           "buckets must be strictly increasing (%u after %u)",
                           c->graph_buckets[i], c->graph_buckets[i - 1]);
    }
    if (c->cuda_split_scratch % 2)
        return fail_at(e, mark_of(c, "cuda_split_scratch"), "cuda_split_scratch",
                       "%llu is odd: the scratch holds bf16 values of 2 bytes",
                       (unsigned long long)c->cuda_split_scratch);
    if (c->ngraph_buckets &&
        c->graph_buckets[c->ngraph_buckets - 1] < c->limits.max_batch_seqs)
        return fail_at(e, mark_of(c, "batching.graph_buckets"), "batching.graph_buckets",
                       "the largest bucket %u is below limits.max_batch_seqs %u",
                       c->graph_buckets[c->ngraph_buckets - 1], c->limits.max_batch_seqs);
    return 0;
}

/* ---------------------------------------------------------------------- */
/* Public                                                                 */
/* ---------------------------------------------------------------------- */

void kd_config_free(kd_config *c)
{
    for (size_t i = 0; i < NKEYS; i++) {
        if (schema[i].type == K_STR || schema[i].type == K_DEVICE)
            free(*(char **)((char *)c + schema[i].offset));
    }
    free(c->allowed_uids);
    free(c->allowed_gids);
    layers_free(c->layers, c->nlayers);
    for (uint32_t i = 0; i < c->nfiles; i++)
        free(c->files[i]);
    free(c->files);
    free(c->marks);
    memset(c, 0, sizeof(*c));
}

/* The built-in default underneath everything. */
static int load_builtin(kd_config *c, cerr *e)
{
    memset(c, 0, sizeof(*c));
    c->marks = calloc(NKEYS, sizeof(*c->marks));
    if (!c->marks)
        return fail_at(e, (kd_conf_mark){KD_BUILTIN_CONFIG_NAME, 0, 0}, NULL, "out of memory");
    for (size_t i = 0; i < NKEYS; i++)
        c->marks[i] = (kd_conf_mark){KD_BUILTIN_CONFIG_NAME, 0, 0};
    return apply_yaml(c, KD_BUILTIN_CONFIG_NAME, NULL, kd_builtin_config, kd_builtin_config_len,
                      e);
}

static int read_file(const char *path, char **text, size_t *len, cerr *e)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail_at(e, (kd_conf_mark){path, 0, 0}, NULL, "cannot open: %s", strerror(errno));
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            /* a config file is a few KiB; refuse anything absurd */
            if (cap >= (16u << 20)) {
                free(buf);
                fclose(f);
                return fail_at(e, (kd_conf_mark){path, 0, 0}, NULL, "larger than 16 MiB");
            }
            cap = cap ? cap * 2 : 8192;
            char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                fclose(f);
                return fail_at(e, (kd_conf_mark){path, 0, 0}, NULL, "out of memory");
            }
            buf = grown;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return fail_at(e, (kd_conf_mark){path, 0, 0}, NULL, "read error");
    }
    *text = buf;
    *len = n;
    return 0;
}

static int apply_overrides(kd_config *c, const kd_config_overrides *ov, cerr *e)
{
    const struct { const char *flag, *key, *value; } list[] = {
        {"--socket", "socket.path", ov->socket},       {"--backend", "backend", ov->backend},
        {"--heads", "heads", ov->heads},               {"--slots", "slots", ov->slots},
        {"--state-dtype", "state_dtype", ov->state_dtype}, {"--device", "device", ov->device},
        {"--log-level", "log.level", ov->log_level},
    };
    for (size_t i = 0; i < sizeof(list) / sizeof(list[0]); i++) {
        if (!list[i].value)
            continue;
        const key_spec *k = find_key(list[i].key);
        kd_conf_mark m = {list[i].flag, 0, 0};
        if (set_scalar(c, k, list[i].value, m, e))
            return -1;
        c->marks[k - schema] = m;
    }
    return 0;
}

int kd_config_load(kd_config *c, const char *path, const kd_config_overrides *ov, char *err,
                   size_t errlen)
{
    cerr e = {err, errlen};
    if (load_builtin(c, &e))
        goto fail;
    if (path) {
        char *text = NULL;
        size_t len = 0;
        if (read_file(path, &text, &len, &e))
            goto fail;
        char *dir = strdup(path);
        char *slash = dir ? strrchr(dir, '/') : NULL;
        if (slash)
            *slash = '\0';
        int rc = dir ? apply_yaml(c, path, slash ? dir : NULL, text, len, &e)
                     : fail_at(&e, (kd_conf_mark){path, 0, 0}, NULL, "out of memory");
        free(dir);
        free(text);
        if (rc)
            goto fail;
    }
    if (ov && apply_overrides(c, ov, &e))
        goto fail;
    if (check(c, &e))
        goto fail;
    return 0;
fail:
    kd_config_free(c);
    return -1;
}

int kd_config_load_text(kd_config *c, const char *name, const char *text, size_t len,
                        char *err, size_t errlen)
{
    cerr e = {err, errlen};
    if (load_builtin(c, &e) || apply_yaml(c, name, NULL, text, len, &e) || check(c, &e)) {
        kd_config_free(c);
        return -1;
    }
    return 0;
}

const char *kd_config_socket_path(const kd_config *c, char *buf, size_t size)
{
    if (c->socket_path && c->socket_path[0])
        snprintf(buf, size, "%s", c->socket_path);
    else if (getenv("XDG_RUNTIME_DIR") && getenv("XDG_RUNTIME_DIR")[0])
        snprintf(buf, size, "%s/kdad.sock", getenv("XDG_RUNTIME_DIR"));
    else
        snprintf(buf, size, "/run/kdad/kdad.sock");
    return buf;
}

/* ---------------------------------------------------------------------- */
/* Printing (kdad --print-config)                                         */
/* ---------------------------------------------------------------------- */

static void print_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        if (*s == '"' || *s == '\\')
            fputc('\\', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static void print_origin(FILE *f, kd_conf_mark m)
{
    if (!m.file || strcmp(m.file, KD_BUILTIN_CONFIG_NAME) == 0)
        fputs("  # built-in\n", f);
    else if (m.line > 0)
        fprintf(f, "  # %s:%d\n", m.file, m.line);
    else
        fprintf(f, "  # %s\n", m.file);
}

static void print_ids(FILE *f, const uint32_t *ids, uint32_t n)
{
    fputc('[', f);
    for (uint32_t i = 0; i < n; i++)
        fprintf(f, "%s%u", i ? ", " : "", ids[i]);
    fputc(']', f);
}

static void print_value(FILE *f, const kd_config *c, const key_spec *k)
{
    const char *at = (const char *)c + k->offset;
    switch (k->type) {
    case K_STR:
        print_string(f, *(char *const *)at);
        break;
    case K_DEVICE: {
        const char *dev = *(char *const *)at;
        if (dev && *dev && strspn(dev, "0123456789") == strlen(dev))
            fputs(dev, f); /* an ordinal, as it was written */
        else
            print_string(f, dev);
        break;
    }
    case K_U32:
        fprintf(f, "%u", *(const uint32_t *)at);
        break;
    case K_SIZE:
        fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)at);
        break;
    case K_BOOL:
        fputs(*(const bool *)at ? "true" : "false", f);
        break;
    case K_MODE:
        fprintf(f, "0%o", *(const uint32_t *)at);
        break;
    case K_ENUM:
        fputs(k->choices[*(const int *)at], f);
        break;
    case K_UID_LIST:
    case K_GID_LIST:
        print_ids(f, *(uint32_t *const *)at, *(const uint32_t *)((const char *)c + k->count_off));
        break;
    case K_BUCKETS:
        print_ids(f, (const uint32_t *)at, *(const uint32_t *)((const char *)c + k->count_off));
        break;
    case K_LAYERS:
        break;
    }
}

void kd_config_print(const kd_config *c, FILE *f)
{
    fputs("# kdad's effective configuration: the built-in file, then --config FILE, then the\n"
          "# flags; each key says where its value came from.  Sizes in bytes.\n", f);
    const char *section = NULL;
    size_t section_len = 0;
    for (size_t i = 0; i < NKEYS; i++) {
        const key_spec *k = &schema[i];
        const char *dot = strchr(k->path, '.');
        size_t len = dot ? (size_t)(dot - k->path) : 0;
        if (len != section_len || (len && strncmp(section, k->path, len) != 0)) {
            if (len)
                fprintf(f, "%.*s:\n", (int)len, k->path);
            section = k->path;
            section_len = len;
        }
        const char *name = len ? k->path + len + 1 : k->path;
        if (k->type == K_LAYERS) {
            fprintf(f, "%s:%s", name, c->nlayers ? "" : " []");
            print_origin(f, c->marks[i]);
            for (uint32_t j = 0; j < c->nlayers; j++) {
                const kd_layer_conf *l = &c->layers[j];
                fputs("  - name: ", f);
                print_string(f, l->name);
                print_origin(f, l->mark);
                fputs("    file: ", f);
                print_string(f, l->file);
                fputs("\n    A_log: ", f);
                print_string(f, l->a_log_tensor);
                fputs("\n    dt_bias: ", f);
                print_string(f, l->dt_bias_tensor);
                fprintf(f, "\n    lower_bound: %.9g\n    scale: %.9g\n", l->lower_bound, l->scale);
            }
            continue;
        }
        fprintf(f, "%s%s: ", len ? "  " : "", name);
        print_value(f, c, k);
        print_origin(f, c->marks[i]);
    }
}

kp_client_bounds kd_config_client_bounds(const kd_config *cfg)
{
    return (kp_client_bounds){
        .max_connections = cfg->max_connections,
        .max_connections_per_uid = cfg->max_connections_per_uid,
        .max_inflight_bytes_per_uid = cfg->max_inflight_bytes_per_uid,
        .max_inflight_bytes_total = cfg->max_inflight_bytes_total,
        .output_hard_limit = cfg->output_hard_limit,
        .output_soft_limit = cfg->output_soft_limit,
        .output_soft_seconds = cfg->output_soft_seconds,
        .max_output_bytes_per_uid = cfg->max_output_bytes_per_uid,
        .max_output_bytes_total = cfg->max_output_bytes_total,
        .max_region_bytes_per_connection = cfg->max_region_bytes_per_connection,
        .max_region_bytes_per_uid = cfg->max_region_bytes_per_uid,
        .frame_stall_seconds = cfg->frame_stall_seconds,
        .output_stall_seconds = cfg->output_stall_seconds,
    };
}
