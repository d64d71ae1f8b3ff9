"""What the machine is: CUDA devices, the CPU's native bf16, the cores this process may use, accelerators' peak
FLOP/s, this process's memory, and the network interface gloo binds. The ground floor: it imports nothing of the
package above errors.py, and torch only inside the functions that need it, so the fast commands (`recipe list`,
`validate`) never pay its import.
"""

from __future__ import annotations

import ipaddress
import os
import resource
import socket
import threading
from pathlib import Path

from accel_fsdp.errors import Problem, UserError, first_line

# ------------------------------------------------------------------------------------------------- devices

_NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/proc/driver/nvidia")


def visible_cuda_devices() -> int:
    """CUDA devices this process can use. Without an NVIDIA device node (or WSL's) there are none, and torch (1.8 s
    to import) is not asked."""
    if not any(Path(p).exists() for p in _NVIDIA_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices_said(env=None) -> str:
    """CUDA_VISIBLE_DEVICES as a message shows it: a value (indices, or GPU UUIDs as SLURM or a container may give),
    "'' (empty: no GPU)", or "unset" (every GPU)."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return "CUDA_VISIBLE_DEVICES unset"
    return f"CUDA_VISIBLE_DEVICES={visible}" if visible.strip() else "CUDA_VISIBLE_DEVICES='' (empty: no GPU)"


def cuda_unavailable_reason() -> str:
    """Why this process cannot use CUDA, in torch's words where it has them: a torch built without CUDA, no device
    visible, or the error CUDA's initialization reports (a driver too old, none loaded). Imports torch."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not any(Path(p).exists() for p in _NVIDIA_NODES):
        return "no NVIDIA device node (/dev/nvidia*) on this machine or in this container"
    try:
        torch.cuda.init()
    except Exception as e:  # torch raises RuntimeError, AssertionError or AcceleratorError: all say why
        return f"CUDA failed to initialize: {first_line(e)}"
    if torch.cuda.device_count() == 0:
        return f"no CUDA device is visible ({visible_devices_said()})"
    return "torch.cuda.is_available() is false"


def cuda_capability() -> tuple[int, int] | None:
    """The lowest compute capability (major, minor) of the CUDA devices this process can use; None without one."""
    if not visible_cuda_devices():
        return None
    import torch

    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return min(capabilities) if capabilities else None


def usable_cores() -> int:
    """CPU cores this process may run on (cgroups, SLURM, taskset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


OMP_THREADS_ENV = "OMP_NUM_THREADS"
"""Threads per process of OpenMP (torch's CPU kernels). libgomp reads it when torch loads and, for a value that is
not a positive number, says "libgomp: Invalid value for environment variable OMP_NUM_THREADS" and uses its own
default; Accelerate's launcher reads it with `int()` (accelerate/commands/launch.py, _validate_launch_command;
accelerate 1.15): a traceback."""


def settle_thread_environment(env) -> None:
    """Before torch is imported (by any command): OMP_NUM_THREADS exported empty is as unset (removed, so no library
    reads ""); a value that is not a positive whole number is one message naming it."""
    value = env.get(OMP_THREADS_ENV)
    if value is None:
        return
    if not value.strip():
        del env[OMP_THREADS_ENV]
        return
    if not (value.strip().isascii() and value.strip().isdigit()) or int(value) == 0:
        raise UserError(Problem(OMP_THREADS_ENV, f"{value!r} is not a positive whole number of threads",
                                f"export {OMP_THREADS_ENV}=<threads per process>, e.g. 1, or unset it (CPU ranks then "
                                "share this machine's usable cores equally)"))


def oversubscribed_cores_note(env, ranks_per_machine: int) -> str | None:
    """A note when the OMP_NUM_THREADS the user exported gives this machine's CPU ranks more threads together than
    the cores they may use: each runs slower than with its share."""
    value, cores = env.get(OMP_THREADS_ENV, ""), usable_cores()
    if not value.isdigit() or int(value) * ranks_per_machine <= cores:
        return None
    return (f"{OMP_THREADS_ENV}={value} gives each of this machine's {ranks_per_machine} CPU rank(s) {value} "
            f"thread(s): {int(value) * ranks_per_machine} on {cores} usable core(s), so the ranks slow each other; "
            f"unset it (each rank then gets {max(1, cores // ranks_per_machine)}) or lower it")


CPU_BF16_ENV = "ACCEL_FSDP_CPU_BF16"
"""1 or 0: what to assume about this CPU's native bf16 support instead of detecting it (tests, odd platforms)."""

def cpu_bf16() -> tuple[bool, str]:
    """(this CPU computes bf16 matrix products natively, its name). x86: the avx512_bf16 or amx_bf16 flags; Arm:
    the bf16 feature (Linux /proc/cpuinfo, macOS sysctl). Without them PyTorch emulates bf16 on the CPU."""
    forced = os.environ.get(CPU_BF16_ENV)
    name = "this CPU"
    if forced in ("0", "1"):
        return forced == "1", f"this CPU ({CPU_BF16_ENV}={forced})"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    if info:
        for line in info.splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                name = line.split(":", 1)[1].strip() or name
                break
        flags = set()
        for line in info.splitlines():
            if line.lower().startswith(("flags", "features")):
                flags |= set(line.split(":", 1)[1].split())
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}), name
    import platform
    import subprocess

    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5).stdout.split("\n")
            return out[0].strip() == "1", out[1].strip() or name
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return False, name


# ------------------------------------------------------------------------------------------ peak FLOP/s

# Dense peak FLOP/s of common accelerators for MFU, per compute dtype: (bf16/fp16 tensor cores, fp32 without
# TF32). Matched by the longest key contained in the device name, so "H100 PCIe" and "H100 NVL" are not read as
# the SXM part. Vendor datasheets (dense, no sparsity).
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756e12, 51e12), "H100 NVL": (835e12, 60e12), "H100": (989e12, 67e12),
    "H200 NVL": (835e12, 60e12), "H200": (989e12, 67e12), "GH200": (989e12, 67e12), "H800": (989e12, 67e12),
    "H20": (148e12, 44e12), "B200": (2250e12, 80e12), "B100": (1750e12, 60e12),
    "A100": (312e12, 19.5e12), "A800": (312e12, 19.5e12), "A40": (150e12, 37.4e12), "A30": (165e12, 10.3e12),
    "A10G": (70e12, 31.2e12), "A10": (125e12, 31.2e12), "L40S": (362e12, 91.6e12), "L40": (181e12, 90.5e12),
    "L4": (121e12, 30.3e12), "RTX 6000 Ada": (364e12, 91.1e12), "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12), "V100": (125e12, 15.7e12), "T4": (65e12, 8.1e12),
    "MI300X": (1307e12, 163e12), "MI250X": (383e12, 47.9e12),
}


def peak_memory_bytes(device) -> int:
    """Peak memory of this rank since the last `reset_peak_memory`: the CUDA allocator's peak on GPU, the peak
    resident set size of the process (VmHWM) on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device) -> None:
    """Start a new peak-memory window (a logging window)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    _reset_high_water_mark()


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current resident size; whether that worked (Linux: writing 5 to /proc/self/clear_refs,
    proc(5)), so that VmHWM read later is the peak since now.

    The mark was reset when it reads no more than the resident size just before or just after. Other threads free and
    allocate meanwhile, a 2 MiB huge page at a time where THP is `always`: hence the room of two huge pages (a kernel
    that ignored the write passes only while the process sits within that room of its old peak, off by that much)."""
    before = rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    mark = _vm_hwm()
    return mark is not None and mark <= max(before, rss_bytes()) + (4 << 20)


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def peak_flops(device_name: str, half: bool, *, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the named device for a 16-bit compute dtype (`half`: bf16, fp16 on tensor cores) or fp32:
    plain fp32, or with `tf32` matmuls allowed the tensor-core figure halved, about what TF32 delivers."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in device_name:
            low, fp32 = PEAK_FLOPS[key]
            if half:
                return low
            return low / 2 if tf32 else fp32
    return None


def device_peak_flops(device, half: bool) -> float | None:
    """`peak_flops` of this rank's GPU (None on CPU), with torch's TF32 switch as it is now."""
    if device.type != "cuda":
        return None
    import torch

    return peak_flops(torch.cuda.get_device_name(device), half, tf32=torch.backends.cuda.matmul.allow_tf32)


# ------------------------------------------------------------------------------------------------ memory

class PeakMemory:
    """Resident memory of this process from now until `stop()`: the peak of this operation alone, not of whatever
    the process did before. On Linux the kernel's own high-water mark (VmHWM), reset here, gives the exact peak; a
    background thread also samples every few milliseconds, the only measure where the mark cannot be reset. The
    sampler alone misses a short peak when the cores are busy: it needs the GIL and a core to look (one run on 2 busy
    cores saw 0.88 of a model it held whole)."""

    def __init__(self, interval: float = 0.002):
        self.exact = _reset_high_water_mark()
        """Whether the peak is the kernel's mark (Linux, where /proc/self/clear_refs takes it); else sampled."""
        self.baseline = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(interval)

    def stop(self) -> "PeakMemory":
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(), (self.exact and _vm_hwm()) or 0)
        return self

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def oom_kills() -> int | None:
    """Processes the kernel's out-of-memory killer has ended on this machine since it booted (oom_kill in /proc/vmstat,
    Linux 4.13 on; a memory cgroup's kills count too: mm/oom_kill.c `__oom_kill_process`); None where it is not
    said. Read before and after a launch, it tells a rank the OOM killer ended from one `kill -9` ended."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def rss_bytes() -> int:
    """Current resident memory of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------- network


def gloo_interface(env, interfaces: dict[str, list[str]]) -> tuple[str | None, str]:
    """GLOO_SOCKET_IFNAME for this machine (None: leave it as it is) and the note said before a multi-machine launch.

    Barriers, object collectives and CPU tensors ride on gloo (the group is cuda:nccl,cpu:gloo). Without
    GLOO_SOCKET_IFNAME gloo binds the address this machine's name resolves to, else loopback, silently: other machines
    cannot reach it and the job hangs until the collective timeout. gloo takes exact interface names, comma separated,
    one device each, and ignores a one-character value (torch/csrc/distributed/c10d/init.cpp, ProcessGroupGloo;
    gloo/transport/tcp/device.cc, lookupAddrForIface compares names with strcmp; torch 2.13.0). NCCL_SOCKET_IFNAME
    lists prefixes, `=` makes them exact, `^` excludes. One interface is derived, so every machine opens one gloo
    device. `interfaces`: name -> addresses, in the system's order."""
    own = env.get("GLOO_SOCKET_IFNAME", "").strip()
    if own:
        return None, f"gloo (barriers, object collectives) binds GLOO_SOCKET_IFNAME={own}"
    nccl = env.get("NCCL_SOCKET_IFNAME", "").strip()
    usable = [name for name, addresses in interfaces.items() if addresses]
    if nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        for want in (w.strip() for w in nccl.lstrip("=").split(",") if w.strip()):
            for name in usable:
                if name == want or (not exact and name.startswith(want)):
                    return name, (f"gloo (barriers, object collectives) binds {name}: GLOO_SOCKET_IFNAME derived "
                                  f"from NCCL_SOCKET_IFNAME={nccl}")
        return None, (f"NCCL_SOCKET_IFNAME={nccl} names no interface with an address on this machine "
                      f"({', '.join(usable) or 'none'}): gloo binds the address of this machine's name; set "
                      "GLOO_SOCKET_IFNAME to the interface the machines share")
    where = host_address()
    why = (f"NCCL_SOCKET_IFNAME={nccl} excludes interfaces rather than naming one" if nccl
           else "neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME is set")
    loop = ", a loopback address the other machines cannot reach" if _is_loopback(where) else ""
    return None, (f"{why}: gloo (barriers, object collectives) binds the address this machine's name resolves to "
                  f"({where}{loop}); set GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to the interface the machines "
                  "share, on every machine")


def host_address() -> str:
    """The address this machine's name resolves to, as gloo looks for it: any family, IPv6 included (torch/csrc/
    distributed/c10d/ProcessGroupGloo.cpp, doesHostnameResolveToUsableAddress: getaddrinfo with AF_UNSPEC, the first
    address it can bind; else the loopback address). gethostbyname, IPv4 alone, called an IPv6-only machine's name
    unresolvable and said that gloo would bind loopback."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        found = []
    return found[0][4][0] if found else "nothing (gloo falls back to the loopback address)"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def network_interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4/IPv6 addresses (psutil, a dependency of Accelerate)."""
    import psutil

    return {name: [a.address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addresses in psutil.net_if_addrs().items()}
