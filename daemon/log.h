/*
 * log.h - kdad's log: levels, one line per event on stderr.
 *
 * Under systemd (JOURNAL_STREAM names our stderr) each line starts with the
 * sd-daemon priority prefix "<N>" so the journal records the level, and
 * carries no timestamp (the journal adds one).  Otherwise lines read
 * "2025-01-31T12:00:00.123Z kdad info: message".  The level can change at
 * run time (SIGHUP); logging is safe from any thread.
 */
#ifndef KDAD_LOG_H
#define KDAD_LOG_H

#include <stdbool.h>

/* Values are the syslog priorities, as the journal expects them. */
typedef enum kd_log_level {
    KD_LOG_ERROR = 3,
    KD_LOG_WARNING = 4,
    KD_LOG_NOTICE = 5,
    KD_LOG_INFO = 6,
    KD_LOG_DEBUG = 7,
} kd_log_level;

/* Decides the line format from the environment (JOURNAL_STREAM vs stderr). */
void kd_log_init(kd_log_level level);
void kd_log_set_level(kd_log_level level);
bool kd_log_enabled(kd_log_level level);

/* "error", "warning", "notice", "info", "debug". */
const char *kd_log_level_name(kd_log_level level);

void kd_log(kd_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define KD_ERROR(...) kd_log(KD_LOG_ERROR, __VA_ARGS__)
#define KD_WARN(...) kd_log(KD_LOG_WARNING, __VA_ARGS__)
#define KD_NOTICE(...) kd_log(KD_LOG_NOTICE, __VA_ARGS__)
#define KD_INFO(...) kd_log(KD_LOG_INFO, __VA_ARGS__)
#define KD_DEBUG(...)                          \
    do {                                       \
        if (kd_log_enabled(KD_LOG_DEBUG))      \
            kd_log(KD_LOG_DEBUG, __VA_ARGS__); \
    } while (0)

#endif /* KDAD_LOG_H */
