/*
 * test_bounds.c - what a hostile client can make a real kdad (cpu backend)
 * hold, measured through the daemon's own accounting (stats, Prometheus
 * text: kdad_held_bytes_peak) and through /proc (VmHWM, VmPeak):
 *
 *   regions      64 sealed sparse memfds of 16 TiB each: refused before
 *                anything is mapped; regions within the per-connection bound
 *                are refused past the per-uid bound; kdad serves others on.
 *   output       8 connections pipeline slot.read (inline answers) and never
 *                read: kdad stops reading them once their uid's unread output
 *                passes clients.max_output_bytes_per_uid.
 *   half frames  24 connections each send all but the last byte of a large
 *                frame: the bytes count as the uid's in-flight bytes (its
 *                complete requests meet BUSY), reading stops past the bound,
 *                and the stalled connections are closed after
 *                clients.frame_stall_seconds.
 *   reported     hello and stats report the bounds configured, and the
 *                usage against them while a frame is half sent.
 *
 * KDAD_BOUNDS_FULL=1 runs the attacks at full size (250 MiB frames, 2000
 * reads of 256 KiB per connection: 4 GiB of answers) and prints kdad's peak RSS, with
 * KDAD_BOUNDS_YAML appended to the configuration (e.g. "clients:\n
 * max_inflight_bytes_per_uid: 1GiB\n  frame_stall_seconds: 5\n"); the
 * checks then use the bounds of the configuration in force.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon_harness.h"

static bool full(void)
{
    const char *v = getenv("KDAD_BOUNDS_FULL");
    return v && *v && strcmp(v, "0") != 0;
}

/* A daemon with yaml plus KDAD_BOUNDS_YAML (full runs). */
static void start(dh_daemon *d, const char *yaml)
{
    char buf[4096];
    const char *extra = full() && getenv("KDAD_BOUNDS_YAML") ? getenv("KDAD_BOUNDS_YAML") : "";
    snprintf(buf, sizeof(buf), "%s%s", yaml, extra);
    dh_start_or_skip(d, buf);
}

/* A field of /proc/PID/status in bytes ("VmHWM", "VmPeak"). */
static uint64_t proc_bytes(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    uint64_t kb = 0;
    size_t n = strlen(field);
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, field, n) == 0 && line[n] == ':')
            kb = strtoull(line + n + 1, NULL, 10);
    }
    fclose(f);
    return kb * 1024;
}

/* A number from kdad's Prometheus text: the line that starts with `series`. */
static uint64_t metric(dh_client *c, const char *series)
{
    uint32_t id = dh_id(c);
    assert_int_equal(kp_stats_params_encode2(&c->w, id, KP_STATS_PROMETHEUS, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_stats_result r;
    kp_error e;
    assert_int_equal(kp_stats_result_decode(&c->msg, &r, &e), KP_OK);
    assert_non_null(r.prometheus);
    const char *at = strstr(r.prometheus, series);
    if (!at)
        fail_msg("no %s in the stats", series);
    return strtoull(at + strlen(series), NULL, 10);
}

/* Writes what the socket takes of bytes without blocking; returns how much. */
static size_t push(int fd, const uint8_t *bytes, size_t n)
{
    size_t off = 0;
    while (off < n) {
        ssize_t w = send(fd, bytes + off, n - off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    return off;
}

static void report(const char *attack, const dh_daemon *d)
{
    printf("bounds: %-12s kdad peak RSS %.1f MiB, peak virtual size %.1f GiB\n", attack,
           (double)proc_bytes(d->pid, "VmHWM") / (1 << 20),
           (double)proc_bytes(d->pid, "VmPeak") / (1 << 30));
    fflush(stdout);
}

/* ---------------------------------------------------------------------- */

static int sparse_memfd(uint64_t size)
{
    int fd = memfd_create("sparse", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    return fd;
}

static uint32_t send_register(dh_client *c, uint64_t size)
{
    int fd = sparse_memfd(size);
    uint32_t id = dh_id(c);
    kp_region_register_shm_params p = {size};
    assert_int_equal(kp_region_register_shm_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send_fd(c, fd);
    close(fd);
    return id;
}

static void test_sparse_regions(void **unused)
{
    (void)unused;
    dh_daemon d;
    start(&d, "heads: 4\nslots: 16\ncpu_threads: 1\n");
    dh_client c[8], other;
    const uint64_t vm_start = proc_bytes(d.pid, "VmPeak"); /* ASan reserves terabytes */
    for (int i = 0; i < 8; i++) {
        dh_connect(&c[i], &d);
        dh_hello(&c[i]);
    }
    /* 64 regions of 16 TiB, 8 per connection: each refused before it is mapped */
    for (int k = 0; k < 64; k++) {
        uint32_t id = send_register(&c[k % 8], 16ull << 40);
        dh_expect_error(&c[k % 8], id, KP_E_QUOTA_EXCEEDED,
                        "above clients.max_region_bytes_per_connection");
    }
    assert_true(proc_bytes(d.pid, "VmPeak") - vm_start < (1ull << 40));
    /* within a connection's bound, they add up to the uid's */
    uint64_t per_conn = metric(&c[0], "kdad_held_bytes_bound{kind=\"regions\","
                                      "key=\"clients.max_region_bytes_per_connection\"} ");
    uint64_t per_uid = metric(&c[0], "kdad_held_bytes_bound{kind=\"regions\","
                                     "key=\"clients.max_region_bytes_per_uid\"} ");
    assert_true(per_conn > 0 && per_uid >= per_conn);
    uint64_t mapped = 0;
    int refused = 0;
    for (int i = 0; i < 8 && !refused; i++) {
        uint32_t id = send_register(&c[i], per_conn);
        dh_recv_response(&c[i], id);
        if (c[i].msg.error) {
            kp_error remote, e;
            assert_int_equal(kp_response_error_decode(&c[i].msg, &remote, &e), KP_OK);
            assert_int_equal(remote.code, KP_E_QUOTA_EXCEEDED);
            assert_non_null(strstr(remote.message, "above clients.max_region_bytes_per_uid"));
            refused++;
        } else {
            mapped += per_conn;
        }
    }
    assert_int_equal(refused, 1);
    assert_true(mapped <= per_uid);
    assert_int_equal(metric(&c[0], "kdad_held_bytes{kind=\"regions\"} "), mapped);
    /* another client is served as before */
    dh_connect(&other, &d);
    dh_hello(&other);
    uint64_t slot = dh_alloc(&other);
    float *state = malloc(4 * 128 * 128 * sizeof(float));
    assert_int_equal(dh_read_state(&other, slot, state), 0);
    free(state);
    report("regions", &d);
    /* closing gives the mapped bytes back */
    for (int i = 0; i < 8; i++)
        dh_close(&c[i]);
    for (int i = 0; i < 100 && metric(&other, "kdad_held_bytes{kind=\"regions\"} ") != 0; i++)
        usleep(10000);
    assert_int_equal(metric(&other, "kdad_held_bytes{kind=\"regions\"} "), 0);
    dh_close(&other);
    dh_stop(&d);
}

/* ---------------------------------------------------------------------- */

static void test_unread_output(void **unused)
{
    (void)unused;
    dh_daemon d;
    const bool big = full();
    /* 4 heads: 256 KiB f32 answers */
    start(&d, big ? "heads: 4\nslots: 16\ncpu_threads: 1\n"
                  : "heads: 4\nslots: 16\ncpu_threads: 1\nlimits:\n  max_inflight_requests: 16\n"
                    "clients:\n  max_output_bytes_per_uid: 32MiB\n");
    const int nconn = 8, nreads = big ? 2000 : 400;
    dh_client c[8], watch;
    dh_connect(&watch, &d);
    dh_hello(&watch);
    uint64_t sent_total = 0;
    for (int i = 0; i < nconn; i++) {
        dh_connect(&c[i], &d);
        dh_hello(&c[i]);
        uint64_t slot = dh_alloc(&c[i]);
        /* the pipeline: nreads requests, written while the socket takes them */
        size_t cap = 64 * (size_t)nreads, len = 0;
        uint8_t *all = malloc(cap);
        for (int k = 0; k < nreads; k++) {
            kp_slot_read_params p = {slot, true, KP_DTYPE_F32, {0}};
            assert_int_equal(kp_slot_read_params_encode(&c[i].w, dh_id(&c[i]), &p, NULL), KP_OK);
            uint8_t *frame;
            size_t n;
            assert_int_equal(kp_writer_flatten(&c[i].w, &frame, &n, NULL), KP_OK);
            assert_true(len + n <= cap);
            memcpy(all + len, frame, n);
            len += n;
            free(frame);
        }
        sent_total += push(c[i].fd, all, len);
        free(all);
    }
    assert_true(sent_total > 0);
    usleep(big ? 15000000 : 1000000); /* full: as long as the attack ran in the review */
    uint64_t bound = metric(&watch, "kdad_held_bytes_bound{kind=\"output\","
                                    "key=\"clients.max_output_bytes_per_uid\"} ");
    uint64_t peak = metric(&watch, "kdad_held_bytes_peak{kind=\"output\"} ");
    report("output", &d);
    printf("bounds: output: unread output peaked at %.1f MiB (bound %.1f MiB)\n",
           (double)peak / (1 << 20), (double)bound / (1 << 20));
    /* past the bound each connection finishes only what it had read:
     * max_inflight_requests answers of 256 KiB at most */
    uint64_t slack = big ? 0 : (uint64_t)nconn * 16 * (256u << 10) + (1u << 20);
    if (!big) {
        assert_true(peak > bound / 2);
        assert_true(peak <= bound + slack);
        assert_true(proc_bytes(d.pid, "VmHWM") < bound + slack + (192u << 20));
    }
    for (int i = 0; i < nconn; i++)
        dh_close(&c[i]);
    for (int i = 0; i < 200 && metric(&watch, "kdad_held_bytes{kind=\"output\"} ") != 0; i++)
        usleep(10000);
    assert_int_equal(metric(&watch, "kdad_held_bytes{kind=\"output\"} "), 0);
    dh_close(&watch);
    dh_stop(&d);
}

/* ---------------------------------------------------------------------- */

static void test_half_frames(void **unused)
{
    (void)unused;
    dh_daemon d;
    const bool big = full();
    start(&d, big ? "heads: 4\nslots: 16\ncpu_threads: 1\n"
                  : "heads: 4\nslots: 16\ncpu_threads: 1\nlimits:\n  max_frame_bytes: 16MiB\n"
                    "  max_inline_bytes: 16MiB\n  max_inflight_bytes: 16MiB\n"
                    "clients:\n  max_inflight_bytes_per_uid: 48MiB\n  frame_stall_seconds: 2\n");
    const int nconn = 24;
    const size_t body = big ? (250u << 20) : (15u << 20);
    uint8_t *frame = calloc(1, 4 + body);
    frame[0] = (uint8_t)(body >> 24);
    frame[1] = (uint8_t)(body >> 16);
    frame[2] = (uint8_t)(body >> 8);
    frame[3] = (uint8_t)body;
    dh_client c[24], watch;
    dh_connect(&watch, &d);
    dh_hello(&watch);
    size_t off[24] = {0};
    for (int i = 0; i < nconn; i++) {
        dh_connect(&c[i], &d);
        dh_hello(&c[i]);
    }
    /* all but the last byte, as far as kdad reads, until the uid's complete
     * requests meet BUSY: the half frames hold its in-flight bytes */
    bool busy = false;
    for (int round = 0; round < 20000 && !busy; round++) {
        for (int i = 0; i < nconn; i++)
            off[i] += push(c[i].fd, frame + off[i], 4 + body - 1 - off[i]);
        uint32_t id = dh_id(&watch);
        assert_int_equal(kp_health_params_encode(&watch.w, id, NULL), KP_OK);
        dh_send(&watch);
        dh_recv_response(&watch, id);
        if (watch.msg.error) {
            kp_error remote, e;
            assert_int_equal(kp_response_error_decode(&watch.msg, &remote, &e), KP_OK);
            assert_int_equal(remote.code, KP_E_BUSY);
            assert_non_null(strstr(remote.message, "clients.max_inflight_bytes_per_uid"));
            busy = true;
        } else {
            usleep(5000);
        }
    }
    assert_true(busy);
    /* what the sockets still take, for the peak below */
    for (int i = 0; i < nconn; i++)
        off[i] += push(c[i].fd, frame + off[i], 4 + body - 1 - off[i]);
    free(frame);
    /* stalled: closed after frame_stall_seconds, their bytes given back */
    for (int i = 0; i < nconn; i++)
        dh_expect_goodbye(&c[i], KP_E_BUSY, "clients.frame_stall_seconds");
    kp_stats_result r;
    dh_stats(&watch, &r);
    assert_int_equal(dh_counter(r.disconnects, r.ndisconnects, "stalled"), nconn);
    /* counted while they lasted, and bounded: the bound, plus the oldest
     * frame, plus what one read (a socket buffer at most) adds to each */
    uint64_t bound = metric(&watch, "kdad_held_bytes_bound{kind=\"inflight\","
                                    "key=\"clients.max_inflight_bytes_per_uid\"} ");
    uint64_t peak = metric(&watch, "kdad_held_bytes_peak{kind=\"partial\"} ");
    report("half frames", &d);
    printf("bounds: half frames: partial frames peaked at %.1f MiB (bound %.1f MiB)\n",
           (double)peak / (1 << 20), (double)bound / (1 << 20));
    assert_true(peak + 4096 >= bound); /* BUSY came: partial + one request > bound */
    assert_true(peak <= bound + (4 + body) + (uint64_t)nconn * (1u << 20));
    assert_int_equal(metric(&watch, "kdad_held_bytes{kind=\"partial\"} "), 0);
    /* only the stats request asking */
    assert_true(metric(&watch, "kdad_held_bytes{kind=\"inflight\"} ") < 64);
    for (int i = 0; i < nconn; i++)
        dh_close(&c[i]);
    dh_close(&watch);
    dh_stop(&d);
}

/* ---------------------------------------------------------------------- */

/* The bounds in force, as hello and stats report them, and the usage against
 * them: a frame half sent shows as the uid's partial bytes until it stalls. */
static void test_bounds_reported(void **unused)
{
    (void)unused;
    dh_daemon d;
    dh_start_or_skip(&d, "heads: 4\nslots: 16\ncpu_threads: 1\nlimits:\n"
                         "  max_frame_bytes: 16MiB\n  max_inline_bytes: 16MiB\n"
                         "  max_inflight_bytes: 16MiB\nclients:\n"
                         "  max_connections_per_uid: 3\n  max_inflight_bytes_per_uid: 40MiB\n"
                         "  max_output_bytes_per_uid: 64MiB\n  frame_stall_seconds: 2\n"
                         "  output_stall_seconds: 9\n");
    dh_client watch, half, third, fourth;
    dh_connect(&watch, &d);
    kp_hello_params hp = {{KP_PROTOCOL_VERSION}, 1, "test_bounds"};
    uint32_t id = dh_id(&watch);
    assert_int_equal(kp_hello_params_encode(&watch.w, id, &hp, NULL), KP_OK);
    dh_send(&watch);
    dh_expect_result(&watch, id);
    kp_hello_result h;
    assert_int_equal(kp_hello_result_decode(&watch.msg, &h, NULL), KP_OK);
    kp_session_from_hello(&watch.session, &h);
    assert_true(h.limits.has_clients);
    assert_int_equal(h.limits.clients.max_connections_per_uid, 3);
    assert_int_equal(h.limits.clients.max_inflight_bytes_per_uid, 40u << 20);
    assert_int_equal(h.limits.clients.max_output_bytes_per_uid, 64u << 20);
    assert_int_equal(h.limits.clients.frame_stall_seconds, 2);
    assert_int_equal(h.limits.clients.output_stall_seconds, 9);
    /* the keys left out: resolved, never 0 */
    assert_true(h.limits.clients.max_inflight_bytes_total >= (16u << 20));
    assert_true(h.limits.clients.max_region_bytes_per_uid > 0);
    assert_true(h.limits.clients.max_connections > 0);
    assert_int_equal(h.limits.max_slots_per_uid, 16);
    assert_true(h.limits.max_layers_per_uid > 0);

    kp_stats_result r;
    dh_stats(&watch, &r);
    assert_true(r.has_clients && r.has_uid && r.has_uid_held);
    assert_int_equal(r.bounds.max_inflight_bytes_per_uid, 40u << 20);
    assert_int_equal(r.bounds.frame_stall_seconds, 2);
    assert_int_equal(r.uid_connections, 1);
    assert_int_equal(r.uid_held.partial_bytes, 0);
    assert_true(r.uid_held.inflight_bytes > 0); /* the stats request itself */
    assert_true(r.uid_held.inflight_bytes < 64);
    assert_int_equal(r.held.partial_bytes, 0);
    assert_int_equal(r.stalled, 0);
    assert_int_equal(r.refused, 0);

    /* 256 KiB of a 1 MiB frame body */
    dh_connect(&half, &d);
    dh_hello(&half);
    const size_t body = 1u << 20, sent = 256u << 10;
    uint8_t *frame = calloc(1, 4 + sent);
    assert_non_null(frame);
    frame[1] = (uint8_t)(body >> 16);
    dh_write(&half, frame, 4 + sent);
    free(frame);
    for (int i = 0; i < 400; i++) {
        dh_stats(&watch, &r);
        if (r.uid_held.partial_bytes == sent)
            break;
        usleep(5000);
    }
    assert_int_equal(r.uid_held.partial_bytes, sent);
    assert_int_equal(r.held.partial_bytes, sent);
    assert_true(r.uid_held.inflight_bytes > sent); /* the partial bytes and the stats request */
    assert_true(r.held_peak.partial_bytes >= sent);
    assert_int_equal(r.uid_connections, 2);

    /* the uid's fourth connection is refused */
    dh_connect(&third, &d);
    dh_hello(&third);
    dh_connect(&fourth, &d);
    dh_expect_goodbye(&fourth, KP_E_QUOTA_EXCEEDED, "clients.max_connections_per_uid");
    dh_close(&fourth);
    dh_stats(&watch, &r);
    assert_int_equal(r.refused, 1);
    assert_int_equal(r.uid_connections, 3);

    /* the half frame stalls: closed, its bytes given back */
    dh_expect_goodbye(&half, KP_E_BUSY, "clients.frame_stall_seconds");
    dh_close(&half);
    dh_stats(&watch, &r);
    assert_int_equal(r.stalled, 1);
    assert_int_equal(r.uid_held.partial_bytes, 0);
    assert_int_equal(r.held.partial_bytes, 0);
    assert_true(r.held_peak.partial_bytes >= sent);
    for (int i = 0; i < 400 && r.uid_connections != 2; i++) {
        usleep(5000);
        dh_stats(&watch, &r);
    }
    assert_int_equal(r.uid_connections, 2);
    dh_close(&third);
    dh_close(&watch);
    dh_stop(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sparse_regions),
        cmocka_unit_test(test_unread_output),
        cmocka_unit_test(test_half_frames),
        cmocka_unit_test(test_bounds_reported),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
