/*
 * profile.cuh - per-phase cycle counters for one CTA (built with -DKDA_PROFILE
 * only).  The producer's thread 0 and the first consumer's thread 0 add
 * clock64() deltas per phase; the totals go to g_profile at kernel exit.
 */
#pragma once

#include <stdint.h>

namespace kda {

enum ProfileSlot {
    PROF_P_FETCH, PROF_P_LOADWAIT, PROF_P_EMPTYWAIT, PROF_P_OPERANDS, PROF_P_LMQK, PROF_P_INV,
    PROF_C_FULLWAIT, PROF_C_STATE, PROF_C_STEP1, PROF_C_STEP23, PROF_C_STEP4, PROF_C_EPILOGUE,
    PROF_CHUNKS, PROF_TOTAL, PROF_SLOTS
};

__device__ unsigned long long g_profile[PROF_SLOTS];

struct Profiler {
    unsigned long long acc[PROF_SLOTS] = {};
    long long t = 0, begin = 0;
    bool on = false;
    __device__ void start(bool enable) { on = enable && blockIdx.x == 0; t = begin = clock64(); }
    __device__ void mark(int slot)   /* charges the time since the last mark to `slot` */
    {
        const long long now = clock64();
        if (on)
            acc[slot] += now - t;
        t = now;
    }
    __device__ void count(int slot) { if (on) acc[slot]++; }
    __device__ void flush(int total_slot)
    {
        acc[total_slot] = clock64() - begin;
        if (on)
            for (int i = 0; i < PROF_SLOTS; i++)
                if (acc[i])
                    atomicAdd(&g_profile[i], acc[i]);
    }
};

}  // namespace kda

#ifdef KDA_PROFILE
#define PROF_START(enable) ::kda::Profiler prof_; prof_.start(enable)
#define PROF_MARK(slot) prof_.mark(::kda::slot)
#define PROF_COUNT(slot) prof_.count(::kda::slot)
#define PROF_FLUSH(total_slot) prof_.flush(::kda::total_slot)
#else
#define PROF_START(enable) ((void)0)
#define PROF_MARK(slot) ((void)0)
#define PROF_COUNT(slot) ((void)0)
#define PROF_FLUSH(total_slot) ((void)0)
#endif
