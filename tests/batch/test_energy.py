"""`accessory batch --country-iso-code XXX`: the summary reports the generation's energy (kWh) and CO2 (kg), both
above zero, and how codecarbon estimated them (its version, how it read the CPU, the country's grid), with nothing
written beside the job (no emissions.csv in the working directory); a country codecarbon has no data for, and
codecarbon missing, are refused by name before any model loads. The oracle for CO2: energy times the grid intensity
the summary names."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("codecarbon")


def batch(args: list[str], cwd, python_prefix: str = "") -> subprocess.CompletedProcess:
    code = f"{python_prefix}import sys; from accessory.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, "batch", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Story number {i}"}) + "\n" for i in range(4)))
    return path


def test_the_summary_reports_energy_and_co2_and_how(tiny_checkpoints, records, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    done = batch(["--pretrained_path", str(tiny_checkpoints["gqa", 1]), "--max_seq_len", "256", "--max_gen_len",
                  "48", "--input", str(records), "--output", str(tmp_path / "out.jsonl"),
                  "--country-iso-code", "fra"], work)
    assert done.returncode == 0, done.stderr
    energy = re.search(r"energy +([0-9.e+-]+) kWh, ([0-9.e+-]+) kg CO2eq while generating \(1 machine", done.stdout)
    assert energy, done.stdout
    kwh, kg = float(energy[1]), float(energy[2])
    assert kwh > 0 and kg > 0
    method = re.search(r"estimated by +codecarbon (\S+) offline, CPU .*; France \(FRA\) grid (\d+) g CO2eq/kWh",
                       done.stdout)
    assert method, done.stdout
    import codecarbon

    assert method[1] == codecarbon.__version__
    assert kg == pytest.approx(kwh * int(method[2]) / 1000, rel=0.01)  # the grid's intensity, rounded to 1 g
    assert list(work.iterdir()) == []  # nothing written where it ran
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("code", ["XYZ", ""])
def test_an_unknown_country_is_refused_before_loading(records, tmp_path, code):
    """An empty code too: it was taken silently, as if the flag were not given."""
    done = batch(["--pretrained_path", str(tmp_path / "no-such-model"), "--input", str(records), "--output",
                  str(tmp_path / "out.jsonl"), "--country-iso-code", code], tmp_path)
    assert done.returncode == 2
    assert f"--country-iso-code {code!r}: not a 3-letter ISO code codecarbon has an electricity mix for" in done.stderr


def test_without_codecarbon_the_flag_says_what_to_install(records, tmp_path):
    done = batch(["--pretrained_path", str(tmp_path / "no-such-model"), "--input", str(records), "--output",
                  str(tmp_path / "out.jsonl"), "--country-iso-code", "FRA"], tmp_path,
                 python_prefix="import sys; sys.modules['codecarbon'] = None; ")  # as if not installed
    assert done.returncode == 2
    assert "--country-iso-code needs codecarbon to estimate energy: pip install 'accessory[energy]'" in done.stderr
