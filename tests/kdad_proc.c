/*
 * kdad_proc.c - real kdad and kdactl processes for end-to-end tests (see
 * kdad_proc.h).
 */
#define _GNU_SOURCE
#include "kdad_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kdaclient.h"

extern char **environ;

#define START_WAIT_S 30
#define STOP_WAIT_S 60
#define CMD_WAIT_S 300

const char *build_path(const char *rel)
{
    static char bufs[4][512];
    static int next;
    char *b = bufs[next++ % 4];
    snprintf(b, sizeof(bufs[0]), "%s/%s", KDAD_BUILD_DIR, rel);
    return b;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return strdup("");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = 0;
    fclose(f);
    return s;
}

/* Waits for pid up to `seconds`; returns its exit code, or -1. */
static int wait_exit(pid_t pid, double seconds, bool *exited)
{
    double end = now() + seconds;
    int st;
    *exited = false;
    while (now() < end) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            *exited = true;
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        usleep(10000);
    }
    return -1;
}

/* Spawns argv with stdout and stderr to the given files. */
static pid_t spawn(char *const argv[], const char *out, const char *err)
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc == 0 ? pid : -1;
}

bool kdad_start(kdad_proc *d, int heads, const char *config_yaml)
{
    return kdad_start_on(d, "cpu", heads, config_yaml);
}

bool kdad_start_on(kdad_proc *d, const char *backend, int heads, const char *config_yaml)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/kdad-e2e-XXXXXX");
    if (!mkdtemp(d->dir))
        return false;
    snprintf(d->sock, sizeof(d->sock), "%s/kdad.sock", d->dir);
    snprintf(d->log, sizeof(d->log), "%s/kdad.log", d->dir);
    char conf[96], hs[16];
    snprintf(conf, sizeof(conf), "%s/kdad.yaml", d->dir);
    snprintf(hs, sizeof(hs), "%d", heads);
    char *argv[16] = {(char *)build_path("daemon/kdad"), "--socket", d->sock, "--backend",
                      (char *)backend,
                      "--heads", hs, "--slots", "64", "--log-level", "notice", NULL};
    if (config_yaml) {
        FILE *f = fopen(conf, "w");
        fputs(config_yaml, f);
        fclose(f);
        argv[11] = "--config";
        argv[12] = conf;
    }
    d->pid = spawn(argv, d->log, d->log);
    if (d->pid < 0)
        return false;
    double end = now() + START_WAIT_S;
    while (now() < end) {
        kdac_options o;
        kdac_options_init(&o);
        o.socket_path = d->sock;
        o.timeout_ms = 5000;
        kdac_client *c;
        if (kdac_client_open(&c, &o, NULL) == KDAC_OK) {
            kdac_client_close(c);
            return true;
        }
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid)
            break;
        usleep(20000);
    }
    char *log = slurp(d->log);
    fprintf(stderr, "kdad did not start; its log:\n%s\n", log);
    free(log);
    return false;
}

int kdad_stop(kdad_proc *d)
{
    bool exited;
    kill(d->pid, SIGTERM);
    int code = wait_exit(d->pid, STOP_WAIT_S, &exited);
    if (!exited) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
    }
    if (code != 0) {
        char *log = slurp(d->log);
        fprintf(stderr, "kdad exited with %d; its log:\n%s\n", code, log);
        free(log);
    }
    char path[128];
    static const char *const files[] = {"kdad.sock", "kdad.yaml", "kdad.log"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/%s", d->dir, files[i]);
        unlink(path);
    }
    rmdir(d->dir);
    return code;
}

cmd_result cmd_run(char *const argv[])
{
    cmd_result r = {-1, NULL, NULL};
    char dir[] = "/tmp/kdactl-run-XXXXXX", out[64], err[64];
    if (!mkdtemp(dir))
        return r;
    snprintf(out, sizeof(out), "%s/out", dir);
    snprintf(err, sizeof(err), "%s/err", dir);
    pid_t pid = spawn(argv, out, err);
    if (pid > 0) {
        bool exited;
        r.status = wait_exit(pid, CMD_WAIT_S, &exited);
        if (!exited) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
    }
    r.out = slurp(out);
    r.err = slurp(err);
    unlink(out);
    unlink(err);
    rmdir(dir);
    return r;
}

cmd_result kdactl_v(const char *sock, const char *first, va_list ap)
{
    char *argv[64] = {(char *)build_path("client/kdactl"), "--socket", (char *)sock};
    int n = 3;
    if (first)
        argv[n++] = (char *)first;
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 63)
        argv[n++] = (char *)a;
    argv[n] = NULL;
    return cmd_run(argv);
}

cmd_result kdactl(const char *sock, ...)
{
    va_list ap;
    va_start(ap, sock);
    cmd_result r = kdactl_v(sock, NULL, ap);
    va_end(ap);
    return r;
}

void cmd_free(cmd_result *r)
{
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}
