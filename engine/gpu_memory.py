"""Sizing the KV pool of an engine on a CUDA device.

The engine may use ``gpu_memory_utilization`` of the device's total memory (vLLM's flag, same
meaning: this process's share, so two workers on one GPU at 0.45 each leave 10% free). Out of
that share come, in this order:

- the CUDA context (driver state, kernels, cuBLAS workspaces): 512 MiB for the context itself
  (estimated: the device has no per-process figure before NVML) plus whatever memory outside
  PyTorch's allocator the device lost while the weights loaded (measured);
- the weights, measured (``torch.cuda.memory_allocated`` after they are on the device);
- activations and the CUDA graphs' memory pool, estimated from the model's shape and the
  scheduler's limits (:func:`activation_reserve`); the engine captures its graphs after the pool
  is allocated (they read it) and reports what they took;
- the KV pool: whatever is left, in whole blocks, and never more than the device has free now
  (another process on the same GPU may hold more than its own share).

:func:`plan_kv_pool` is pure arithmetic on those numbers, so it is tested on any machine; the
engine measures them (:class:`DeviceMemory`) and logs :meth:`KVPoolPlan.describe` at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from baton.engine.errors import InvalidRequestError

GiB = 1 << 30
MIN_RESERVE = 512 << 20  # activations and graphs: never plan fewer bytes than this
MIN_FREE_MARGIN = 256 << 20  # left free on the device whatever the share says
CONTEXT_ESTIMATE = 512 << 20  # a CUDA context on a recent GPU and driver


@dataclass(frozen=True)
class KVPoolPlan:
    device: str
    total: int  # device memory, bytes
    utilization: float
    context: int  # the CUDA context's share, measured
    weights: int
    reserve: int  # activations + CUDA graphs, estimated
    free_now: int  # free on the device after the weights (every process's use counted)
    block_nbytes: int
    num_blocks: int

    @property
    def budget(self) -> int:
        return int(self.utilization * self.total)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def describe(self) -> str:
        g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        return (f"{self.device}: {g(self.total)} total, this engine's share "
                f"{self.utilization:.0%} = {g(self.budget)}: CUDA context {g(self.context)}, "
                f"weights {g(self.weights)}, activations and CUDA graphs {g(self.reserve)} "
                f"(estimate), KV pool {g(self.kv_bytes)} = {self.num_blocks} blocks of "
                f"{self.block_nbytes / 1024:.0f} KiB")


def plan_kv_pool(*, device: str, total: int, free_now: int, context: int, weights: int,
                 reserve: int, utilization: float, block_nbytes: int) -> KVPoolPlan:
    """The KV pool that fits (see the module's docstring). Raises InvalidRequestError naming
    ``gpu_memory_utilization`` when not even one block fits, with the numbers."""
    left = int(utilization * total) - context - weights - reserve
    left = min(left, free_now - reserve - MIN_FREE_MARGIN)
    num_blocks = left // block_nbytes if left > 0 else 0
    plan = KVPoolPlan(device, total, utilization, context, weights, reserve, free_now,
                      block_nbytes, num_blocks)
    if num_blocks < 1:
        raise InvalidRequestError(
            "gpu_memory_utilization", utilization,
            f"leaves no room for a KV block on {device}: {plan.describe()}; {free_now / GiB:.2f} "
            f"GiB free on the device now. Raise --gpu-memory-utilization, or free the device")
    return plan


def activation_reserve(model_cfg, max_num_batched_tokens: int, max_num_seqs: int,
                       elem: int) -> int:
    """Bytes for one step's activations and the decode graphs' pool, estimated from the shapes
    (the attention kernels are paged: nothing grows with the square of the context).

    Per token of a step: the residual, the normed input, the attention output (hidden each), the
    fused q/k/v, gate/up and the activated MLP input, in the compute dtype; per sampled row the
    float32 logits. Doubled for the allocator's rounding and temporaries, once for prefill
    chunks and once for the graphs' static buffers (captured up to ``max_num_seqs``)."""
    m = model_cfg
    per_token = (3 * m.hidden_size + m.q_size + 2 * m.kv_size + 3 * m.intermediate_size) * elem
    logits = max_num_seqs * m.vocab_size * 4
    step = 2 * (max_num_batched_tokens * per_token + logits)
    graphs = 2 * (max_num_seqs * per_token + logits)
    return max(MIN_RESERVE, step + graphs)


def check_cuda_device(device: str) -> None:
    """Raise InvalidRequestError naming ``device`` unless this process can use it."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequestError("device", device, "CUDA is not available here (no GPU visible "
                                  "to this process, or a CPU-only build of PyTorch)")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise InvalidRequestError("device", device, f"this process sees "
                                  f"{torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES="
                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


class DeviceMemory:
    """Measures an engine's use of a CUDA device around the weights' load::

        m = DeviceMemory(device)     # first CUDA call: the context exists from here
        ... weights to the device ...
        plan = m.plan(cfg, block_nbytes, reserve)
    """

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        torch.cuda.init()
        self.free0, self.total = torch.cuda.mem_get_info(self.device)
        self.reserved0 = torch.cuda.memory_reserved(self.device)

    def plan(self, utilization: float, block_nbytes: int, reserve: int) -> KVPoolPlan:
        import torch

        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        torch_growth = torch.cuda.memory_reserved(self.device) - self.reserved0
        outside = max(0, (self.free0 - free) - torch_growth)  # cuBLAS and the like
        name = f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return plan_kv_pool(device=name, total=total, free_now=free,
                            context=CONTEXT_ESTIMATE + outside, weights=weights,
                            reserve=reserve, utilization=utilization, block_nbytes=block_nbytes)

    def used_now(self) -> int:
        """This process's allocator's reservation now (bytes)."""
        import torch

        return torch.cuda.memory_reserved(self.device)
