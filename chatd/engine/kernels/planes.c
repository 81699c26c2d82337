/* Byte planes of 2- and 4-byte elements, for the KV snapshot codec (chatd/kv/snapshot_frames.py).
 *
 * A snapshot stores each head slab as byte planes: plane 0 holds the most significant byte of every element,
 * plane 1 the next, and so on, so the slowly varying sign and exponent bytes sit together and compress. A
 * restore joins the decompressed planes back into the elements; a snapshot write splits them. numpy does
 * either in several passes over memory, with a casting loop for the 2-byte case; one vectorised pass does it at
 * memory speed (a 2,048-token restore on 2 threads: 31.8 ms warm with numpy, 24.4 with this; see
 * benchmarks/snapshot_planes.py).
 *
 * Elements are read and written as native integers, so the result does not depend on the host's byte order.
 * Both run on the calling thread: the snapshot decoder's own threads call them side by side.
 */
#include <stdint.h>

/* out[i] = the element whose bytes, most significant first, are planes[0][i], planes[1][i], ...
 * planes is [size][n] (plane p at planes + p * n); size 2 or 4. Returns 0, or -1 for another size. */
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

/* The inverse: planes[p][i] = byte p (most significant first) of element i of data. */
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
