/*
 * config.h - kdad's configuration: the YAML file (libyaml), the default
 * compiled in from config/kdad.yaml, and command-line overrides.
 *
 * Loading is layered: the built-in default is parsed first, then the file
 * (every key it names replaces the default; `layers` replaces the whole
 * list), then the overrides.  Each step checks types and ranges; the result
 * is then checked as a whole (kd_config_check).  Every error reads
 * "FILE:LINE:COLUMN: key.path: reason" (overrides: "--heads: reason").
 * config/kdad.yaml documents every key.
 */
#ifndef KDAD_CONFIG_H
#define KDAD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "defaults.h"
#include <stdio.h>

#include "kdaproto.h"
#include "log.h"

#define KD_CONFIG_ERR_MAX 512
#define KD_BUILTIN_CONFIG_NAME "<built-in kdad.yaml>"

/* Where a value came from, for error messages. */
typedef struct kd_conf_mark {
    const char *file; /* the file name (owned by the kd_config), or an override name */
    int line, col;    /* 1-based; 0 for command-line overrides */
} kd_conf_mark;

typedef enum kd_backend_kind {
    KD_BACKEND_AUTO = 0, /* cuda when a usable GPU is present, else cpu */
    KD_BACKEND_CPU = 1,
    KD_BACKEND_CUDA = 2,
} kd_backend_kind;

/* How the cuda backend learns that a batch finished (cuda_completion). */
typedef enum kd_cuda_completion {
    KD_CUDA_COMPLETION_POLL = 0,  /* a thread polls the batch's event every few microseconds */
    KD_CUDA_COMPLETION_BLOCK = 1, /* a thread sleeps in cudaEventSynchronize (blocking sync) */
} kd_cuda_completion;

/* One entry of `layers`: weights loaded from a safetensors file at start. */
typedef struct kd_layer_conf {
    char *name;           /* layer name, KP_NAME_MAX bytes of [A-Za-z0-9._:/-] */
    char *file;           /* safetensors file */
    char *a_log_tensor;   /* tensor name of A_log, f32 [heads] */
    char *dt_bias_tensor; /* tensor name of dt_bias, f32 [heads, 128] */
    float lower_bound;    /* in [-5, 0) */
    float scale;          /* finite */
    kd_conf_mark mark;      /* the list entry */
    kd_conf_mark file_mark; /* the `file` value: file errors point here */
} kd_layer_conf;

typedef struct kd_config {
    /* socket */
    char *socket_path;        /* "" = $XDG_RUNTIME_DIR/kdad.sock or /run/kdad/kdad.sock */
    uint32_t socket_mode;     /* permission bits of the socket file */
    char *socket_group;       /* "" = the daemon's group */
    /* access [reload]; the file may name users and groups, resolved at load (access.h) */
    uint32_t *allowed_uids;   /* empty uids and gids: everyone who can open the socket */
    uint32_t nallowed_uids;
    uint32_t *allowed_gids;
    uint32_t nallowed_gids;
    /* backend and pool */
    kd_backend_kind backend;
    kd_cuda_completion cuda_completion;
    uint64_t cuda_split_scratch; /* bytes of the split path's outputs scratch per kernel instance */
    char *device;             /* "N" (CUDA ordinal) or "GPU-..." (a GPU UUID, or a unique
                                 prefix of one); the cuda backend resolves it */
    uint32_t cpu_threads;     /* 0 = one per online CPU */
    uint32_t heads;           /* H, 1..KP_MAX_HEADS */
    uint32_t slots;           /* pool size, 1..KD_MAX_SLOTS */
    kp_dtype state_dtype;
    bool slots_persist;       /* slots belong to the uid and survive disconnects */
    /* limits announced in hello (docs/daemon.md says which a reload may change) */
    kp_limits limits;
    /* batching */
    uint32_t graph_buckets[KD_MAX_GRAPH_BUCKETS]; /* strictly increasing */
    uint32_t ngraph_buckets;    /* 0 in the file = powers of two up to max_batch_seqs */
    uint32_t max_queued_requests;
    uint32_t spin_us;           /* the loop polls this long after answering a batch [reload] */
    bool hold_while_busy;       /* hold.h [reload] */
    uint32_t hold_fill_percent; /* 1..100 [reload] */
    uint32_t hold_max_us;       /* [reload] */
    uint32_t gather_us;         /* hold.h, gathering; 0: off [reload] */
    uint32_t gather_wave_percent; /* 1..100 [reload] */
    uint32_t ready_spin_us;     /* sem.h: the loop spins this long on a new ready wait [reload] */
    uint32_t ready_timeout_ms;  /* sem.h: a ready word below its value this long fails [reload] */
    bool ready_on_device;       /* engine.h: gated prefills staged behind a device-side wait [reload] */
    /* clients [reload] */
    uint32_t max_connections;
    uint32_t max_connections_per_uid;     /* quota.h */
    uint64_t max_inflight_bytes_per_uid;  /* unanswered request frame bytes; quota.h */
    uint64_t max_inflight_bytes_total;    /* the same, all uids; 0 in the file = half the RAM */
    uint64_t output_hard_limit;
    uint64_t output_soft_limit;
    uint32_t output_soft_seconds;
    uint64_t max_output_bytes_per_uid;    /* unread responses of one uid; 0 in the file = RAM / 8 */
    uint64_t max_output_bytes_total;      /* the same, all uids; 0 in the file = RAM / 4 */
    uint64_t max_region_bytes_per_connection; /* mapped regions; 0 in the file = memory / 4 */
    uint64_t max_region_bytes_per_uid;    /* the same, all of a uid's; 0 in the file = memory / 2 */
    uint32_t frame_stall_seconds;         /* a frame begun and no byte of it since: closed */
    uint32_t output_stall_seconds;        /* unread output and no byte of it taken since: closed */
    /* transports */
    bool transport_shm;
    bool transport_cuda_ipc;
    /* layers [reload] */
    kd_layer_conf *layers;
    uint32_t nlayers;
    /* log, metrics [reload] */
    kd_log_level log_level;
    char *prometheus_file;    /* "" = no metrics file */
    uint32_t metrics_interval_ms;
    uint32_t drain_timeout_ms;

    /* bookkeeping: the names marks point to, and the mark of every key set */
    char **files;
    uint32_t nfiles;
    kd_conf_mark *marks;      /* one per schema key (config.c) */
} kd_config;

/* Command-line overrides; NULL fields are not given. */
typedef struct kd_config_overrides {
    const char *socket;
    const char *backend;
    const char *heads;
    const char *slots;
    const char *state_dtype;
    const char *device;
    const char *log_level;
} kd_config_overrides;

/*
 * Loads the built-in default, then `path` (NULL: none), then the overrides
 * (NULL: none), and checks the whole.  On failure returns -1 with the
 * message in err and leaves *cfg freed.  Does not open layer files (see
 * layer.h kd_layer_conf_load).
 */
int kd_config_load(kd_config *cfg, const char *path, const kd_config_overrides *ov, char *err,
                   size_t errlen);

/* Parses YAML text (no built-in layer underneath) into a config that starts
 * from the built-in default; `name` labels errors.  For tests and tools. */
int kd_config_load_text(kd_config *cfg, const char *name, const char *text, size_t len,
                        char *err, size_t errlen);

void kd_config_free(kd_config *cfg);

/* The clients.* bounds as hello and stats announce them. */
kp_client_bounds kd_config_client_bounds(const kd_config *cfg);
/* Writes the configuration as YAML kdad reads back, every key with where its value came
 * from (the built-in file, FILE:LINE, or a flag) as a comment: `kdad --print-config`. */
void kd_config_print(const kd_config *cfg, FILE *f);

/* The socket path in force: socket_path, or the default described above. */
const char *kd_config_socket_path(const kd_config *cfg, char *buf, size_t size);

/* The built-in default (config/kdad.yaml, embedded at build time). */
extern const char kd_builtin_config[];
extern const size_t kd_builtin_config_len;

#endif /* KDAD_CONFIG_H */
