"""Model x GPU profiles for the timing model.

Figures and sources (all dense BF16, no sparsity):

Models (HuggingFace ``config.json`` of meta-llama/Meta-Llama-3-8B and -70B):

* Llama-3-8B: 8.03e9 parameters, 32 layers, hidden 4096, 32 query heads, 8 KV heads (GQA),
  head dim 128. KV bytes per token = 2 (K,V) x 32 layers x 8 heads x 128 x 2 bytes = 131072 (128 KiB).
* Llama-3-70B: 70.6e9 parameters, 80 layers, hidden 8192, 64 query heads, 8 KV heads, head dim 128.
  KV bytes per token = 2 x 80 x 8 x 128 x 2 = 327680 (320 KiB).

GPUs (NVIDIA data sheets):

* H100 SXM5 80 GB: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3.
* H200 SXM 141 GB: 989 TFLOP/s BF16 dense, 4.8 TB/s HBM3e.
* A100 SXM 80 GB: 312 TFLOP/s BF16 dense, 2.039 TB/s HBM2e.
* NVLink/NIC for the KV transfer: 8B profiles assume one 400 Gb/s NIC per GPU (50 GB/s);
  achieved RDMA goodput is taken as 80 % of that.

Efficiencies are typical measured fractions (prefill MFU ~ 50-60 %, decode achieved bandwidth
~ 70-80 % of peak) from public vLLM/SGLang benchmarks; they are knobs, not facts.
70B profiles use tensor parallelism (TP=4 on H100/H200, TP=8 on A100): FLOP/s, bandwidth and
memory scale by TP; per-step overhead includes an all-reduce allowance.
"""

from __future__ import annotations

import msgspec


class ModelSpec(msgspec.Struct, frozen=True):
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


class GpuSpec(msgspec.Struct, frozen=True):
    name: str
    tflops: float  # dense BF16 TFLOP/s per GPU
    hbm_tb_s: float  # TB/s per GPU
    mem_gb: float  # GB per GPU
    link_gb_s: float = 50.0  # KV transfer link per GPU, GB/s


class Profile(msgspec.Struct, frozen=True):
    name: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    compute_eff: float = 0.55
    bw_eff: float = 0.75
    link_eff: float = 0.8
    step_overhead_s: float = 0.002  # scheduler + launch + (TP>1) all-reduce allowance per step
    mem_fraction: float = 0.9
    max_running: int = 256
    # prefill tokens per step: SGLang's chunked_prefill_size (8192 on 80-141 GB GPUs, SGLang
    # 0.5.23 arg_groups/memory_hook.py) and vLLM's max_num_batched_tokens (decode tokens
    # included: 8192 on H100/H200, 2048 on A100 for the API server, vLLM 0.32
    # engine/arg_utils.py), on every role
    chunk_tokens: int = 8192
    batched_tokens: int = 8192
    max_prefill_tokens: int = 16384
    block_size: int = 16
    context_length: int = 8192

    @property
    def flops(self) -> float:
        return self.gpu.tflops * 1e12 * self.tp * self.compute_eff

    @property
    def bandwidth(self) -> float:
        return self.gpu.hbm_tb_s * 1e12 * self.tp * self.bw_eff

    @property
    def link_bandwidth(self) -> float:
        return self.gpu.link_gb_s * 1e9 * self.tp * self.link_eff

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.gpu.mem_gb * 1e9 * self.tp * self.mem_fraction - self.model.weight_bytes
        return max(self.block_size * 64, int(free // self.model.kv_bytes_per_token))


LLAMA3_8B = ModelSpec("meta-llama/Meta-Llama-3-8B-Instruct", 8.03e9, 32, 4096, 8, 128)
LLAMA3_70B = ModelSpec("meta-llama/Meta-Llama-3-70B-Instruct", 70.6e9, 80, 8192, 8, 128)

H100 = GpuSpec("H100-SXM-80GB", 989.0, 3.35, 80.0)
H200 = GpuSpec("H200-SXM-141GB", 989.0, 4.8, 141.0)
A100 = GpuSpec("A100-SXM-80GB", 312.0, 2.039, 80.0, link_gb_s=25.0)

PROFILES: dict[str, Profile] = {
    "llama-3-8b-h100": Profile("llama-3-8b-h100", LLAMA3_8B, H100),
    "llama-3-8b-h200": Profile("llama-3-8b-h200", LLAMA3_8B, H200),
    "llama-3-8b-a100": Profile("llama-3-8b-a100", LLAMA3_8B, A100, batched_tokens=2048),
    "llama-3-70b-h100": Profile("llama-3-70b-h100", LLAMA3_70B, H100, tp=4, step_overhead_s=0.004),
    "llama-3-70b-h200": Profile("llama-3-70b-h200", LLAMA3_70B, H200, tp=4, step_overhead_s=0.004),
    "llama-3-70b-a100": Profile(
        "llama-3-70b-a100", LLAMA3_70B, A100, tp=8, step_overhead_s=0.005, batched_tokens=2048
    ),
}
DEFAULT_PROFILE = "llama-3-8b-h100"


def get_profile(name: str) -> Profile:
    key = name.lower()
    if key not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]
