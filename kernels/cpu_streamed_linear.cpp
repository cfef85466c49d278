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
// Needs: x and w contiguous float32 on the CPU, K a multiple of 16 (the Python side
// checks and falls back to F.linear).
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads

constexpr int64_t PREFETCH_ROWS = 8;  // weight rows fetched ahead of the pair being used
constexpr int64_t GRAIN_ROWS = 32;    // output features per parallel chunk, at least

inline lanes16 load16(const float* p) { return *reinterpret_cast<const lanes16*>(p); }

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
template <int MB, int NB>
inline void dot_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n,
                      const float* prefetch) {
  lanes16 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < MB; m++) acc[j][m] = lanes16{};
  for (int64_t k = 0; k < K; k += 16) {
    if (prefetch != nullptr) {
      for (int j = 0; j < NB; j++) __builtin_prefetch(prefetch + j * K + k);
    }
    lanes16 wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load16(w + (n + j) * K + k);
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
template <int NB>
inline void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
                     const float* prefetch) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8, prefetch = nullptr) dot_block<8, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m + 4 <= M; m += 4, prefetch = nullptr) dot_block<4, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m + 2 <= M; m += 2, prefetch = nullptr) dot_block<2, NB>(x, w, y, K, N, m, n, prefetch);
  for (; m < M; m++, prefetch = nullptr) dot_block<1, NB>(x, w, y, K, N, m, n, prefetch);
}

}  // namespace

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "contiguous CPU tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16, got ", K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) {
      const float* ahead = n + PREFETCH_ROWS + 2 <= end ? wp + (n + PREFETCH_ROWS) * K : nullptr;
      all_rows<2>(xp, wp, yp, M, K, N, n, ahead);
    }
    if (n < end) all_rows<1>(xp, wp, yp, M, K, N, n, nullptr);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("streamed_linear", &streamed_linear, "x @ w.T + bias, float32, the weight read once (CPU)");
}
