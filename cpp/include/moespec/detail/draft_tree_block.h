// The draft tree's device core, one block's work, shared by the CUDA kernels (cpp/kernels/draft_tree.cu:
// a block of threads) and the CPU (cpp/src/draft_tree_device.cc: one "thread" walking every index),
// so that the CPU tests hold the kernels' code to the other cores (tests/python/test_draft_tree.py).
// The op, its arguments and semantics: moespec/draft_tree_device.h.
//
// Every function is a sequence of phases; a phase's loop `for (i = blk.thread(); i < n; i +=
// blk.threads())` touches what no other index of the same phase reads, and `blk.sync()` separates
// the phases (__syncthreads on the device: global memory written before it is visible after it), so
// a serial walk of the indices (the CPU) computes what the block computes.
#pragma once

#include <cstdint>

#include "moespec/detail/host_device.h"

namespace moespec {

struct DraftExpandArgs;
struct DraftFinalizeArgs;

namespace detail {

constexpr int64_t kMaxTokenId = 2147483647;  // token ids are clamped into [0, 2^31)

// A block of threads on the device (or the block emulator: tests/cpp/emulated); on the host (never
// used there) one thread.
struct DeviceBlock {
  MOESPEC_HD int thread() const {
#if defined(__CUDA_ARCH__) || defined(MOESPEC_EMULATED)
    return static_cast<int>(threadIdx.x);
#else
    return 0;
#endif
  }
  MOESPEC_HD int threads() const {
#if defined(__CUDA_ARCH__) || defined(MOESPEC_EMULATED)
    return static_cast<int>(blockDim.x);
#else
    return 1;
#endif
  }
  MOESPEC_HD void sync() const {
#if defined(__CUDA_ARCH__) || defined(MOESPEC_EMULATED)
    __syncthreads();
#endif
  }
  MOESPEC_HD bool all(bool v) const {  // (a barrier too)
#if defined(__CUDA_ARCH__) || defined(MOESPEC_EMULATED)
    return __syncthreads_and(v) != 0;
#else
    return v;
#endif
  }
  MOESPEC_HD void add(int32_t* p, int32_t v) const {  // (integer: the sum does not depend on the order)
#if defined(__CUDA_ARCH__) || defined(MOESPEC_EMULATED)
    atomicAdd(p, v);
#else
    *p += v;
#endif
  }
};

// The CPU's block: one thread.
struct HostBlock {
  MOESPEC_HD int thread() const { return 0; }
  MOESPEC_HD int threads() const { return 1; }
  MOESPEC_HD void sync() const {}
  MOESPEC_HD bool all(bool v) const { return v; }
  MOESPEC_HD void add(int32_t* p, int32_t v) const { *p += v; }
};

// Whether candidate (a, ia) ranks before (b, ib): score desc, index asc (index order is depth order);
// NaN ranks first, as in torch's descending sort (the torch core's order; NaN is a recorded problem).
MOESPEC_HD bool ranks_before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = a != a, nb = b != b;
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

MOESPEC_HD int64_t clamp_id(int64_t t) { return t < 0 ? 0 : (t > kMaxTokenId ? kMaxTokenId : t); }

// One level of B requests' trees (all requests in one block). See DraftExpandArgs.
struct ExpandWork {
  int32_t B, K, n;      // n new candidates a request: K at the root level, K * K after
  int64_t base;         // the candidate index of the level's first
  bool root_level;
  const int64_t* tokens;    // [B, n]: target ids, or draft ids when d2t
  const float* logprobs;    // [B, n]
  const int64_t* roots;     // [B] (the root level)
  const int64_t* d2t;       // [V] or null
  int64_t vocab;            // V
  int64_t* cand_tokens;     // [B, stride]
  int32_t* cand_parent;     // [B, stride]
  float* score;             // [B, stride]
  int64_t stride;           // of the candidate records (C at the deepest level)
  int64_t* root;            // [B]
  int64_t* frontier;        // [B, K]
  int32_t* out_index;       // [B, K] each
  int64_t* out_tokens;
  int32_t* out_parent;
  int32_t* out_parent_slot;
  float* out_scores;
  uint8_t* ok;              // flags (null: none)
  float tolerance;          // the largest log-prob accepted
};

template <typename Block>
MOESPEC_HD void expand_block(const Block& blk, const ExpandWork& w) {
  bool ids_ok = true, draft_ok = true, lp_ok = true, roots_ok = true;
  const int64_t total = static_cast<int64_t>(w.B) * w.n;
  for (int64_t i = blk.thread(); i < total; i += blk.threads()) {  // phase 1: record the candidates
    const int64_t b = i / w.n, e = i % w.n, c = w.base + e;
    int64_t t = w.tokens[i];
    if (w.d2t != nullptr) {  // draft id -> target id, the id clamped into the map
      const int64_t inside = t < 0 ? 0 : (t >= w.vocab ? w.vocab - 1 : t);
      draft_ok = draft_ok && inside == t;
      t = t + w.d2t[inside];
    }
    const int64_t id = clamp_id(t);
    ids_ok = ids_ok && id == t;
    const float lp = w.logprobs[i];
    lp_ok = lp_ok && lp <= w.tolerance;  // (false for NaN)
    const float clipped = lp > 0.0f ? 0.0f : lp;  // (NaN stays NaN, as torch's clamp)
    w.cand_tokens[b * w.stride + c] = id;
    if (w.root_level) {
      w.cand_parent[b * w.stride + c] = -1;
      w.score[b * w.stride + c] = clipped;
    } else {
      int64_t parent = w.frontier[b * w.K + e / w.K];  // (an earlier candidate: clamped, for a caller's bad frontier)
      parent = parent < 0 ? 0 : (parent >= w.base ? w.base - 1 : parent);
      w.cand_parent[b * w.stride + c] = static_cast<int32_t>(parent);
      w.score[b * w.stride + c] = w.score[b * w.stride + parent] + clipped;
    }
  }
  if (w.root_level)
    for (int64_t b = blk.thread(); b < w.B; b += blk.threads()) {
      const int64_t id = clamp_id(w.roots[b]);
      roots_ok = roots_ok && id == w.roots[b];
      w.root[b] = id;
    }
  // (the barriers: every thread reaches them; phase 1's writes are visible from here on)
  roots_ok = blk.all(roots_ok);
  draft_ok = blk.all(draft_ok);
  ids_ok = blk.all(ids_ok);
  lp_ok = blk.all(lp_ok);
  if (w.ok != nullptr && blk.thread() == 0) {  // in the order of the torch core's checks
    int f = 0;
    if (w.root_level) w.ok[f++] = roots_ok;
    if (w.d2t != nullptr) w.ok[f++] = draft_ok;
    w.ok[f++] = ids_ok;
    w.ok[f++] = lp_ok;
  }
  for (int64_t i = blk.thread(); i < total; i += blk.threads()) {  // phase 2: the K best are the frontier
    const int64_t b = i / w.n, e = i % w.n, c = w.base + e;
    const float* s = w.score + b * w.stride + w.base;
    const float v = s[e];
    int64_t rank = 0;
    for (int64_t o = 0; o < w.n && rank < w.K; ++o) rank += ranks_before(s[o], o, v, e);
    if (rank >= w.K) continue;
    const int64_t at = b * w.K + rank;
    w.frontier[at] = c;
    w.out_index[at] = static_cast<int32_t>(c);
    w.out_scores[at] = v;
    w.out_tokens[at] = w.cand_tokens[b * w.stride + c];
    w.out_parent[at] = w.cand_parent[b * w.stride + c];
    w.out_parent_slot[at] = w.root_level ? -1 : static_cast<int32_t>(e / w.K);
  }
}

// One request's finished tree (a block per request). See DraftFinalizeArgs.
struct FinalizeWork {
  int32_t K;
  int64_t C, N, W, L;         // candidates, nodes (root included), mask words, path columns
  const float* score;         // [C] of the request
  const int32_t* cand_parent; // [C]
  const int64_t* cand_tokens; // [C]
  const int64_t* root;        // [1]
  int32_t* scratch;           // [2 C + 6 N]
  int64_t* tokens;            // [N]
  int32_t* parents;           // [N]
  int32_t* depth;             // [N]
  float* scores;              // [N]
  int32_t* candidates;        // [N]
  int32_t* mask;              // [N, mask_stride]
  int64_t mask_stride;
  int32_t* paths;             // [N - 1, paths_stride]
  int64_t paths_stride;
  int32_t* num_leaves;        // [1]
  int32_t* max_depth;         // [1]
};

template <typename Block>
MOESPEC_HD void finalize_block(const Block& blk, const FinalizeWork& w) {
  const int64_t C = w.C, N = w.N, M = N - 1;
  int32_t* chosen = w.scratch;      // [C] 1 when among the M best
  int32_t* node_of = chosen + C;    // [C] node of a chosen candidate
  int32_t* cand_of = node_of + C;   // [N] candidate of a node
  int32_t* par = cand_of + N;       // [N] parent node (-1: the root)
  int32_t* dep = par + N;           // [N]
  int32_t* has_child = dep + N;     // [N]
  int32_t* leaves_in = has_child + N;  // [N] leaves of a node's subtree
  int32_t* before = leaves_in + N;  // [N] leaves under a node's earlier siblings
  for (int64_t c = blk.thread(); c < C; c += blk.threads()) {  // the M best candidates
    const float v = w.score[c];
    int64_t rank = 0;
    for (int64_t o = 0; o < C && rank < M; ++o) rank += ranks_before(w.score[o], o, v, c);
    chosen[c] = rank < M;
  }
  blk.sync();
  for (int64_t c = blk.thread(); c < C; c += blk.threads()) {  // nodes 1..M in candidate order
    if (!chosen[c]) continue;
    int32_t before = 0;
    for (int64_t o = 0; o < c; ++o) before += chosen[o];
    node_of[c] = before + 1;
    cand_of[before + 1] = static_cast<int32_t>(c);
  }
  blk.sync();
  for (int64_t i = blk.thread(); i < N; i += blk.threads()) {
    has_child[i] = 0, leaves_in[i] = 0;
    if (i == 0) {
      par[0] = -1, dep[0] = 0;
      w.tokens[0] = *w.root, w.parents[0] = -1, w.depth[0] = 0, w.scores[0] = 0.0f, w.candidates[0] = -1;
      continue;
    }
    const int32_t c = cand_of[i], pc = w.cand_parent[c];
    // (a parent among the chosen, as the ranking guarantees for valid scores, else the root; an earlier
    // candidate, so that par[i] < i and every walk up ends at the root)
    const int32_t p = pc >= 0 && pc < c && chosen[pc] ? node_of[pc] : 0;
    const int32_t d = c < w.K ? 1 : 2 + static_cast<int32_t>((c - w.K) / (static_cast<int64_t>(w.K) * w.K));
    par[i] = p, dep[i] = d;
    w.tokens[i] = w.cand_tokens[c], w.parents[i] = p, w.depth[i] = d, w.scores[i] = w.score[c];
    w.candidates[i] = c;
  }
  for (int64_t i = blk.thread(); i < M * w.L; i += blk.threads())
    w.paths[(i / w.L) * w.paths_stride + i % w.L] = -1;
  blk.sync();
  for (int64_t i = blk.thread(); i < N; i += blk.threads()) {  // masks: a row per index
    int32_t* row = w.mask + i * w.mask_stride;
    for (int64_t k = 0; k < w.W; ++k) row[k] = 0;
    for (int32_t u = static_cast<int32_t>(i), steps = 0; u >= 0 && steps <= w.L; u = par[u], ++steps)
      row[u / 32] |= static_cast<int32_t>(1u << (u % 32));
    if (i > 0) has_child[par[i]] = 1;  // (every writer writes 1)
  }
  blk.sync();
  // The leaves in lexicographic order of their paths: leaf a precedes b where, below their lowest
  // common ancestor, a's path takes the lower-numbered child; so a's rank is the leaves under the
  // earlier siblings of every node of its path.
  for (int64_t i = blk.thread(); i < N; i += blk.threads())  // every leaf counts in its ancestors
    if (!has_child[i])
      for (int32_t u = static_cast<int32_t>(i); u >= 0; u = par[u]) blk.add(&leaves_in[u], 1);
  blk.sync();
  for (int64_t i = blk.thread(); i < N; i += blk.threads()) {
    int32_t under = 0;
    if (i > 0)
      for (int64_t s = 1; s < i; ++s) under += par[s] == par[i] ? leaves_in[s] : 0;
    before[i] = under;
  }
  blk.sync();
  for (int64_t i = blk.thread(); i < N; i += blk.threads()) {  // each leaf's path, at its rank
    if (has_child[i]) continue;
    int32_t rank = 0;
    for (int32_t u = static_cast<int32_t>(i); u > 0; u = par[u]) rank += before[u];
    int32_t* row = w.paths + (rank < M ? rank : M - 1) * w.paths_stride;  // (rank < leaves <= M; kept in bounds)
    for (int32_t u = static_cast<int32_t>(i); u >= 0 && dep[u] < w.L; u = par[u]) row[dep[u]] = u;
  }
  if (blk.thread() == 0) {
    int32_t leaves = 0, deepest = 0;
    for (int64_t i = 0; i < N; ++i) {
      leaves += !has_child[i];
      deepest = dep[i] > deepest ? dep[i] : deepest;
    }
    *w.num_leaves = leaves;
    *w.max_depth = deepest;
  }
}

// The work of the op's arguments (checked first: moespec/draft_tree_device.h): the level of B
// requests, request b's finalize (cpp/src/draft_tree_device.cc; host functions).
ExpandWork expand_work(const DraftExpandArgs& args, int64_t B);
FinalizeWork finalize_work(const DraftFinalizeArgs& args, int64_t b);

}  // namespace detail
}  // namespace moespec
