"""The hardware a plan runs on: a table of GPUs from their makers' public datasheets, and
`cpu`, this machine, measured when it is asked for.

Per GPU: memory, memory bandwidth, dense bf16 and fp8 tensor FLOP/s, and the bandwidth one
GPU has to the others for tensor parallelism. Datasheets quote tensor FLOP/s "with
sparsity"; the dense figure (what a dense model's matrix products can reach) is half, as
their footnotes say, and that half is what the table holds. Link bandwidths are quoted as
the sum of both directions; a ring all-reduce moves data one way at a time, so the table
holds half. Memory is the datasheet's "GB" read as GiB: an 80 GB H100 reports 81,559 MiB
in nvidia-smi, within 1% of 80 GiB and 7% above 80e9 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..cli.args import UsageError

GiB = 2**30
T = 1e12
G = 1e9


@dataclass(frozen=True, slots=True)
class Hardware:
    key: str
    name: str
    memory_bytes: int               # per GPU
    bandwidth: float                # bytes/s, per GPU, the datasheet's peak
    bf16_flops: float               # dense, per GPU
    fp8_flops: float | None         # dense, per GPU; None: no fp8 tensor cores (fp8 weights run at the bf16 rate)
    link_bandwidth: float | None    # bytes/s one way, per GPU, to the others; None: one device only
    source: str                     # the sheet, and its column
    quoted: str = ""                # the sheet's own figures, as it prints them
    measured: bool = False          # cpu: measured on this machine now, not read from a sheet

    def __post_init__(self) -> None:
        for attr in ("memory_bytes", "bandwidth", "bf16_flops"):
            if not getattr(self, attr) > 0:
                raise UsageError(f"hardware {self.key}: {attr} must be positive, got {getattr(self, attr)!r}")

    def flops(self, weight_dtype: str) -> float:
        """The dense tensor rate the weights' matrix products run at: fp8 weights use the fp8
        units where there are any (W8A8), every other dtype the bf16 rate."""
        if weight_dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


SPARSE = "; tensor FLOP/s quoted with sparsity (*), halved here"


H100 = "NVIDIA H100 Tensor Core GPU datasheet"
H200 = "NVIDIA H200 Tensor Core GPU datasheet"
A100 = "NVIDIA A100 Tensor Core GPU datasheet"

TABLE: dict[str, Hardware] = {h.key: h for h in (
    Hardware("h100-sxm", "H100 SXM 80GB", 80 * GiB, 3.35 * T, 989.5 * T, 1979 * T, 450 * G,
             H100 + ", H100 SXM", "3.35 TB/s, BF16 1,979* and FP8 3,958* TFLOPS, NVLink 900 GB/s" + SPARSE),
    Hardware("h100-nvl", "H100 NVL 94GB", 94 * GiB, 3.9 * T, 835.5 * T, 1670.5 * T, 300 * G,
             H100 + ", H100 NVL", "3.9 TB/s, BF16 1,671* and FP8 3,341* TFLOPS, NVLink 600 GB/s" + SPARSE),
    Hardware("h100-pcie", "H100 PCIe 80GB", 80 * GiB, 2.0 * T, 756.5 * T, 1513 * T, 300 * G,
             H100 + ", H100 PCIe", "2 TB/s, BF16 1,513* and FP8 3,026* TFLOPS, NVLink bridge 600 GB/s" + SPARSE),
    Hardware("h200-sxm", "H200 SXM 141GB", 141 * GiB, 4.8 * T, 989.5 * T, 1979 * T, 450 * G,
             H200 + ", H200 SXM", "4.8 TB/s, BF16 1,979* and FP8 3,958* TFLOPS, NVLink 900 GB/s" + SPARSE),
    Hardware("h200-nvl", "H200 NVL 141GB", 141 * GiB, 4.8 * T, 835.5 * T, 1670.5 * T, 450 * G,
             H200 + ", H200 NVL", "4.8 TB/s, BF16 1,671* and FP8 3,341* TFLOPS, NVLink bridge 900 GB/s" + SPARSE),
    Hardware("a100-sxm-80gb", "A100 SXM 80GB", 80 * GiB, 2.039 * T, 312 * T, None, 300 * G,
             A100 + ", A100 80GB SXM", "2,039 GB/s, BF16 624* TFLOPS, no FP8, NVLink 600 GB/s" + SPARSE),
    Hardware("a100-pcie-80gb", "A100 PCIe 80GB", 80 * GiB, 1.935 * T, 312 * T, None, 300 * G,
             A100 + ", A100 80GB PCIe", "1,935 GB/s, BF16 624* TFLOPS, no FP8, NVLink bridge 600 GB/s" + SPARSE),
    Hardware("a100-sxm-40gb", "A100 SXM 40GB", 40 * GiB, 1.555 * T, 312 * T, None, 300 * G,
             A100 + ", A100 40GB SXM", "1,555 GB/s, BF16 624* TFLOPS, no FP8, NVLink 600 GB/s" + SPARSE),
    Hardware("l40s", "L40S 48GB", 48 * GiB, 864 * G, 362.05 * T, 733 * T, 32 * G, "NVIDIA L40S datasheet",
             "864 GB/s, BF16 362.05 dense and FP8 733 dense TFLOPS (733* and 1,466* with sparsity), no NVLink: "
             "PCIe Gen4 x16 64 GB/s"),
    Hardware("l4", "L4 24GB", 24 * GiB, 300 * G, 121 * T, 242.5 * T, 32 * G, "NVIDIA L4 Tensor Core GPU datasheet",
             "300 GB/s, BF16 242* and FP8 485* TFLOPS, PCIe Gen4 x16 64 GB/s" + SPARSE),
    Hardware("a10", "A10 24GB", 24 * GiB, 600 * G, 125 * T, None, 32 * G, "NVIDIA A10 Tensor Core GPU datasheet",
             "600 GB/s, BF16 250* TFLOPS, no FP8, PCIe Gen4 64 GB/s" + SPARSE),
    Hardware("rtx-4090", "GeForce RTX 4090 24GB", 24 * GiB, 1008 * G, 165.2 * T, 330.3 * T, 32 * G,
             "NVIDIA Ada GPU architecture whitepaper, appendix, GeForce RTX 4090",
             "1,008 GB/s; dense tensor TFLOPS with FP32 accumulate: BF16 165.2, FP8 330.3; PCIe Gen4 x16 64 GB/s"),
    Hardware("mi300x", "AMD Instinct MI300X 192GB", 192 * GiB, 5.3 * T, 1307.4 * T, 2614.9 * T, 448 * G,
             "AMD Instinct MI300X datasheet",
             "5.3 TB/s, dense BF16 1,307.4 and FP8 2,614.9 TFLOPS, Infinity Fabric 896 GB/s over 7 links"),
)}
CPU = "cpu"
DEFAULT_GPU = "h100-sxm"     # --gpu when it is not given


def normal_key(key: str) -> str:
    """A table key as typed, case, spaces and underscores forgiven."""
    return key.strip().lower().replace(" ", "-").replace("_", "-")


def gpu_key(args) -> str:
    """--gpu as given (normalized), or the default."""
    return normal_key(args.gpu) if getattr(args, "gpu", None) else DEFAULT_GPU


def names() -> str:
    return ", ".join([*TABLE, CPU])


def find(key: str) -> Hardware:
    """A table row by its key (case and spaces forgiven), or `cpu`, measured now."""
    k = normal_key(key)
    if k == CPU:
        return measure_cpu()
    if k in TABLE:
        return TABLE[k]
    close = [n for n in TABLE if k and (k in n or n.startswith(k.split("-")[0]))]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UsageError(f"unknown GPU {key!r}{hint}; accepted: {names()} (kvchat plan --list-gpus shows each "
                     "with its figures and source)")


def with_memory(hw: Hardware, memory_bytes: int) -> Hardware:
    return replace(hw, memory_bytes=memory_bytes)


# ---- this machine --------------------------------------------------------------------------
def measure_cpu() -> Hardware:
    """This machine, measured now in this process with torch's thread count: read bandwidth
    from timed sums over a buffer past any cache (the bench's own probe), dense FLOP/s from
    timed fp32 matrix products, memory from /proc/meminfo's MemAvailable. About two seconds."""
    import time

    import torch

    from ..bench.floor import BandwidthProbe
    from kvchat.engine.engine import available_memory
    probe = BandwidthProbe(0)
    probe.sample(repeats=7)
    bw, reader = probe.result().gb_s * G, probe.reader
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b                                       # warm: threads started
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n**3 / best
    threads = torch.get_num_threads()
    del probe
    mem = available_memory(torch.device("cpu"))
    return Hardware(CPU, f"this CPU ({threads} threads)", mem, bw, flops, None, None,
                    f"this machine, now, {threads} torch threads",
                    f"median of 7 timed sums ({reader}) over 512 MiB: {bw / G:.1f} GB/s; best of 5 fp32 {n}x{n} products: "
                    f"{flops / T:.3f} TFLOP/s; MemAvailable {mem / GiB:.1f} GiB", measured=True)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo (no torch): the cpu row's memory when a calibration
    gives its rates."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 * GiB


def cpu_calibrated(bandwidth: float, flops: float, source: str) -> Hardware:
    """The cpu row with the rates a calibration measured, instead of measuring again now (on a
    shared machine the bandwidth drifts by half from one minute to the next)."""
    mem = mem_available()
    return Hardware(CPU, "this CPU (calibrated)", mem, bandwidth, flops, None, None, source,
                    f"MemAvailable {mem / GiB:.1f} GiB now", measured=True)
