/*
 * kda_cpu.c - the CPU backend: a persistent thread pool over (sequence, head)
 * work items, each item one chain of chunk.c (prefill) or of step.c (step).
 *
 * Items are handed out longest sequence first from one atomic counter, so a
 * batch of one long and many short sequences keeps every thread busy.  The
 * calling thread works too; the call returns when every item is done.
 */
#define _GNU_SOURCE   /* qsort_r */
#include "kda_cpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "chunk.h"
#include "step.h"

typedef struct cpu_item {
    int64_t seq;
    int32_t head;
} cpu_item;

struct kda_cpu {
    int nthreads;                 /* workers including the calling thread */
    pthread_t *threads;           /* nthreads - 1 helpers */
    cpu_scratch *scratch;         /* one per worker; [0] is the caller's */

    pthread_mutex_t mu;
    pthread_cond_t wake;          /* a new job (generation bumped) or stop */
    pthread_cond_t done;          /* the last helper finished the job */
    uint64_t generation;
    int running_helpers;
    int stopping;

    /* the job in progress: a prefill (seqs, items) or a step (item i = sequence i / H, head i % H) */
    const kda_pool *pool;
    const kda_seq *seqs;
    const kda_step *step;
    cpu_item *items;
    int64_t nitems;
    size_t items_cap;
    _Atomic int64_t next_item;
};

static void run_items(kda_cpu *cpu, cpu_scratch *ws)
{
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&cpu->next_item, 1, memory_order_relaxed);
        if (i >= cpu->nitems)
            return;
        if (cpu->step) {
            const int32_t heads = cpu->pool->heads;
            cpu_step_run(ws, cpu->pool, cpu->step, (int32_t)(i / heads), (int32_t)(i % heads));
            continue;
        }
        const cpu_item *it = &cpu->items[i];
        cpu_chain_run(ws, cpu->pool, &cpu->seqs[it->seq], it->head);
    }
}

typedef struct helper_arg {
    kda_cpu *cpu;
    int index;
} helper_arg;

static void *helper_main(void *p)
{
    helper_arg arg = *(helper_arg *)p;
    free(p);
    kda_cpu *cpu = arg.cpu;
    uint64_t seen = 0;
    pthread_mutex_lock(&cpu->mu);
    for (;;) {
        while (cpu->generation == seen && !cpu->stopping)
            pthread_cond_wait(&cpu->wake, &cpu->mu);
        if (cpu->stopping)
            break;
        seen = cpu->generation;
        pthread_mutex_unlock(&cpu->mu);
        run_items(cpu, &cpu->scratch[arg.index]);
        pthread_mutex_lock(&cpu->mu);
        if (--cpu->running_helpers == 0)
            pthread_cond_signal(&cpu->done);
    }
    pthread_mutex_unlock(&cpu->mu);
    return NULL;
}

int kda_cpu_create(int nthreads, kda_cpu **out, kda_error *err)
{
    if (nthreads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = n > 0 ? (int)n : 1;
    }
    kda_cpu *cpu = calloc(1, sizeof *cpu);
    if (!cpu)
        return kda_fail(err, KDA_ENOMEM, "no memory for the CPU backend");
    cpu->nthreads = nthreads;
    cpu->scratch = aligned_alloc(64, sizeof(cpu_scratch) * (size_t)nthreads);
    cpu->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!cpu->scratch || !cpu->threads) {
        free(cpu->scratch);
        free(cpu->threads);
        free(cpu);
        return kda_fail(err, KDA_ENOMEM, "no memory for %d CPU workers", nthreads);
    }
    pthread_mutex_init(&cpu->mu, NULL);
    pthread_cond_init(&cpu->wake, NULL);
    pthread_cond_init(&cpu->done, NULL);
    for (int i = 1; i < nthreads; i++) {
        helper_arg *arg = malloc(sizeof *arg);
        if (arg)
            *arg = (helper_arg){cpu, i};   /* before the thread starts: it reads arg at once */
        if (!arg || pthread_create(&cpu->threads[i], NULL, helper_main, arg) != 0) {
            free(arg);
            cpu->nthreads = i;     /* destroy joins the ones that started */
            kda_cpu_destroy(cpu);
            return kda_fail(err, KDA_ENOMEM, "could not start CPU worker %d", i);
        }
    }
    *out = cpu;
    return KDA_OK;
}

void kda_cpu_destroy(kda_cpu *cpu)
{
    if (!cpu)
        return;
    pthread_mutex_lock(&cpu->mu);
    cpu->stopping = 1;
    pthread_cond_broadcast(&cpu->wake);
    pthread_mutex_unlock(&cpu->mu);
    for (int i = 1; i < cpu->nthreads; i++)
        pthread_join(cpu->threads[i], NULL);
    pthread_mutex_destroy(&cpu->mu);
    pthread_cond_destroy(&cpu->wake);
    pthread_cond_destroy(&cpu->done);
    free(cpu->items);
    free(cpu->scratch);
    free(cpu->threads);
    free(cpu);
}

int kda_cpu_threads(const kda_cpu *cpu) { return cpu->nthreads; }

/* qsort_r key: sequence indices by length, longest first. */
static int by_length_desc(const void *a, const void *b, void *seqs)
{
    int64_t la = ((const kda_seq *)seqs)[((const cpu_item *)a)->seq].len;
    int64_t lb = ((const kda_seq *)seqs)[((const cpu_item *)b)->seq].len;
    return (la < lb) - (la > lb);
}

static int build_items(kda_cpu *cpu, const kda_pool *pool, const kda_seq *seqs, int64_t nseqs,
                       kda_error *err)
{
    int64_t nonempty = 0;
    for (int64_t i = 0; i < nseqs; i++)
        nonempty += seqs[i].len > 0;
    size_t need = (size_t)nonempty * (size_t)pool->heads;
    if (need > cpu->items_cap) {
        cpu_item *items = realloc(cpu->items, need * sizeof *items);
        if (!items)
            return kda_fail(err, KDA_ENOMEM, "no memory for %zu work items", need);
        cpu->items = items;
        cpu->items_cap = need;
    }
    /* one item per sequence first, sorted, then expanded over heads */
    int64_t n = 0;
    for (int64_t i = 0; i < nseqs; i++)
        if (seqs[i].len > 0)
            cpu->items[n++] = (cpu_item){i, 0};
    qsort_r(cpu->items, (size_t)n, sizeof *cpu->items, by_length_desc, (void *)seqs);
    for (int64_t i = n - 1; i >= 0; i--) {
        int64_t seq = cpu->items[i].seq;
        for (int32_t h = pool->heads - 1; h >= 0; h--)
            cpu->items[i * pool->heads + h] = (cpu_item){seq, h};
    }
    cpu->nitems = n * pool->heads;
    return KDA_OK;
}

/* Runs cpu->nitems items of a prefill (seqs) or a step on every worker; returns when all are done. */
static void run_job(kda_cpu *cpu, const kda_pool *pool, const kda_seq *seqs, const kda_step *step)
{
    pthread_mutex_lock(&cpu->mu);
    cpu->pool = pool;
    cpu->seqs = seqs;
    cpu->step = step;
    atomic_store(&cpu->next_item, 0);
    cpu->running_helpers = cpu->nthreads - 1;
    cpu->generation++;
    pthread_cond_broadcast(&cpu->wake);
    pthread_mutex_unlock(&cpu->mu);

    run_items(cpu, &cpu->scratch[0]);

    pthread_mutex_lock(&cpu->mu);
    while (cpu->running_helpers > 0)
        pthread_cond_wait(&cpu->done, &cpu->mu);
    cpu->pool = NULL;
    cpu->seqs = NULL;
    cpu->step = NULL;
    pthread_mutex_unlock(&cpu->mu);
}

int kda_cpu_prefill(kda_cpu *cpu, const kda_pool *pool, const kda_seq *seqs, int64_t nseqs,
                    kda_error *err)
{
    int rc = kda_batch_check(pool, seqs, nseqs, err);
    if (rc != KDA_OK)
        return rc;
    for (int64_t i = 0; i < nseqs; i++) {
        kda_error layer_err;
        if (seqs[i].len > 0 && kda_layer_check(seqs[i].layer, &layer_err) != KDA_OK)
            return kda_fail(err, layer_err.code, "seqs[%lld]: %s", (long long)i, layer_err.msg);
    }
    if ((rc = build_items(cpu, pool, seqs, nseqs, err)) != KDA_OK)
        return rc;

    for (int64_t i = 0; i < nseqs; i++)
        if (seqs[i].len == 0 && (seqs[i].flags & KDA_SEQ_ZERO_STATE))
            cpu_slot_zero(pool, seqs[i].slot);
    run_job(cpu, pool, seqs, NULL);
    return KDA_OK;
}

int kda_cpu_step(kda_cpu *cpu, const kda_pool *pool, const kda_step *step, kda_error *err)
{
    int rc = kda_step_check(pool, step, err);
    if (rc != KDA_OK)
        return rc;
    if (step->nseqs == 0)
        return KDA_OK;
    if ((rc = kda_layer_check(step->layer, err)) != KDA_OK)
        return rc;
    cpu->nitems = (int64_t)step->nseqs * pool->heads;
    run_job(cpu, pool, NULL, step);
    return KDA_OK;
}
