/*
 * fuzz_config.c - kdad's configuration parser fed hostile YAML: every input
 * is either loaded (and freed) or refused with a message; nothing else may
 * happen (no crash, leak, or undefined behaviour under ASan + UBSan).
 *
 * A libFuzzer target (scripts/fuzz.sh config); replay.c runs the same
 * function over files: ctest's fuzz_config_seeds replays the documented
 * default (config/kdad.yaml) and the seeds in tests/fuzz/config/.
 */
#include <stdint.h>
#include <stdlib.h>

#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    kd_config c;
    char err[KD_CONFIG_ERR_MAX] = "";
    if (kd_config_load_text(&c, "fuzz.yaml", (const char *)data, len, err, sizeof(err)) == 0)
        kd_config_free(&c);
    else if (!err[0])
        abort(); /* a refusal always says why */
    return 0;
}
