// The CPU kernels of kernels.c as a torch operator, accessory::quantized_linear_cpu, so that eager code and
// torch.compile's generated code both reach them through the dispatcher at C++ cost (no Python per call).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
void accessory_linear_int4(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                           const uint16_t *mins, int64_t N, float *y);
void accessory_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                           float *y);
}

static at::Tensor quantized_linear_cpu(const at::Tensor &x, c10::string_view fmt, const at::Tensor &q,
                                       const at::Tensor &scale, const std::optional<at::Tensor> &minimum) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "quantized_linear_cpu: x must be a contiguous float32 matrix");
    TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kHalf,
                "quantized_linear_cpu: q and scale must be contiguous, scale float16");
    const int64_t rows = x.size(0), features = x.size(1), outputs = q.size(0);
    at::Tensor y = at::empty({rows, outputs}, x.options());
    const auto *scales = reinterpret_cast<const uint16_t *>(scale.data_ptr());
    if (fmt == "int4") {
        TORCH_CHECK(minimum.has_value() && minimum->is_contiguous() && q.scalar_type() == at::kByte &&
                    q.size(1) * 2 == features, "quantized_linear_cpu: int4 needs uint8 q (out, in / 2) and min");
        accessory_linear_int4(x.data_ptr<float>(), rows, features, q.data_ptr<uint8_t>(), scales,
                              reinterpret_cast<const uint16_t *>(minimum->data_ptr()), outputs, y.data_ptr<float>());
    } else {
        TORCH_CHECK(fmt == "int8" && q.scalar_type() == at::kChar && q.size(1) == features,
                    "quantized_linear_cpu: int8 needs int8 q (out, in)");
        accessory_linear_int8(x.data_ptr<float>(), rows, features, q.data_ptr<int8_t>(), scales, outputs,
                              y.data_ptr<float>());
    }
    return y;
}

TORCH_LIBRARY(accessory, m) {
    m.def("quantized_linear_cpu(Tensor x, str fmt, Tensor q, Tensor scale, Tensor? minimum) -> Tensor");
}

TORCH_LIBRARY_IMPL(accessory, CPU, m) { m.impl("quantized_linear_cpu", &quantized_linear_cpu); }
