#include <gtest/gtest.h>

#include "kvferry/layouts/status.h"

namespace kvferry {
namespace {

Result<int> half(int x) {
  if (x % 2) return Result<int>(ErrorCode::kInvalidArgument, std::to_string(x) + " is odd");
  return x / 2;
}

Result<int> quarter(int x) {
  KVFERRY_ASSIGN_OR_RETURN(int h, half(x));
  KVFERRY_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

Status check_even(int x) {
  KVFERRY_TRY(half(x));
  return Status::Ok();
}

TEST(Status, CodesHaveFixedWireValues) {
  // These values cross the wire: changing one breaks every deployed client.
  EXPECT_EQ(static_cast<int>(ErrorCode::kOk), 0);
  EXPECT_EQ(static_cast<int>(ErrorCode::kOutOfRange), 2);
  EXPECT_EQ(static_cast<int>(ErrorCode::kProtocol), 11);
  EXPECT_EQ(static_cast<int>(ErrorCode::kChecksumMismatch), 14);
  EXPECT_EQ(static_cast<int>(ErrorCode::kDataLoss), 22);
  EXPECT_EQ(sizeof(ErrorCode), 2u);
  for (int c = 0; c <= 22; ++c) EXPECT_NE(error_code_name(static_cast<ErrorCode>(c)), "unknown") << c;
}

TEST(Status, OkAndErrorText) {
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().to_string(), "ok");
  Status s(ErrorCode::kOutOfRange, "block 17 is out of range");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.to_string(), "out_of_range: block 17 is out of range");
  EXPECT_EQ(s.with_context("load").message(), "load: block 17 is out of range");
  EXPECT_TRUE(Status::Ok().with_context("x").ok());
}

TEST(Status, ResultAndTryPropagate) {
  auto q = quarter(12);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 3);
  auto bad = quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "3 is odd");
  EXPECT_TRUE(check_even(4).ok());
  EXPECT_EQ(check_even(5).message(), "5 is odd");
}

TEST(Status, ResultFromOkStatusIsAnInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInternal);
}

}  // namespace
}  // namespace kvferry
