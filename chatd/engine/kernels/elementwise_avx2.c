/* The element-wise steps' AVX2 variant: the portable reference (elementwise_scalar.c) compiled with AVX2's flags,
 * where gcc vectorises every row loop 8 lanes wide; nothing here is written by hand for AVX2. */
#define ROWS_TABLE chatd_rows_avx2
#include "elementwise_scalar.c"
