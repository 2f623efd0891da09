"""Reading /proc/<pid>/numa_maps: the kernel's own account of where a process's mapped
pages are, the independent check of what tiercache counts with move_pages."""

from __future__ import annotations


def numa_maps_line(pid: int, address: int) -> str:
    """The line of /proc/<pid>/numa_maps for the mapping that starts at ``address``."""
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            if int(line.split()[0], 16) == address:
                return line
    raise AssertionError(f"no mapping of pid {pid} starts at {address:#x}")


def numa_maps_pages(line: str) -> dict[int, int]:
    """The ``N<node>=<pages>`` fields of a numa_maps line."""
    return {int(f[1:f.index("=")]): int(f.split("=")[1])
            for f in line.split() if f[0] == "N" and f[1].isdigit()}
