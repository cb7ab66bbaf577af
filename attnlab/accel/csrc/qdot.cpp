// Integer dot-product kernels for int4 / int8 weights on x86 CPUs without bf16 hardware.
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
constexpr int ROWS_AT_ONCE = 4;  // activation rows dotted with one weight block per load

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

void quantize_block(const float* x, int8_t* q, float* d,
                                                         float* sum) {
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

// ---- int4 (Q4_1 blocks) x int8 activations ----------------------------------------------------

void q4_rows(
    const BlockQ4* w, const QuantizedRows& xq, float* y, int64_t M, int64_t N, int64_t K,
    int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++) {
    const BlockQ4* row = w + n * nb;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
      const int rows = static_cast<int>(std::min<int64_t>(ROWS_AT_ONCE, M - m0));
      __m256 acc[ROWS_AT_ONCE];
      float mins[ROWS_AT_ONCE] = {0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < ROWS_AT_ONCE; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; b++) {
        const float dw = _cvtsh_ss(row[b].d), mw = _cvtsh_ss(row[b].m);
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[b].qs));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        const __m256i q = _mm256_and_si256(both, low);  // q[0..15] | q[16..31], unsigned
        for (int r = 0; r < rows; r++) {
          const int64_t i = (m0 + r) * nb + b;
          const __m256i qx =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * QK));
          const __m256i dot = dot_u8s8(q, qx);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xq.d[i]), acc[r]);
          mins[r] += mw * xq.sum[i];
        }
      }
      for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = hsum(acc[r]) + mins[r];
    }
  }
}

// ---- int8 (per-row scale) x int8 activations --------------------------------------------------

void q8_rows(
    const int8_t* w, const float* scales, const QuantizedRows& xq, float* y, int64_t M,
    int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* row = w + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
      const int rows = static_cast<int>(std::min<int64_t>(ROWS_AT_ONCE, M - m0));
      __m256 acc[ROWS_AT_ONCE];
      for (int r = 0; r < ROWS_AT_ONCE; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; b++) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
        const __m256i uq = _mm256_sign_epi8(q, q);  // |q|: the unsigned operand
        for (int r = 0; r < rows; r++) {
          const int64_t i = (m0 + r) * nb + b;
          const __m256i qx =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * QK));
          const __m256i sx = _mm256_sign_epi8(qx, q);  // qx * sign(q): the product's sign
          const __m256i dot = dot_u8s8(uq, sx);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xq.d[i]), acc[r]);
        }
      }
      for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = hsum(acc[r]) * scales[n];
    }
  }
}

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
    q4_rows(w, xq, out, M, N, K, n0, n1);
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
    q8_rows(w, s, xq, out, M, N, K, n0, n1);
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
