// build_tree: a batch of token trees (parents[B, N]) -> attention mask, positions, depth
// and child/sibling links. Twin: backend_src/specdec/ops/tree_mask.py::build_tree_torch.
//
// Layout (docs/DESIGN.md, "Tree layout"): parents[0] = -1, parents[i] < i, siblings in
// rank order. Nodes at or past num_nodes[b] are padding: their row of the mask is the
// diagonal only (so attention over a padding row never sees an empty row), depth 0,
// position prefix_len, no links. Node 0 always exists; the parent pointer of node 0 and
// of padding nodes is never followed.
//
//   node      0  1  2  3        depth [0, 1, 1, 2], prefix 7 -> positions [7, 8, 8, 9]
//   parents  -1  0  0  1        first_child [1, 3, -1, -1], next_sibling [-1, 2, -1, -1]
//
// One block per request; threads stride over nodes. Each thread walks its node's
// ancestor chain (depth <= N - 1 steps) and scans later nodes for its first child and
// next sibling (<= N reads): O(N^2 / threads) per block, for N up to a few hundred.

extern "C" __global__ void build_tree(
    const long long* __restrict__ parents,     // [B, N]
    const long long* __restrict__ num_nodes,   // [B]
    const long long* __restrict__ prefix_len,  // [B]
    bool* __restrict__ tree_mask,              // [B, N, N] out: row attends to column
    long long* __restrict__ positions,         // [B, N] out: prefix_len + depth
    long long* __restrict__ depth,             // [B, N] out
    long long* __restrict__ first_child,       // [B, N] out: -1 when none
    long long* __restrict__ next_sibling,      // [B, N] out: -1 when none
    int N) {
  const int b = blockIdx.x;
  const long long row0 = (long long)b * N;
  const long long* par = parents + row0;
  bool* mask = tree_mask + row0 * N;
  long long n = num_nodes[b];
  n = n < 1 ? 1 : (n > N ? N : n);
  const long long prefix = prefix_len[b];

  // Zero the block's mask with coalesced writes before any thread sets its bits.
  const long long nn = (long long)N * N;
  for (long long k = threadIdx.x; k < nn; k += blockDim.x) mask[k] = false;
  __syncthreads();

  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    bool* row = mask + (long long)i * N;
    row[i] = true;
    long long d = 0;
    long long child = -1;
    long long sibling = -1;
    if (i < n) {
      // Walk to the root. A padding ancestor ends the walk (its own parent is ignored);
      // the step bound and range checks only guard malformed input.
      long long j = (i == 0) ? -1 : par[i];
      while (j >= 0 && j < N && d < N) {
        row[j] = true;
        ++d;
        if (j == 0 || j >= n) break;
        j = par[j];
      }
      // Links: the first later real node whose parent is i (child) or i's parent
      // (sibling); a node with an out-of-range parent has no siblings.
      const long long pi = par[i];
      const bool has_siblings = i > 0 && pi >= 0 && pi < N;
      for (long long c = i + 1; c < n; ++c) {
        const long long pc = par[c];
        if (child < 0 && pc == i) child = c;
        if (sibling < 0 && has_siblings && pc == pi) sibling = c;
        if (child >= 0 && (sibling >= 0 || !has_siblings)) break;
      }
    }
    depth[row0 + i] = d;
    positions[row0 + i] = prefix + d;
    first_child[row0 + i] = child;
    next_sibling[row0 + i] = sibling;
  }
}
