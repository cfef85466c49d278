// kv_compact: after verification, move each request's accepted path to contiguous cache
// positions, for every layer, key and value, in one launch and in place.
// Twin: backend_src/specdec/ops/kv_compact.py::kv_compact_torch.
//
// kv[L, 2, S, H, T, D]; request b owns slot slots[b]. For j = 1..accept_len[b]:
//   kv[l, k/v, slot, h, prefix + j, :] = kv[l, k/v, slot, h, prefix + accepted_nodes[b, j], :]
//
//   accepted_nodes [0, 2, 3], prefix 7:  j = 1: pos 9 -> 8;  j = 2: pos 10 -> 9
//
// The in-place hazard: above, copy 2 writes position 9, which copy 1 reads; run in
// parallel, copy 2 could overwrite it first. Since accepted_nodes[b, j] >= j and the
// path increases, copying in increasing j never overwrites a source before it is read,
// so each block runs its copies in that order with a barrier between them. Blocks are
// (layer * 2 + k/v, request): disjoint memory, no ordering between them.
//
// Elements are only moved, never interpreted, so the kernels take raw 2- or 4-byte
// storage; rows whose byte length is a multiple of 16 (with a 16-byte-aligned base) are
// moved as uint4.

template <typename Unit>
__device__ void kv_compact_rows(
    Unit* kv,                               // [L * 2, S, H, T, row_units]
    const long long* slots, const long long* prefix_len,
    const long long* accepted_nodes, const long long* accept_len,
    int S, int H, int T, int row_units, int N) {
  const long long lkv = blockIdx.x;  // layer * 2 + (0: key, 1: value)
  const int b = blockIdx.y;
  long long a = accept_len[b];
  a = a > N - 1 ? N - 1 : a;
  if (a <= 0) return;  // block-uniform
  const long long slot = slots[b];
  const long long prefix = prefix_len[b];
  if (slot < 0 || slot >= S) return;  // block-uniform; guards malformed input only
  Unit* base = kv + (lkv * S + slot) * H * (long long)T * row_units;
  const long long head_units = (long long)T * row_units;
  const int units = H * row_units;
  for (long long j = 1; j <= a; ++j) {
    const long long src = prefix + accepted_nodes[(long long)b * N + j];
    const long long dst = prefix + j;
    if (src != dst && src >= 0 && src < T && dst >= 0 && dst < T) {
      for (int e = threadIdx.x; e < units; e += blockDim.x) {
        const int h = e / row_units;
        const int u = e - h * row_units;
        base[h * head_units + dst * row_units + u] = base[h * head_units + src * row_units + u];
      }
    }
    __syncthreads();  // copy j + 1 writes what copy j reads: it must not overtake it
  }
}

template <typename Elem>
__device__ void kv_compact_dispatch(
    Elem* kv, const long long* slots, const long long* prefix_len,
    const long long* accepted_nodes, const long long* accept_len,
    int S, int H, int T, int D, int N) {
  const int row_bytes = D * (int)sizeof(Elem);
  if (row_bytes % 16 == 0 && ((unsigned long long)kv & 15ull) == 0) {
    kv_compact_rows<uint4>(reinterpret_cast<uint4*>(kv), slots, prefix_len, accepted_nodes,
                           accept_len, S, H, T, row_bytes / 16, N);
  } else {
    kv_compact_rows<Elem>(kv, slots, prefix_len, accepted_nodes, accept_len, S, H, T, D, N);
  }
}

#define KV_COMPACT_KERNEL(NAME, STORAGE)                                                  \
  extern "C" __global__ void NAME(                                                        \
      STORAGE* kv,                      /* [L, 2, S, H, T, D] */                          \
      const long long* slots,           /* [B] */                                         \
      const long long* prefix_len,      /* [B] */                                         \
      const long long* accepted_nodes,  /* [B, N] */                                      \
      const long long* accept_len,      /* [B] */                                         \
      int S, int H, int T, int D, int N) {                                                \
    kv_compact_dispatch<STORAGE>(kv, slots, prefix_len, accepted_nodes, accept_len, S, H, \
                                 T, D, N);                                                \
  }

KV_COMPACT_KERNEL(kv_compact_f32, unsigned int)
KV_COMPACT_KERNEL(kv_compact_f16, unsigned short)
KV_COMPACT_KERNEL(kv_compact_bf16, unsigned short)
