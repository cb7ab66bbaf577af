/* The CPU's own fp32 ceiling: AVX-512 fused multiply-adds with nothing else in the loop.
 *
 *     gcc -O2 -mavx512f -mfma -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
 *     OMP_NUM_THREADS=2 /tmp/fma_peak
 *
 * Each thread runs 12 independent chains a = a * b + c on 16 floats (12 > the FMA latency times
 * the number of FMA units, so the units never wait on a result), 2 FLOP per lane per FMA.
 * No GEMM, in any library, can run faster than this number; train.py's MFUs divide by measured
 * GEMM peaks, which sit below it. Best of 5 repetitions.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define CHAINS 12
#define ITERS 100000000L

int main(void) {
    double best = 0.0;
    for (int rep = 0; rep < 5; rep++) {
        float sink = 0.0f;
        double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
        {
            const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
            __m512 a[CHAINS];
            for (int i = 0; i < CHAINS; i++)  /* distinct starts: no two chains can be merged */
                a[i] = _mm512_set1_ps((float)(i + CHAINS * omp_get_thread_num()));
            for (long n = 0; n < ITERS; n++) {
#pragma GCC unroll 12
                for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
            }
            __m512 s = a[0];
            for (int i = 1; i < CHAINS; i++) s = _mm512_add_ps(s, a[i]);
            sink += _mm512_reduce_add_ps(s);  /* keeps the chains alive */
        }
        double seconds = omp_get_wtime() - t0;
        double flops = (double)omp_get_max_threads() * ITERS * CHAINS * 16 * 2;
        if (flops / seconds > best) best = flops / seconds;
        if (sink == 42.0f) printf(" ");
    }
    printf("%d threads: fp32 FMA peak %.1f GFLOP/s\n", omp_get_max_threads(), best / 1e9);
    return 0;
}
