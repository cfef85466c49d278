// A float32 linear over 4-bit or int8 block weights on Intel AMX tiles, for the few rows of
// a CPU decode step.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] + bias[n]      x [M, K], w [N, K], y [M, N]
//   w[n, k] = q[n, k] * scale[n, b] + offset[n, b]   q in [0, 15], b = k / 32 (GGUF's Q4_1 blocks)
//   w[n, k] = q[n, k] * scale[n, b]                  q in [-127, 127] (GGUF's Q8_0 blocks)
//
// Built at run time by specdec/models/cpu_amx.py (torch.utils.cpp_extension, -march of the
// machine it runs on); its torch twin is F.linear on the dequantized weight. The streamed
// kernel (cpu_streamed_linear.cpp) spends one vector multiply-add per 16 weights per row,
// so a tree's 8 rows cost 2.6x one row's. AMX multiplies a 16 x 32 block of bfloat16 by a
// 32 x 16 one in one instruction, so here rows come cheap and a call costs mostly what
// widening the weights and adding up the blocks cost (cpu_amx.py has the timings).
//
// Per row m, block b and weight row n, with x split exactly into three bfloat16 parts
// (x = hi + mid + lo: a float32's 24 significant bits, 8 a part):
//   dot[m, n, b] = sum over the block's 32 k of (hi + mid + lo)[m, k] * q[n, k]
// is one tile product per part (AMX's float32 accumulation; q and the parts are exact in
// bfloat16, so every product is exact), and
//   y[m, n] = sum over b, in order, of  dot[m, n, b] * scale[n, b] + offset[n, b] * xsum[m, b]
// with xsum[m, b] the block's 32 values of x summed in a fixed order (int8 weights have no
// offset, so no such term). A row's result does not depend on the rows beside it in a call.
// It differs from F.linear's in the last bits (another summation order; the offset
// multiplies the block's sum, not each value).
//
// The weight comes laid out for the tiles (cpu_amx.tile_weight), block by block: for block b
// and 16 output features t, 256 bytes as 4 loads of 32 16-bit words, word 2n + j of load L
// holding in its nibbles, lowest first, q[16 t + n, 32 b + 2 r + j] for r = L, L + 4, L + 8,
// L + 12. A 16-bit permute of a load (shifted by 0, 4, 8, 12) gives the weight tile's row r
// (bfloat16 pairs along k, AMX's B layout). An int8 weight comes as 512 bytes per block and
// 16 features: the weight tile's 16 rows of 32 values, widened through float32 to bfloat16.
// Scales and offsets come [K / 32, N / 16, 16].
//
// Loop: each thread takes a range of feature tiles and splits x itself; a span of that range
// at a time (its sums fit in L1), block by block, x's parts are loaded as tiles once and
// meet every feature tile of the span, whose sums wait in a buffer. A tile load of lines
// just stored waits for the stores, so each unit (16 features of a block) is widened two
// units before its tile product, and its product is added one unit after.
//
// Needs: AMX-BF16, AVX-512BW and AVX-512 BF16 in the build (else `available()` is false and
// the Python side keeps to the streamed kernel), the OS's permission for tile data (asked once), x contiguous
// float32 [M, K], N a multiple of 16 and K of 32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SPECDEC_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t TILE_N = 16;      // output features a tile product gives
constexpr int64_t BLOCK = 32;       // k per block (one scale and offset), one tile product's depth
constexpr int64_t TILE_ROWS = 16;   // rows of x a tile holds
constexpr int64_t CHUNK_BYTES = 256;  // a (16 features, block)'s 4-bit values
constexpr int64_t INT8_CHUNK_BYTES = 512;  // a (16 features, block)'s int8 values
constexpr int64_t SPAN_BYTES = 32 * 1024;  // the feature tiles' sums kept while blocks pass (L1)
constexpr int64_t PREFETCH_CHUNKS = 4;  // weight chunks fetched ahead of the one being widened

#ifdef SPECDEC_AMX

// The OS must grant a process the right to AMX's tile state before its first tile
// instruction (Linux 5.16 on): asked once, false where it is refused.
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

struct TileConfig {  // ldtilecfg's 64 bytes (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 and 5 the products (rows x 16 float32, taking turns), 1-3 x's parts (rows x 32
// bfloat16), 4 and 6 the weights (16 bfloat16 pairs along k x 16 features, taking turns).
void configure_tiles(int rows) {
  TileConfig config;
  for (int tile : {0, 1, 2, 3, 5}) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = static_cast<uint8_t>(rows);
  }
  for (int tile : {4, 6}) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = 16;
  }
  asm volatile("" : : "r"(&config) : "memory");  // the stores above must land: GCC 12 dropped them as dead
  _tile_loadconfig(&config);
}

// bfloat16 of 0..15, twice (a 16-bit permute reads its index's low 5 bits, so the bit
// above a nibble may be set).
__m512i level_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; i++) {
    const float value = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    table[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(table);
}

// A chunk's 256 bytes as the B tile's 16 rows: 16-bit word i of load L holds rows L, L + 4,
// L + 8 and L + 12's word i in its four nibbles, lowest first.
inline void widen_chunk(const uint8_t* chunk, const __m512i& table, uint16_t* weights) {
  for (int load = 0; load < 4; load++) {
    const __m512i words = _mm512_loadu_si512(chunk + 64 * load);
    _mm512_store_si512(weights + 32 * load, _mm512_permutexvar_epi16(words, table));
    _mm512_store_si512(weights + 32 * (load + 4), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table));
    _mm512_store_si512(weights + 32 * (load + 8), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table));
    _mm512_store_si512(weights + 32 * (load + 12), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table));
  }
}

// An int8 chunk's 512 bytes as the B tile's 16 rows: row r's bytes are its 32 values in
// order, each exact in bfloat16 (|q| <= 127 has 7 significant bits).
inline void widen_int8_chunk(const uint8_t* chunk, uint16_t* weights) {
  for (int r = 0; r < 16; r++) {
    const __m128i* row = reinterpret_cast<const __m128i*>(chunk + 32 * r);
    const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
    const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
    _mm512_store_si512(weights + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(second, first));
  }
}

// The tile product of x's parts (tiles 1-3, loaded) and `weights` into `product`: through
// product tile 0 and weight tile 4, or (ODD) 5 and 6, so that neighbouring units overlap.
// The tile intrinsics take register numbers as literals, hence the macro for the two pairs.
#define SPECDEC_TILE_PRODUCT(PRODUCT_TILE, WEIGHT_TILE)      \
  do {                                                       \
    _tile_loadd(WEIGHT_TILE, weights, 64);                   \
    _tile_zero(PRODUCT_TILE);                                \
    _tile_dpbf16ps(PRODUCT_TILE, 1, WEIGHT_TILE);            \
    _tile_dpbf16ps(PRODUCT_TILE, 2, WEIGHT_TILE);            \
    _tile_dpbf16ps(PRODUCT_TILE, 3, WEIGHT_TILE);            \
    _tile_stored(PRODUCT_TILE, product, 64);                 \
  } while (0)

template <bool ODD>
inline void tile_product(const uint16_t* weights, float* product) {
  if constexpr (!ODD) {
    SPECDEC_TILE_PRODUCT(0, 4);
  } else {
    SPECDEC_TILE_PRODUCT(5, 6);
  }
}
#undef SPECDEC_TILE_PRODUCT

// acc[m] += product[m] * scale + offset * xs[m] (int8 weights: no offset), rows m < MC: a
// unit's share of y.
template <bool INT8, int MC>
inline void add_product(const float* product, const float* scale, const float* offset, const float* xs, float* acc) {
  const __m512 s = _mm512_loadu_ps(scale);
  for (int m = 0; m < MC; m++) {
    const __m512 a = _mm512_fmadd_ps(_mm512_load_ps(product + TILE_N * m), s, _mm512_load_ps(acc + TILE_N * m));
    if constexpr (INT8) {
      _mm512_store_ps(acc + TILE_N * m, a);
    } else {
      _mm512_store_ps(acc + TILE_N * m, _mm512_fmadd_ps(_mm512_loadu_ps(offset), _mm512_set1_ps(xs[m]), a));
    }
  }
}

constexpr int RING = 4;     // widened chunks in flight
constexpr int AHEAD = 2;    // a chunk is widened this many units before its tile product (a tile
                            // load of lines just stored waits for the stores: 45 against 16 ns a unit)

// Rows [m0, m0 + MC) of x (as parts `hi`, `mid`, `lo` [M, K] bfloat16 bits and block sums
// `xsum` [M, K / 32]) against features [16 t0, 16 t1) of 4-bit (or INT8) weights: y's
// columns there. A span of feature tiles at a time (their sums, MC x 16 floats a tile, fill
// at most SPAN_BYTES), block by block: x's parts are loaded once and meet every feature
// tile of the span, whose sums wait in `acc`. Each unit (16 features of a block) goes
// through three stages a unit apart or more: widened AHEAD units before its tile product,
// added to `acc` one unit after it.
template <bool INT8, int MC>
void tile_rows(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, const float* xsum, const uint8_t* q,
               const float* scales, const float* offsets, float* y, int64_t K, int64_t N, int64_t m0, int64_t t0,
               int64_t t1) {
  constexpr int64_t chunk_bytes = INT8 ? INT8_CHUNK_BYTES : CHUNK_BYTES;
  constexpr int64_t span = std::max<int64_t>(2, SPAN_BYTES / (MC * TILE_N * 4));
  const int64_t blocks = K / BLOCK, tiles = N / TILE_N;
  const __m512i table = level_table();
  alignas(64) uint16_t ring[RING][16 * 32];
  alignas(64) float product[2][TILE_ROWS * TILE_N];
  alignas(64) float acc[span * MC * TILE_N];  // [t - s0, m, 16]
  float xs[MC];
  configure_tiles(MC);
  for (int64_t s0 = t0; s0 < t1; s0 += span) {
    const int64_t s1 = std::min(t1, s0 + span);
    std::memset(acc, 0, sizeof(float) * (s1 - s0) * MC * TILE_N);
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t column = m0 * K + b * BLOCK;
      _tile_loadd(1, hi + column, K * 2);
      _tile_loadd(2, mid + column, K * 2);
      _tile_loadd(3, lo + column, K * 2);
      for (int m = 0; m < MC; m++) xs[m] = xsum[(m0 + m) * blocks + b];
      const uint8_t* chunks = q + (b * tiles) * chunk_bytes;
      const float* sb = scales + (b * tiles) * TILE_N;
      const float* ob = INT8 ? nullptr : offsets + (b * tiles) * TILE_N;
      auto widen = [&](int64_t t) {
        if (t < s1) {
          for (int64_t line = 0; line < chunk_bytes; line += 64)
            __builtin_prefetch(chunks + (t + PREFETCH_CHUNKS) * chunk_bytes + line);
          if constexpr (INT8) {
            widen_int8_chunk(chunks + t * chunk_bytes, ring[(t - s0) % RING]);
          } else {
            widen_chunk(chunks + t * chunk_bytes, table, ring[(t - s0) % RING]);
          }
        }
      };
      auto add = [&](int64_t t) {
        add_product<INT8, MC>(product[(t - s0) & 1], sb + t * TILE_N, INT8 ? nullptr : ob + t * TILE_N, xs,
                              acc + (t - s0) * MC * TILE_N);
      };
      for (int64_t t = s0; t < s0 + AHEAD; t++) widen(t);
      int64_t t = s0;
      for (; t + 2 <= s1; t += 2) {
        widen(t + AHEAD);
        tile_product<false>(ring[(t - s0) % RING], product[0]);
        if (t > s0) add(t - 1);
        widen(t + 1 + AHEAD);
        tile_product<true>(ring[(t + 1 - s0) % RING], product[1]);
        add(t);
      }
      if (t < s1) {
        tile_product<false>(ring[(t - s0) % RING], product[0]);
        if (t > s0) add(t - 1);
        add(t);
      } else if (t > s0) {
        add(t - 1);
      }
    }
    for (int64_t t = s0; t < s1; t++)
      for (int m = 0; m < MC; m++)
        std::memcpy(y + (m0 + m) * N + t * TILE_N, acc + ((t - s0) * MC + m) * TILE_N, TILE_N * sizeof(float));
  }
  _tile_release();
}

template <bool INT8, int MC>
void dispatch_rows(int rows, const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, const float* xsum,
                   const uint8_t* q, const float* scales, const float* offsets, float* y, int64_t K, int64_t N,
                   int64_t m0, int64_t t0, int64_t t1) {
  if constexpr (MC > 0) {
    if (rows == MC) {
      tile_rows<INT8, MC>(hi, mid, lo, xsum, q, scales, offsets, y, K, N, m0, t0, t1);
    } else {
      dispatch_rows<INT8, MC - 1>(rows, hi, mid, lo, xsum, q, scales, offsets, y, K, N, m0, t0, t1);
    }
  }
}

// x's three bfloat16 parts (each the top 8 significant bits of what the ones before left:
// exact, so hi + mid + lo == x) and its block sums (32 values, a fixed order).
// 16 floats exact in bfloat16 (their low 16 bits zero) stored as bfloat16 bits.
inline void store_bfloat16(__m512 exact, uint16_t* out) {
  const __m512i upper = _mm512_srli_epi32(_mm512_castps_si512(exact), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(upper));
}

void split_rows(const float* x, int64_t M, int64_t K, uint16_t* hi, uint16_t* mid, uint16_t* lo, float* xsum) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < M * K; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 h = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
    const __m512 rest = _mm512_sub_ps(v, h);
    const __m512 md = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
    const __m512 l = _mm512_sub_ps(rest, md);
    store_bfloat16(h, hi + i);
    store_bfloat16(md, mid + i);
    store_bfloat16(l, lo + i);
  }
  for (int64_t i = 0; i < M * K; i += BLOCK) {
    xsum[i / BLOCK] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i + 16)));
  }
}

#endif  // SPECDEC_AMX

}  // namespace

bool available() {
#ifdef SPECDEC_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                         const c10::optional<torch::Tensor>& offsets, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(available(), "AMX tiles are not available here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x [M, K] contiguous float32 on the CPU expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of ", BLOCK, ", got ", K);
  const bool int8 = q.scalar_type() == torch::kInt8;
  TORCH_CHECK((q.scalar_type() == torch::kUInt8 || int8) && q.is_contiguous() && q.dim() == 3 &&
              q.size(0) == K / BLOCK && q.size(2) == (int8 ? INT8_CHUNK_BYTES : CHUNK_BYTES),
              "q [K / 32, N / 16, 256] uint8 (4-bit) or [K / 32, N / 16, 512] int8 (cpu_amx.tile_weight) expected");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(has_offsets != int8, "4-bit weights need offsets, and only they take them");
  const int64_t tiles = q.size(1), N = tiles * TILE_N;
  for (const torch::Tensor* blocks : {&scales, has_offsets ? &*offsets : &scales}) {
    TORCH_CHECK(blocks->scalar_type() == torch::kFloat32 && blocks->is_contiguous() && blocks->dim() == 3 &&
                blocks->size(0) == K / BLOCK && blocks->size(1) == tiles && blocks->size(2) == TILE_N,
                "scales and offsets [K / 32, N / 16, 16] float32 expected");
  }
  auto y = torch::empty({M, N}, x.options());
#ifdef SPECDEC_AMX
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offsets ? offsets->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 2, [&](int64_t t0, int64_t t1) {
    // Each thread splits x itself: tile loads of lines another core just wrote wait on
    // them one tile at a time (1 thread took 25 us over 576 x 576 and 8 rows, 2 took 28).
    std::unique_ptr<uint16_t[]> parts(new uint16_t[3 * M * K]);
    std::unique_ptr<float[]> xsum(new float[M * (K / BLOCK)]);
    uint16_t* hi = parts.get();
    uint16_t* mid = hi + M * K;
    uint16_t* lo = mid + M * K;
    split_rows(xp, M, K, hi, mid, lo, xsum.get());
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE_ROWS, M - m0));
      if (int8) {
        dispatch_rows<true, TILE_ROWS>(rows, hi, mid, lo, xsum.get(), qp, sp, op, yp, K, N, m0, t0, t1);
      } else {
        dispatch_rows<false, TILE_ROWS>(rows, hi, mid, lo, xsum.get(), qp, sp, op, yp, K, N, m0, t0, t1);
      }
    }
  });
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "AMX tiles can be used here (built in and permitted by the OS)");
  m.def("amx_linear", &amx_linear,
        "x @ w.T + bias in float32 over 4-bit or int8 block weights laid out for AMX tiles",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scales"), pybind11::arg("offsets") = pybind11::none(),
        pybind11::arg("bias") = pybind11::none());
}
