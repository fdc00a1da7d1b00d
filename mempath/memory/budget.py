"""DeviceBudget: one device's memory promise, granted pathway by pathway to its tenants.

The budget is ``gpu_memory_utilization × total``. Every tenant of the device (a
model with its weights, step buffers, graphs and KV cache; later a second model or a
draft) is granted its pathways' bytes here, in its own ledger, and whatever is left
after the others is what a KV cache may take. Grants are measured or derived figures,
never guesses; a grant made before a pathway exists (the graph pool, sized before the
graphs are captured) is replaced by the measured figure once it does.

On the CPU there is no device budget: the KV cache has its own size
(``cpu_kv_cache_bytes``) and ``limit`` is None; the ledgers still hold every pathway.
"""
from mempath.memory.ledger import Ledger, Pathway, format_bytes

# PyTorch's caching allocator takes a large tensor's memory in a segment rounded up to a multiple of 2 MiB,
# and hands the tensor the whole segment when less than 1 MiB would be left over.
ALLOCATION_ROUNDING = 2 << 20
# Device memory outside PyTorch that grows after start-up (kernel modules loaded on
# first use): 2 MiB over 1,000 serving steps on the H200 (BENCHMARKS.md, "The budget is a
# promise"); the budget keeps sixteen times that spare for it, a margin (the ledger says so).
# Once a process: several models on one device share it.
OUTSIDE_TORCH_GROWTH = 32 << 20


def check_host_room(nbytes: float, setting: str, what: str) -> None:
    """Refuse ``what`` (host memory reserved whole at start-up: a CPU engine's KV cache, the host KV tier)
    larger than the host has available now, in one line naming ``setting`` ("--flag value"), before it is
    allocated: the kernel may grant it lazily and end the process once it fills, or refuse it as out of
    memory, which names no setting. Available, not total: other processes' memory is not ours."""
    import psutil
    available = psutil.virtual_memory().available
    if nbytes > available:
        raise ValueError(f"{setting} asks for {what} of {format_bytes(nbytes)}, more than the "
                         f"{format_bytes(available)} of host memory available now; lower {setting.split()[0]} "
                         "(or free host memory)")


class DeviceBudget:
    def __init__(self, device: str, limit: int | None):
        self.device = device
        self.limit = limit
        self.ledgers: dict[str, Ledger] = {}

    @classmethod
    def of_cuda(cls, device, utilization: float) -> "DeviceBudget":
        import torch
        return cls("cuda", int(torch.cuda.mem_get_info(device)[1] * utilization))

    def ledger(self, tenant: str) -> Ledger:
        """The tenant's ledger: its grants on this device and what it holds elsewhere (host, disk)."""
        return self.ledgers.setdefault(tenant, Ledger())

    def grant(self, tenant: str, pathway: Pathway, nbytes: int, source: str = "measured",
              detail: str = "") -> None:
        self.ledger(tenant).record(pathway, nbytes, self.device, source, detail)

    def granted(self) -> int:
        return sum(ledger.total(self.device) for ledger in self.ledgers.values())

    def remaining(self) -> int:
        """What no tenant has been granted yet (negative when the grants exceed the limit)."""
        if self.limit is None:
            raise ValueError("a CPU engine has no device budget: size its KV cache with cpu_kv_cache_bytes")
        return self.limit - self.granted()

    def grant_blocks(self, tenant: str, pathway: Pathway, block_bytes: int, detail: str = "",
                     allocations: int = 0) -> int:
        """Grant the tenant as many whole blocks as remain; how many (0 when nothing is left). The blocks
        leave ALLOCATION_ROUNDING of what remains for each of the ``allocations`` tensors they will be
        allocated as, so that those tensors, rounded up by the allocator, stay within the budget."""
        num_blocks = max(0, self.remaining() - allocations * ALLOCATION_ROUNDING) // block_bytes
        self.grant(tenant, pathway, num_blocks * block_bytes, "derived", detail)
        return num_blocks
