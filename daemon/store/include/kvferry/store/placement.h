#pragma once
// Rendezvous (highest-random-weight) placement of a block over the live members (DESIGN.md §4):
// every member gets a pseudo-random weight for the key, and the owners are the members with the
// highest weights. No central index; when a member joins or leaves, only the keys it wins or held
// move (about 1/n of them), and every daemon with the same view computes the same owners.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/store/block_key.h"

namespace kvferry::store {

/// The weight of `key` on the member whose id hashes to `member_seed` (splitmix64 finalizer over
/// both halves of the key, seeded per member: an even spread and no correlation between members).
inline uint64_t rendezvous_weight(const BlockKey& key, uint64_t member_seed) {
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return mix(mix(key.lo ^ member_seed) ^ key.hi ^ (member_seed * 0x9e3779b97f4a7c15ull));
}

/// A member id's seed: FNV-1a 64 of its bytes, finalized. Depends on the id only, so a restarted
/// member (new incarnation) keeps its keys.
inline uint64_t member_seed(std::string_view id) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : id) h = (h ^ c) * 0x100000001b3ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 33);
}

/// Placement over a fixed list of member ids (a snapshot of the view). Immutable, so any thread may
/// use it; build a new one when the view changes.
class RendezvousPlacement {
 public:
  explicit RendezvousPlacement(std::vector<std::string> ids) : ids_(std::move(ids)) {
    seeds_.reserve(ids_.size());
    for (auto& id : ids_) seeds_.push_back(member_seed(id));
  }

  const std::vector<std::string>& ids() const { return ids_; }
  size_t size() const { return ids_.size(); }

  /// Indices into ids() of the `replicas` owners of `key`, best first (fewer when there are fewer
  /// members; empty when there are none). Ties (equal weights) go to the smaller id.
  std::vector<size_t> owners(const BlockKey& key, size_t replicas = 1) const {
    std::vector<std::pair<uint64_t, size_t>> w;
    w.reserve(ids_.size());
    for (size_t i = 0; i < ids_.size(); ++i) w.emplace_back(rendezvous_weight(key, seeds_[i]), i);
    const size_t n = std::min(replicas, w.size());
    auto better = [&](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : ids_[a.second] < ids_[b.second];
    };
    std::partial_sort(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(n), w.end(), better);
    std::vector<size_t> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) out.push_back(w[i].second);
    return out;
  }

  /// The first owner's id ("" when there are no members).
  std::string owner(const BlockKey& key) const {
    auto o = owners(key, 1);
    return o.empty() ? std::string() : ids_[o[0]];
  }

 private:
  std::vector<std::string> ids_;
  std::vector<uint64_t> seeds_;
};

}  // namespace kvferry::store
