// The Python module of loraplex's CPU step kernels (paged_attention.cpp, fused_pointwise.cpp, fused_decode.cpp),
// built at first use by loraplex/ops/cpu_kernels.py.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                                     const torch::Tensor& first, const torch::Tensor& end, double scale,
                                     const c10::optional<torch::Tensor>& k_new,
                                     const c10::optional<torch::Tensor>& v_new);
torch::Tensor decode_attention_qkv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                   const torch::Tensor& cache, const torch::Tensor& tables, const torch::Tensor& first,
                                   const torch::Tensor& end, double scale, int64_t heads);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight, double eps,
                           double offset);
torch::Tensor silu_mul(const torch::Tensor& x);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention reading the paged KV cache in place",
        py::arg("q"), py::arg("cache"), py::arg("tables"), py::arg("first"), py::arg("end"), py::arg("scale"),
        py::arg("k_new") = py::none(), py::arg("v_new") = py::none());
  m.def("decode_attention_qkv", &decode_attention_qkv,
        "rotary, K/V write and decode attention from the packed q/k/v projection output");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual add in place, then RMSNorm of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of each row");
  m.def("rotary", &rotary, "rotary embedding of each head");
}
