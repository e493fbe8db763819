/*
 * test_service.c - kdad started the way systemd starts it, by systemd's own
 * tool: systemd-socket-activate owns the listening socket and executes kdad
 * on the first connection, passing the socket (LISTEN_FDS); a datagram
 * socket of the test stands in for systemd's NOTIFY_SOCKET and receives
 * READY, the watchdog pings and STOPPING.  kdactl then runs a prefill
 * through the passed socket and reads the counters back in the Prometheus
 * format (the stats method), and SIGTERM drains.  Run as root, the test runs
 * the launcher and kdad as nobody (65534, no groups), as kdad.service runs
 * kdad as an unprivileged user: it needs nothing but the socket it is given.
 *
 * (test_daemon covers the same protocol with a hand-made LISTEN_FDS harness;
 * this is the real launcher.)  Exits 77 and says why without
 * systemd-socket-activate (Debian package systemd).
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kdad_proc.h"

extern char **environ;

#define NOBODY 65534

static char launcher[512]; /* systemd-socket-activate, from PATH */
static pid_t running;      /* the launcher-turned-kdad, killed by teardown if a test fails */

static int teardown(void **state)
{
    if (running > 0) {
        kill(running, SIGKILL);
        waitpid(running, NULL, 0);
        running = 0;
    }
    return 0;
}

static bool find_launcher(void)
{
    const char *path = getenv("PATH");
    char dirs[4096];
    snprintf(dirs, sizeof(dirs), "%s", path && *path ? path : "/usr/bin:/bin");
    for (char *save, *dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        snprintf(launcher, sizeof(launcher), "%s/systemd-socket-activate", dir);
        if (access(launcher, X_OK) == 0)
            return true;
    }
    return false;
}

/* Waits up to ms for an sd_notify datagram containing want (others are
 * skipped); the datagram in got. */
static bool notify_wait(int fd, const char *want, int ms, char *got, size_t size)
{
    for (int waited = 0; waited < ms; waited += 10) {
        ssize_t n;
        while ((n = recv(fd, got, size - 1, MSG_DONTWAIT)) > 0) {
            got[n] = '\0';
            if (strstr(got, want))
                return true;
        }
        usleep(10000);
    }
    return false;
}

/* Copies the file at from to to (mode 0755). */
static void copy_exe(const char *from, const char *to)
{
    char *buf = malloc(1 << 20);
    int in = open(from, O_RDONLY | O_CLOEXEC), out = open(to, O_WRONLY | O_CREAT | O_EXCL, 0755);
    assert_true(buf && in >= 0 && out >= 0);
    ssize_t n;
    while ((n = read(in, buf, 1 << 20)) > 0)
        assert_int_equal(write(out, buf, (size_t)n), n);
    assert_int_equal(n, 0);
    close(in);
    assert_int_equal(close(out), 0);
    free(buf);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *s = calloc(1, 1 << 20);
    if (f) {
        size_t n = fread(s, 1, (1 << 20) - 1, f);
        s[n] = '\0';
        fclose(f);
    }
    return s;
}

static void expect_in(const char *text, const char *want, const char *what)
{
    if (!strstr(text, want))
        fail_msg("%s lacks \"%s\":\n%s", what, want, text);
}

static void test_socket_activation_notify_prometheus(void **unused)
{
    char dir[] = "/tmp/kdad-service-XXXXXX", sock[96], notify[96], cfg[96], log[96], got[512];
    char exe[96];
    bool root = geteuid() == 0;
    assert_non_null(mkdtemp(dir));
    /* As root: kdad runs as nobody, from a copy (the build tree may be closed to it), in a
     * folder it may create the launcher's socket in. */
    snprintf(exe, sizeof(exe), "%s/kdad", dir);
    if (root) {
        copy_exe(build_path("daemon/kdad"), exe);
        assert_int_equal(chmod(dir, 0755), 0);
        assert_int_equal(chown(dir, NOBODY, NOBODY), 0);
    } else {
        snprintf(exe, sizeof(exe), "%s", build_path("daemon/kdad"));
    }
    snprintf(sock, sizeof(sock), "%s/kdad.sock", dir);
    snprintf(notify, sizeof(notify), "%s/notify", dir);
    snprintf(cfg, sizeof(cfg), "%s/kdad.yaml", dir);
    snprintf(log, sizeof(log), "%s/kdad.log", dir);
    FILE *f = fopen(cfg, "w");
    assert_non_null(f);
    fputs("heads: 4\nslots: 16\ncpu_threads: 2\n", f);
    assert_int_equal(fclose(f), 0);
    int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un na = {.sun_family = AF_UNIX};
    snprintf(na.sun_path, sizeof(na.sun_path), "%s", notify);
    assert_int_equal(bind(nfd, (struct sockaddr *)&na, sizeof(na)), 0);
    assert_int_equal(chmod(notify, 0777), 0); /* like systemd's: any service may write */

    /* systemd-socket-activate passes on only the variables named with -E. */
    char notify_env[128], watchdog_env[] = "WATCHDOG_USEC=400000";
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", notify);
    char *argv[24] = {launcher, "-l", sock, "-E", notify_env, "-E", watchdog_env};
    int n = 7;
    static char *const passed[] = {"ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"};
    for (size_t i = 0; i < sizeof(passed) / sizeof(passed[0]); i++) {
        if (getenv(passed[i])) {
            argv[n++] = "-E";
            argv[n++] = passed[i];
        }
    }
    char *kdad_args[] = {exe, "--config", cfg, "--backend", "cpu", NULL};
    for (int i = 0; kdad_args[i]; i++)
        argv[n++] = kdad_args[i];
    argv[n] = NULL;
    int logfd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    assert_true(logfd >= 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0 ||
            (root && (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)))
            _exit(126);
        execve(launcher, argv, environ);
        _exit(127);
    }
    close(logfd);
    running = pid;

    /* The launcher listens first; kdad starts with the first connection.  (The
     * socket file appears at bind, before listen: connect until it accepts.) */
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    int first = -1;
    for (int tries = 0; first < 0 && tries < 500; tries++) {
        first = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        assert_true(first >= 0);
        if (connect(first, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            close(first);
            first = -1;
            usleep(10000);
        }
    }
    if (first < 0)
        fail_msg("the launcher's socket %s accepted no connection in 5 s", sock);
    if (!notify_wait(nfd, "READY=1", 30000, got, sizeof(got))) {
        char *text = slurp(log);
        fail_msg("no READY=1 from kdad; its log:\n%s", text);
    }
    expect_in(got, "STATUS=serving: backend cpu, 4 heads, 16 slots", "READY");
    char *text = slurp(log);
    expect_in(text, "listening on the socket passed by systemd", "the log");
    free(text);
    if (root) { /* the launcher became kdad, and kdad is nobody */
        char status_path[64];
        snprintf(status_path, sizeof(status_path), "/proc/%d/status", (int)pid);
        text = slurp(status_path);
        expect_in(text, "\nUid:\t65534\t65534\t65534\t65534\n", "kdad's /proc status");
        free(text);
    }
    assert_true(notify_wait(nfd, "WATCHDOG=1", 5000, got, sizeof(got)));
    close(first);

    /* A prefill through the passed socket, and the counters it left. */
    cmd_result r = kdactl(sock, "--timeout", "60", "prefill", "--random", "--tokens", "64",
                          "--heads", "4", NULL);
    if (r.status != 0)
        fail_msg("kdactl prefill: exit %d\n%s%s", r.status, r.out, r.err);
    cmd_free(&r);
    r = kdactl(sock, "--timeout", "60", "stats", "--prometheus", NULL);
    if (r.status != 0)
        fail_msg("kdactl stats --prometheus: exit %d\n%s%s", r.status, r.out, r.err);
    expect_in(r.out, "# TYPE kdad_requests_total counter\n", "the exposition");
    expect_in(r.out, "\nkdad_sequences_total 1\n", "the exposition");
    expect_in(r.out, "\nkdad_tokens_total 64\n", "the exposition");
    expect_in(r.out, "# TYPE kdad_prefill_latency_seconds histogram\n", "the exposition");
    expect_in(r.out, "\nkdad_prefill_latency_seconds_count 1\n", "the exposition");
    expect_in(r.out, "# TYPE kdad_batches_total counter\n", "the exposition");
    expect_in(r.out, "# TYPE kdad_errors_total counter\n", "the exposition");
    expect_in(r.out, "kdad_pool_slots{state=\"total\"} 16\n", "the exposition");
    cmd_free(&r);

    /* SIGTERM: STOPPING, a drain, exit 0; the socket file stays the launcher's. */
    assert_int_equal(kill(pid, SIGTERM), 0);
    assert_true(notify_wait(nfd, "STOPPING=1", 10000, got, sizeof(got)));
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    running = 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        text = slurp(log);
        fail_msg("kdad ended with status 0x%x; its log:\n%s", status, text);
    }
    assert_int_equal(access(sock, F_OK), 0);
    close(nfd);
    unlink(sock);
    unlink(notify);
    unlink(cfg);
    unlink(log);
    if (root)
        unlink(exe);
    rmdir(dir);
}

int main(void)
{
    if (!find_launcher()) {
        printf("skipped: systemd-socket-activate is not installed (Debian package systemd)\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_socket_activation_notify_prometheus, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
