/* The dispatch table: which variant of each op family a struct chatd_kernels runs, chosen once, when the caller
 * fills it (chatd_kernels_init), from the CPU features the caller passes: chatd.engine.kernels.cpu.cpu_features()
 * after CHATD_CPU_ISA's cap, so a capped process runs the smaller class's variants on a host that has more. Every
 * kernel reads its variants from the struct it is given; the only later change is chatd_q4_matmul_select and the
 * AMX row threshold, on that struct alone (the tests compare kinds on a struct of their own). */
#include "kernels_impl.h"

/* The loader compiles the x86 variants' files only on x86-64 machines (loader.py's SOURCES) and says so here. */
#ifdef CHATD_X86_VARIANTS
#define X86_VARIANT(table) (&(table))
#define AMX_READY() chatd_amx_ready()
#else
#define X86_VARIANT(table) NULL
#define AMX_READY() 0
#endif

#define AMX_MIN_ROWS 16

/* The variants by CHATD_ISA_* (attention and element-wise ops) and by CHATD_MATMUL_* (tile matmuls), each with the
 * features it needs; NULL where this library does not hold it. */
static const struct chatd_attention_ops *const attention_variants[] = {
    [CHATD_ISA_SCALAR] = &chatd_attention_scalar,
    [CHATD_ISA_AVX2] = X86_VARIANT(chatd_attention_avx2),
    [CHATD_ISA_AVX512] = X86_VARIANT(chatd_attention_avx512),
};
static const struct chatd_row_ops *const row_variants[] = {
    [CHATD_ISA_SCALAR] = &chatd_rows_scalar,
    [CHATD_ISA_AVX2] = X86_VARIANT(chatd_rows_avx2),
    [CHATD_ISA_AVX512] = X86_VARIANT(chatd_rows_avx512),
};
static const struct chatd_matmul_ops *const matmul_variants[] = {
    [CHATD_MATMUL_NONE] = NULL,
    [CHATD_MATMUL_VNNI] = X86_VARIANT(chatd_matmul_vnni),
    [CHATD_MATMUL_AMX] = X86_VARIANT(chatd_matmul_amx),
    [CHATD_MATMUL_AVX2] = X86_VARIANT(chatd_matmul_avx2),
    [CHATD_MATMUL_SCALAR] = &chatd_matmul_scalar,
};
#define VNNI_NEEDS (CHATD_CPU_AVX2 | CHATD_CPU_AVX512 | CHATD_CPU_AVX512_VNNI)
static const int matmul_needs[] = {
    [CHATD_MATMUL_NONE] = 0,
    [CHATD_MATMUL_VNNI] = VNNI_NEEDS,
    [CHATD_MATMUL_AMX] = VNNI_NEEDS | CHATD_CPU_AVX512_BF16 | CHATD_CPU_AMX, /* AMX's few rows run on VNNI */
    [CHATD_MATMUL_AVX2] = CHATD_CPU_AVX2,
    [CHATD_MATMUL_SCALAR] = 0,
};
#define MATMUL_KINDS ((int)(sizeof matmul_variants / sizeof matmul_variants[0]))

static int has(int features, int wanted) { return (features & wanted) == wanted; }

/* The tile matmul `kind` where `features` have it and this library holds it, else NULL. AMX also needs this
 * process's permission to use the tile registers (Linux asks each process to request them). */
static const struct chatd_matmul_ops *matmul_for(int features, int kind)
{
    if (kind < 0 || kind >= MATMUL_KINDS || matmul_variants[kind] == NULL || !has(features, matmul_needs[kind]))
        return NULL;
    if (kind == CHATD_MATMUL_AMX && !AMX_READY())
        return NULL;
    return matmul_variants[kind];
}

/* The best tile matmul `features` have: never the scalar reference. */
static const struct chatd_matmul_ops *best_matmul(int features)
{
    static const int preference[] = {CHATD_MATMUL_AMX, CHATD_MATMUL_VNNI, CHATD_MATMUL_AVX2};
    for (int i = 0; i < 3; i++) {
        const struct chatd_matmul_ops *ops = matmul_for(features, preference[i]);
        if (ops != NULL)
            return ops;
    }
    return NULL;
}

int64_t chatd_kernels_size(void) { return (int64_t)sizeof(struct chatd_kernels); }

void chatd_kernels_init(struct chatd_kernels *kernels, int features)
{
    int isa = has(features, CHATD_CPU_AVX2 | CHATD_CPU_AVX512) ? CHATD_ISA_AVX512
              : has(features, CHATD_CPU_AVX2)                  ? CHATD_ISA_AVX2
                                                               : CHATD_ISA_SCALAR;
    while (attention_variants[isa] == NULL) /* a library of the portable files alone */
        isa--;
    memset(kernels, 0, sizeof *kernels);
    kernels->features = features;
    kernels->isa = isa;
    kernels->attention = attention_variants[isa];
    kernels->rows = row_variants[isa];
    kernels->matmul = best_matmul(features);
    kernels->amx_min_rows = AMX_MIN_ROWS;
}

int chatd_kernels_isa(const struct chatd_kernels *kernels) { return kernels->isa; }

int chatd_q4_matmul_kind(const struct chatd_kernels *kernels)
{
    return kernels->matmul != NULL ? kernels->matmul->kind : CHATD_MATMUL_NONE;
}

int chatd_q4_matmul_select(struct chatd_kernels *kernels, int kind)
{
    const struct chatd_matmul_ops *chosen = kind != CHATD_MATMUL_NONE ? matmul_for(kernels->features, kind) : NULL;
    kernels->matmul = chosen != NULL ? chosen : best_matmul(kernels->features);
    return chatd_q4_matmul_kind(kernels);
}

int chatd_q4_matmul_amx_rows(struct chatd_kernels *kernels, int rows)
{
    if (rows > 0)
        kernels->amx_min_rows = rows;
    return kernels->amx_min_rows;
}
