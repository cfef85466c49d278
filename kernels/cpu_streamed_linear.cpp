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
// The weight may also come in fewer bytes, where its float32 values allow it exactly
// (cpu_streamed.compact_weight checks every value before making such a copy):
// - float16 or bfloat16 (a drafter's weights, which its checkpoint holds in 16 bits);
// - int8 in blocks of 32 along k, each block with a float32 scale, w = q * scale (the
//   target's LM head, dequantized from GGUF's Q8_0 blocks: q * scale is exact in float32).
// - 4-bit values in blocks of 32 along k, each block with a float32 scale and offset,
//   w = q * scale + offset with q in [0, 15] (the target's layers, dequantized from GGUF's
//   Q4_1 blocks: q * scale is exact, so a fused multiply-add rounds as the separate
//   product and sum did). A block's 16 bytes hold its first 16 values in their low
//   nibbles and its last 16 in their high ones, as GGUF lays Q4_1 out.
// Each value is widened to float32 as it is loaded, so the results equal, bit for bit,
// the kernel's on the float32 weight, for a half, a bit over a quarter or under a fifth of
// the memory read.
//
// Needs: x contiguous float32 and w contiguous (float32, float16, bfloat16, int8 with
// scales [N, K / 32] float32, or uint8 [N, K / 2] with scales and offsets [N, K / 32]
// float32) on the CPU, K a multiple of 16 (32 for int8 and 4-bit); the Python side checks
// and falls back to F.linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads

constexpr int64_t PREFETCH_ROWS = 8;  // weight rows fetched ahead of the pair being used
constexpr int64_t GRAIN_ROWS = 32;    // output features per parallel chunk, at least
constexpr int64_t INT8_BLOCK = 32;    // int8 weights per scale, along k
constexpr int64_t Q4_BLOCK = 32;      // 4-bit weights per scale and offset, along k

inline lanes16 load16(const float* p) { return *reinterpret_cast<const lanes16*>(p); }

// 16 weights of 16 bits: float16 as the compiler's _Float16, bfloat16 as its raw bits;
// 16 int8 weights.
typedef _Float16 halves16 __attribute__((vector_size(32), aligned(2)));
typedef uint16_t bits16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t bits32x16 __attribute__((vector_size(64)));
typedef int8_t bytes16 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t ubytes16 __attribute__((vector_size(16), aligned(1)));

#if !defined(__AVX512F__) && (defined(__F16C__) || defined(__AVX2__))
// Two 8-lane halves as one 16-lane vector (the AVX2 and F16C conversions give 8 lanes).
inline lanes16 join_halves(__m256 low, __m256 high) {
  lanes16 out;
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
  return out;
}
#endif

// A weight matrix as the kernel reads it: weights [n, k, k + 16 * kVectors) as float32
// (exact for every type) from `load(n, k)` (one vector) or `load_block(n, k, out)` (a
// 4-bit block's two; `load_weights` calls either), `address(n, k)` where they sit (for
// prefetching).
struct Float32Rows {
  static constexpr int kVectors = 1;
  const float* w;
  int64_t K;
  lanes16 load(int64_t n, int64_t k) const { return load16(w + n * K + k); }
  const void* address(int64_t n, int64_t k) const { return w + n * K + k; }
};

// The compiler's own vector conversion of _Float16 goes one value at a time, so the
// CPU's conversion instructions are named where the build has them (AVX-512F, else F16C).
struct Float16Rows {
  static constexpr int kVectors = 1;
  const _Float16* w;
  int64_t K;
  lanes16 load(int64_t n, int64_t k) const {
    const _Float16* p = w + n * K + k;
#if defined(__AVX512F__)
    return (lanes16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return join_halves(low, high);
#else
    return __builtin_convertvector(*reinterpret_cast<const halves16*>(p), lanes16);
#endif
  }
  const void* address(int64_t n, int64_t k) const { return w + n * K + k; }
};

struct BFloat16Rows {  // bfloat16 is a float32's upper 16 bits
  static constexpr int kVectors = 1;
  const uint16_t* w;
  int64_t K;
  lanes16 load(int64_t n, int64_t k) const {
    const uint16_t* p = w + n * K + k;
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return (lanes16)_mm512_slli_epi32(wide, 16);
#else
    const bits32x16 wide = __builtin_convertvector(*reinterpret_cast<const bits16x16*>(p), bits32x16) << 16;
    return reinterpret_cast<const lanes16&>(wide);
#endif
  }
  const void* address(int64_t n, int64_t k) const { return w + n * K + k; }
};

// The compiler's own vector conversion of int8 goes one value at a time too, so the
// widening instructions are named where the build has them (AVX-512F, else AVX2).
struct Int8BlockRows {  // w[n, k] = q[n, k] * scales[n, k / 32]: an exact product
  static constexpr int kVectors = 1;
  const int8_t* q;
  const float* scales;
  int64_t K;
  lanes16 load(int64_t n, int64_t k) const {
    const int8_t* p = q + n * K + k;
#if defined(__AVX512F__)
    const lanes16 values = (lanes16)_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
    const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    const __m256 high =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    const lanes16 values = join_halves(low, high);
#else
    const lanes16 values = __builtin_convertvector(*reinterpret_cast<const bytes16*>(p), lanes16);
#endif
    return values * scales[n * (K / INT8_BLOCK) + k / INT8_BLOCK];
  }
  const void* address(int64_t n, int64_t k) const { return q + n * K + k; }
};

// A 4-bit block's 16 bytes hold both of its 16-value halves, so the whole block is
// loaded at once: `load_block` gives weights [n, k, k + 32) as two vectors (k a multiple of 32).
struct Q4BlockRows {  // w[n, k] = q[n, k] * scales[n, k / 32] + offsets[n, k / 32], q in [0, 15]
  static constexpr int kVectors = 2;
  const uint8_t* q;  // [N, K / 2]: a block's 16 bytes, value j in byte j's low nibble, value 16 + j in its high one
  const float* scales;
  const float* offsets;
  int64_t K;
  void load_block(int64_t n, int64_t k, lanes16* out) const {
    const uint8_t* p = q + n * (K / 2) + k / 2;
    const int64_t block = n * (K / Q4_BLOCK) + k / Q4_BLOCK;
    const float scale = scales[block], offset = offsets[block];
#if defined(__AVX512F__)
    // The block's 16 weights q * scale + offset, q = 0..15 (one rounding: q * scale is
    // exact), each value's nibble picking its own (a permute reads an index's low 4 bits).
    const __m512 levels = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_ps(scale), _mm512_set1_ps(offset));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    out[0] = (lanes16)_mm512_permutexvar_ps(bytes, levels);
    out[1] = (lanes16)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), levels);
#else
#if defined(__AVX2__)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i first = _mm256_cvtepu8_epi32(raw), second = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    const lanes16 low = join_halves(_mm256_cvtepi32_ps(_mm256_and_si256(first, mask)),
                                    _mm256_cvtepi32_ps(_mm256_and_si256(second, mask)));
    const lanes16 high = join_halves(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)),
                                     _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)));
#else
    const bits32x16 bytes = __builtin_convertvector(*reinterpret_cast<const ubytes16*>(p), bits32x16);
    const lanes16 low = __builtin_convertvector(bytes & 15, lanes16);
    const lanes16 high = __builtin_convertvector(bytes >> 4, lanes16);
#endif
    out[0] = low * scale + offset;
    out[1] = high * scale + offset;
#endif
  }
  const void* address(int64_t n, int64_t k) const { return q + n * (K / 2) + k / 2; }
};

// Weights [n, k, k + 16 * kVectors) as float32 vectors.
template <typename Rows>
inline void load_weights(const Rows& w, int64_t n, int64_t k, lanes16* out) {
  if constexpr (Rows::kVectors == 1) {
    out[0] = w.load(n, k);
  } else {
    w.load_block(n, k, out);
  }
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

// Rows [m0, m0 + MB) of x against weight rows [wn, wn + NB), into outputs [yn, yn + NB):
// NB * MB dot products of length K. With `prefetch`, the weight rows PREFETCH_ROWS further
// on are fetched meanwhile. Each lane sums its k in order, whatever the loads' width.
template <int MB, int NB, typename Rows>
inline void dot_block(const float* x, const Rows& w, float* y, int64_t K, int64_t N, int64_t m0, int64_t wn,
                      int64_t yn, bool prefetch) {
  constexpr int V = Rows::kVectors;
  lanes16 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < MB; m++) acc[j][m] = lanes16{};
  for (int64_t k = 0; k < K; k += 16 * V) {
    if (prefetch) {
      for (int j = 0; j < NB; j++) __builtin_prefetch(w.address(wn + PREFETCH_ROWS + j, k));
    }
    lanes16 wv[NB][V];
    for (int j = 0; j < NB; j++) load_weights(w, wn + j, k, wv[j]);
    for (int v = 0; v < V; v++) {
      for (int m = 0; m < MB; m++) {
        const lanes16 xv = load16(x + (m0 + m) * K + k + 16 * v);
        for (int j = 0; j < NB; j++) acc[j][m] += wv[j][v] * xv;
      }
    }
  }
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < MB; m++) y[(m0 + m) * N + yn + j] = sum_lanes(acc[j][m]);
}

// Rows of x a block takes at most: its 2 * ROW_BLOCK accumulators, the weight vectors and
// an x vector fit AVX-512's 32 registers (AVX2's 16 hold half as many 16-lane vectors).
#if defined(__AVX512F__)
constexpr int ROW_BLOCK = 12;
#else
constexpr int ROW_BLOCK = 8;
#endif

// The last `rows` rows of x from row m (fewer than ROW_BLOCK) as one block: dot_block of
// that many rows, chosen among MB, MB - 1, ..., 1.
template <int MB, int NB, typename Rows>
inline void last_block(int64_t rows, const float* x, const Rows& w, float* y, int64_t K, int64_t N, int64_t m,
                       int64_t wn, int64_t yn, bool prefetch) {
  if constexpr (MB > 0) {
    if (rows == MB) {
      dot_block<MB, NB>(x, w, y, K, N, m, wn, yn, prefetch);
    } else {
      last_block<MB - 1, NB>(rows, x, w, y, K, N, m, wn, yn, prefetch);
    }
  }
}

// Every row of x against weight rows [wn, wn + NB): blocks of ROW_BLOCK rows, then the
// rest as one block, so that a compact weight is widened once per block and a call of at
// most ROW_BLOCK rows widens it once (7 rows as blocks of 4, 2 and 1 took 1.3x as long
// as 8 rows). Only the first block prefetches (the later ones find the weight rows in L1).
template <int NB, typename Rows>
inline void all_rows(const float* x, const Rows& w, float* y, int64_t M, int64_t K, int64_t N, int64_t wn,
                     int64_t yn, bool prefetch) {
  int64_t m = 0;
  for (; m + ROW_BLOCK <= M; m += ROW_BLOCK, prefetch = false) {
    dot_block<ROW_BLOCK, NB>(x, w, y, K, N, m, wn, yn, prefetch);
  }
  last_block<ROW_BLOCK - 1, NB>(M - m, x, w, y, K, N, m, wn, yn, prefetch);
}

// y [M, N] = x [M, K] @ w [N, K].T, output rows split over torch's threads.
template <typename Rows>
void streamed_rows(const float* xp, const Rows& w, float* yp, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) all_rows<2>(xp, w, yp, M, K, N, n, n, n + PREFETCH_ROWS + 2 <= end);
    if (n < end) all_rows<1>(xp, w, yp, M, K, N, n, n, false);
  });
}

// `blocks` [N, K / block] contiguous float32 on the CPU (each block's scale or offset).
void check_blocks(const torch::Tensor& blocks, int64_t N, int64_t K, int64_t block, const char* what) {
  TORCH_CHECK(blocks.scalar_type() == torch::kFloat32 && blocks.is_contiguous() && blocks.device().is_cpu() &&
              blocks.dim() == 2 && blocks.size(0) == N && blocks.size(1) == K / block,
              what, " [N, K / ", block, "] contiguous float32 expected");
}

}  // namespace

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias,
                              const c10::optional<torch::Tensor>& scales,
                              const c10::optional<torch::Tensor>& offsets) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [M, K] and w [N, K] (or [N, K / 2] 4-bit) expected");
  const auto wtype = w.scalar_type();
  const bool four_bit = wtype == torch::kUInt8;
  TORCH_CHECK(x.size(1) == w.size(1) * (four_bit ? 2 : 1), "x [M, K] and w [N, K] (or [N, K / 2] 4-bit) expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 x expected");
  TORCH_CHECK(wtype == torch::kFloat32 || wtype == torch::kFloat16 || wtype == torch::kBFloat16 ||
              wtype == torch::kInt8 || four_bit, "float32, float16, bfloat16, int8 or uint8 (4-bit) w expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "contiguous CPU tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16, got ", K);
  const bool has_scales = scales.has_value() && scales->defined();
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(has_scales == (wtype == torch::kInt8 || four_bit),
              "int8 and 4-bit w need scales, and only they take them");
  TORCH_CHECK(has_offsets == four_bit, "4-bit w needs offsets, and only it takes them");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (four_bit) {
    TORCH_CHECK(K % Q4_BLOCK == 0, "4-bit w: K must be a multiple of ", Q4_BLOCK, ", got ", K);
    check_blocks(*scales, N, K, Q4_BLOCK, "4-bit w: scales");
    check_blocks(*offsets, N, K, Q4_BLOCK, "4-bit w: offsets");
    streamed_rows(xp, Q4BlockRows{w.data_ptr<uint8_t>(), scales->data_ptr<float>(), offsets->data_ptr<float>(), K},
                  yp, M, K, N);
  } else if (wtype == torch::kInt8) {
    TORCH_CHECK(K % INT8_BLOCK == 0, "int8 w: K must be a multiple of ", INT8_BLOCK, ", got ", K);
    check_blocks(*scales, N, K, INT8_BLOCK, "int8 w: scales");
    streamed_rows(xp, Int8BlockRows{w.data_ptr<int8_t>(), scales->data_ptr<float>(), K}, yp, M, K, N);
  } else if (wtype == torch::kFloat16) {
    streamed_rows(xp, Float16Rows{reinterpret_cast<const _Float16*>(w.data_ptr<at::Half>()), K}, yp, M, K, N);
  } else if (wtype == torch::kBFloat16) {
    streamed_rows(xp, BFloat16Rows{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K}, yp, M, K, N);
  } else {
    streamed_rows(xp, Float32Rows{w.data_ptr<float>(), K}, yp, M, K, N);
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("streamed_linear", &streamed_linear,
        "x @ w.T + bias in float32, w float32, float16, bfloat16, int8 with scales or 4-bit with scales and "
        "offsets, the weight read once (CPU)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("scales") = pybind11::none(),
        pybind11::arg("offsets") = pybind11::none());
}
