/* The byte planes of the KV snapshot codec (planes.c): the library's exported functions. The engine's loader
 * (chatd/engine/kernels/loader.py) builds planes.c into a library of its own, for this very CPU, and binds these
 * with ctypes (tests/test_kernel_header.py checks its argtypes against the prototypes here). */
#ifndef CHATD_PLANES_H
#define CHATD_PLANES_H

#include <stdint.h>

/* out[i] = the element whose bytes, most significant first, are planes[0][i], planes[1][i], ...
 * planes is [size][n] (plane p at planes + p * n); size 2 or 4. Returns 0, or -1 for another size. */
int chatd_join_planes(const uint8_t *planes, void *out, int64_t n, int size);

/* The inverse: planes[p][i] = byte p (most significant first) of element i of data. Returns 0, or -1 for a size
 * other than 2 or 4. */
int chatd_split_planes(const void *data, uint8_t *planes, int64_t n, int size);

#endif
