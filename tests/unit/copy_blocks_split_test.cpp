// copy_blocks' host-side helpers: the split of a run list over DMA streams and the engine choice.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvferry/kernels/copy_blocks.h"

namespace kvferry {
namespace {

using namespace kernels;

/// Checks the ranges cover [0, runs.size()) in order, none empty, at most `parts` of them.
void expect_valid_split(const std::vector<CopyRun>& runs, int parts, const size_t* ends, int n) {
  ASSERT_GE(n, 1);
  ASSERT_LE(n, parts);
  size_t begin = 0;
  for (int i = 0; i < n; ++i) {
    EXPECT_GT(ends[i], begin) << "range " << i << " is empty";
    begin = ends[i];
  }
  EXPECT_EQ(begin, runs.size());
}

TEST(CopyBlocksSplit, EqualRunsSplitEvenly) {
  const std::vector<CopyRun> runs(4096, CopyRun{0, 0, 16 << 10});
  size_t ends[4];
  for (int parts : {1, 2, 3, 4}) {
    const int n = split_copy_runs(runs, parts, ends);
    EXPECT_EQ(n, parts);
    expect_valid_split(runs, parts, ends, n);
    size_t begin = 0;
    for (int i = 0; i < n; ++i) {
      const size_t len = ends[i] - begin;
      EXPECT_LE(len, 4096u / static_cast<size_t>(parts) + 1) << parts << " parts, range " << i;
      EXPECT_GE(len, 4096u / static_cast<size_t>(parts) - 1) << parts << " parts, range " << i;
      begin = ends[i];
    }
  }
}

TEST(CopyBlocksSplit, BalancesBytesNotRuns) {
  // One big run then many small ones: the first range is the big run alone.
  std::vector<CopyRun> runs{{0, 0, 1 << 20}};
  for (int i = 0; i < 64; ++i) runs.push_back({0, 0, 16 << 10});
  size_t ends[2];
  const int n = split_copy_runs(runs, 2, ends);
  ASSERT_EQ(n, 2);
  EXPECT_EQ(ends[0], 1u);
  EXPECT_EQ(ends[1], runs.size());
}

TEST(CopyBlocksSplit, FewRunsAndEdgeCases) {
  size_t ends[4] = {};
  EXPECT_EQ(split_copy_runs({}, 4, ends), 0);
  const std::vector<CopyRun> one{{0, 0, 5}};
  EXPECT_EQ(split_copy_runs(one, 4, ends), 1);
  EXPECT_EQ(ends[0], 1u);
  const std::vector<CopyRun> zeros(3, CopyRun{0, 0, 0});
  const int n = split_copy_runs(zeros, 4, ends);
  expect_valid_split(zeros, 4, ends, n);
  // The last run holds nearly all the bytes: still non-empty ranges that cover the list.
  std::vector<CopyRun> tail(10, CopyRun{0, 0, 1});
  tail.back().bytes = 1 << 30;
  const int m = split_copy_runs(tail, 4, ends);
  expect_valid_split(tail, 4, ends, m);
  // Random lists, every part count.
  std::mt19937 g(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<CopyRun> runs(1 + g() % 40);
    for (auto& r : runs) r.bytes = g() % 3 == 0 ? 0 : static_cast<int64_t>(g() % (1 << 22));
    for (int parts = 1; parts <= 4; ++parts) {
      const int k = split_copy_runs(runs, parts, ends);
      expect_valid_split(runs, parts, ends, k);
    }
  }
}

TEST(CopyBlocksSplit, SizesSplitLikeRuns) {
  const std::vector<size_t> sizes{100, 100, 100, 100, 400};
  size_t ends[4];
  const int n = split_copy_sizes(sizes, 2, ends);
  ASSERT_EQ(n, 2);
  EXPECT_EQ(ends[0], 4u);
  EXPECT_EQ(ends[1], 5u);
}

TEST(CopyBlocksSplit, HostCopiesMergeFollowingRanges) {
  // Host side = destination: 0..100, 100..150 merge; 300 starts a new copy; the empty run is
  // skipped and does not break the next merge (400 follows 300..400).
  const std::vector<CopyRun> runs{{9000, 0, 100}, {5, 100, 50}, {77, 300, 100}, {0, 999, 0}, {1, 400, 10}};
  EXPECT_EQ(count_host_copies(runs, false), 2);
  // Host side = source: 9000, 5, 77, 1 follow nothing.
  EXPECT_EQ(count_host_copies(runs, true), 4);
  EXPECT_EQ(count_host_copies({}, true), 0);
}

TEST(CopyBlocksSplit, AutoPicksByMeanRun) {
  const std::vector<CopyRun> small(8, CopyRun{0, 0, 64 << 10}), big(8, CopyRun{0, 0, 1 << 20});
  EXPECT_EQ(choose_copy_engine(small, CopyEngine::kAuto), CopyEngine::kKernel);
  EXPECT_EQ(choose_copy_engine(big, CopyEngine::kAuto), CopyEngine::kDma);
  EXPECT_EQ(choose_copy_engine(big, CopyEngine::kKernel), CopyEngine::kKernel);
  EXPECT_STREQ(copy_direction_name(CopyDirection::kHostToDevice), "h2d");
  EXPECT_STREQ(copy_engine_name(CopyEngine::kStaged), "staged");
}

}  // namespace
}  // namespace kvferry
