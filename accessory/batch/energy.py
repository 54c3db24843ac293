"""The energy (kWh) and CO2 (kg) of a batch job's generation (`accessory batch --country-iso-code XXX`), estimated
by codecarbon (the `energy` extra) offline: its OfflineEmissionsTracker with the country's electricity mix from
codecarbon's own tables, nothing sent anywhere and no file written (save_to_file, save_to_api and save_to_logger
off). One rank per machine measures the whole machine (the first local rank, tracking mode "machine": every rank
there is counted once); global rank 0 adds the machines up. The summary says how it was estimated: codecarbon's
version, how it read the CPU (RAPL counters, or its TDP scaled by the load) and the RAM, and the country's intensity.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from accessory.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'accessory[energy]' (codecarbon)"
CPU_METHODS = {"intel_rapl": "RAPL energy counters", "cpu_load": "TDP x CPU load", "constant": "constant TDP",
               "intel_power_gadget": "Intel Power Gadget", "windows_emi": "Windows EMI"}


def check_country(code: str) -> str:
    """`code` upper-cased, if codecarbon is installed and has that country's electricity mix; else a ConfigError
    naming the flag and what it takes."""
    try:
        from codecarbon.input import DataSource
    except ImportError:
        raise ConfigError(f"--country-iso-code needs codecarbon to estimate energy: {INSTALL_HINT}") from None
    known = DataSource().get_global_energy_mix_data()
    if code.upper() not in known:
        raise ConfigError(f"--country-iso-code {code!r}: not a 3-letter ISO code codecarbon has an electricity mix "
                          f"for (e.g. USA, FRA, DEU; {len(known)} known)")
    return code.upper()


@dataclass(frozen=True)
class EnergyReport:
    """What one machine (or, summed, the job) used while generating."""
    kwh: float
    kg_co2: float
    method: str  # how it was estimated
    machines: int = 1

    def __add__(self, other: "EnergyReport") -> "EnergyReport":
        return EnergyReport(self.kwh + other.kwh, self.kg_co2 + other.kg_co2, self.method,
                            self.machines + other.machines)

    def lines(self) -> list[str]:
        return [f"  energy          {self.kwh:.6g} kWh, {self.kg_co2:.6g} kg CO2eq while generating "
                f"({self.machines} machine(s))",
                f"  estimated by    {self.method}"]


class EnergyMeter:
    """Measures this machine from `start` to `stop` on its first local rank; a no-op elsewhere or without a
    country."""

    def __init__(self, country: Optional[str]):
        self.tracker = None
        if country and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from codecarbon import OfflineEmissionsTracker

            # every output off: nothing leaves the machine, no emissions.csv in the working directory
            self.tracker = OfflineEmissionsTracker(
                country_iso_code=country, save_to_file=False, save_to_api=False, save_to_logger=False,
                tracking_mode="machine", log_level="error", allow_multiple_runs=True, measure_power_secs=1)

    def start(self) -> None:
        if self.tracker is not None:
            self.tracker.start()

    def stop(self) -> Optional[EnergyReport]:
        if self.tracker is None:
            return None
        self.tracker.stop()
        data = self.tracker.final_emissions_data
        return EnergyReport(data.energy_consumed, data.emissions, describe(self.tracker, data))


def describe(tracker, data) -> str:
    """codecarbon's version, how it read each device, and the country's grid intensity."""
    # How it read the CPU is not in codecarbon's public results: its CPU object's mode ("unknown" if that changes)
    cpu_mode = next((getattr(h, "_mode", None) for h in getattr(tracker, "_hardware", ())
                     if type(h).__name__ == "CPU"), None)
    cpu = f"CPU {data.cpu_model}: {CPU_METHODS.get(cpu_mode, cpu_mode or 'unknown')}, {data.cpu_power:.1f} W"
    parts = [cpu, f"RAM {data.ram_power:.1f} W"]
    if data.gpu_count:
        parts.append(f"{data.gpu_count} GPU(s) {data.gpu_model}: NVML, {data.gpu_power:.1f} W")
    intensity = data.emissions / data.energy_consumed * 1000 if data.energy_consumed else 0.0
    return (f"codecarbon {data.codecarbon_version} offline, {'; '.join(parts)}; {data.country_name} "
            f"({data.country_iso_code}) grid {intensity:.0f} g CO2eq/kWh")


def job_energy(reports: list[Optional[EnergyReport]]) -> Optional[EnergyReport]:
    """The machines' reports added up (None if none measured)."""
    measured = [r for r in reports if r is not None]
    if not measured:
        return None
    total = measured[0]
    for report in measured[1:]:
        total = total + report
    return total
