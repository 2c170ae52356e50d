"""This machine's measured rates (matmul FLOP/s per dtype, memory-copy bandwidth),
measured once in a few seconds and cached per CPU model, flags, torch version and
thread count (or CUDA device): the denominator of MFU, and the rates a time model
turns FLOPs and bytes into seconds with."""

from mct.machine.cache import Calibration, cache_file, calibrate, calibration_table
from mct.machine.profile import (DTYPES, MachineProfile, cpu_identity, cpu_line, current_key, default_device,
                                 format_flops,
                                 format_rate, machine_key, measure_profile, usable_cores)

__all__ = ["Calibration", "DTYPES", "MachineProfile", "cache_file", "calibrate", "calibration_table", "cpu_identity", "cpu_line",
           "current_key", "default_device", "format_flops", "format_rate", "machine_key", "measure_profile", "usable_cores"]
