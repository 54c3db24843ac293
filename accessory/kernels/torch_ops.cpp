// The CPU kernels of cpu_kernels.c as torch operators (accessory::linear_cpu, quantized_linear_cpu, dequantize_gguf_cpu,
// gguf_int8x_linear_cpu, int4_int8x_linear_cpu, decode_attention_cpu, rms_norm_cpu, rotary_cpu, gated_cpu, attend_cpu, and a block's halves
// attention_block_cpu and mlp_block_cpu), so that eager code and torch.compile's generated code both reach them through the dispatcher at C++ cost.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <string>
#include <vector>

extern "C" {
void accessory_linear_int4(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                           const uint16_t *mins, int64_t N, float *y);
void accessory_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                           float *y);
void accessory_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y);
int accessory_linear_gguf(const char *fmt, const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N,
                          float *y);
int accessory_dequantize_gguf(const char *fmt, const uint8_t *q, int64_t N, int64_t K, float *out);
int accessory_linear_gguf_int8x(const char *fmt, const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N,
                                float *y);
int accessory_linear_int4_int8x(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                               const uint16_t *mins, int64_t N, float *y);
int accessory_int8x(void);
void accessory_decode_attention(const float *q, const float *k, const float *v, const int64_t *positions, int64_t B,
                                int64_t L, int64_t H, int64_t Hkv, int64_t S, int64_t D, float *out);
void accessory_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float offset,
                        float *y);
void accessory_rotary(const float *x, int64_t tokens, int64_t heads, int64_t D, const float *rotations, float *y);
void accessory_gated(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows,
                     int64_t width, int gelu_tanh, float *y);
void accessory_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, int64_t B, int64_t L, int64_t H, int64_t Hkv, int64_t D,
                      const float *rotations, int64_t rotation_rows, const int64_t *positions, float *k_cache,
                      float *v_cache, int64_t S, int ring, float q_scale, const float *q_norm, const float *k_norm,
                      float eps, float offset, float *out);
int accessory_shm_all_reduce(int handle, const void *in, void *out, int64_t n, int dtype, double timeout_s);
int accessory_shm_all_gather(int handle, const void *in, void *out, int64_t bytes, double timeout_s);
const char *accessory_shm_error(void);
}

// GGUF's block formats (quant/formats.py GGUF_BLOCKS): values and bytes per block.
static bool gguf_block(c10::string_view fmt, int64_t &values, int64_t &bytes) {
    if (fmt == "q4_k") values = 256, bytes = 144;
    else if (fmt == "q5_k") values = 256, bytes = 176;
    else if (fmt == "q6_k") values = 256, bytes = 210;
    else if (fmt == "q5_0") values = 32, bytes = 22;
    else return false;
    return true;
}

// W (out, in) in a GGUF block format as float32, exactly as the products' kernels make each weight.
static at::Tensor dequantize_gguf_cpu(const at::Tensor &q, c10::string_view fmt, int64_t features) {
    int64_t values = 0, bytes = 0;
    TORCH_CHECK(gguf_block(fmt, values, bytes), "dequantize_gguf_cpu: ", fmt, " is not a GGUF block format");
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte && features % values == 0 &&
                q.size(1) == features / values * bytes, "dequantize_gguf_cpu: ", fmt, " needs uint8 q (out, in / ",
                values, " * ", bytes, ") and in a multiple of ", values);
    at::Tensor w = at::empty({q.size(0), features}, q.options().dtype(at::kFloat));
    const std::string name(fmt.data(), fmt.size());
    accessory_dequantize_gguf(name.c_str(), q.data_ptr<uint8_t>(), q.size(0), features, w.data_ptr<float>());
    return w;
}

// x (rows, in) @ W^T for W in a GGUF block format, with x quantized to int8 (cpu_kernels.c: a prompt's products).
static at::Tensor gguf_int8x_linear_cpu(const at::Tensor &x, c10::string_view fmt, const at::Tensor &q) {
    int64_t values = 0, bytes = 0;
    TORCH_CHECK(accessory_int8x(), "gguf_int8x_linear_cpu: the kernels were built without AVX-512 or AVX2");
    TORCH_CHECK(gguf_block(fmt, values, bytes), "gguf_int8x_linear_cpu: ", fmt, " is not a GGUF block format");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "gguf_int8x_linear_cpu: x must be a contiguous float32 matrix");
    const int64_t rows = x.size(0), features = x.size(1), outputs = q.size(0);
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte && features % values == 0 &&
                q.size(1) == features / values * bytes, "gguf_int8x_linear_cpu: ", fmt, " needs uint8 q (out, in / ",
                values, " * ", bytes, ") and in a multiple of ", values);
    at::Tensor y = at::empty({rows, outputs}, x.options());
    const std::string name(fmt.data(), fmt.size());
    const int failed = accessory_linear_gguf_int8x(name.c_str(), x.data_ptr<float>(), rows, features,
                                                   q.data_ptr<uint8_t>(), outputs, y.data_ptr<float>());
    TORCH_CHECK(!failed, "gguf_int8x_linear_cpu: out of memory for x's ", rows * features, " int8 values");
    return y;
}

static at::Tensor quantized_linear_cpu(const at::Tensor &x, c10::string_view fmt, const at::Tensor &q,
                                       const std::optional<at::Tensor> &scale,
                                       const std::optional<at::Tensor> &minimum) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "quantized_linear_cpu: x must be a contiguous float32 matrix");
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "quantized_linear_cpu: q must be a contiguous matrix");
    const int64_t rows = x.size(0), features = x.size(1), outputs = q.size(0);
    at::Tensor y = at::empty({rows, outputs}, x.options());
    int64_t values = 0, bytes = 0;
    if (gguf_block(fmt, values, bytes)) {
        TORCH_CHECK(q.scalar_type() == at::kByte && features % values == 0 && q.size(1) == features / values * bytes,
                    "quantized_linear_cpu: ", fmt, " needs uint8 q (out, in / ", values, " * ", bytes,
                    ") and in a multiple of ", values);
        const std::string name(fmt.data(), fmt.size());
        accessory_linear_gguf(name.c_str(), x.data_ptr<float>(), rows, features, q.data_ptr<uint8_t>(), outputs,
                              y.data_ptr<float>());
        return y;
    }
    TORCH_CHECK(scale.has_value() && scale->is_contiguous() && scale->scalar_type() == at::kHalf,
                "quantized_linear_cpu: ", fmt, " needs a contiguous float16 scale");
    const auto *scales = reinterpret_cast<const uint16_t *>(scale->data_ptr());
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

// int4 repacked for the product with x in int8 (cpu_kernels.c, dispatch.py pack_int4_int8x): q (tiles, groups * 256)
// uint8, scale and min (tiles, groups * 16) fp16; `outputs` the rows of W (the last tile's rows past it are padding).
static at::Tensor int4_int8x_linear_cpu(const at::Tensor &x, const at::Tensor &q, const at::Tensor &scale,
                                       const at::Tensor &minimum, int64_t outputs) {
    TORCH_CHECK(accessory_int8x(),
                "int4_int8x_linear_cpu: the kernels were built without AVX-512 VNNI or AVX2");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 32 == 0,
                "int4_int8x_linear_cpu: x must be a contiguous float32 matrix, its columns a multiple of 32");
    const int64_t rows = x.size(0), features = x.size(1), tiles = (outputs + 15) / 16, groups = features / 32;
    TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(0) == tiles &&
                q.size(1) == groups * 256 && scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                minimum.scalar_type() == at::kHalf && minimum.is_contiguous() &&
                scale.numel() == tiles * groups * 16 && minimum.numel() == scale.numel(),
                "int4_int8x_linear_cpu: q (", tiles, ", ", groups * 256, ") uint8 and scale, min (", tiles, ", ",
                groups * 16, ") float16 expected for ", outputs, " x ", features);
    at::Tensor y = at::empty({rows, outputs}, x.options());
    const int failed = accessory_linear_int4_int8x(x.data_ptr<float>(), rows, features, q.data_ptr<uint8_t>(),
                                                  reinterpret_cast<const uint16_t *>(scale.data_ptr()),
                                                  reinterpret_cast<const uint16_t *>(minimum.data_ptr()), outputs,
                                                  y.data_ptr<float>());
    TORCH_CHECK(!failed, "int4_int8x_linear_cpu: out of memory for x's ", rows * features, " int8 values");
    return y;
}

static at::Tensor linear_cpu(const at::Tensor &x, const at::Tensor &w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1) && w.size(1) % 32 == 0,
                "linear_cpu: x (M, K) and w (N, K) contiguous float32, K a multiple of 32");
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    accessory_linear_f32(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), w.size(0), y.data_ptr<float>());
    return y;
}

static at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                       const at::Tensor &positions) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                v.scalar_type() == at::kFloat && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "decode_attention_cpu: q (B, L, H, D), k and v (rows, H_kv, S, D) contiguous float32, positions "
                "(B, L) int64");
    const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), dim = q.size(3);
    TORCH_CHECK(k.size(0) >= batch && k.size(3) == dim && heads % k.size(1) == 0 &&
                positions.numel() == batch * length, "decode_attention_cpu: shapes do not match");
    at::Tensor out = at::empty_like(q);
    accessory_decode_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                               positions.data_ptr<int64_t>(), batch, length, heads, k.size(1), k.size(2), dim,
                               out.data_ptr<float>());
    return out;
}

// x (..., dim) float32, any strides; weight (dim,) float32.
static at::Tensor rms_norm_cpu(const at::Tensor &x, const at::Tensor &weight, double eps, double offset) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                x.dim() >= 1 && x.size(-1) == weight.size(0), "rms_norm_cpu: x (..., dim) and weight (dim,) float32");
    const at::Tensor in = x.contiguous(), w = weight.contiguous();
    at::Tensor y = at::empty_like(in);
    const int64_t dim = w.size(0);
    accessory_rms_norm(in.data_ptr<float>(), dim ? in.numel() / dim : 0, dim, w.data_ptr<float>(), (float)eps,
                       (float)offset, y.data_ptr<float>());
    return y;
}

// x (B, L, H, D) float32, any strides; rotations (B or 1, L, D / 2, 2) float32 (rope_table's rows).
static at::Tensor rotary_cpu(const at::Tensor &x, const at::Tensor &rotations) {
    TORCH_CHECK(x.dim() == 4 && rotations.dim() == 4 && x.scalar_type() == at::kFloat &&
                rotations.scalar_type() == at::kFloat && x.size(3) % 2 == 0 &&
                (rotations.size(0) == 1 || rotations.size(0) == x.size(0)) && rotations.size(1) == x.size(1) &&
                rotations.size(2) * 2 == x.size(3) && rotations.size(3) == 2,
                "rotary_cpu: x (B, L, H, D) and rotations (B or 1, L, D / 2, 2) float32");
    const at::Tensor in = x.contiguous();
    const at::Tensor turns = rotations.expand({x.size(0), x.size(1), x.size(3) / 2, 2}).contiguous();
    at::Tensor y = at::empty_like(in);
    accessory_rotary(in.data_ptr<float>(), x.size(0) * x.size(1), x.size(2), x.size(3), turns.data_ptr<float>(),
                     y.data_ptr<float>());
    return y;
}

// gate and up (..., width) float32, any strides -> act(gate) * up (..., width); act "silu" or "gelu_tanh".
static at::Tensor gated_cpu(const at::Tensor &gate, const at::Tensor &up, c10::string_view activation) {
    TORCH_CHECK(gate.dim() >= 1 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat &&
                up.scalar_type() == at::kFloat, "gated_cpu: gate and up of one shape, float32");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "gated_cpu: activation silu or gelu_tanh");
    const int64_t width = gate.size(-1);
    auto rows_of = [width](const at::Tensor &x) {  // (rows, width), unit stride along width: a view where it can be
        at::Tensor flat = x.reshape({-1, width});
        return flat.stride(1) == 1 ? flat : flat.contiguous();
    };
    const at::Tensor g = rows_of(gate), u = rows_of(up);
    at::Tensor y = at::empty(gate.sizes(), gate.options());
    accessory_gated(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), g.size(0), width,
                    activation == "gelu_tanh", y.data_ptr<float>());
    return y;
}

// (B, L, n * D) float32 with unit stride along the last dim and tokens evenly spaced (a split of one product's
// output), as (B * L, n * D) rows: the stride between tokens.
static int64_t token_stride(const at::Tensor &x, int64_t width, const char *name) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(2) == width && x.stride(2) == 1 &&
                x.stride(0) == x.size(1) * x.stride(1), "attend_cpu: ", name, " must be (B, L, ", width,
                ") float32, its tokens evenly spaced");
    return x.stride(1);
}

// q (B, L, H * D), k and v (B, L, H_kv * D) (token_stride); rotations (B or 1, L, D / 2, 2); positions (B, L) int64;
// caches (rows, H_kv, S, D) contiguous float32, written in place; q_norm, k_norm (D,) float32 or none.
// -> (B, L, H * D): accessory_attend.
static at::Tensor attend_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &rotations,
                             const at::Tensor &positions, at::Tensor &k_cache, at::Tensor &v_cache, bool ring,
                             double q_scale, const std::optional<at::Tensor> &q_norm,
                             const std::optional<at::Tensor> &k_norm, double eps, double offset) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
                "attend_cpu: the caches must be (rows, H_kv, S, D) contiguous float32");
    const int64_t batch = q.size(0), length = q.dim() == 3 ? q.size(1) : 0, kv_heads = k_cache.size(1),
                  columns = k_cache.size(2), dim = k_cache.size(3);
    TORCH_CHECK(q.dim() == 3 && q.size(2) % dim == 0 && (q.size(2) / dim) % kv_heads == 0 && dim % 2 == 0 &&
                batch <= k_cache.size(0) && (length == 1 || !ring), "attend_cpu: q (B, L, H * ", dim,
                ") for ", kv_heads, " KV heads, B at most the caches' rows, L 1 on a ring");
    const int64_t q_stride = token_stride(q, q.size(2), "q"), k_stride = token_stride(k, kv_heads * dim, "k"),
                  v_stride = token_stride(v, kv_heads * dim, "v");
    TORCH_CHECK(k.size(0) == batch && k.size(1) == length && v.size(0) == batch && v.size(1) == length &&
                positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                positions.numel() == batch * length, "attend_cpu: k, v and positions (B, L) must match q");
    TORCH_CHECK(rotations.dim() == 4 && rotations.scalar_type() == at::kFloat && rotations.is_contiguous() &&
                (rotations.size(0) == 1 || rotations.size(0) == batch) && rotations.size(1) == length &&
                rotations.size(2) * 2 == dim && rotations.size(3) == 2,
                "attend_cpu: rotations (B or 1, L, D / 2, 2) contiguous float32");
    for (const auto *norm : {&q_norm, &k_norm})
        TORCH_CHECK(!norm->has_value() || ((*norm)->scalar_type() == at::kFloat && (*norm)->is_contiguous() &&
                                           (*norm)->numel() == dim), "attend_cpu: q_norm, k_norm (D,) float32");
    at::Tensor out = at::empty({batch, length, q.size(2)}, q.options());
    accessory_attend(q.data_ptr<float>(), q_stride, k.data_ptr<float>(), k_stride, v.data_ptr<float>(), v_stride, batch,
                     length, q.size(2) / dim, kv_heads, dim, rotations.data_ptr<float>(), rotations.size(0),
                     positions.data_ptr<int64_t>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), columns,
                     ring, (float)q_scale, q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr,
                     k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr, (float)eps, (float)offset,
                     out.data_ptr<float>());
    return out;
}

// ---- a block's halves in one call (eager decode steps) -----------------------------------------------------------
// What dispatch.py's `linear` and `quantized_linear` would run for these rows, called from here instead of from
// Python: W float32 (fmt "", parts [W]; one row by the BLAS library unless `one_row_kernel`) or in `fmt`'s parts.
static at::Tensor block_product(const at::Tensor &x, c10::string_view fmt, at::TensorList parts, bool one_row_kernel) {
    if (fmt.empty())
        return x.size(0) == 1 && !one_row_kernel ? at::linear(x, parts[0]) : linear_cpu(x, parts[0]);
    auto part = [&](size_t i) { return parts.size() > i ? std::optional<at::Tensor>(parts[i]) : std::nullopt; };
    return quantized_linear_cpu(x, fmt, parts[0], part(1), part(2));
}

// A decode step's attention but for its all-reduce: x (B, L, dim), normed -> the q, k, v product (+ bias) -> attend_cpu
// -> the output product: this rank's partial sum (B, L, dim).
static at::Tensor attention_block_cpu(const at::Tensor &x, c10::string_view qkv_fmt, at::TensorList qkv,
                                      const std::optional<at::Tensor> &qkv_bias, const at::Tensor &rotations,
                                      const at::Tensor &positions, at::Tensor &k_cache, at::Tensor &v_cache, bool ring,
                                      double q_scale, const std::optional<at::Tensor> &q_norm,
                                      const std::optional<at::Tensor> &k_norm, double eps, double offset,
                                      c10::string_view out_fmt, at::TensorList out, bool one_row_kernel) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "attention_block_cpu: x (B, L, dim) float32");
    const int64_t batch = x.size(0), length = x.size(1);
    at::Tensor y = block_product(x.reshape({batch * length, x.size(2)}).contiguous(), qkv_fmt, qkv, one_row_kernel);
    if (qkv_bias.has_value()) y.add_(*qkv_bias);
    const int64_t kv = k_cache.size(1) * k_cache.size(3), q_width = y.size(1) - 2 * kv;
    TORCH_CHECK(q_width > 0, "attention_block_cpu: the q, k, v product is narrower than k's and v's heads");
    const at::Tensor qkv_out = y.view({batch, length, y.size(1)});
    const at::Tensor attended = attend_cpu(qkv_out.narrow(2, 0, q_width), qkv_out.narrow(2, q_width, kv),
                                           qkv_out.narrow(2, q_width + kv, kv), rotations, positions, k_cache, v_cache,
                                           ring, q_scale, q_norm, k_norm, eps, offset);
    return block_product(attended.view({batch * length, q_width}), out_fmt, out, one_row_kernel)
        .view({batch, length, -1});
}

// A gated MLP but for its all-reduce: x (..., dim), normed -> the stacked w1 / w3 product -> act(gate) * up -> the
// w2 product: this rank's partial sum (..., dim).
static at::Tensor mlp_block_cpu(const at::Tensor &x, c10::string_view w13_fmt, at::TensorList w13,
                                c10::string_view activation, c10::string_view w2_fmt, at::TensorList w2,
                                bool one_row_kernel) {
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "mlp_block_cpu: x (..., dim) float32");
    const at::Tensor both = block_product(x.reshape({-1, x.size(-1)}).contiguous(), w13_fmt, w13, one_row_kernel);
    const int64_t hidden = both.size(1) / 2;
    const at::Tensor y = block_product(gated_cpu(both.narrow(1, 0, hidden), both.narrow(1, hidden, hidden), activation),
                                       w2_fmt, w2, one_row_kernel);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = y.size(1);
    return y.view(shape);
}

// collectives.c's all-reduce and all-gather between the ranks of one machine, as operators so that a compiled step
// calls them like the products (parallel/shared_memory.py owns the groups; `group` is its handle in this process).
static int shm_dtype(const at::Tensor &x) {
    switch (x.scalar_type()) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    case at::kInt: return 4;
    case at::kLong: return 5;
    default: TORCH_CHECK(false, "shm_all_reduce: no sum of ", x.scalar_type(), " tensors");
    }
}

static at::Tensor shm_all_reduce(const at::Tensor &x, int64_t group, double timeout_s) {
    TORCH_CHECK(x.device().is_cpu(), "shm_all_reduce: x must be on the CPU");
    const at::Tensor in = x.contiguous();
    at::Tensor out = at::empty_like(in);
    TORCH_CHECK(!accessory_shm_all_reduce((int)group, in.data_ptr(), out.data_ptr(), in.numel(), shm_dtype(in),
                                          timeout_s), accessory_shm_error());
    return out;
}

// (world, *x.shape): every rank's x in rank order.
static at::Tensor shm_all_gather(const at::Tensor &x, int64_t group, int64_t world, double timeout_s) {
    TORCH_CHECK(x.device().is_cpu(), "shm_all_gather: x must be on the CPU");
    const at::Tensor in = x.contiguous();
    std::vector<int64_t> shape{world};
    shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
    at::Tensor out = at::empty(shape, in.options());
    TORCH_CHECK(!accessory_shm_all_gather((int)group, in.data_ptr(), out.data_ptr(), in.nbytes(), timeout_s),
                accessory_shm_error());
    return out;
}

TORCH_LIBRARY(accessory, m) {
    m.def("quantized_linear_cpu(Tensor x, str fmt, Tensor q, Tensor? scale, Tensor? minimum) -> Tensor");
    m.def("dequantize_gguf_cpu(Tensor q, str fmt, int features) -> Tensor");
    m.def("gguf_int8x_linear_cpu(Tensor x, str fmt, Tensor q) -> Tensor");
    m.def("int4_int8x_linear_cpu(Tensor x, Tensor q, Tensor scale, Tensor minimum, int outputs) -> Tensor");
    m.def("linear_cpu(Tensor x, Tensor w) -> Tensor");
    m.def("decode_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor positions) -> Tensor");
    m.def("rms_norm_cpu(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
    m.def("rotary_cpu(Tensor x, Tensor rotations) -> Tensor");
    m.def("gated_cpu(Tensor gate, Tensor up, str activation) -> Tensor");
    m.def("attend_cpu(Tensor q, Tensor k, Tensor v, Tensor rotations, Tensor positions, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, bool ring, float q_scale, Tensor? q_norm, Tensor? k_norm, float eps, float offset) "
          "-> Tensor");
    m.def("attention_block_cpu(Tensor x, str qkv_fmt, Tensor[] qkv, Tensor? qkv_bias, Tensor rotations, "
          "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, bool ring, float q_scale, Tensor? q_norm, "
          "Tensor? k_norm, float eps, float offset, str out_fmt, Tensor[] out, bool one_row_kernel) -> Tensor");
    m.def("mlp_block_cpu(Tensor x, str w13_fmt, Tensor[] w13, str activation, str w2_fmt, Tensor[] w2, "
          "bool one_row_kernel) -> Tensor");
    m.def("shm_all_reduce(Tensor x, int group, float timeout_s) -> Tensor");
    m.def("shm_all_gather(Tensor x, int group, int world, float timeout_s) -> Tensor");
}

TORCH_LIBRARY_IMPL(accessory, CPU, m) {
    m.impl("quantized_linear_cpu", &quantized_linear_cpu);
    m.impl("dequantize_gguf_cpu", &dequantize_gguf_cpu);
    m.impl("gguf_int8x_linear_cpu", &gguf_int8x_linear_cpu);
    m.impl("int4_int8x_linear_cpu", &int4_int8x_linear_cpu);
    m.impl("linear_cpu", &linear_cpu);
    m.impl("decode_attention_cpu", &decode_attention_cpu);
    m.impl("rms_norm_cpu", &rms_norm_cpu);
    m.impl("rotary_cpu", &rotary_cpu);
    m.impl("gated_cpu", &gated_cpu);
    m.impl("attend_cpu", &attend_cpu);
    m.impl("attention_block_cpu", &attention_block_cpu);
    m.impl("mlp_block_cpu", &mlp_block_cpu);
    m.impl("shm_all_reduce", &shm_all_reduce);
    m.impl("shm_all_gather", &shm_all_gather);
}
