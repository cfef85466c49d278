// The tree work of a speculative step on the CPU, one call each: what kernels/tree_mask.cu,
// kernels/verify_greedy.cu and kernels/kv_compact.cu do on a GPU, with the same rules, one
// request after another.
//
//   build_tree(parents, num_nodes, prefix_len)
//       -> tree_mask [B, N, N] bool, positions, depth, first_child, next_sibling [B, N] int64
//   verify_greedy(candidates, parents, num_nodes, target_argmax)
//       -> accept_len [B], accepted_nodes [B, N], bonus_token [B] int64
//   kv_compact(kv, slots, prefix_len, accepted_nodes, accept_len)
//       moves each request's accepted path down to consecutive KV cache positions, in place
//
//   node      0  1  2  3        depth [0, 1, 1, 2], prefix 7 -> positions [7, 8, 8, 9]
//   parents  -1  0  0  1        first_child [1, 3, -1, -1], next_sibling [-1, 2, -1, -1]
//   candidates [r, a, b, c], target_argmax [a, c, x, y]
//       -> nodes 1 and 3 accepted, 2 rejected (b != a): accept_len 2,
//          accepted_nodes [0, 1, 3, -1], bonus_token y
//
// Built at run time by specdec/ops/cpu_tree.py (torch.utils.cpp_extension). Their torch twins,
// build_tree_torch (ops/tree_mask.py) and verify_greedy_torch (ops/verify_greedy.py), are the
// reference: every output equals theirs, on malformed trees too (out-of-range parents,
// parents after their node, a num_nodes out of [1, N]), as the CUDA kernels' do.
// kv_compact's twin is kv_compact_torch (ops/kv_compact.py): the same cache after it on every
// accepted path verify_greedy gives; a move whose slot or positions fall outside the cache
// is skipped, as kv_compact.cu skips it (the twin's indexing raises or wraps there).
//
// A tree of a decode step has 2-64 nodes: a few hundred integer steps, where the twins run
// some forty torch operators each (pointer doubling over the batch, bitsets unpacked through
// byte tables), 0.34-0.50 ms each a step on the 2-core Xeon VM for an 8-node tree.
//
// Needs contiguous int64 CPU tensors; the Python side checks and falls back to the twins.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

void check_int64(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.dim() == dims,
              name, ": a contiguous int64 CPU tensor of ", dims, " dims expected");
}

int64_t clamp_nodes(int64_t n, int64_t N) { return n < 1 ? 1 : (n > N ? N : n); }

}  // namespace

std::vector<torch::Tensor> build_tree(const torch::Tensor& parents, const torch::Tensor& num_nodes,
                                      const torch::Tensor& prefix_len) {
  check_int64(parents, "parents", 2);
  check_int64(num_nodes, "num_nodes", 1);
  check_int64(prefix_len, "prefix_len", 1);
  const int64_t B = parents.size(0), N = parents.size(1);
  TORCH_CHECK(N >= 1 && num_nodes.size(0) == B && prefix_len.size(0) == B,
              "parents [B, N >= 1], num_nodes [B] and prefix_len [B] expected");
  auto mask = torch::zeros({B, N, N}, parents.options().dtype(torch::kBool));
  auto positions = torch::empty({B, N}, parents.options());
  auto depth = torch::empty({B, N}, parents.options());
  auto first_child = torch::empty({B, N}, parents.options());
  auto next_sibling = torch::empty({B, N}, parents.options());
  const int64_t* all_parents = parents.data_ptr<int64_t>();
  bool* all_mask = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* par = all_parents + b * N;
    bool* tree = all_mask + b * N * N;
    const int64_t n = clamp_nodes(num_nodes.data_ptr<int64_t>()[b], N), prefix = prefix_len.data_ptr<int64_t>()[b];
    for (int64_t i = 0; i < N; ++i) {
      bool* row = tree + i * N;
      row[i] = true;
      int64_t d = 0, child = -1, sibling = -1;
      if (i < n) {
        // Up to the root. A padding ancestor ends the walk (its own parent is not followed);
        // the step bound and range checks only guard malformed input.
        int64_t j = i == 0 ? -1 : par[i];
        while (j >= 0 && j < N && d < N) {
          row[j] = true;
          ++d;
          if (j == 0 || j >= n) break;
          j = par[j];
        }
        // Links: the first later real node whose parent is i (child) or i's parent (sibling).
        const int64_t pi = par[i];
        const bool has_siblings = i > 0 && pi >= 0 && pi < N;
        for (int64_t c = i + 1; c < n; ++c) {
          if (child < 0 && par[c] == i) child = c;
          if (sibling < 0 && has_siblings && par[c] == pi) sibling = c;
          if (child >= 0 && (sibling >= 0 || !has_siblings)) break;
        }
      }
      depth.data_ptr<int64_t>()[b * N + i] = d;
      positions.data_ptr<int64_t>()[b * N + i] = prefix + d;
      first_child.data_ptr<int64_t>()[b * N + i] = child;
      next_sibling.data_ptr<int64_t>()[b * N + i] = sibling;
    }
  }
  return {mask, positions, depth, first_child, next_sibling};
}

std::vector<torch::Tensor> verify_greedy(const torch::Tensor& candidates, const torch::Tensor& parents,
                                         const torch::Tensor& num_nodes, const torch::Tensor& target_argmax) {
  check_int64(candidates, "candidates", 2);
  check_int64(parents, "parents", 2);
  check_int64(num_nodes, "num_nodes", 1);
  check_int64(target_argmax, "target_argmax", 2);
  const int64_t B = parents.size(0), N = parents.size(1);
  TORCH_CHECK(N >= 1 && candidates.sizes() == parents.sizes() && target_argmax.sizes() == parents.sizes() &&
              num_nodes.size(0) == B, "candidates, parents, target_argmax [B, N >= 1] and num_nodes [B] expected");
  auto accept_len = torch::empty({B}, parents.options());
  auto accepted_nodes = torch::full({B, N}, -1, parents.options());
  auto bonus_token = torch::empty({B}, parents.options());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* par = parents.data_ptr<int64_t>() + b * N;
    const int64_t* cand = candidates.data_ptr<int64_t>() + b * N;
    const int64_t* amax = target_argmax.data_ptr<int64_t>() + b * N;
    const int64_t n = clamp_nodes(num_nodes.data_ptr<int64_t>()[b], N);
    int64_t winner = 0, win_depth = 0;  // the root: always accepted
    for (int64_t i = 1; i < n; ++i) {
      // Accepted when it and every ancestor match the target's choice after their parent;
      // the deepest wins, the lowest index on ties. Padding is never accepted; the step
      // bound only guards malformed input (parents[j] >= j).
      bool ok = true;
      int64_t d = 0, j = i;
      while (j > 0 && d < N) {
        const int64_t p = par[j];
        if (p < 0 || p >= n || cand[j] != amax[p]) {
          ok = false;
          break;
        }
        ++d;
        j = p;
      }
      if (ok && d > win_depth) {
        winner = i;
        win_depth = d;
      }
    }
    int64_t* path = accepted_nodes.data_ptr<int64_t>() + b * N;
    for (int64_t k = win_depth, j = winner; k > 0; --k, j = par[j]) path[k] = j;
    path[0] = 0;
    accept_len.data_ptr<int64_t>()[b] = win_depth;
    bonus_token.data_ptr<int64_t>()[b] = amax[winner];
  }
  return {accept_len, accepted_nodes, bonus_token};
}

// kv [L, 2, S, H, T, D] of any dtype, contiguous: for each request b and j = 1 .. min(accept_len[b],
// N - 1), the row at position prefix + accepted_nodes[b, j] of every layer, key or value and head
// goes to prefix + j. In increasing j, as kv_compact.cu orders them: a path's nodes increase and
// accepted_nodes[b, j] >= j, so no copy overwrites a row a later one reads.
void kv_compact(torch::Tensor kv, const torch::Tensor& slots, const torch::Tensor& prefix_len,
                const torch::Tensor& accepted_nodes, const torch::Tensor& accept_len) {
  TORCH_CHECK(kv.device().is_cpu() && kv.is_contiguous() && kv.dim() == 6 && kv.size(1) == 2,
              "kv: a contiguous CPU tensor [L, 2, S, H, T, D] expected");
  check_int64(slots, "slots", 1);
  check_int64(prefix_len, "prefix_len", 1);
  check_int64(accepted_nodes, "accepted_nodes", 2);
  check_int64(accept_len, "accept_len", 1);
  const int64_t B = accepted_nodes.size(0), N = accepted_nodes.size(1);
  TORCH_CHECK(slots.size(0) == B && prefix_len.size(0) == B && accept_len.size(0) == B,
              "slots, prefix_len and accept_len [B] expected for accepted_nodes [B, N]");
  const int64_t rows = kv.size(0) * 2, S = kv.size(2), H = kv.size(3), T = kv.size(4);
  const int64_t row_bytes = kv.size(5) * kv.element_size();
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t a = std::min(accept_len.data_ptr<int64_t>()[b], N - 1);
    const int64_t slot = slots.data_ptr<int64_t>()[b], prefix = prefix_len.data_ptr<int64_t>()[b];
    if (a <= 0 || slot < 0 || slot >= S) continue;
    for (int64_t j = 1; j <= a; ++j) {
      const int64_t src = prefix + accepted_nodes.data_ptr<int64_t>()[b * N + j], dst = prefix + j;
      if (src == dst || src < 0 || src >= T || dst < 0 || dst >= T) continue;
      for (int64_t r = 0; r < rows; ++r) {  // layer * 2 + (0: keys, 1: values)
        char* slot_rows = base + ((r * S + slot) * H) * T * row_bytes;
        for (int64_t h = 0; h < H; ++h) {
          char* head = slot_rows + h * T * row_bytes;
          std::memcpy(head + dst * row_bytes, head + src * row_bytes, row_bytes);
        }
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_tree", &build_tree, "attention mask, positions, depth and links of a batch of trees (CPU, int64)",
        pybind11::arg("parents"), pybind11::arg("num_nodes"), pybind11::arg("prefix_len"));
  m.def("verify_greedy", &verify_greedy, "greedy acceptance of a batch of trees (CPU, int64)",
        pybind11::arg("candidates"), pybind11::arg("parents"), pybind11::arg("num_nodes"),
        pybind11::arg("target_argmax"));
  m.def("kv_compact", &kv_compact, "moves accepted paths to consecutive KV cache positions, in place (CPU)",
        pybind11::arg("kv"), pybind11::arg("slots"), pybind11::arg("prefix_len"), pybind11::arg("accepted_nodes"),
        pybind11::arg("accept_len"));
}
