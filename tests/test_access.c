/*
 * test_access.c - who may use kdad, and how much of it: a real kdad
 * (daemon_harness) and clients of real uids.
 *
 * The tests run as root.  A forked child takes another identity (setgroups,
 * setgid, setuid: nobody, 65534, with the groups a test names) before it
 * connects, and then speaks through libkdaclient; it reports what happened
 * through a pipe and its exit code, never through cmocka (whose state it must
 * not touch).  The daemon's socket is made reachable for it (folder 0755,
 * socket.mode 0666), so that only kdad's own checks stand in its way.
 * Without root the suite exits 77 and says why.
 *
 *   access lists      uid, primary gid, supplementary groups (SO_PEERGROUPS),
 *                     names in the lists, the refusal and its log line, SIGHUP
 *   connection quota  clients.max_connections_per_uid, per uid
 *   in-flight quota   clients.max_inflight_bytes_per_uid and _total, BUSY
 *                     (retryable) at once
 *   slot ownership    per connection (every slot method refused to another
 *                     connection), per uid with slots_persist (shared by a
 *                     uid's connections, refused to other uids; the slot quota
 *                     counts per uid)
 *   slots per uid     limits.max_slots_per_uid over a uid's connections, and
 *                     what it keeps with slots_persist after they close
 *   layer names       each uid's own: another uid registering a name root
 *                     uses (even right after root's other client dropped its
 *                     registration) gets its own layer and never changes
 *                     root's results; limits.max_layers_per_uid
 * The per-connection slot quota and the region quota are in test_daemon and
 * test_daemon_shm.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "kdaclient.h"

#define NOBODY 65534
#define CHILD_SETUP_FAILED 100 /* the child could not take its identity */

static const char base_yaml[] = "heads: 4\nslots: 16\ncpu_threads: 2\nlog:\n  level: info\n"
                                "socket:\n  mode: 0666\n";

/* A daemon with base_yaml plus extra lines, reachable by any uid. */
static void start(dh_daemon *d, const char *extra)
{
    char yaml[2048];
    snprintf(yaml, sizeof(yaml), "%s%s", base_yaml, extra ? extra : "");
    dh_start_or_skip(d, yaml);
    assert_int_equal(chmod(d->dir, 0755), 0);
}

/* Waits (up to 5 s) for the daemon's log to contain text. */
static void expect_log(const dh_daemon *d, const char *text)
{
    for (int tries = 0; tries < 250; tries++) {
        char *log = dh_log(d);
        bool found = strstr(log, text) != NULL;
        free(log);
        if (found)
            return;
        usleep(20000);
    }
    char *log = dh_log(d);
    fprintf(stderr, "---- kdad log ----\n%s---- end ----\n", log);
    free(log);
    fail_msg("the daemon's log does not contain \"%s\"", text);
}

/* ---------------------------------------------------------------------- */
/* Children of other identities                                           */
/* ---------------------------------------------------------------------- */

typedef struct identity {
    uid_t uid;
    gid_t gid;
    gid_t groups[4]; /* supplementary */
    int ngroups;
} identity;

/* What a child does once it is `who`: 0 for what the test expects, else a
 * code, with a description in msg either way. */
typedef int (*child_fn)(const char *sock, void *arg, char *msg, size_t len);

/* Runs fn in a child as `who`; returns its exit code, its message in msg. */
static int run_as(const identity *who, const dh_daemon *d, child_fn fn, void *arg, char *msg,
                  size_t len)
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char m[1024] = "";
        int rc;
        close(p[0]);
        if (setgroups((size_t)who->ngroups, who->groups) != 0 || setgid(who->gid) != 0 ||
            setuid(who->uid) != 0 || getuid() != who->uid || geteuid() != who->uid) {
            snprintf(m, sizeof(m), "cannot become uid %u gid %u: %s", (unsigned)who->uid,
                     (unsigned)who->gid, strerror(errno));
            rc = CHILD_SETUP_FAILED;
        } else {
            rc = fn(d->sock, arg, m, sizeof(m));
        }
        if (write(p[1], m, strlen(m)) < 0)
            rc = CHILD_SETUP_FAILED;
        _exit(rc);
    }
    close(p[1]);
    size_t n = 0;
    ssize_t got;
    while (n + 1 < len && (got = read(p[0], msg + n, len - 1 - n)) > 0)
        n += (size_t)got;
    msg[n] = '\0';
    close(p[0]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status))
        fail_msg("the child (uid %u) died: status 0x%x", (unsigned)who->uid, status);
    if (WEXITSTATUS(status) == CHILD_SETUP_FAILED)
        fail_msg("%s", msg);
    return WEXITSTATUS(status);
}

static int child_open(const char *sock, kdac_client **c, char *msg, size_t len)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = sock;
    o.timeout_ms = 20000;
    o.client_name = "test_access";
    kdac_error err;
    int rc = kdac_client_open(c, &o, &err);
    if (rc)
        snprintf(msg, len, "%s: %s", kdac_err_name(rc), err.message);
    return rc;
}

/* Opens a connection (hello) and closes it: 0, or 1 with the error. */
static int child_connect(const char *sock, void *arg, char *msg, size_t len)
{
    kdac_client *c;
    if (child_open(sock, &c, msg, len))
        return 1;
    kdac_client_close(c);
    snprintf(msg, len, "connected");
    return 0;
}

/* A whole prefill as a client would run one: a layer, a slot, 8 tokens. */
static int child_prefill(const char *sock, void *arg, char *msg, size_t len)
{
    enum { T = 8, H = DH_HEADS };
    static float A_log[H], dt_bias[H * 128];
    static uint16_t x[T * H * 128], beta[T * H], out[T * H * 128];
    for (size_t i = 0; i < sizeof(x) / sizeof(x[0]); i++)
        x[i] = 0x3c00 + (uint16_t)(i % 64); /* small positive bf16 values */
    for (size_t i = 0; i < sizeof(beta) / sizeof(beta[0]); i++)
        beta[i] = 0x3f00;
    kdac_client *c;
    if (child_open(sock, &c, msg, len))
        return 1;
    kdac_layer layer = {"child.L", A_log, dt_bias, -5.0f, KDAC_DEFAULT_SCALE};
    kdac_seq q = {0};
    kdac_prefill_result res;
    kdac_error err;
    uint64_t pos = 0;
    int rc = kdac_layer_register(c, &layer, NULL, &err);
    if (!rc)
        rc = kdac_slot_alloc(c, 1, 0, &q.slot, &err);
    if (!rc) {
        q.len = T;
        q.q = q.k = q.v = q.g = kdac_tensor_inline(x);
        q.beta = kdac_tensor_inline(beta);
        q.out = kdac_output_inline(out);
        rc = kdac_prefill(c, "child.L", &q, 1, &res, &err);
    }
    if (!rc)
        pos = res.pos[0]; /* lives until the next call on c */
    kdac_client_close(c);
    if (rc) {
        snprintf(msg, len, "%s: %s", kdac_err_name(rc), err.message);
        return 1;
    }
    snprintf(msg, len, "prefilled to position %" PRIu64, pos);
    return pos == T ? 0 : 1;
}

/* Opens *(int *)arg connections at once, each with hello: 0 when all but the
 * last succeed and the last is refused (its error in msg). */
static int child_connect_many(const char *sock, void *arg, char *msg, size_t len)
{
    int n = *(int *)arg;
    kdac_client *c[8];
    int opened = 0, rc = 0;
    while (opened < n && !(rc = child_open(sock, &c[opened], msg, len)))
        opened++;
    for (int i = 0; i < opened; i++)
        kdac_client_close(c[i]);
    return opened == n - 1 && rc != 0 ? 0 : 1;
}

/* Another uid's slot (*(uint64_t *)arg): reading and freeing it must be
 * refused; then allocates two slots of its own and writes the first handle
 * into msg. */
static int child_touch_slot(const char *sock, void *arg, char *msg, size_t len)
{
    static float state[DH_STATE_ELEMS];
    uint64_t slot = *(uint64_t *)arg, mine[2], pos;
    kdac_client *c;
    if (child_open(sock, &c, msg, len))
        return 1;
    kdac_error err;
    memset(&err, 0, sizeof(err));
    int read = kdac_slot_read(c, slot, KDAC_DTYPE_F32, kdac_output_inline(state), &pos, &err);
    char read_msg[sizeof(err.message)];
    snprintf(read_msg, sizeof(read_msg), "%s", err.message);
    int freed = kdac_slot_free(c, &slot, 1, &err);
    int alloc = kdac_slot_alloc(c, 2, 0, mine, &err);
    kdac_client_close(c);
    if (read != KDAC_E_PERMISSION_DENIED || freed != KDAC_E_PERMISSION_DENIED || alloc) {
        snprintf(msg, len, "read: %s (%s), free: %s, alloc: %s", kdac_err_name(read), read_msg,
                 kdac_err_name(freed), kdac_err_name(alloc));
        return 1;
    }
    snprintf(msg, len, "%" PRIu64, mine[0]);
    return 0;
}

/* A child's run on a layer name root also uses: `l` are its weights, `s`
 * its sequence. */
typedef struct layer_job {
    const dh_layer *l;
    const dh_seq *s;
} layer_job;

#define OUT_TOL 0.005 /* KDA.md: output rel RMS error against the oracle */

/* Registers "shared.L" with the child's weights (a layer of its own: created),
 * runs its sequence on it and checks the output against the oracle of its
 * weights; root's "root.L" is not its to drop, and its list shows its own
 * layer alone. */
static int child_own_layer(const char *sock, void *arg, char *msg, size_t len)
{
    const layer_job *j = arg;
    const size_t n = (size_t)j->s->len * DH_HEADS * 128;
    uint16_t *out = malloc(n * sizeof(uint16_t));
    double *state = calloc(DH_STATE_ELEMS, sizeof(double)), *ref = calloc(n, sizeof(double));
    kdac_client *c;
    if (!out || !state || !ref || child_open(sock, &c, msg, len))
        return 1;
    kdac_layer layer = {"shared.L", j->l->A_log, j->l->dt_bias, j->l->lower_bound, j->l->scale};
    kdac_seq q = {0};
    kdac_prefill_result res;
    kdac_error err, drop_err;
    kdac_layer_info info[4];
    uint32_t nlayers = 0;
    bool created = false;
    int rc = kdac_layer_register(c, &layer, &created, &err);
    if (!rc)
        rc = kdac_slot_alloc(c, 1, 0, &q.slot, &err);
    if (!rc) {
        q.len = j->s->len;
        q.q = kdac_tensor_inline(j->s->q);
        q.k = kdac_tensor_inline(j->s->k);
        q.v = kdac_tensor_inline(j->s->v);
        q.g = kdac_tensor_inline(j->s->g);
        q.beta = kdac_tensor_inline(j->s->beta);
        q.out = kdac_output_inline(out);
        rc = kdac_prefill(c, "shared.L", &q, 1, &res, &err);
    }
    int dropped = rc ? 0 : kdac_layer_drop(c, "root.L", &drop_err);
    if (!rc)
        rc = kdac_layer_list(c, info, 4, &nlayers, &err);
    kdac_client_close(c);
    int code = 1;
    if (rc) {
        snprintf(msg, len, "%s: %s", kdac_err_name(rc), err.message);
    } else {
        dh_oracle(j->l, j->s, state, ref);
        double e = dh_err_bf16(out, ref, n);
        snprintf(msg, len, "created %d, output error %.2e, drop root.L: %s (%s), %u layers "
                 "listed, the first %s", created, e, kdac_err_name(dropped), drop_err.message,
                 nlayers, nlayers ? info[0].name : "-");
        code = created && e <= OUT_TOL && dropped == KDAC_E_UNKNOWN_LAYER && nlayers == 1 &&
                       strcmp(info[0].name, "shared.L") == 0
                   ? 0
                   : 1;
    }
    free(out);
    free(state);
    free(ref);
    return code;
}

/* Registers *(int *)arg layers of its own, then one more: 0 when the last
 * alone is refused QUOTA_EXCEEDED (its error in msg). */
static int child_layers_up_to_quota(const char *sock, void *arg, char *msg, size_t len)
{
    int n = *(int *)arg;
    static float A_log[DH_HEADS], dt_bias[DH_HEADS * 128];
    kdac_client *c;
    if (child_open(sock, &c, msg, len))
        return 1;
    kdac_error err;
    int rc = 0, i;
    for (i = 0; i <= n && !rc; i++) {
        char name[24];
        snprintf(name, sizeof(name), "child.%d", i);
        kdac_layer layer = {name, A_log, dt_bias, -5.0f, KDAC_DEFAULT_SCALE};
        rc = kdac_layer_register(c, &layer, NULL, &err);
    }
    kdac_client_close(c);
    snprintf(msg, len, "%d registered; then %s: %s", i - 1, kdac_err_name(rc),
             rc ? err.message : "");
    return i - 1 == n && rc == KDAC_E_QUOTA_EXCEEDED ? 0 : 1;
}

/* ---------------------------------------------------------------------- */
/* Root-side helpers (raw protocol through daemon_harness)                */
/* ---------------------------------------------------------------------- */

/* Connects and says hello; false when the daemon answers with a goodbye
 * instead (whose error is then in *refusal). */
static bool try_hello(dh_client *c, const dh_daemon *d, kp_error *refusal)
{
    dh_connect(c, d);
    kp_hello_params p = {{KP_PROTOCOL_VERSION}, 1, "test_access"};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_hello_params_encode(&c->w, id, &p, NULL), KP_OK);
    /* A connection over quota is refused at accept: the daemon may have sent its
       goodbye and closed before the hello goes out, so the write may fail with
       EPIPE while the goodbye still waits to be read. */
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&c->w, &frame, &len, NULL), KP_OK);
    ssize_t w = send(c->fd, frame, len, MSG_NOSIGNAL);
    assert_true(w == (ssize_t)len || (w < 0 && (errno == EPIPE || errno == ECONNRESET)));
    free(frame);
    assert_true(dh_recv(c));
    if (c->msg.kind == KP_MSG_RESPONSE && !c->msg.error) {
        kp_hello_result r;
        assert_int_equal(kp_hello_result_decode(&c->msg, &r, NULL), KP_OK);
        kp_session_from_hello(&c->session, &r);
        return true;
    }
    kp_error e;
    assert_int_equal(kp_goodbye_decode(&c->msg, refusal, &e), KP_OK);
    return false;
}

static uint64_t stats_counter(dh_client *c, bool disconnects, const char *name)
{
    kp_stats_result r;
    dh_stats(c, &r);
    return disconnects ? dh_counter(r.disconnects, r.ndisconnects, name)
                       : dh_counter(r.errors, r.nerrors, name);
}

static void send_slot_list(dh_client *c, uint32_t id, kp_method m, uint64_t slot)
{
    kp_slot_list p = {&slot, 1};
    if (m == KP_METHOD_SLOT_FREE)
        assert_int_equal(kp_slot_free_params_encode(&c->w, id, &p, NULL), KP_OK);
    else if (m == KP_METHOD_SLOT_RESET)
        assert_int_equal(kp_slot_reset_params_encode(&c->w, id, &p, NULL), KP_OK);
    else
        assert_int_equal(kp_slot_info_params_encode(&c->w, id,
                                                    &(kp_slot_info_params){true, p}, NULL),
                         KP_OK);
    dh_send(c);
}

/* slot.info of one slot of ours: its position. */
static uint64_t slot_pos(dh_client *c, uint64_t slot)
{
    uint32_t id = dh_id(c);
    send_slot_list(c, id, KP_METHOD_SLOT_INFO, slot);
    dh_expect_result(c, id);
    kp_slot_info_result r;
    assert_int_equal(kp_slot_info_result_decode(&c->msg, &r, NULL), KP_OK);
    assert_int_equal(r.nslots, 1);
    assert_int_equal(r.slots[0].status, KP_SLOT_READY);
    return r.slots[0].pos;
}

/* ---------------------------------------------------------------------- */
/* Tests                                                                  */
/* ---------------------------------------------------------------------- */

/* The access lists, with real uids and groups: who is refused, how, and
 * what the log says; names in the lists; a reload changes who may connect. */
static void test_access_lists(void **unused)
{
    dh_daemon d;
    dh_client c;
    char msg[1024];
    start(&d, "access:\n  allowed_uids: [root]\n  allowed_gids: [4242]\n");

    identity plain = {NOBODY, NOBODY, {0}, 0};
    assert_int_equal(run_as(&plain, &d, child_connect, NULL, msg, sizeof(msg)), 1);
    if (!strstr(msg, "PERMISSION_DENIED") ||
        !strstr(msg, "uid 65534 (gid 65534, 0 supplementary groups) may not use this daemon"))
        fail_msg("the refused client was told: %s", msg);
    expect_log(&d, "refused: uid 65534 (gid 65534, 0 supplementary groups) may not use");

    /* a supplementary group in allowed_gids lets it in, all the way to a prefill */
    identity member = {NOBODY, NOBODY, {4100, 4242}, 2};
    if (run_as(&member, &d, child_prefill, NULL, msg, sizeof(msg)) != 0)
        fail_msg("a member of an allowed supplementary group: %s", msg);
    /* so does the primary gid */
    identity primary = {NOBODY, 4242, {0}, 0};
    if (run_as(&primary, &d, child_connect, NULL, msg, sizeof(msg)) != 0)
        fail_msg("an allowed primary gid: %s", msg);
    /* other groups do not */
    identity others = {NOBODY, NOBODY, {4243, 4244}, 2};
    assert_int_equal(run_as(&others, &d, child_connect, NULL, msg, sizeof(msg)), 1);
    if (!strstr(msg, "PERMISSION_DENIED") || !strstr(msg, "2 supplementary groups"))
        fail_msg("other groups were told: %s", msg);

    /* root, by name */
    dh_connect(&c, &d);
    dh_hello(&c);
    assert_int_equal(stats_counter(&c, true, "permission"), 2);

    /* SIGHUP: the lists apply to the connections made after it */
    dh_write_config(&d, "heads: 4\nslots: 16\ncpu_threads: 2\nsocket:\n  mode: 0666\n"
                        "access:\n  allowed_uids: [root, 65534]\n");
    kill(d.pid, SIGHUP);
    expect_log(&d, "reloaded");
    if (run_as(&plain, &d, child_connect, NULL, msg, sizeof(msg)) != 0)
        fail_msg("uid 65534 after the reload: %s", msg);
    dh_close(&c);
    dh_stop(&d);
}

/* clients.max_connections_per_uid counts each uid apart. */
static void test_connection_quota(void **unused)
{
    dh_daemon d;
    dh_client c1, c2, c3;
    kp_error refusal;
    char msg[1024];
    start(&d, "clients:\n  max_connections_per_uid: 2\n");
    assert_true(try_hello(&c1, &d, &refusal));
    assert_true(try_hello(&c2, &d, &refusal));
    assert_false(try_hello(&c3, &d, &refusal));
    assert_int_equal(refusal.code, KP_E_QUOTA_EXCEEDED);
    if (!strstr(refusal.message, "uid 0 has 2 connections open"))
        fail_msg("refused with: %s", refusal.message);
    assert_false(dh_recv(&c3)); /* then closed */
    dh_close(&c3);
    expect_log(&d, "refused: uid 0 has 2 connections open");

    /* another uid has its own count, while root holds its two */
    identity plain = {NOBODY, NOBODY, {0}, 0};
    int three = 3;
    if (run_as(&plain, &d, child_connect_many, &three, msg, sizeof(msg)) != 0 ||
        !strstr(msg, "QUOTA_EXCEEDED") || !strstr(msg, "uid 65534 has 2 connections open"))
        fail_msg("uid 65534 opening three: %s", msg);

    /* a closed connection gives its place back (once the daemon has seen it close:
       retrying before that would be refused and counted) */
    dh_close(&c2);
    kp_stats_result st;
    for (int tries = 0;; tries++) {
        dh_stats(&c1, &st);
        if (st.connections == 1)
            break;
        assert_true(tries < 250);
        usleep(20000);
    }
    assert_true(try_hello(&c3, &d, &refusal));
    assert_int_equal(stats_counter(&c1, true, "quota"), 2);
    dh_close(&c3);
    dh_close(&c1);
    dh_stop(&d);
}

/* A quota on unanswered request bytes (the `clients` section given): a request
 * that would go beyond it is refused at once, BUSY naming the quota; the
 * others run, and answers give the bytes back. */
static void inflight_bytes_refused(const char *clients, const char *quota_name)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    rng_seed(&r, 7);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 6); /* a frame of about 24.6 KB: two fit in 64 KiB, three do not */
    char yaml[256];
    snprintf(yaml, sizeof(yaml), "limits:\n  max_frame_bytes: 64KiB\n  max_inline_bytes: 64KiB\n%s",
             clients);
    start(&d, yaml);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t a = dh_alloc(&c), b = dh_alloc(&c);

    /* All four frames must reach the daemon before it answers any: stop it,
     * write them (about 75 KB: the socket buffer takes them), and let it go. */
    int status;
    assert_int_equal(kill(d.pid, SIGSTOP), 0);
    assert_int_equal(waitpid(d.pid, &status, WUNTRACED), d.pid);
    assert_true(WIFSTOPPED(status));
    uint32_t id1 = dh_send_prefill(&c, "L", a, &s, 0);
    uint32_t id2 = dh_send_prefill(&c, "L", b, &s, 0);
    uint32_t id3 = dh_send_prefill(&c, "L", a, &s, 6);
    uint32_t id4 = dh_id(&c);
    assert_int_equal(kp_health_params_encode(&c.w, id4, NULL), KP_OK);
    dh_send(&c);
    assert_int_equal(kill(d.pid, SIGCONT), 0);

    /* refused at once, while the first two are admitted; the small health
     * request after it still fits */
    dh_expect_error(&c, id3, KP_E_BUSY, quota_name);
    dh_expect_result(&c, id4);
    assert_int_equal(dh_recv_prefill(&c, id1, &s, NULL), 6);
    assert_int_equal(dh_recv_prefill(&c, id2, &s, NULL), 6);
    /* answered requests give their bytes back */
    id3 = dh_send_prefill(&c, "L", a, &s, 6);
    assert_int_equal(dh_recv_prefill(&c, id3, &s, NULL), 12);
    assert_int_equal(stats_counter(&c, false, "BUSY"), 1);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

/* clients.max_inflight_bytes_per_uid: one uid's unanswered bytes. */
static void test_inflight_bytes_quota(void **unused)
{
    inflight_bytes_refused("clients:\n  max_inflight_bytes_per_uid: 64KiB\n",
                           "above clients.max_inflight_bytes_per_uid");
}

/* clients.max_inflight_bytes_total: all uids' together (here below the uid's own). */
static void test_inflight_bytes_total(void **unused)
{
    inflight_bytes_refused("clients:\n  max_inflight_bytes_per_uid: 1MiB\n"
                           "  max_inflight_bytes_total: 64KiB\n",
                           "above clients.max_inflight_bytes_total");
}

/* Without slots_persist a slot belongs to its connection: every method that
 * names it is refused to any other connection, even of the same uid, and
 * leaves it as it was. */
static void test_slots_belong_to_their_connection(void **unused)
{
    dh_daemon d;
    dh_client c, o;
    dh_layer l;
    dh_seq s;
    test_rng r;
    rng_seed(&r, 8);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 50);
    start(&d, NULL);
    dh_connect(&c, &d);
    dh_hello(&c);
    dh_register_layer(&c, "L", &l);
    uint64_t a = dh_alloc(&c);
    uint32_t id = dh_send_prefill(&c, "L", a, &s, 0);
    assert_int_equal(dh_recv_prefill(&c, id, &s, NULL), 50);

    dh_connect(&o, &d);
    dh_hello(&o);
    uint64_t mine = dh_alloc(&o);
    static float state[DH_STATE_ELEMS];
    const char *why = "belongs to another client";

    id = dh_send_prefill(&o, "L", a, &s, -1);
    dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, why);
    kp_slot_read_params rp = {.slot = a, .has_dtype = true, .dtype = KP_DTYPE_F32};
    id = dh_id(&o);
    assert_int_equal(kp_slot_read_params_encode(&o.w, id, &rp, NULL), KP_OK);
    dh_send(&o);
    dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, why);
    kp_slot_write_params wp = {a, 7, KP_DTYPE_F32, kp_ref_inline(state, sizeof(state))};
    id = dh_id(&o);
    assert_int_equal(kp_slot_write_params_encode(&o.w, id, &wp, NULL), KP_OK);
    dh_send(&o);
    dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, why);
    kp_slot_fork_params from = {a, false, 0}, into = {mine, true, a};
    id = dh_id(&o);
    assert_int_equal(kp_slot_fork_params_encode(&o.w, id, &from, NULL), KP_OK);
    dh_send(&o);
    dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, "src: slot");
    id = dh_id(&o);
    assert_int_equal(kp_slot_fork_params_encode(&o.w, id, &into, NULL), KP_OK);
    dh_send(&o);
    dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, "dst: slot");
    const kp_method lists[] = {KP_METHOD_SLOT_FREE, KP_METHOD_SLOT_RESET, KP_METHOD_SLOT_INFO};
    for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++) {
        id = dh_id(&o);
        send_slot_list(&o, id, lists[i], a);
        dh_expect_error(&o, id, KP_E_PERMISSION_DENIED, why);
    }

    /* the owner's slot is untouched: position and state */
    assert_int_equal(slot_pos(&c, a), 50);
    assert_int_equal(dh_read_state(&c, a, state), 50);
    bool nonzero = false;
    for (size_t i = 0; i < DH_STATE_ELEMS && !nonzero; i++)
        nonzero = state[i] != 0.0f;
    assert_true(nonzero);
    dh_seq_free(&s);
    dh_close(&o);
    dh_close(&c);
    dh_stop(&d);
}

/* With slots_persist a slot belongs to its uid: the uid's connections share
 * it (and one quota), other uids cannot use it, and it outlives the
 * connection that allocated it. */
static void test_slots_belong_to_their_uid(void **unused)
{
    dh_daemon d;
    dh_client c1, c2;
    char msg[1024];
    static float state[DH_STATE_ELEMS];
    start(&d, "slots_persist: true\nlimits:\n  max_slots_per_client: 2\n");
    dh_connect(&c1, &d);
    dh_hello(&c1);
    dh_connect(&c2, &d);
    dh_hello(&c2);
    uint64_t a = dh_alloc(&c1);
    assert_int_equal(dh_read_state(&c2, a, state), 0); /* same uid: shared */
    dh_alloc(&c2);
    kp_slot_alloc_params ap = {1, true};
    uint32_t id = dh_id(&c2);
    assert_int_equal(kp_slot_alloc_params_encode(&c2.w, id, &ap, NULL), KP_OK);
    dh_send(&c2);
    dh_expect_error(&c2, id, KP_E_QUOTA_EXCEEDED, "max_slots_per_client 2 (2 held)");

    /* another uid: refused on root's slot; its own slots are refused to root */
    identity plain = {NOBODY, NOBODY, {0}, 0};
    if (run_as(&plain, &d, child_touch_slot, &a, msg, sizeof(msg)) != 0)
        fail_msg("uid 65534 on root's slot: %s", msg);
    uint64_t theirs = strtoull(msg, NULL, 10);
    kp_slot_read_params rp = {.slot = theirs, .has_dtype = true, .dtype = KP_DTYPE_F32};
    id = dh_id(&c1);
    assert_int_equal(kp_slot_read_params_encode(&c1.w, id, &rp, NULL), KP_OK);
    dh_send(&c1);
    dh_expect_error(&c1, id, KP_E_PERMISSION_DENIED, "belongs to another client");

    /* the slot outlives the connection that allocated it */
    dh_close(&c1);
    assert_int_equal(slot_pos(&c2, a), 0);
    dh_close(&c2);
    dh_stop(&d);
}

/* Sends slot.alloc of count slots; returns its id. */
static uint32_t send_alloc(dh_client *c, uint32_t count)
{
    kp_slot_alloc_params ap = {count, true};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_slot_alloc_params_encode(&c->w, id, &ap, NULL), KP_OK);
    dh_send(c);
    return id;
}

/* limits.max_slots_per_uid bounds a uid's connections together (each also
 * bounded by max_slots_per_client) and not other uids; with slots_persist it
 * bounds what the uid keeps after its connections closed.  hello announces it. */
static void test_slots_per_uid(void **unused)
{
    dh_daemon d;
    dh_client c1, c2;
    char msg[1024];
    start(&d, "limits:\n  max_slots_per_client: 2\n  max_slots_per_uid: 3\n");
    dh_connect(&c1, &d);
    dh_hello(&c1);
    assert_int_equal(c1.session.limits.max_slots_per_uid, 3);
    dh_connect(&c2, &d);
    dh_hello(&c2);
    dh_expect_result(&c1, send_alloc(&c1, 2));
    uint64_t mine = dh_alloc(&c2);
    dh_expect_error(&c2, send_alloc(&c2, 1), KP_E_QUOTA_EXCEEDED,
                    "max_slots_per_uid 3 (uid 0 holds 3)");
    /* another uid has its own bound (and cannot touch root's slots) */
    identity plain = {NOBODY, NOBODY, {0}, 0};
    if (run_as(&plain, &d, child_touch_slot, &mine, msg, sizeof(msg)) != 0)
        fail_msg("uid 65534: %s", msg);
    dh_close(&c1);
    dh_close(&c2);
    dh_stop(&d);

    /* slots_persist: the uid keeps its three after disconnecting, and no more */
    dh_daemon p;
    start(&p, "slots_persist: true\nlimits:\n  max_slots_per_client: 8\n"
              "  max_slots_per_uid: 3\n");
    dh_connect(&c1, &p);
    dh_hello(&c1);
    dh_expect_result(&c1, send_alloc(&c1, 3));
    dh_close(&c1);
    dh_connect(&c2, &p);
    dh_hello(&c2);
    dh_expect_error(&c2, send_alloc(&c2, 1), KP_E_QUOTA_EXCEEDED,
                    "max_slots_per_uid 3 (uid 0 holds 3)");
    kp_slot_info_params ip = {false, {NULL, 0}};
    uint32_t id = dh_id(&c2);
    assert_int_equal(kp_slot_info_params_encode(&c2.w, id, &ip, NULL), KP_OK);
    dh_send(&c2);
    dh_expect_result(&c2, id);
    kp_slot_info_result ir;
    assert_int_equal(kp_slot_info_result_decode(&c2.msg, &ir, NULL), KP_OK);
    assert_int_equal(ir.nslots, 3);
    assert_int_equal(ir.quota_left, 0);
    kp_stats_result st;
    dh_stats(&c2, &st);
    assert_int_equal(st.uid_slots, 3);
    dh_close(&c2);
    dh_stop(&p);
}

/* Output of a prefill on c (layer name, a fresh slot of c) against the
 * oracle of weights l: its relative RMS error. */
static double prefill_error(dh_client *c, const char *name, const dh_layer *l, const dh_seq *s)
{
    const size_t n = (size_t)s->len * DH_HEADS * 128;
    uint16_t *out = malloc(n * sizeof(uint16_t));
    double *state = calloc(DH_STATE_ELEMS, sizeof(double)), *ref = calloc(n, sizeof(double));
    uint64_t slot = dh_alloc(c);
    uint32_t id = dh_send_prefill(c, name, slot, s, 0);
    assert_int_equal(dh_recv_prefill(c, id, s, out), s->len);
    dh_oracle(l, s, state, ref);
    double e = dh_err_bf16(out, ref, n);
    send_slot_list(c, id = dh_id(c), KP_METHOD_SLOT_FREE, slot);
    dh_expect_result(c, id);
    free(out);
    free(state);
    free(ref);
    return e;
}

/*
 * Layer names are each uid's own.  Root's second client still holds a
 * registration of "shared.L" when the first drops its own; another uid then
 * registers "shared.L" with other weights: it gets a layer of its own (and
 * runs on it), root's next prefill still runs on root's weights, neither
 * sees nor drops the other's layers.
 */
static void test_layer_names_per_uid(void **unused)
{
    dh_daemon d;
    dh_client c1, c2;
    dh_layer l, other;
    dh_seq s;
    test_rng r;
    char msg[1024];
    rng_seed(&r, 31);
    dh_layer_make(&l, &r);
    dh_layer_make(&other, &r);
    dh_seq_make(&s, &r, 48);
    start(&d, NULL);
    dh_connect(&c1, &d);
    dh_hello(&c1);
    dh_connect(&c2, &d);
    dh_hello(&c2);
    dh_register_layer(&c1, "shared.L", &l);
    dh_register_layer(&c2, "shared.L", &l);
    dh_register_layer(&c1, "root.L", &l);
    kp_layer_drop_params dp = {"shared.L"};
    uint32_t id = dh_id(&c1);
    assert_int_equal(kp_layer_drop_params_encode(&c1.w, id, &dp, NULL), KP_OK);
    dh_send(&c1);
    dh_expect_result(&c1, id);

    identity plain = {NOBODY, NOBODY, {0}, 0};
    layer_job job = {&other, &s};
    if (run_as(&plain, &d, child_own_layer, &job, msg, sizeof(msg)) != 0)
        fail_msg("uid 65534 on \"shared.L\": %s", msg);
    /* root's results: its own weights, not the other uid's */
    assert_true(prefill_error(&c2, "shared.L", &l, &s) <= OUT_TOL);
    assert_true(prefill_error(&c1, "shared.L", &other, &s) > 10 * OUT_TOL); /* a real check */
    id = dh_id(&c2);
    assert_int_equal(kp_layer_list_params_encode(&c2.w, id, NULL), KP_OK);
    dh_send(&c2);
    dh_expect_result(&c2, id);
    kp_layer_list_result ll;
    assert_int_equal(kp_layer_list_result_decode(&c2.msg, &ll, NULL), KP_OK);
    assert_int_equal(ll.nlayers, 2); /* shared.L and root.L: not the other uid's */
    dh_seq_free(&s);
    dh_close(&c1);
    dh_close(&c2);
    dh_stop(&d);
}

/* limits.max_layers_per_uid counts each uid apart: root holding its bound
 * leaves the other uid its own. */
static void test_layers_per_uid(void **unused)
{
    dh_daemon d;
    dh_client c1;
    dh_layer l;
    test_rng r;
    char msg[1024];
    rng_seed(&r, 32);
    dh_layer_make(&l, &r);
    start(&d, "limits:\n  max_layers: 5\n  max_layers_per_uid: 2\n");
    dh_connect(&c1, &d);
    dh_hello(&c1);
    assert_int_equal(c1.session.limits.max_layers_per_uid, 2);
    dh_register_layer(&c1, "root.L", &l);
    dh_register_layer(&c1, "root.K", &l);
    kp_layer_register_params lp = {"root.M", kp_ref_inline(l.A_log, sizeof(l.A_log)),
                                   kp_ref_inline(l.dt_bias, sizeof(l.dt_bias)), l.lower_bound,
                                   l.scale};
    uint32_t id = dh_id(&c1);
    assert_int_equal(kp_layer_register_params_encode(&c1.w, id, &lp, NULL), KP_OK);
    dh_send(&c1);
    dh_expect_error(&c1, id, KP_E_QUOTA_EXCEEDED,
                    "uid 0 holds 2 layers, limits.max_layers_per_uid");
    identity plain = {NOBODY, NOBODY, {0}, 0};
    int two = 2;
    if (run_as(&plain, &d, child_layers_up_to_quota, &two, msg, sizeof(msg)) != 0 ||
        !strstr(msg, "uid 65534 holds 2 layers"))
        fail_msg("uid 65534 registering: %s", msg);
    dh_close(&c1);
    dh_stop(&d);
}

int main(void)
{
    if (geteuid() != 0) {
        printf("skipped: these tests take other uids (setuid to nobody); run them as root\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_access_lists, dh_teardown),
        cmocka_unit_test_teardown(test_connection_quota, dh_teardown),
        cmocka_unit_test_teardown(test_inflight_bytes_quota, dh_teardown),
        cmocka_unit_test_teardown(test_inflight_bytes_total, dh_teardown),
        cmocka_unit_test_teardown(test_slots_belong_to_their_connection, dh_teardown),
        cmocka_unit_test_teardown(test_slots_belong_to_their_uid, dh_teardown),
        cmocka_unit_test_teardown(test_slots_per_uid, dh_teardown),
        cmocka_unit_test_teardown(test_layer_names_per_uid, dh_teardown),
        cmocka_unit_test_teardown(test_layers_per_uid, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
