/*
 * main.c - kdad's command line, start-up and exit.
 *
 *   kdad [--config FILE] [--socket PATH] [--backend auto|cpu|cuda] [--heads N]
 *        [--slots N] [--state-dtype bf16|f32] [--device N] [--log-level LEVEL]
 *   kdad --check-config FILE     check a configuration (and its layer files), then exit
 *
 * Exit codes: 0 after a drain (SIGTERM/SIGINT), 1 on a runtime or device
 * failure, 2 for a bad command line or configuration, 69 when the backend
 * asked for (--backend cuda) is not available.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "config.h"
#include "daemon.h"
#include "defaults.h"
#include "layer.h"
#include "log.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kdad [--config FILE] [--socket PATH] [--backend auto|cpu|cuda]\n"
            "            [--heads N] [--slots N] [--state-dtype bf16|f32] [--device N]\n"
            "            [--log-level error|warning|notice|info|debug]\n"
            "       kdad --check-config FILE\n"
            "       kdad --help | --version\n"
            "\n"
            "Serves Kimi Delta Attention prefill on a Unix socket.  Without --config the\n"
            "built-in configuration (config/kdad.yaml) is used; flags override the file.\n"
            "SIGTERM/SIGINT drain and exit 0; SIGHUP reloads the configuration.\n");
}

/* --check-config: parse and check the file, and read every layer file. */
static int check_config(const char *path, const kd_config_overrides *ov)
{
    kd_config cfg;
    char err[KD_CONFIG_ERR_MAX];
    if (kd_config_load(&cfg, path, ov, err, sizeof(err)) != 0) {
        fprintf(stderr, "%s\n", err);
        return KD_EXIT_USAGE;
    }
    for (uint32_t i = 0; i < cfg.nlayers; i++) {
        float *a, *dt;
        if (kd_layer_conf_load(&cfg.layers[i], i, cfg.heads, &a, &dt, err, sizeof(err)) != 0) {
            fprintf(stderr, "%s\n", err);
            kd_config_free(&cfg);
            return KD_EXIT_USAGE;
        }
        free(a);
        free(dt);
    }
    printf("%s: ok (backend %s, %u heads, %u slots, %u layers)\n", path,
           cfg.backend == KD_BACKEND_AUTO ? "auto" : cfg.backend == KD_BACKEND_CPU ? "cpu" : "cuda",
           cfg.heads, cfg.slots, cfg.nlayers);
    kd_config_free(&cfg);
    return KD_EXIT_OK;
}

int main(int argc, char **argv)
{
    enum { OPT_CHECK = 256, OPT_SOCKET, OPT_BACKEND, OPT_HEADS, OPT_SLOTS, OPT_DTYPE, OPT_DEVICE,
           OPT_LEVEL, OPT_VERSION };
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", required_argument, NULL, OPT_CHECK},
        {"socket", required_argument, NULL, OPT_SOCKET},
        {"backend", required_argument, NULL, OPT_BACKEND},
        {"heads", required_argument, NULL, OPT_HEADS},
        {"slots", required_argument, NULL, OPT_SLOTS},
        {"state-dtype", required_argument, NULL, OPT_DTYPE},
        {"device", required_argument, NULL, OPT_DEVICE},
        {"log-level", required_argument, NULL, OPT_LEVEL},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, OPT_VERSION},
        {NULL, 0, NULL, 0},
    };
    const char *config_path = NULL, *check = NULL;
    kd_config_overrides ov = {0};
    int opt;
    while ((opt = getopt_long(argc, argv, "c:h", opts, NULL)) != -1) {
        switch (opt) {
        case 'c': config_path = optarg; break;
        case OPT_CHECK: check = optarg; break;
        case OPT_SOCKET: ov.socket = optarg; break;
        case OPT_BACKEND: ov.backend = optarg; break;
        case OPT_HEADS: ov.heads = optarg; break;
        case OPT_SLOTS: ov.slots = optarg; break;
        case OPT_DTYPE: ov.state_dtype = optarg; break;
        case OPT_DEVICE: ov.device = optarg; break;
        case OPT_LEVEL: ov.log_level = optarg; break;
        case 'h': usage(stdout); return KD_EXIT_OK;
        case OPT_VERSION: printf("kdad %s\n", KD_VERSION_STRING); return KD_EXIT_OK;
        default: usage(stderr); return KD_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kdad: unexpected argument \"%s\"\n", argv[optind]);
        usage(stderr);
        return KD_EXIT_USAGE;
    }
    if (check)
        return check_config(check, &ov);

    kd_log_init(KD_LOG_INFO);
    kd_config cfg;
    char err[KD_CONFIG_ERR_MAX];
    if (kd_config_load(&cfg, config_path, &ov, err, sizeof(err)) != 0) {
        KD_ERROR("configuration: %s", err);
        return KD_EXIT_USAGE;
    }
    kd_log_set_level(cfg.log_level);
    /* A peer that vanishes must cost an EPIPE, not the process. */
    signal(SIGPIPE, SIG_IGN);

    /* libuv reads it when its thread pool starts (kd_daemon_init starts it) */
    char threads[16];
    snprintf(threads, sizeof(threads), "%d", KD_UV_THREADPOOL_SIZE);
    setenv("UV_THREADPOOL_SIZE", threads, 0);
    uv_loop_t loop;
    uv_loop_init(&loop);
    static kd_daemon d; /* large, and referenced by every callback */
    int rc = kd_daemon_init(&d, &loop, &cfg, config_path, &ov, err, sizeof(err));
    if (rc != KD_EXIT_OK) {
        KD_ERROR("start-up: %s", err);
    } else {
        /* Before the socket accepts anyone: a client may send SIGTERM as soon
         * as it can connect, and the default action would kill kdad undrained. */
        kd_daemon_handle_signals(&d);
        rc = kd_daemon_listen(&d, err, sizeof(err));
        if (rc != KD_EXIT_OK) {
            KD_ERROR("start-up: %s", err);
            kd_daemon_drain(&d);
        } else {
            kd_daemon_ready(&d);
        }
        uv_run(&loop, UV_RUN_DEFAULT);
        if (rc == KD_EXIT_OK)
            rc = d.exit_code;
    }
    kd_daemon_destroy(&d);
    uv_run(&loop, UV_RUN_DEFAULT); /* close callbacks of a backend torn down after a failed start */
    if (uv_loop_close(&loop) != 0)
        KD_WARN("the event loop did not close cleanly");
    return rc;
}
