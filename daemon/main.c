/*
 * main.c - kdad's command line, start-up and exit.
 *
 *   kdad [--config FILE] [--socket PATH] [--backend auto|cpu|cuda] [--heads N]
 *        [--slots N] [--state-dtype bf16|f32] [--device N] [--log-level LEVEL]
 *   kdad --check-config [FILE] [flags]   check a configuration (and its layer files), then exit
 *   kdad --print-config [--config FILE] [flags]   print the configuration kdad would run with
 *
 * Exit codes: 0 after a drain (SIGTERM/SIGINT), 1 on a runtime or device
 * failure, 2 for a bad command line or configuration, 69 when the backend
 * asked for (--backend cuda) is not available.
 */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
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
            "       kdad --check-config [FILE] [flags]\n"
            "       kdad --print-config [--config FILE] [flags]\n"
            "       kdad --help | --version\n"
            "\n"
            "Serves Kimi Delta Attention prefill on a Unix socket.  Without --config the\n"
            "built-in configuration (config/kdad.yaml) is used; flags override the file.\n"
            "SIGTERM/SIGINT drain and exit 0; SIGHUP reloads the configuration.\n"
            "\n"
            "  -c, --config FILE      the configuration file (every key: config/kdad.yaml)\n"
            "      --socket PATH      the socket to listen on (socket.path)\n"
            "      --backend KIND     auto (the GPU when usable, else the CPU), cpu or cuda\n"
            "      --heads N          heads of every layer and slot (heads)\n"
            "      --slots N          state slots in the pool (slots)\n"
            "      --state-dtype T    the pool's dtype: bf16 (bfloat16) or f32 (fp32, float32)\n"
            "      --device N         the CUDA device (device)\n"
            "      --log-level LEVEL  error, warning, notice, info or debug (log.level)\n"
            "      --check-config [FILE]  check the configuration (FILE, else the built-in one,\n"
            "                         with the flags) and its layer files, then exit\n"
            "      --print-config     print the configuration kdad would run with, each key\n"
            "                         with where its value came from, then exit\n"
            "  -h, --help             this help\n"
            "      --version          kdad's version\n"
            "\n"
            "Examples:\n"
            "  kdad --socket /tmp/kdad.sock --heads 8 --backend cpu\n"
            "  kdad --check-config /etc/kdad/kdad.yaml\n"
            "  kdad --print-config --config /etc/kdad/kdad.yaml --slots 512\n");
}

/*
 * The socket's folder exists and kdad may create the socket there, and the path is free or a
 * socket: checked before the pool is allocated (a GPU pool takes seconds), so that a wrong
 * path fails at once with what to do.  Not when systemd passes the socket.
 */
static int check_socket_path(const char *path, char *err, size_t errlen)
{
    if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        snprintf(err, errlen, "socket %s: the path is %zu bytes; a Unix socket path holds at "
                 "most %zu", path, strlen(path), sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
        return -1;
    }
    char copy[sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(copy, sizeof(copy), "%s", path);
    const char *dir = dirname(copy);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno == ENOENT)
            snprintf(err, errlen, "socket %s: the folder %s does not exist; create it (mkdir -p "
                     "%s; for /run/kdad: systemd-tmpfiles --create kdad.conf) or choose another "
                     "path with --socket or socket.path", path, dir, dir);
        else
            snprintf(err, errlen, "socket %s: %s: %s", path, dir, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "socket %s: %s is not a folder", path, dir);
        return -1;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        snprintf(err, errlen, "socket %s: kdad (uid %u) may not create files in %s (%s); run it "
                 "as a user who may, or choose another path with --socket", path,
                 (unsigned)geteuid(), dir, strerror(errno));
        return -1;
    }
    if (lstat(path, &sb) == 0 && !S_ISSOCK(sb.st_mode)) {
        snprintf(err, errlen, "socket %s: the path exists and is not a socket; remove it or "
                 "choose another path", path);
        return -1;
    }
    return 0;
}

/* --print-config: the configuration kdad would run with. */
static int print_config(const char *path, const kd_config_overrides *ov)
{
    kd_config cfg;
    char err[KD_CONFIG_ERR_MAX];
    if (kd_config_load(&cfg, path, ov, err, sizeof(err)) != 0) {
        fprintf(stderr, "%s\n", err);
        return KD_EXIT_USAGE;
    }
    kd_config_print(&cfg, stdout);
    kd_config_free(&cfg);
    return KD_EXIT_OK;
}

/* --check-config: parse and check the file (NULL: the built-in one), with the flags, and read
 * every layer file. */
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
    printf("%s: ok (backend %s, %u heads, %u slots, %u layers)\n",
           path ? path : "built-in configuration",
           cfg.backend == KD_BACKEND_AUTO ? "auto" : cfg.backend == KD_BACKEND_CPU ? "cpu" : "cuda",
           cfg.heads, cfg.slots, cfg.nlayers);
    kd_config_free(&cfg);
    return KD_EXIT_OK;
}

int main(int argc, char **argv)
{
    enum { OPT_CHECK = 256, OPT_SOCKET, OPT_BACKEND, OPT_HEADS, OPT_SLOTS, OPT_DTYPE, OPT_DEVICE,
           OPT_LEVEL, OPT_VERSION, OPT_PRINT };
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", no_argument, NULL, OPT_CHECK},
        {"print-config", no_argument, NULL, OPT_PRINT},
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
    const char *config_path = NULL;
    bool check = false, print = false;
    kd_config_overrides ov = {0};
    int opt;
    while ((opt = getopt_long(argc, argv, "c:h", opts, NULL)) != -1) {
        switch (opt) {
        case 'c': config_path = optarg; break;
        case OPT_CHECK: check = true; break;
        case OPT_PRINT: print = true; break;
        case OPT_SOCKET: ov.socket = optarg; break;
        case OPT_BACKEND: ov.backend = optarg; break;
        case OPT_HEADS: ov.heads = optarg; break;
        case OPT_SLOTS: ov.slots = optarg; break;
        case OPT_DTYPE: ov.state_dtype = optarg; break;
        case OPT_DEVICE: ov.device = optarg; break;
        case OPT_LEVEL: ov.log_level = optarg; break;
        case 'h': usage(stdout); return KD_EXIT_OK;
        case OPT_VERSION: printf("kdad %s\n", KD_VERSION_STRING); return KD_EXIT_OK;
        default:
            fprintf(stderr, "kdad: kdad --help lists the options\n");
            return KD_EXIT_USAGE;
        }
    }
    /* --check-config FILE: the file may also follow as an argument */
    if (check && !config_path && optind < argc)
        config_path = argv[optind++];
    if (optind < argc) {
        fprintf(stderr, "kdad: unexpected argument \"%s\" (kdad --help lists the options)\n",
                argv[optind]);
        return KD_EXIT_USAGE;
    }
    if (check && print) {
        fprintf(stderr, "kdad: --check-config and --print-config: one at a time\n");
        return KD_EXIT_USAGE;
    }
    if (check)
        return check_config(config_path, &ov);
    if (print)
        return print_config(config_path, &ov);

    kd_log_init(KD_LOG_INFO);
    kd_config cfg;
    char err[KD_CONFIG_ERR_MAX];
    if (kd_config_load(&cfg, config_path, &ov, err, sizeof(err)) != 0) {
        KD_ERROR("configuration: %s", err);
        return KD_EXIT_USAGE;
    }
    kd_log_set_level(cfg.log_level);
    char sock[sizeof(((struct sockaddr_un *)0)->sun_path) + 64];
    if (sd_listen_fds(0) <= 0 &&
        check_socket_path(kd_config_socket_path(&cfg, sock, sizeof(sock)), err, sizeof(err))) {
        KD_ERROR("start-up: %s", err);
        kd_config_free(&cfg);
        return KD_EXIT_USAGE;
    }
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
