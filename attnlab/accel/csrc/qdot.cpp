// Integer dot-product kernels for int4 / int8 weights on x86 CPUs with AVX2.
// The method is llama.cpp's for Q4_1 x Q8_1 and Q8_0 x Q8_0 (ggml-cpu/arch/x86/quants.c):
// the activations are rounded to int8 in blocks of 32, with one fp32 scale per block,
//
//     x[j] ~= d_x * qx[j]          d_x = max_j |x[j]| / 127,  qx in -127..127,
//
// and a weight block times an activation block is one integer dot product and two scalings:
//
//     int4 (w = d_w * q + m_w, q in 0..15):   sum_j w[j] x[j] ~= d_w d_x sum_j q[j] qx[j] + m_w sum_j x[j]
//     int8 (w = s_w[n] * q, q in -127..127):  sum_j w[j] x[j] ~= s_w d_x sum_j q[j] qx[j]
//
// sum_j x[j] is taken exactly (fp32), so the only rounding beyond the weights' own is x's to
// int8 (relative 1/254 of a block's largest |x| at worst). The integer sums are exact: AVX2's
// maddubs (u8 x s8 -> s16 pairs) cannot saturate here (15 * 127 * 2 and 127 * 127 * 2 both
// fit in int16). The file is compiled for AVX2, FMA and F16C (every AVX2 CPU has the three).
//
// Weight layouts (built once by the Python side from attnlab's plain layout):
//   int4: per row, per block of 32 weights: {fp16 d, fp16 m, 16 bytes}, byte j holding
//         q[j] in its low nibble and q[j + 16] in its high nibble (llama.cpp's block_q4_1,
//         so one load and two masks give all 32 values in order).
//   int8: attnlab's own (N, K) int8 and (N,) fp32 scales, read as they are.
//
// Shapes: x (M, K) fp32 activations, N output rows, K a multiple of 32; y (M, N) fp32.
// Threads: at::parallel_for over output rows (torch's intra-op pool).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 32;          // weights (and activations) per block
// Each weight row's bytes this far ahead are asked for while the current block is used: one
// core's loads alone do not keep enough reads in flight when two or more rows stream side by
// side (measured on SmolLM2's shapes: ~1.4x with 4 rows, 4096 and 8192 alike, 512 less; a few
// percent for one row, which the hardware prefetcher follows on its own).
constexpr int PREFETCH_BYTES = 4096;

struct BlockQ4 {  // 20 bytes: llama.cpp's block_q4_1
  uint16_t d;     // fp16 scale
  uint16_t m;     // fp16 minimum
  uint8_t qs[QK / 2];
};
static_assert(sizeof(BlockQ4) == 20, "BlockQ4 must be packed as in llama.cpp");

// ---- the activations: int8 blocks, one scale and one exact sum per block -------------------

struct QuantizedRows {
  std::vector<int8_t> q;    // (M, K)
  std::vector<float> d;     // (M, K / QK)
  std::vector<float> sum;   // (M, K / QK): sum of the fp32 values of each block
};

void quantize_block(const float* x, int8_t* q, float* d, float* sum) {
  __m256 maxabs = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int j = 0; j < QK; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    maxabs = _mm256_max_ps(maxabs, _mm256_andnot_ps(sign, v));
    s = _mm256_add_ps(s, v);
  }
  float m[8], t[8];
  _mm256_storeu_ps(m, maxabs);
  _mm256_storeu_ps(t, s);
  float amax = 0.f, total = 0.f;
  for (int j = 0; j < 8; j++) {
    amax = std::max(amax, m[j]);
    total += t[j];
  }
  const float scale = amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int j = 0; j < QK; j++) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
  *d = scale;
  *sum = total;
}

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows r;
  const int64_t nb = K / QK;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.sum.resize(M * nb);
  for (int64_t i = 0; i < M * nb; i++)
    quantize_block(x + i * QK, r.q.data() + i * QK, r.d.data() + i, r.sum.data() + i);
  return r;
}

// ---- 32 products summed to 8 int32 lanes ----------------------------------------------------

inline __m256i dot_u8s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);             // 16 x int16, no saturation here
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));        // 8 x int32
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// ---- the tiles ------------------------------------------------------------------------------------
//
// A tile is ROWS output rows times MT activation rows, each pair with its own accumulator: a
// weight block is unpacked once for MT activation rows, an activation block loaded once for
// ROWS weight blocks, and ROWS * MT chains of multiply-adds run side by side (one chain alone
// would wait on each fmadd's latency). ROWS * MT <= 8 keeps the accumulators in registers
// (AVX2 has 16).

inline __m256i q4_values(const BlockQ4& block, __m256i low) {  // q[0..15] | q[16..31], unsigned
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
}

inline __m256i x_block(const QuantizedRows& xq, int64_t i) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * QK));
}

// int4 (Q4_1 blocks) x int8 activations
template <int ROWS, int MT>
void q4_tile(const BlockQ4* w, const QuantizedRows& xq, float* y, int64_t N, int64_t nb,
             int64_t n, int64_t m0) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[ROWS][MT];
  float mins[ROWS][MT];
  for (int r = 0; r < ROWS; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm256_setzero_ps(), mins[r][t] = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    for (int r = 0; r < ROWS; r++) {
      const BlockQ4& block = w[(n + r) * nb + b];
      _mm_prefetch(reinterpret_cast<const char*>(&block) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m256i q = q4_values(block, low);
      const float dw = _cvtsh_ss(block.d), mw = _cvtsh_ss(block.m);
      for (int t = 0; t < MT; t++) {
        const int64_t i = (m0 + t) * nb + b;
        const __m256 scale = _mm256_set1_ps(dw * xq.d[i]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, x_block(xq, i))), scale,
                                    acc[r][t]);
        mins[r][t] += mw * xq.sum[i];
      }
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int t = 0; t < MT; t++) y[(m0 + t) * N + n + r] = hsum(acc[r][t]) + mins[r][t];
}

// int8 (per-row scale) x int8 activations; maddubs takes one unsigned operand, so |q| times
// qx carrying q's sign
template <int ROWS, int MT>
void q8_tile(const int8_t* w, const float* scales, const QuantizedRows& xq, float* y, int64_t N,
             int64_t nb, int64_t n, int64_t m0) {
  __m256 acc[ROWS][MT];
  for (int r = 0; r < ROWS; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    for (int r = 0; r < ROWS; r++) {
      const int8_t* block = w + ((n + r) * nb + b) * QK;
      _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
      const __m256i uq = _mm256_sign_epi8(q, q);
      for (int t = 0; t < MT; t++) {
        const int64_t i = (m0 + t) * nb + b;
        const __m256i dot = dot_u8s8(uq, _mm256_sign_epi8(x_block(xq, i), q));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xq.d[i]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int t = 0; t < MT; t++) y[(m0 + t) * N + n + r] = hsum(acc[r][t]) * scales[n + r];
}

// Output rows n0..n1 for every activation row, tile by tile (`tile<ROWS, MT>(n, m0)`).
// One activation row (a decode step): one weight row after another, a single stream through
// memory (4 rows side by side streamed int8 weights at half the speed, measured on SmolLM2's
// shapes with AVX2); more activation rows: 2 weight rows x up to 4, for the reuse.
template <typename Tile>
void tiles(Tile tile, int64_t M, int64_t n0, int64_t n1) {
  if (M == 1) {
    for (int64_t n = n0; n < n1; n++) tile.template run<1, 1>(n, 0);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mt = std::min<int64_t>(4, M - m0);
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
      switch (mt) {
        case 4: tile.template run<2, 4>(n, m0); break;
        case 3: tile.template run<2, 3>(n, m0); break;
        case 2: tile.template run<2, 2>(n, m0); break;
        default: tile.template run<2, 1>(n, m0);
      }
    }
    for (; n < n1; n++)
      for (int64_t m = m0; m < m0 + mt; m++) tile.template run<1, 1>(n, m);
  }
}

struct Q4Tile {
  const BlockQ4* w; const QuantizedRows& xq; float* y; int64_t N, nb;
  template <int ROWS, int MT> void run(int64_t n, int64_t m0) const {
    q4_tile<ROWS, MT>(w, xq, y, N, nb, n, m0);
  }
};

struct Q8Tile {
  const int8_t* w; const float* scales; const QuantizedRows& xq; float* y; int64_t N, nb;
  template <int ROWS, int MT> void run(int64_t n, int64_t m0) const {
    q8_tile<ROWS, MT>(w, scales, xq, y, N, nb, n, m0);
  }
};

// ---- the ops ------------------------------------------------------------------------------------

// Output rows per task: a few hundred KB of weights, so a thread's work outweighs its start.
constexpr int64_t GRAIN = 64;

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "qdot: x must be a contiguous (M, K) float32 tensor");
  TORCH_CHECK(x.size(1) == K && K % QK == 0, "qdot: K must be ", K, " and a multiple of 32");
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  check_x(x, K);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.numel() == N * (K / QK) * static_cast<int64_t>(sizeof(BlockQ4)),
              "qdot: int4 blocks must be N * K / 32 * 20 contiguous bytes");
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  const auto* w = reinterpret_cast<const BlockQ4*>(blocks.data_ptr<uint8_t>());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
    tiles(Q4Tile{w, xq, out, N, K / QK}, M, n0, n1);
  });
  return y;
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  check_x(x, K);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == K,
              "qdot: int8 weight must be a contiguous (N, K) int8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "qdot: int8 scales must be (N,) float32");
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
    tiles(Q8Tile{w, s, xq, out, N, K / QK}, M, n0, n1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(attnlab_qdot, m) {
  m.def("q4_matmul(Tensor x, Tensor blocks, int N) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_qdot, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
}
