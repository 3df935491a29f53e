// The merge loop shared by the BPE tokenizers: starting from one symbol per character, merge
// the best adjacent pair until no pair can merge. Greedy by priority, leftmost on ties, as
// sentencepiece (scores) and GPT-2 (merge ranks) both do. O(n log n) with a heap.
#ifndef KVLENS_ENGINE_TOKENIZER_BPE_MERGE_H_
#define KVLENS_ENGINE_TOKENIZER_BPE_MERGE_H_

#include <optional>
#include <queue>
#include <string_view>
#include <vector>

namespace kvlens::internal {

// `symbols` are contiguous, adjacent slices of one buffer (symbols[i + 1] starts where
// symbols[i] ends). `priority(left, right)` returns the priority of merging the pair
// (higher wins), or nullopt when the pair may not merge. Returns the merged symbols.
template <typename PriorityFn>
std::vector<std::string_view> MergeSymbols(const std::vector<std::string_view>& symbols,
                                           PriorityFn&& priority) {
  struct Symbol {
    int prev;
    int next;
    std::string_view text;  // empty once merged into its left neighbour
  };
  struct Candidate {
    double priority;
    int left;
    int right;
    size_t size;  // left + right bytes when queued; a mismatch later means it is stale
  };
  struct Worse {
    bool operator()(const Candidate& a, const Candidate& b) const {
      return a.priority < b.priority || (a.priority == b.priority && a.left > b.left);
    }
  };

  const int n = static_cast<int>(symbols.size());
  std::vector<Symbol> syms(n);
  for (int i = 0; i < n; ++i) syms[i] = {i - 1, i + 1 < n ? i + 1 : -1, symbols[i]};
  std::priority_queue<Candidate, std::vector<Candidate>, Worse> queue;
  const auto try_add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    const std::optional<double> p = priority(syms[l].text, syms[r].text);
    if (p) queue.push({*p, l, r, syms[l].text.size() + syms[r].text.size()});
  };
  for (int i = 1; i < n; ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = syms[c.left];
    Symbol& right = syms[c.right];
    if (left.text.empty() || right.text.empty() || left.next != c.right ||
        left.text.size() + right.text.size() != c.size) {
      continue;  // one side changed since this pair was queued
    }
    left.text = std::string_view(left.text.data(), c.size);
    right.text = {};
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.left;
    try_add(left.prev, c.left);
    try_add(c.left, left.next);
  }

  std::vector<std::string_view> out;
  for (int i = n > 0 ? 0 : -1; i >= 0; i = syms[i].next) out.push_back(syms[i].text);
  return out;
}

}  // namespace kvlens::internal

#endif  // KVLENS_ENGINE_TOKENIZER_BPE_MERGE_H_
