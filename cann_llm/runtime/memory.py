"""This machine's memory and this process's share of it (Linux's /proc; None where it cannot be read)."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """The memory this machine can still give without swapping (Linux: MemAvailable); None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# a container's limit (cgroup v2, then v1): what the process may hold, however much the host has
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def total_bytes() -> int | None:
    """The memory this process may hold: the machine's physical memory, or its container's limit if lower;
    None if unknown."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as limit:
                text = limit.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) and v1's huge "no limit" value leave the physical memory
            return min(physical, int(text))
    return physical


def resident_bytes() -> int:
    """The process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
