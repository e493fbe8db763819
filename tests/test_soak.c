/*
 * test_soak.c - many clients against one kdad (cpu backend) for a while,
 * with faults, and the daemon back where it started afterwards.
 *
 * CLIENTS processes loop until the deadline, each round one of:
 *   plain      connect, register the shared layer (one more registration of
 *              it), a slot, two chained prefills of random lengths (the
 *              second continues the first's state), drop, close
 *   shm        the same with every tensor in a shared-memory region that is
 *              registered for the round and released after it
 *   private    a layer of the client's own name, registered and dropped
 *   vanish     a long prefill sent, and the connection closed at once
 *   half       a frame header and part of its body, then closed
 *   slow       eight prefills with 512 KiB answers in flight, unread for a
 *              while, then read
 * Every answer a client reads is checked against the float64 oracle (output
 * and position).  Afterwards the daemon holds nothing (no slot, region or
 * client layer but the one the test keeps), its descriptors are exactly the
 * baseline's, and its resident memory is within a bound of the baseline
 * (not under ASan, whose quarantine keeps freed memory).  The baseline is
 * taken after a warm-up round of each kind and a write into every slot (the
 * pool's pages count from their first write).  kdad runs with glibc's
 * malloc told to give freed memory back (GLIBC_TUNABLES), so that its RSS
 * follows what it holds, not the peak of many clients at once.
 *
 * test_idle_trim runs kdad with glibc's malloc as it comes: after a burst
 * of the same clients its RSS falls back once it has been idle for a
 * second (it trims its heap then).
 *
 * KDAD_SOAK_SECONDS sets the duration: 5 by default (CI), 90 for a soak.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <dirent.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_kdac.h"

#define CLIENTS 12
#define SLOTS 128 /* >= 8 per client: the slow round's */
#define OUT_TOL 0.005 /* KDA.md: output rel RMS error against the oracle */
#define SHARED "soak.L"
#define RSS_SLACK_KIB (8u << 10) /* what the allocator may keep (fragments of its arenas) */

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* The shared layer's weights: the same in every process. */
static void shared_layer(dh_layer *l)
{
    test_rng r;
    rng_seed(&r, 4242);
    dh_layer_make(l, &r);
}

/* ---------------------------------------------------------------------- */
/* Clients (forked: no cmocka; a failure is a message and an exit code)    */
/* ---------------------------------------------------------------------- */

typedef struct client {
    const char *sock;
    int index;
    test_rng rng;
    dh_layer shared;
    char msg[1024];
    uint64_t checked, vanished, half, slow, regions; /* what it did */
} client;

static int failed(client *k, const char *what, int rc, const kdac_error *err)
{
    snprintf(k->msg, sizeof(k->msg), "client %d: %s: %s: %s", k->index, what,
             kdac_err_name(rc), err ? err->message : "");
    return 1;
}

static int open_client(client *k, kdac_client **c)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = k->sock;
    o.timeout_ms = 60000;
    o.client_name = "test_soak";
    kdac_error err;
    int rc = kdac_client_open(c, &o, &err);
    return rc ? failed(k, "open", rc, &err) : 0;
}

static uint32_t random_len(client *k, uint32_t max)
{
    return 1 + (uint32_t)(rng_next(&k->rng) % max);
}

/* The output of s (run from *state, which advances) against the oracle. */
static int check_output(client *k, const dh_layer *l, const dh_seq *s, double *state,
                        const uint16_t *out, uint64_t pos, uint64_t want_pos)
{
    size_t n = (size_t)s->len * DH_HEADS * 128;
    double *ref = malloc(n * sizeof(double));
    if (!ref)
        return failed(k, "no memory for the oracle", 0, NULL);
    dh_oracle(l, s, state, ref);
    double e = dh_err_bf16(out, ref, n);
    free(ref);
    k->checked++;
    if (e > OUT_TOL || pos != want_pos) {
        snprintf(k->msg, sizeof(k->msg), "client %d: len %u: output error %.2e, position %" PRIu64
                 " (expected %" PRIu64 ")", k->index, s->len, e, pos, want_pos);
        return 1;
    }
    return 0;
}

/*
 * Two chained prefills on one fresh slot, inline or through a region (shm),
 * on layer `name` (weights l), checked against the oracle.
 */
static int chained(client *k, kdac_client *c, const char *name, const dh_layer *l, bool shm)
{
    kdac_error err;
    uint64_t slot;
    int rc = kdac_slot_alloc(c, 1, 0, &slot, &err);
    if (rc)
        return failed(k, "slot.alloc", rc, &err);
    double *state = calloc(DH_STATE_ELEMS, sizeof(double));
    dh_seq s[2];
    dh_seq_make(&s[0], &k->rng, random_len(k, 160));
    dh_seq_make(&s[1], &k->rng, random_len(k, 160));
    uint16_t *out = malloc(DH_TOKEN_BYTES(160));
    kdac_shm shm_map = {-1, NULL, 0};
    uint32_t region = 0;
    uint64_t pos = 0;
    int bad = !state || !out;
    if (!bad && shm) {
        /* q k v g out, then beta: every offset a multiple of 16 */
        rc = kdac_shm_create(&shm_map, 5 * DH_TOKEN_BYTES(160) + DH_BETA_BYTES(160), "soak", &err);
        if (!rc)
            rc = kdac_region_register_shm(c, shm_map.fd, shm_map.size, &region, &err);
        bad = rc ? failed(k, "shm region", rc, &err) : 0;
        k->regions += !bad;
    }
    for (int i = 0; i < 2 && !bad; i++) {
        kdac_seq q = dh_kdac_seq(slot, &s[i], out);
        if (shm) {
            char *base = shm_map.base;
            const uint16_t *src[4] = {s[i].q, s[i].k, s[i].v, s[i].g};
            kdac_tensor *dst[4] = {&q.q, &q.k, &q.v, &q.g};
            for (int t = 0; t < 4; t++) {
                memcpy(base + t * DH_TOKEN_BYTES(160), src[t], DH_TOKEN_BYTES(s[i].len));
                *dst[t] = kdac_tensor_region(region, t * DH_TOKEN_BYTES(160));
            }
            memcpy(base + 5 * DH_TOKEN_BYTES(160), s[i].beta, DH_BETA_BYTES(s[i].len));
            q.beta = kdac_tensor_region(region, 5 * DH_TOKEN_BYTES(160));
            q.out = kdac_output_region(region, 4 * DH_TOKEN_BYTES(160));
        }
        kdac_prefill_result res;
        if ((rc = kdac_prefill(c, name, &q, 1, &res, &err))) {
            bad = failed(k, "prefill", rc, &err);
            break;
        }
        uint64_t got = res.pos[0];
        if (shm)
            memcpy(out, (char *)shm_map.base + 4 * DH_TOKEN_BYTES(160), DH_TOKEN_BYTES(s[i].len));
        pos += s[i].len;
        bad = check_output(k, l, &s[i], state, out, got, pos);
    }
    if (!bad && shm && (rc = kdac_region_release(c, region, &err)))
        bad = failed(k, "region.release", rc, &err);
    if (!bad && (rc = kdac_slot_free(c, &slot, 1, &err)))
        bad = failed(k, "slot.free", rc, &err);
    if (shm_map.base)
        kdac_shm_close(&shm_map);
    dh_seq_free(&s[0]);
    dh_seq_free(&s[1]);
    free(state);
    free(out);
    return bad;
}

/* plain / shm / private: a whole client's life. */
static int round_whole(client *k, bool shm, bool private_layer)
{
    kdac_client *c;
    if (open_client(k, &c))
        return 1;
    dh_layer own;
    char name[32];
    const dh_layer *l = &k->shared;
    snprintf(name, sizeof(name), "%s", SHARED);
    if (private_layer) {
        dh_layer_make(&own, &k->rng);
        snprintf(name, sizeof(name), "soak.client%d", k->index);
        l = &own;
    }
    kdac_layer layer = {name, l->A_log, l->dt_bias, l->lower_bound, l->scale};
    kdac_error err;
    int rc = kdac_layer_register(c, &layer, NULL, &err);
    int bad = rc ? failed(k, "layer.register", rc, &err) : chained(k, c, name, l, shm);
    if (!rc && (rc = kdac_layer_drop(c, name, &err)) && !bad)
        bad = failed(k, "layer.drop", rc, &err);
    kdac_client_close(c);
    return bad;
}

static void ignored(kdac_client *c, void *data, const kdac_result *res, int status)
{
}

/* vanish: a long prefill on its way, and the connection closed under it. */
static int round_vanish(client *k)
{
    kdac_client *c;
    if (open_client(k, &c))
        return 1;
    kdac_error err;
    uint64_t slot;
    dh_seq s;
    dh_seq_make(&s, &k->rng, 1024);
    uint16_t *out = malloc(DH_TOKEN_BYTES(1024));
    int rc = kdac_slot_alloc(c, 1, 0, &slot, &err);
    if (!rc) {
        kdac_seq q = dh_kdac_seq(slot, &s, out);
        rc = kdac_prefill_send(c, SHARED, &q, 1, ignored, NULL, &err);
    }
    for (int i = 0; !rc && i < 50 && (kdac_client_events(c) & KDAC_WRITABLE); i++) {
        struct pollfd p = {kdac_client_fd(c), POLLOUT, 0};
        poll(&p, 1, 10);
        kdac_client_progress(c);
    }
    kdac_client_close(c); /* the answer is never read */
    dh_seq_free(&s);
    free(out);
    k->vanished++;
    return rc ? failed(k, "vanish", rc, &err) : 0;
}

/* half: a frame header announcing 4096 bytes, 100 of them, then gone. */
static int round_half(client *k)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", k->sock);
    uint8_t frame[104] = {0, 0, 0x10, 0x00}; /* big-endian 4096 */
    memset(frame + 4, 0x93, sizeof(frame) - 4);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
             send(fd, frame, sizeof(frame), MSG_NOSIGNAL) == (ssize_t)sizeof(frame);
    if (fd >= 0)
        close(fd);
    k->half++;
    if (!ok) {
        snprintf(k->msg, sizeof(k->msg), "client %d: half frame: cannot connect or send",
                 k->index);
        return 1;
    }
    return 0;
}

typedef struct slow_req {
    client *k;
    int done, status;
    uint64_t pos;
} slow_req;

static void slow_done(kdac_client *c, void *data, const kdac_result *res, int status)
{
    slow_req *r = data;
    r->done = 1;
    r->status = status;
    if (status == 0)
        r->pos = res->u.prefill.pos[0];
}

/* slow: eight 512 KiB answers in flight and unread for 300 ms, then read and checked. */
static int round_slow(client *k)
{
    enum { N = 8, LEN = 512 };
    kdac_client *c;
    if (open_client(k, &c))
        return 1;
    kdac_error err;
    uint64_t slots[N];
    dh_seq s;
    dh_seq_make(&s, &k->rng, LEN);
    uint16_t *out = malloc(N * DH_TOKEN_BYTES(LEN));
    slow_req req[N];
    kdac_layer layer = {SHARED, k->shared.A_log, k->shared.dt_bias, k->shared.lower_bound,
                        k->shared.scale};
    int rc = kdac_layer_register(c, &layer, NULL, &err);
    int registered = rc == 0;
    if (!rc)
        rc = kdac_slot_alloc(c, N, 0, slots, &err);
    for (int i = 0; !rc && i < N; i++) {
        req[i] = (slow_req){k, 0, 0, 0};
        kdac_seq q = dh_kdac_seq(slots[i], &s, out + (size_t)i * LEN * DH_HEADS * 128);
        rc = kdac_prefill_send(c, SHARED, &q, 1, slow_done, &req[i], &err);
    }
    int bad = rc ? failed(k, "slow: send", rc, &err) : 0;
    /* send everything, then read nothing for a while */
    double until = now_s() + 10;
    while (!bad && (kdac_client_events(c) & KDAC_WRITABLE) && now_s() < until) {
        struct pollfd p = {kdac_client_fd(c), POLLOUT, 0};
        poll(&p, 1, 10);
        kdac_client_progress(c);
    }
    usleep(300000);
    int done = 0;
    until = now_s() + 60;
    while (!bad && done < N && now_s() < until) {
        struct pollfd p = {kdac_client_fd(c), POLLIN, 0};
        poll(&p, 1, 50);
        if ((rc = kdac_client_progress(c)))
            bad = failed(k, "slow: progress", rc, NULL);
        done = 0;
        for (int i = 0; i < N; i++)
            done += req[i].done;
    }
    if (!bad && done < N)
        bad = failed(k, "slow: answers did not come", 0, NULL);
    double *state = calloc(DH_STATE_ELEMS, sizeof(double));
    for (int i = 0; !bad && i < N; i++) {
        if (req[i].status) {
            bad = failed(k, "slow: prefill", req[i].status, NULL);
            break;
        }
        memset(state, 0, DH_STATE_ELEMS * sizeof(double));
        bad = check_output(k, &k->shared, &s, state, out + (size_t)i * LEN * DH_HEADS * 128,
                           req[i].pos, LEN);
    }
    if (registered && (rc = kdac_layer_drop(c, SHARED, &err)) && !bad)
        bad = failed(k, "slow: layer.drop", rc, &err);
    kdac_client_close(c);
    free(state);
    free(out);
    dh_seq_free(&s);
    k->slow++;
    return bad;
}

static int client_main(client *k, double deadline)
{
    static const char *const plan = "ppsspvhlpsvh"; /* p plain, s shm, v vanish, h half,
                                                       l slow; private every fifth round */
    int bad = 0;
    for (uint64_t round = 0; !bad && now_s() < deadline; round++) {
        char what = plan[(round + (uint64_t)k->index) % strlen(plan)];
        if (round % 5 == 4)
            bad = round_whole(k, false, true);
        else if (what == 'p' || what == 's')
            bad = round_whole(k, what == 's', false);
        else if (what == 'v')
            bad = round_vanish(k);
        else if (what == 'h')
            bad = round_half(k);
        else
            bad = round_slow(k);
    }
    if (!bad)
        snprintf(k->msg, sizeof(k->msg), "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                 " %" PRIu64, k->checked, k->vanished, k->half, k->slow, k->regions);
    return bad;
}

/* ---------------------------------------------------------------------- */
/* The daemon's footprint                                                 */
/* ---------------------------------------------------------------------- */

static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kib = -1;
    while (f && fgets(line, sizeof(line), f)) {
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    }
    if (f)
        fclose(f);
    return kib;
}

static int open_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return d ? n : -1;
}

/* Waits (up to 10 s) until the daemon has let go of every other connection,
 * slot and region: what the stats say through c. */
static kp_stats_result settle(dh_client *c)
{
    kp_stats_result st;
    for (int tries = 0;; tries++) {
        dh_stats(c, &st);
        if ((st.connections == 1 && st.slots_used == 0 && st.regions == 0) || tries == 500)
            return st;
        usleep(20000);
    }
}

/* Writes every slot of the pool once, so that the baseline counts the pool's
 * memory (the cpu backend's pool pages are touched as slots are first written). */
static void touch_pool(dh_client *c, uint32_t slots)
{
    static float zeros[DH_STATE_ELEMS];
    kp_slot_alloc_params ap = {slots, false};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_alloc_params_encode(&c->w, id, &ap, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_slot_list got;
    assert_int_equal(kp_slot_alloc_result_decode(&c->msg, &got, NULL), KP_OK);
    uint64_t *handles = malloc(slots * sizeof(uint64_t));
    memcpy(handles, got.slots, slots * sizeof(uint64_t));
    for (uint32_t i = 0; i < slots; i++) {
        kp_slot_write_params wp = {handles[i], 0, KP_DTYPE_F32,
                                   kp_ref_inline(zeros, sizeof(zeros))};
        id = dh_id(c);
        assert_int_equal(kp_slot_write_params_encode(&c->w, id, &wp, NULL), KP_OK);
        dh_send(c);
        dh_expect_result(c, id);
    }
    kp_slot_list fl = {handles, slots};
    id = dh_id(c);
    assert_int_equal(kp_slot_free_params_encode(&c->w, id, &fl, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    free(handles);
}

/* ---------------------------------------------------------------------- */

/* A daemon with the shared layer registered through *keeper (held throughout:
 * vanishing clients use it) and a warm-up round of each kind done, so that
 * later measurements have every thread and buffer; then every slot written
 * once, so that they count the pool's memory (the cpu backend's pool pages
 * are touched as slots are first written).  log_level: the daemon's. */
static void start_warm(dh_daemon *d, dh_client *keeper, const char *log_level)
{
    dh_layer l;
    shared_layer(&l);
    char yaml[160];
    snprintf(yaml, sizeof(yaml), "heads: 4\nslots: %d\ncpu_threads: 2\nlog:\n  level: %s\n"
             "limits:\n  max_layers: 64\n", SLOTS, log_level);
    dh_start_or_skip(d, yaml);
    dh_connect(keeper, d);
    dh_hello(keeper);
    dh_register_layer(keeper, SHARED, &l);
    client warm = {.sock = d->sock, .index = CLIENTS};
    rng_seed(&warm.rng, 99);
    shared_layer(&warm.shared);
    if (round_whole(&warm, false, false) || round_whole(&warm, true, true) ||
        round_slow(&warm) || round_vanish(&warm) || round_half(&warm))
        fail_msg("warm-up: %s", warm.msg);
    settle(keeper);
    touch_pool(keeper, SLOTS);
}

/* CLIENTS client processes against d for `seconds`; total: their counts
 * (results checked, vanished, half frames, slow readers, regions).  Fails
 * the test when one of them failed. */
static void run_clients(const dh_daemon *d, double seconds, uint64_t total[5])
{
    double deadline = now_s() + seconds;
    pid_t pids[CLIENTS];
    int pipes[CLIENTS];
    fflush(NULL);
    for (int i = 0; i < CLIENTS; i++) {
        int p[2];
        assert_int_equal(pipe(p), 0);
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] == 0) {
            close(p[0]);
            client k = {.sock = d->sock, .index = i};
            rng_seed(&k.rng, 1000 + (uint64_t)i);
            shared_layer(&k.shared);
            int rc = client_main(&k, deadline);
            if (write(p[1], k.msg, strlen(k.msg)) < 0)
                rc = 1;
            _exit(rc);
        }
        close(p[1]);
        pipes[i] = p[0];
    }
    memset(total, 0, 5 * sizeof(total[0]));
    int bad = 0;
    for (int i = 0; i < CLIENTS; i++) {
        char msg[1024];
        ssize_t n = read(pipes[i], msg, sizeof(msg) - 1);
        msg[n > 0 ? n : 0] = '\0';
        close(pipes[i]);
        int status;
        assert_int_equal(waitpid(pids[i], &status, 0), pids[i]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s (status 0x%x)\n", msg, status);
            bad++;
            continue;
        }
        uint64_t v[5];
        if (sscanf(msg, "%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &v[0],
                   &v[1], &v[2], &v[3], &v[4]) == 5)
            for (int j = 0; j < 5; j++)
                total[j] += v[j];
    }
    if (bad)
        fail_msg("%d of %d clients failed", bad, CLIENTS);
}

/* Drops the keeper's layer (the daemon then has none), closes it and stops d. */
static void finish(dh_daemon *d, dh_client *keeper)
{
    uint32_t id = dh_id(keeper);
    kp_layer_drop_params dp = {SHARED};
    assert_int_equal(kp_layer_drop_params_encode(&keeper->w, id, &dp, NULL), KP_OK);
    dh_send(keeper);
    dh_expect_result(keeper, id);
    kp_stats_result st;
    dh_stats(keeper, &st);
    assert_int_equal(st.layers, 0);
    dh_close(keeper);
    dh_stop(d);
}

static void test_soak(void **unused)
{
    const char *env = getenv("KDAD_SOAK_SECONDS");
    double seconds = env ? atof(env) : 5;
    dh_daemon d;
    dh_client keeper;
    /* glibc returns what kdad frees: large blocks always mapped and unmapped (no
     * dynamic threshold), arena tops trimmed early; so its RSS follows what it
     * holds rather than the peak of the run. */
    setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536:"
           "glibc.malloc.trim_threshold=131072", 1);
    start_warm(&d, &keeper, "notice");
    unsetenv("GLIBC_TUNABLES");
    kp_stats_result st = settle(&keeper);
    long rss0 = rss_kib(d.pid);
    int fds0 = open_fds(d.pid);
    assert_true(rss0 > 0 && fds0 > 0);

    uint64_t total[5];
    run_clients(&d, seconds, total);
    st = settle(&keeper);
    long rss1 = rss_kib(d.pid);
    int fds1 = open_fds(d.pid);
    printf("  %.0f s, %d clients: %" PRIu64 " results checked, %" PRIu64 " vanished, %" PRIu64
           " half frames, %" PRIu64 " slow readers, %" PRIu64 " regions; %" PRIu64
           " connections; RSS %ld -> %ld KiB, fds %d -> %d\n",
           seconds, CLIENTS, total[0], total[1], total[2], total[3], total[4],
           st.connections_total, rss0, rss1, fds0, fds1);
    assert_true(total[0] > 0);
    assert_int_equal(st.connections, 1);
    assert_int_equal(st.slots_used, 0);
    assert_int_equal(st.regions, 0);
    assert_int_equal(st.layers, 1); /* the keeper's; every client's drop came back */
    assert_int_equal(fds1, fds0);
#ifndef UNDER_ASAN
    if (rss1 > rss0 + (long)RSS_SLACK_KIB)
        fail_msg("RSS grew from %ld to %ld KiB", rss0, rss1);
#endif
    finish(&d, &keeper);
}

/* How many times the daemon's log says it trimmed its heap (debug level). */
static int trims(const dh_daemon *d)
{
    char *log = dh_log(d);
    int n = 0;
    for (const char *p = log; (p = strstr(p, "idle: malloc_trim")); p++)
        n++;
    free(log);
    return n;
}

/* With glibc's malloc as it comes, a burst leaves freed memory in its
 * arenas; once nothing has happened for a second kdad trims them
 * (malloc_trim), and its RSS falls back by at least a quarter of what the
 * burst added (without the trim nothing comes back: the ratio printed is
 * 1.00). */
static void test_idle_trim(void **unused)
{
    enum { BURST_S = 3, WAIT_MS = 6000 };
    dh_daemon d;
    dh_client keeper;
    start_warm(&d, &keeper, "debug");
    settle(&keeper);
    usleep(2500 * 1000); /* idle: the warm-up's memory is trimmed too */
    long rss0 = rss_kib(d.pid);
    uint64_t total[5];
    run_clients(&d, BURST_S, total);
    settle(&keeper); /* its stats requests keep the daemon from idling meanwhile */
    long busy = rss_kib(d.pid);
    int before = trims(&d), waited = 0;
    for (; waited < WAIT_MS && trims(&d) == before; waited += 100)
        usleep(100 * 1000);
    long rss1 = rss_kib(d.pid);
    double kept = busy > rss0 ? (double)(rss1 - rss0) / (double)(busy - rss0) : 0.0;
    printf("  RSS idle %ld KiB, after a %d s burst of %d clients %ld KiB, trimmed %d ms later: "
           "%ld KiB (%.2f of what the burst added)\n", rss0, BURST_S, CLIENTS, busy, waited,
           rss1, kept);
    assert_true(waited < WAIT_MS);
#ifndef UNDER_ASAN /* its allocator is not glibc's */
    assert_true(busy > rss0);
    if (kept > 0.75)
        fail_msg("RSS %ld KiB after the burst, %ld KiB after the trim (idle before: %ld KiB)",
                 busy, rss1, rss0);
#endif
    finish(&d, &keeper);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_soak, dh_teardown),
        cmocka_unit_test_teardown(test_idle_trim, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
