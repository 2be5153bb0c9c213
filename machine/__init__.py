"""Readings of the machine: parsers of /proc and /sys (memory, pressure, block devices, devices,
NVMe health), shared by the agent and the collector. Pure readers: no store, no series names."""
