/*
 * log.c - see log.h.  Each line is formatted into one buffer and written
 * with a single write(2), so lines from different threads never interleave.
 */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Longest line we write; longer messages are cut (with "..." at the end). */
#define LOG_LINE_MAX 2048

static _Atomic int log_level = KD_LOG_INFO;
static bool log_journal;

static const char *const level_names[] = {
    [KD_LOG_ERROR] = "error", [KD_LOG_WARNING] = "warning", [KD_LOG_NOTICE] = "notice",
    [KD_LOG_INFO] = "info",   [KD_LOG_DEBUG] = "debug",
};

/* JOURNAL_STREAM is "device:inode" of the journal's stream; it only counts
 * when it still is our stderr (a child may inherit the variable). */
static bool stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
        return false;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

void kd_log_init(kd_log_level level)
{
    log_journal = stderr_is_journal();
    kd_log_set_level(level);
}

void kd_log_set_level(kd_log_level level)
{
    atomic_store(&log_level, (int)level);
}

bool kd_log_enabled(kd_log_level level)
{
    return (int)level <= atomic_load(&log_level);
}

const char *kd_log_level_name(kd_log_level level)
{
    return level >= KD_LOG_ERROR && level <= KD_LOG_DEBUG ? level_names[level] : "?";
}

void kd_log(kd_log_level level, const char *fmt, ...)
{
    if (!kd_log_enabled(level))
        return;
    char line[LOG_LINE_MAX];
    int n;
    if (log_journal) {
        n = snprintf(line, sizeof(line), "<%d>", (int)level);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ kdad %s: ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, level_names[level]);
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2) {
        len = sizeof(line) - 2;
        memcpy(line + len - 3, "...", 3);
    }
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w; /* nowhere left to report a failing stderr */
}
