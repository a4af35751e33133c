// Unit tests of TensorView and the argument checks (cpp/src/tensor_view.cc).
#include "check.h"
#include "moespec/error.h"
#include "moespec/tensor_view.h"

using namespace moespec;

TEST(contiguous_view_has_row_major_strides) {
  float data[24];
  TensorView t = TensorView::contiguous(data, DType::kFloat32, {2, 3, 4});
  CHECK(t.ndim == 3);
  CHECK(t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1);
  CHECK(t.numel() == 24);
  CHECK(t.is_contiguous());
  CHECK(t.describe() == "float32[2, 3, 4] (cpu)");
  t.strides[0] = 13;
  CHECK(!t.is_contiguous());
}

TEST(absent_view_is_not_defined) {
  TensorView t;
  CHECK(!t.defined());
  CHECK(t.describe() == "nothing");
  CHECK_THROWS_WITH(check_not_null(t, "bias"), "bias: a tensor is required");
}

TEST(dtype_sizes_and_names) {
  CHECK(dtype_size(DType::kBFloat16) == 2 && dtype_size(DType::kInt64) == 8);
  CHECK(std::string(dtype_name(DType::kFloat16)) == "float16");
}

TEST(checks_name_the_argument_and_the_values) {
  int32_t data[6];
  TensorView t = TensorView::contiguous(data, DType::kInt32, {2, 3}, Device::kCUDA, 1);
  CHECK_THROWS_WITH(check_ndim(t, "ids", 3), "ids: expected a 3-d tensor, got int32[2, 3] (cuda:1)");
  CHECK_THROWS_WITH(check_dtype(t, "ids", {DType::kFloat32, DType::kBFloat16}),
                    "ids: expected dtype float32 or bfloat16");
  CHECK_THROWS_WITH(check_dim(t, "ids", 1, 4), "expected size 4 in dim 1");
  CHECK_THROWS_WITH(check_device(t, "ids", Device::kCPU), "expected a tensor on cpu");
  check_device(t, "ids", Device::kCUDA, 1);
  CHECK_THROWS_WITH(check_device(t, "ids", Device::kCUDA, 0), "expected a tensor on cuda:0");
  check_dtype(t, "ids", {DType::kInt32});
  check_dim(t, "ids", 0, 2);
}

TEST(too_many_dims_is_an_error) {
  CHECK_THROWS_WITH(TensorView::contiguous(nullptr, DType::kFloat32, {1, 1, 1, 1, 1, 1, 1}), "at most 6 dims");
}

TEST(error_kinds) {
  bool thrown = false;
  try {
    throw_runtime("boom ", 42);
  } catch (const Error& e) {
    thrown = true;
    CHECK(e.kind() == ErrorKind::kRuntime);
    CHECK(std::string(e.what()) == "boom 42");
  }
  CHECK(thrown);  // (a throw_runtime that returned would pass the checks above unseen)
}
