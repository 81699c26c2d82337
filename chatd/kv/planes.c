/* Byte planes of 2- and 4-byte elements, for the KV snapshot codec (snapshot_frames.py beside this file).
 *
 * A snapshot stores each head slab as byte planes: plane 0 holds the most significant byte of every element,
 * plane 1 the next, and so on, so the slowly varying sign and exponent bytes sit together and compress. A
 * restore joins the decompressed planes back into the elements; a snapshot write splits them. numpy does
 * either in several passes over memory, with a casting loop for the 2-byte case; one vectorised pass does it at
 * memory speed (docs/performance.md, "Snapshot restore: byte planes joined natively, and what bounds figure 1
 * here"; benchmarks/snapshot_planes.py). It is built on its own, for this very CPU (-march), since its loops are
 * what the compiler vectorises: chatd/engine/kernels/loader.py builds and loads it (EngineKernels.join_planes and
 * split_planes, which the codec takes as its PlaneKernels).
 *
 * Elements are read and written as native integers, so the result does not depend on the host's byte order.
 * Both run on the calling thread: the snapshot decoder's own threads call them side by side.
 */
#include <stdint.h>

#include "planes.h"

int chatd_join_planes(const uint8_t *restrict planes, void *restrict out, int64_t n, int size)
{
    if (size == 2) {
        const uint8_t *restrict high = planes, *restrict low = planes + n;
        uint16_t *restrict words = out;
        for (int64_t i = 0; i < n; i++)
            words[i] = (uint16_t)((uint16_t)high[i] << 8 | low[i]);
        return 0;
    }
    if (size == 4) {
        const uint8_t *restrict b0 = planes, *restrict b1 = planes + n, *restrict b2 = planes + 2 * n,
                      *restrict b3 = planes + 3 * n;
        uint32_t *restrict words = out;
        for (int64_t i = 0; i < n; i++)
            words[i] = (uint32_t)b0[i] << 24 | (uint32_t)b1[i] << 16 | (uint32_t)b2[i] << 8 | b3[i];
        return 0;
    }
    return -1;
}

int chatd_split_planes(const void *restrict data, uint8_t *restrict planes, int64_t n, int size)
{
    if (size == 2) {
        const uint16_t *restrict words = data;
        uint8_t *restrict high = planes, *restrict low = planes + n;
        for (int64_t i = 0; i < n; i++) {
            high[i] = (uint8_t)(words[i] >> 8);
            low[i] = (uint8_t)words[i];
        }
        return 0;
    }
    if (size == 4) {
        const uint32_t *restrict words = data;
        uint8_t *restrict b0 = planes, *restrict b1 = planes + n, *restrict b2 = planes + 2 * n,
                *restrict b3 = planes + 3 * n;
        for (int64_t i = 0; i < n; i++) {
            b0[i] = (uint8_t)(words[i] >> 24);
            b1[i] = (uint8_t)(words[i] >> 16);
            b2[i] = (uint8_t)(words[i] >> 8);
            b3[i] = (uint8_t)words[i];
        }
        return 0;
    }
    return -1;
}
