// A float32 linear for the few rows of a CPU decode step, reading the weight once.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] + bias[n]      x [M, K], w [N, K], y [M, N]
//
// Built at run time by specdec/models/cpu_streamed.py (torch.utils.cpp_extension, -march
// of the machine it runs on); its torch twin is F.linear. A decode step's matmuls are
// bound by memory on a small CPU, so a few rows should cost about what one row costs if
// each weight row is read from memory once. MKL's sgemm re-packs the weight at every
// call; MKL's packs and oneDNN's layout are copies of the weights. Here each pair of
// weight rows is loaded once (prefetched a few rows ahead) and meets every input row
// while it sits in L1; the weight is used as it is.
//
// Each output is one row's dot product in a fixed order (16 lanes over k, then the lanes
// summed as a fixed tree), whatever M is and whichever rows share a call: a row's result does
// not depend on the rows beside it. It differs from F.linear's in the last bits only
// (another summation order).
//
// The weight may also be float16 or bfloat16 (a drafter's weights, which its checkpoint
// holds in 16 bits: cpu_streamed.compact_weight keeps a copy only where it is exact).
// Its values are widened to float32 as they are loaded, so the results equal, bit for
// bit, the kernel's on the float32 weight of the same values, for half the memory read.
//
// Needs: x contiguous float32 and w contiguous float32, float16 or bfloat16 on the CPU,
// K a multiple of 16 (the Python side checks and falls back to F.linear).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads

constexpr int64_t PREFETCH_ROWS = 8;  // weight rows fetched ahead of the pair being used
constexpr int64_t GRAIN_ROWS = 32;    // output features per parallel chunk, at least

inline lanes16 load16(const float* p) { return *reinterpret_cast<const lanes16*>(p); }

// 16 weights of 16 bits: float16 as the compiler's _Float16, bfloat16 as its raw bits.
typedef _Float16 halves16 __attribute__((vector_size(32), aligned(2)));
typedef uint16_t bits16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t bits32x16 __attribute__((vector_size(64)));
struct BFloat16Bits { uint16_t bits; };  // the type the kernel reads bfloat16 weights as

// 16 weights widened to float32 (exact for each of the three types). The compiler's own
// vector conversion of _Float16 goes one value at a time, so the CPU's conversion
// instructions are named where the build has them (AVX-512F, else F16C).
inline lanes16 load_weights(const float* p) { return load16(p); }
inline lanes16 load_weights(const _Float16* p) {
#if defined(__AVX512F__)
  return (lanes16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  lanes16 out;
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
  return out;
#else
  return __builtin_convertvector(*reinterpret_cast<const halves16*>(p), lanes16);
#endif
}
inline lanes16 load_weights(const BFloat16Bits* p) {  // bfloat16 is a float32's upper 16 bits
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (lanes16)_mm512_slli_epi32(wide, 16);
#else
  const bits32x16 wide = __builtin_convertvector(*reinterpret_cast<const bits16x16*>(p), bits32x16) << 16;
  return reinterpret_cast<const lanes16&>(wide);
#endif
}

typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes4 __attribute__((vector_size(16)));

// The 16 lanes summed as a fixed tree (halves, then quarters, ...): the same order for
// every row, a few vector adds instead of 15 dependent scalar ones.
inline float sum_lanes(lanes16 v) {
  const lanes8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const lanes4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Rows [m0, m0 + MB) of x against weight rows [n, n + NB): NB * MB dot products of length K.
template <int MB, int NB, typename W>
inline void dot_block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n,
                      const W* prefetch) {
  lanes16 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < MB; m++) acc[j][m] = lanes16{};
  for (int64_t k = 0; k < K; k += 16) {
    if (prefetch != nullptr) {
      for (int j = 0; j < NB; j++) __builtin_prefetch(prefetch + j * K + k);
    }
    lanes16 wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load_weights(w + (n + j) * K + k);
    for (int m = 0; m < MB; m++) {
      const lanes16 xv = load16(x + (m0 + m) * K + k);
      for (int j = 0; j < NB; j++) acc[j][m] += wv[j] * xv;
    }
  }
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < MB; m++) y[(m0 + m) * N + n + j] = sum_lanes(acc[j][m]);
}

// Every row of x against weight rows [n, n + NB), in blocks of 8, 4, 2 and 1 rows; only
// the first block prefetches (the later ones find the weight rows in L1).
template <int NB, typename W>
inline void all_rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
                     const W* prefetch) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8, prefetch = nullptr) dot_block<8, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m + 4 <= M; m += 4, prefetch = nullptr) dot_block<4, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m + 2 <= M; m += 2, prefetch = nullptr) dot_block<2, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m < M; m++, prefetch = nullptr) dot_block<1, NB>(x, w, y, K, N, m, n, prefetch);
}

// y [M, N] = x [M, K] @ w [N, K].T, output rows split over torch's threads.
template <typename W>
void streamed_rows(const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) {
      const W* ahead = n + PREFETCH_ROWS + 2 <= end ? wp + (n + PREFETCH_ROWS) * K : nullptr;
      all_rows<2>(xp, wp, yp, M, K, N, n, ahead);
    }
    if (n < end) all_rows<1>(xp, wp, yp, M, K, N, n, static_cast<const W*>(nullptr));
  });
}

}  // namespace

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  const auto wtype = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 x expected");
  TORCH_CHECK(wtype == torch::kFloat32 || wtype == torch::kFloat16 || wtype == torch::kBFloat16,
              "float32, float16 or bfloat16 w expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "contiguous CPU tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16, got ", K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (wtype == torch::kFloat16) {
    streamed_rows(xp, reinterpret_cast<const _Float16*>(w.data_ptr<at::Half>()), yp, M, K, N);
  } else if (wtype == torch::kBFloat16) {
    streamed_rows(xp, reinterpret_cast<const BFloat16Bits*>(w.data_ptr<at::BFloat16>()), yp, M, K, N);
  } else {
    streamed_rows(xp, w.data_ptr<float>(), yp, M, K, N);
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("streamed_linear", &streamed_linear,
        "x @ w.T + bias in float32, w float32, float16 or bfloat16, the weight read once (CPU)");
}
